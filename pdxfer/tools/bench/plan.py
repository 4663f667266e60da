"""The benchmark's workloads and room plans: which pages every room moves, derived
from a seed, so that the raw reference runs and pdxfer move the same blocks.

A plan is saved to a small ``.npz`` file that every benchmark process reads: the
simulated engines (``python -m pdxfer.tools.sim ... --plan FILE``), the raw transfer-engine
processes and the socket processes (``python -m pdxfer.tools.bench.raw``). Blocks come from
``pdxfer.core.plan.plan_blocks``, the function the prefill daemon plans with.

Pages are never reused within a plan: the pools hold every room's pages, so sources
can be filled before the first room and destinations checked after the last one,
outside the timed window.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from ...core.plan import Blocks, check_pages, layout_regions, pages_from_bytes, pages_to_bytes, plan_blocks, region_bases
from ...core.protocol import KVLayout, Layout



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
        return (f"{self.rooms} rooms of {size}, {self.in_flight} in flight; per-layer K/V, {self.layers} layers, "
                f"{self.region_page_bytes // 1024} KiB pages")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


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

    def blocks(self, src_base: int = 0, dst_base: int = 0) -> list[Blocks]:
        """Each room's blocks between pools at these addresses (offsets from the pool
        start when both are 0), exactly as the prefill daemon plans them."""
        regions = layout_regions(self.layout)
        src_bases, dst_bases = region_bases(src_base, regions), region_bases(dst_base, regions)
        return [plan_blocks(regions, src_bases, dst_bases, r.src, r.dst) for r in self.rooms]

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
