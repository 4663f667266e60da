"""The benchmark's workloads and room plans: which pages every room moves, derived
from a seed, so that the raw reference runs and pdxfer move the same blocks.

A plan is saved to a small ``.npz`` file that every benchmark process reads: the
simulated engines (``python -m pdxfer.tools.sim ... --plan FILE``), the raw transfer-engine
processes and the socket processes (``python -m pdxfer.tools.bench.raw``).

Pages are never reused within a plan: the pools hold every room's pages, so sources
can be filled before the first room and destinations checked after the last one,
outside the timed window.

A workload runs between a prefill engine of TP ``prefill_tp`` and a decode engine of TP
``decode_tp`` (``--topology P:D``): every rank has a pool of its own holding its share of
the model's ``heads`` KV heads (pdxfer.core.topology), the ranks of one engine use the
same page indices, and a room's blocks are its legs' (pdxfer.core.topology's legs,
pdxfer.core.plan.plan_leg_blocks: what the prefill daemon plans). At 1:1 the one leg
moves whole pages, coalesced (plan_blocks).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import msgspec
import numpy as np

from ...core.plan import (Blocks, canonical, check_pages, layout_registration, layout_regions, pages_from_bytes, pages_to_bytes,
                          plan_blocks, plan_leg_blocks, region_bases)
from ...core.protocol import Heads, KVLayout, KVRegion, KVSpec, Layout, PageOrder
from ...core.topology import first_head, legs_for_decode_rank, local_heads


@dataclass(frozen=True)
class Workload:
    """Rooms of min_pages..max_pages page indices in a per-layer K/V (MHA) pool."""

    name: str
    rooms: int
    in_flight: int
    layers: int
    page_size: int  # tokens per page
    token_bytes: int  # bytes per token per layer, in each of K and V
    min_pages: int
    max_pages: int
    prefill_tp: int = 1
    decode_tp: int = 1
    heads: int = 1  # KV heads of the model, split over each engine's TP ranks
    page_order: str = PageOrder.TOKEN_MAJOR.value

    @property
    def topology(self) -> str:
        return f"{self.prefill_tp}:{self.decode_tp}"

    def tp(self, side: str) -> int:
        return self.prefill_tp if side == "prefill" else self.decode_tp

    def rank_layout(self, num_pages: int, side: str) -> KVLayout:
        """The pool of one rank of ``side``: its share of every page's heads."""
        return KVLayout(layout=Layout.MHA, num_layers=self.layers, num_pages=num_pages, page_size=self.page_size,
                        token_bytes=self.token_bytes * local_heads(self.heads, self.tp(side)) // self.heads, dtype="uint8")

    def rank_registration(self, num_pages: int, side: str) -> tuple[KVSpec, tuple[KVRegion, ...]]:
        return rank_registration(self.rank_layout(num_pages, side), self.heads, self.tp(side), PageOrder(self.page_order))

    def share(self, side: str, rank: int) -> "HeadShare":
        return HeadShare.of_rank(self.heads, self.tp(side), rank, self.page_size, PageOrder(self.page_order))

    @property
    def region_page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def page_index_bytes(self) -> int:
        """Bytes one page index moves: its page in every K and V buffer."""
        return 2 * self.layers * self.region_page_bytes

    def layout(self, num_pages: int) -> KVLayout:
        return KVLayout(layout=Layout.MHA, num_layers=self.layers, num_pages=num_pages, page_size=self.page_size,
                        token_bytes=self.token_bytes, dtype="uint8")

    def describe(self) -> str:
        low, high = self.min_pages * self.page_index_bytes, self.max_pages * self.page_index_bytes
        size = (f"{self.min_pages}-{self.max_pages} pages ({_size(low)}-{_size(high)})" if high > low
                else f"{self.min_pages} page{'s' * (self.min_pages > 1)} ({_size(low)})")
        ranks = (f"; TP {self.topology}, {self.heads} KV heads, {self.page_order.replace('_', '-')}"
                 if (self.prefill_tp, self.decode_tp) != (1, 1) else "")
        return (f"{self.rooms} rooms of {size}, {self.in_flight} in flight; per-layer K/V, {self.layers} layers, "
                f"{self.region_page_bytes // 1024} KiB pages{ranks}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


@dataclass(frozen=True)
class HeadShare:
    """The heads [start, start + count) of ``total`` one rank holds of every page: what
    of a page of the whole model (every head) lies in that rank's page, in its order."""

    total: int = 1
    start: int = 0
    count: int = 1
    page_size: int = 1
    head_major: bool = False

    @classmethod
    def of_rank(cls, total_heads: int, tp: int, rank: int, page_size: int, page_order: PageOrder) -> "HeadShare":
        """What TP rank ``rank`` of ``tp`` holds (pdxfer.core.topology)."""
        return cls(total_heads, first_head(total_heads, tp, rank), local_heads(total_heads, tp), page_size,
                   page_order is PageOrder.HEAD_MAJOR)

    @property
    def whole(self) -> bool:
        return self.count == self.total

    def of(self, pages: np.ndarray) -> np.ndarray:
        """[n, whole page bytes] -> [n, this rank's page bytes]."""
        if self.whole:
            return pages
        n, end = pages.shape[0], self.start + self.count
        if self.head_major:  # [head][token][unit]
            return pages.reshape(n, self.total, -1)[:, self.start : end].reshape(n, -1)
        return pages.reshape(n, self.page_size, self.total, -1)[:, :, self.start : end].reshape(n, -1)


WHOLE = HeadShare()


def rank_registration(layout: KVLayout, total_heads: int, tp: int, page_order: PageOrder) -> tuple[KVSpec, tuple[KVRegion, ...]]:
    """A pool pdxfer's layout describes, holding one TP rank's heads of ``total_heads``
    (``layout.token_bytes`` is that rank's bytes per token), registered with its heads
    and page order: what a rank of the benchmark's engines registers."""
    spec, regions = layout_registration(layout)
    local = local_heads(total_heads, tp)
    heads = Heads(local=local, total=total_heads, bytes_per_token_head=layout.token_bytes // local)
    return msgspec.structs.replace(spec, heads=heads, page_order=page_order), regions


@dataclass(frozen=True)
class RoomPages:
    room: int
    tokens: int
    src: np.ndarray  # int32 page indices in the prefill pool
    dst: np.ndarray  # int32 page indices in the decode pool, as many as src


@dataclass(frozen=True)
class Plan:
    workload: Workload
    num_pages: int  # pages in each pool
    rooms: list[RoomPages]

    @property
    def layout(self) -> KVLayout:
        return self.workload.layout(self.num_pages)

    def room_bytes(self) -> np.ndarray:
        return np.array([r.src.size for r in self.rooms], np.int64) * self.workload.page_index_bytes

    def rank_layout(self, side: str) -> KVLayout:
        return self.workload.rank_layout(self.num_pages, side)

    def blocks(self, src_bases: tuple[int, ...] = (), dst_bases: tuple[int, ...] = ()) -> list[Blocks]:
        """Each room's blocks, every leg of every decode rank, between the ranks' pools
        at these addresses (prefill ranks', decode ranks'; offsets from each pool's
        start when left out), exactly as the prefill daemon plans them."""
        w = self.workload
        src_bases, dst_bases = src_bases or (0,) * w.prefill_tp, dst_bases or (0,) * w.decode_tp
        sides = {side: canonical(w.rank_registration(self.num_pages, side)[1]) for side in ("prefill", "decode")}
        bases = {side: [[base + r.offset for r in sides[side]] for base in at] for side, at in (("prefill", src_bases), ("decode", dst_bases))}
        heads = {side: local_heads(w.heads, w.tp(side)) for side in sides}
        legs = [leg for d in range(w.decode_tp)
                for leg in legs_for_decode_rank(w.prefill_tp, w.decode_tp, w.heads, d, False, num_layers=w.layers)]
        out = []
        for r in self.rooms:
            parts = [plan_leg_blocks(sides["prefill"], bases["prefill"][leg.prefill_tp], heads["prefill"],
                                     sides["decode"], bases["decode"][leg.decode_tp], heads["decode"], w.page_size,
                                     PageOrder(w.page_order), leg.src_head_start, leg.head_count, leg.dst_head_start,
                                     (leg.layer_start, leg.layer_end), r.src, r.dst) for leg in legs]
            out.append(parts[0] if len(parts) == 1 else Blocks.of(*(np.concatenate([getattr(b, f) for b in parts]) for f in ("src", "dst", "length"))))
        return out

    def save(self, path: str) -> None:
        offsets = np.cumsum([0] + [r.src.size for r in self.rooms])
        np.savez(
            path,
            meta=np.array(json.dumps({"workload": asdict(self.workload), "num_pages": self.num_pages})),
            room=np.array([r.room for r in self.rooms], np.uint64),
            tokens=np.array([r.tokens for r in self.rooms], np.int64),
            offsets=offsets.astype(np.int64),
            src=np.concatenate([r.src for r in self.rooms]) if self.rooms else np.zeros(0, np.int32),
            dst=np.concatenate([r.dst for r in self.rooms]) if self.rooms else np.zeros(0, np.int32),
        )

    @classmethod
    def load(cls, path: str) -> "Plan":
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            offsets, src, dst = data["offsets"], data["src"], data["dst"]
            rooms = [
                RoomPages(int(room), int(tokens), src[a:b].copy(), dst[a:b].copy())
                for room, tokens, a, b in zip(data["room"], data["tokens"], offsets[:-1], offsets[1:])
            ]
        return cls(Workload(**meta["workload"]), int(meta["num_pages"]), rooms)


def parse_placement(text: str) -> int:
    """``--placement``: how an allocator hands out a room's pages, as the length of the
    runs of consecutive pages: contiguous (0: every room one run), scattered (1: page by
    page) or runs:N."""
    if text == "contiguous":
        return 0
    if text == "scattered":
        return 1
    kind, _, size = text.partition(":")
    if kind == "runs" and size.isdigit() and int(size) >= 1:
        return int(size)
    raise ValueError(f"placement {text!r}: use contiguous, scattered or runs:N with N >= 1")


def page_order(num_pages: int, run: int, rng: np.random.Generator) -> np.ndarray:
    """Every page of a pool once, in the order rooms take them: consecutive pages
    (run 0), runs of ``run`` consecutive pages in random order, or pages in random order
    (run 1). num_pages is a multiple of ``run``."""
    if run == 0:
        return np.arange(num_pages, dtype=np.int32)
    runs = rng.permutation(num_pages // run)
    return (runs[:, None] * run + np.arange(run)).ravel().astype(np.int32)


DEFAULT_PLACEMENT = "runs:8"


def make_plan(workload: Workload, seed: int, placement: str = DEFAULT_PLACEMENT) -> Plan:
    """Rooms with random 64-bit ids and sizes; source and destination pages laid out
    alike by ``placement`` (see parse_placement), each side in its own random order."""
    run = parse_placement(placement)
    rng = np.random.default_rng([seed, workload.rooms, workload.min_pages, workload.max_pages])
    sizes = rng.integers(workload.min_pages, workload.max_pages + 1, size=workload.rooms)
    total = int(sizes.sum())
    unit = max(run, 1)
    num_pages = max(unit, -(-total // unit) * unit)
    src_order = page_order(num_pages, run, rng)
    dst_order = page_order(num_pages, run, rng)
    ids = rng.integers(1, 2**63, size=workload.rooms, dtype=np.int64).astype(np.uint64) | np.uint64(1 << 63)
    rooms, at = [], 0
    for room, n in zip(ids, sizes):
        n = int(n)
        tokens = n * workload.page_size - int(rng.integers(0, workload.page_size))  # the last page part full
        rooms.append(RoomPages(int(room), tokens, src_order[at : at + n], dst_order[at : at + n]))
        at += n
    return Plan(workload, num_pages, rooms)


def block_counts(plan: Plan) -> np.ndarray:
    return np.array([len(b) for b in plan.blocks()], np.int64)


PLANNING_TIMINGS = 3  # the planning figure is the median of this many timings: one is at the mercy of a noisy host


def time_planning(workload: Workload, num_indices: int, window: int, seed: int = 0) -> dict:
    """Seconds the prefill daemon's planning path takes for num_indices scattered page
    indices: decoding both page lists, bounds checks (C2), coalescing, and turning
    the blocks into the Python lists the transfer engine is called with, ``window``
    blocks at a time as the pump submits them (all at once cost ~1.7 times as much:
    one list of millions of new ints). Each the median of PLANNING_TIMINGS timings
    (single timings of the same planning ranged 55-137 ms on this project's VM)."""
    rng = np.random.default_rng(seed)
    layout = workload.layout(num_indices)
    src_raw = pages_to_bytes(rng.permutation(num_indices).astype(np.int32))
    dst_raw = pages_to_bytes(rng.permutation(num_indices).astype(np.int32))
    regions = layout_regions(layout)
    plan_s, to_lists_s = [], []
    for _ in range(PLANNING_TIMINGS):
        t0 = time.perf_counter()
        src, dst = pages_from_bytes(src_raw), pages_from_bytes(dst_raw)
        check_pages(src, num_indices, "source")
        check_pages(dst, num_indices, "destination")
        blocks = plan_blocks(regions, region_bases(1 << 40, regions), region_bases(1 << 41, regions), src, dst)
        t1 = time.perf_counter()
        for start in range(0, len(blocks), window):
            lists = blocks.lists(start, start + window)
        t2 = time.perf_counter()
        del lists
        plan_s.append(t1 - t0)
        to_lists_s.append(t2 - t1)
    return {
        "page_indices": num_indices,
        "blocks": len(blocks),
        "bytes": blocks.nbytes,
        "plan_s": statistics.median(plan_s),
        "to_lists_s": statistics.median(to_lists_s),
        "timings": PLANNING_TIMINGS,
    }
