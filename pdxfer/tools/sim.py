"""Simulated engines: a prefill engine that fills KV pages with a known pattern and
sends them, and a decode engine that receives them and checks every byte.

They use pdxfer.client exactly as a real engine would, run as their own processes
(``python -m pdxfer.tools.sim prefill|decode ...``), and print JSON lines on stdout:
``progress`` lines while they run and one ``summary`` line at the end (with the CPU
seconds the process spent from its first room to its last: ``cpu_s``). The demo,
the integration tests and the benchmark drive them.

Both engines derive the same room list from the seed, so no router is needed: room
ids are random 64-bit values, prompts are 1..max_tokens tokens, and page choices are
scattered so that coalescing has real work to do.

An engine of TP size ``--tp`` runs as one process per rank (``--rank``), each with its
own pool holding its share (pdxfer.core.topology) of the model's ``--heads`` KV heads, laid
out ``--page-order``; the pattern is defined over every head, so a decode rank's pages
are checked against the heads it holds whichever prefill ranks wrote them. A decode rank
names the prefill engine's TP size (``--prefill-tp``). The defaults are one rank
holding one head. With ``--lockstep FILE`` an engine's ranks admit rooms together, as
the engine's one scheduler would.

For the benchmark, ``--plan FILE`` takes the rooms and both sides' page lists from a
plan file (pdxfer.tools.bench.plan) instead, and fills the sources and makes every room's
aux record before the first room; ``--timings FILE`` records when each room's
send()/expect() was called and when its wait() returned.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

import msgspec

from ..client import AsyncClient, KVPool, Slot
from ..core import errors
from ..core.plan import pages_for_tokens
from ..core.protocol import ONE_RANK, KVLayout, Layout, PageOrder, Rank, Role, RoomState
from ..loop import run_uvloop
from .bench.plan import WHOLE, HeadShare, rank_registration

AUX_RECORD_BYTES = 64
FAULTS = ("small", "stale", "out_of_range")


@dataclass(frozen=True)
class RoomSpec:
    index: int
    room: int
    tokens: int


def room_plan(seed: int, count: int, max_tokens: int) -> list[RoomSpec]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 2**63, size=count, dtype=np.int64).astype(np.uint64) | np.uint64(1 << 63)
    tokens = rng.integers(1, max_tokens + 1, size=count)
    return [RoomSpec(i, int(r), int(t)) for i, (r, t) in enumerate(zip(ids, tokens))]


def page_pattern(room: int, region: int, nbytes: int) -> np.ndarray:
    """The bytes the prefill writes into a room's pages of one region: distinct for
    every room, region and 8-byte position, so a misplaced page cannot pass, and
    cheap enough that the engines do not hide the transfer's speed."""
    seed = (room * 0x9E3779B97F4A7C15 + region * 0xBF58476D1CE4E5B9) % 2**64
    words = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x94D049BB133111EB) + np.uint64(seed)
    return words.view(np.uint8)


def _pattern(room: int, region: int, pages: np.ndarray, page_bytes: int, share: HeadShare) -> np.ndarray:
    """The room's pattern over every head of these pages of a region, as the rank holding
    ``share`` of them (pages of ``page_bytes``) has it: [pages, page_bytes]."""
    whole = page_bytes * share.total // share.count
    return share.of(page_pattern(room, region, pages.size * whole).reshape(pages.size, whole))


def fill_pages(arrays: list[np.ndarray], room: int, pages: np.ndarray, share: HeadShare = WHOLE) -> None:
    """Write a room's pattern (this rank's share of its heads) into its pages of every region."""
    for r, arr in enumerate(arrays):
        arr[pages] = _pattern(room, r, pages, arr.shape[1], share)


def pages_match(arrays: list[np.ndarray], room: int, pages: np.ndarray, share: HeadShare = WHOLE) -> bool:
    """Whether a room's pages of every region hold its pattern (this rank's share), byte for byte."""
    for r, arr in enumerate(arrays):
        if not np.array_equal(arr[pages], _pattern(room, r, pages, arr.shape[1], share)):
            return False
    return True


def tp_sizes(tp: int) -> Rank:
    """The sizes of an engine of TP ``tp`` alone (ONE_RANK for one rank)."""
    return msgspec.structs.replace(ONE_RANK, tp=tp)


def corrupt_one_byte(arrays: list[np.ndarray], pages: np.ndarray) -> None:
    """Testing aid: flip one byte of these pages, as a faulty transfer might."""
    arrays[0][pages[0], 0] ^= 0xFF


def aux_record(room: int, tokens: int) -> bytes:
    head = room.to_bytes(8, "little") + tokens.to_bytes(8, "little")
    return head + hashlib.sha256(head).digest() + bytes(AUX_RECORD_BYTES - 16 - 32)


def planned_records(specs: list[RoomSpec], planned: bool) -> dict[int, bytes]:
    """With --plan, every room's aux record by spec index, made before the timed rooms
    as their pages are filled; otherwise none (record_of makes each when it is needed)."""
    return {spec.index: aux_record(spec.room, spec.tokens) for spec in specs} if planned else {}


def record_of(records: dict[int, bytes], spec: RoomSpec) -> bytes:
    return records.get(spec.index) or aux_record(spec.room, spec.tokens)


def fault_of(index: int, faults: dict[str, int]) -> str:
    for kind, every in faults.items():
        if every and index % every == every - 1:
            return kind
    return ""


class PageAllocator:
    """Free pages handed out scattered, in short runs of consecutive pages (as real
    allocators produce them); waits when the pool is short, until closed."""

    RUN = 4

    def __init__(self, num_pages: int, seed: int) -> None:
        runs = np.random.default_rng(seed).permutation(num_pages // self.RUN)
        order = (runs[:, None] * self.RUN + np.arange(self.RUN)).ravel()
        self._free = order.tolist() + list(range(order.size, num_pages))
        self._cond = asyncio.Condition()
        self._closed = ""

    async def take(self, n: int) -> np.ndarray:
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or len(self._free) >= n)
            if self._closed:
                raise errors.PdxferError(f"page pool closed: {self._closed}")
            pages, self._free = self._free[:n], self._free[n:]
        return np.asarray(pages, dtype=np.int32)

    async def give(self, pages: np.ndarray) -> None:
        async with self._cond:
            self._free.extend(pages.tolist())
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return bool(self._closed)

    async def close(self, why: str) -> None:
        """Wake every waiter with an error (pages given up for lost never come back)."""
        async with self._cond:
            self._closed = why
            self._cond.notify_all()


class Reporter:
    def __init__(self, every: float = 0.2) -> None:
        self.every = every
        self.last = 0.0

    def emit(self, event: str, force: bool = False, **fields) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
            sys.stdout.flush()


def layout_from(args) -> KVLayout:
    return KVLayout(
        layout=Layout(args.layout), num_layers=args.layers, num_pages=args.pages, page_size=args.page_size,
        token_bytes=args.token_bytes, dtype="uint8",
    )


def _rooms(args) -> tuple[list[RoomSpec], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The rooms to run and, with --plan, each room's (source, destination) pages."""
    if not args.plan:
        return room_plan(args.seed, args.rooms, args.max_tokens), {}
    from .bench.plan import Plan

    plan = Plan.load(args.plan)
    if plan.num_pages > args.pages:
        raise SystemExit(f"--plan needs pools of {plan.num_pages} pages, --pages is {args.pages}")
    specs = [RoomSpec(i, r.room, r.tokens) for i, r in enumerate(plan.rooms)]
    return specs, {i: (r.src, r.dst) for i, r in enumerate(plan.rooms)}


def _save_timings(path: str, timings: list[tuple[int, float, float, bool]]) -> None:
    if path:
        rooms, starts, ends, ok = zip(*timings) if timings else ((), (), (), ())
        np.savez(path, room=np.array(rooms, np.uint64), start=np.array(starts, np.float64),
                 end=np.array(ends, np.float64), ok=np.array(ok, bool))


async def _ready(args, report: Reporter) -> None:
    """Say the pools are registered (and, with --plan, the sources filled); with
    --start-on-stdin, wait for a line on stdin before the first room."""
    report.emit("ready", force=True)
    if args.start_on_stdin:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _connect(args) -> tuple[AsyncClient, KVPool, HeadShare]:
    """A rank's client, its registered pool, and its share of the heads."""
    client = AsyncClient(args.engine, timeout=args.timeout, engine_id=f"sim-{args.role}", slot_batch=8,
                         role=Role(args.role), rank=Rank(tp=args.rank), sizes=tp_sizes(args.tp))
    await client.connect()
    pool = KVPool.create(layout_from(args))
    try:
        spec, regions = rank_registration(pool.layout, args.heads, args.tp, PageOrder(args.page_order))
        pool.version = await client.register_kv([pool.memory.handle], spec, regions)
        await client.create_aux_buffer(args.slots, AUX_RECORD_BYTES)
    except BaseException:
        pool.close()
        await client.close()
        raise
    share = HeadShare.of_rank(args.heads, args.tp, args.rank, pool.layout.page_size, spec.page_order)
    return client, pool, share


async def _give_back(client: AsyncClient, slot: Slot) -> None:
    """Return a slot whose room may never have started (its request was refused, or
    lost); if the daemon bound it after all, it is released with the room instead."""
    try:
        await client.free_slot(slot)
    except errors.PdxferError:
        pass


async def _alloc_slot(client: AsyncClient) -> Slot:
    while True:
        try:
            return await client.alloc_slot()
        except errors.Busy as exc:
            await asyncio.sleep(exc.retry_after_ms / 1000)


class Lockstep:
    """The ranks of one engine admit rooms together, as one scheduler does for all of
    its TP ranks (SGLang and vLLM gate each step on every rank's state): the ranks
    share a file of rooms finished per rank, and the room at position i of the list
    starts once every rank finished i - in_flight + 1. Ranks left to run alone drift
    apart by whole rooms, and their calls for a room no longer arrive together."""

    # A wakeup sent before a rank bound its socket is lost: look at the counts again anyway.
    RECHECK_S = 0.05

    def __init__(self, path: str, ranks: int, rank: int) -> None:
        self.finished = np.memmap(path, dtype=np.int64, mode="r+", shape=(ranks,))
        self.rank = rank
        # Each rank hears the others' finishes on a datagram socket in the abstract namespace
        # (nothing to clean up); waiting ranks wake when a count moves instead of polling it:
        # six ranks polling every 0.5 ms took more CPU than both daemons on a 2-core box.
        tag = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
        self.names = [f"\0pdxfer-lockstep-{tag}-{r}" for r in range(ranks)]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.names[rank])
        self.sock.setblocking(False)
        self.listening = False
        self.moved: asyncio.Future | None = None

    def _heard(self) -> None:
        try:
            while self.sock.recv(16):
                pass
        except BlockingIOError:
            pass
        self._wake()

    def _wake(self) -> None:
        if self.moved is not None and not self.moved.done():
            self.moved.set_result(None)
        self.moved = None

    async def admit(self, position: int, in_flight: int) -> None:
        loop = asyncio.get_running_loop()
        if not self.listening:
            loop.add_reader(self.sock, self._heard)
            self.listening = True
        while int(self.finished.min()) < position - in_flight + 1:
            if self.moved is None:
                self.moved = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self.moved), self.RECHECK_S)
            except asyncio.TimeoutError:
                pass

    def finish(self) -> None:
        self.finished[self.rank] += 1  # only this rank writes its counter
        for rank, name in enumerate(self.names):
            if rank != self.rank:
                try:
                    self.sock.sendto(b"\1", name)
                except OSError:  # not bound yet (the recheck covers it), or its queue is full of wakeups
                    pass
        self._wake()

    def close(self) -> None:
        if self.listening:
            asyncio.get_running_loop().remove_reader(self.sock)
        self.sock.close()


async def run_rooms(specs: list[RoomSpec], in_flight: int, one, lockstep: Lockstep | None = None) -> None:
    """``one(spec)`` for every spec, ``in_flight`` at a time, in order: one task per
    room in flight, not one per room; with ``lockstep``, in step with the engine's
    other ranks."""
    queue = iter(enumerate(specs))

    async def worker() -> None:
        for position, spec in queue:
            if lockstep is not None:
                await lockstep.admit(position, in_flight)
            await one(spec)
            if lockstep is not None:
                lockstep.finish()

    try:
        await asyncio.gather(*(worker() for _ in range(min(in_flight, len(specs)) or 1)))
    finally:
        if lockstep is not None:
            lockstep.close()


async def run_prefill(args) -> dict:
    client, kv, share = await _connect(args)
    layout = kv.layout
    pages = PageAllocator(layout.num_pages, args.seed + 1)
    arrays = kv.arrays()
    specs, fixed = _rooms(args)
    for spec in specs if fixed else ():  # planned pages are never reused: fill them all now
        fill_pages(arrays, spec.room, fixed[spec.index][0], share)
    records = planned_records(specs, bool(fixed))
    outcome: dict[str, int] = {}
    timings: list[tuple[int, float, float, bool]] = []
    report = Reporter()
    await _ready(args, report)
    cpu = time.process_time()

    async def one(spec: RoomSpec) -> None:
        n = pages_for_tokens(spec.tokens, layout.page_size)
        src = fixed[spec.index][0] if fixed else await pages.take(n)
        try:
            if not fixed:
                fill_pages(arrays, spec.room, src, share)
            slot = await _alloc_slot(client)
            client.aux.payload(slot)[:AUX_RECORD_BYTES] = np.frombuffer(record_of(records, spec), np.uint8)
            t0 = time.monotonic()
            try:  # the daemon releases the room once settled: no release() below
                await client.send(spec.room, src, spec.tokens, slot, aux_bytes=AUX_RECORD_BYTES, wait=False, release_when_settled=True)
                status = await client.wait(spec.room, timeout=args.room_timeout)
            except errors.PdxferError:  # refused (or lost): the slot may never have been bound
                await _give_back(client, slot)
                raise
            timings.append((spec.room, t0, time.monotonic(), status.state is RoomState.SUCCESS))
            key = status.state.value if status.state is RoomState.SUCCESS else f"failed:{status.code.value}"
        except errors.PdxferError as exc:
            key = f"error:{exc.code.value}"
        outcome[key] = outcome.get(key, 0) + 1
        if not fixed:
            await pages.give(src)
        report.emit("progress", done=sum(outcome.values()))

    await run_rooms(specs, args.in_flight, one, _lockstep(args))
    cpu = time.process_time() - cpu
    await client.close()
    kv.close()
    _save_timings(args.timings, timings)
    return {"event": "summary", "role": "prefill", "outcome": outcome, "cpu_s": cpu}


async def run_decode(args) -> dict:
    client, kv, share = await _connect(args)
    layout = kv.layout
    prefill_sizes = tp_sizes(args.prefill_tp)
    faults = {k: v for k, v in (f.split(":") for f in args.fault)} if args.fault else {}
    faults = {k: int(v) for k, v in faults.items()}
    pages = PageAllocator(layout.num_pages, args.seed + 2)
    arrays = kv.arrays()
    region_bytes = sum(a.shape[1] for a in arrays)
    specs, fixed = _rooms(args)
    records = planned_records(specs, bool(fixed))
    outcome: dict[str, int] = {}
    by_fault: dict[str, dict[str, int]] = {}
    latencies: list[float] = []
    timings: list[tuple[int, float, float, bool]] = []
    to_check: list[tuple[RoomSpec, np.ndarray]] = []  # with --plan: rooms whose pages are checked at the end
    moved = 0
    mismatches = 0
    corrupt = args.corrupt
    report = Reporter()
    await _ready(args, report)
    started, cpu = time.perf_counter(), time.process_time()

    def check(spec: RoomSpec, pages: np.ndarray) -> bool:
        nonlocal corrupt
        if corrupt:
            corrupt = False
            corrupt_one_byte(arrays, pages)
        return pages_match(arrays, spec.room, pages, share)

    async def one(spec: RoomSpec) -> None:
        nonlocal moved, mismatches
        fault = fault_of(spec.index, faults)
        n_src = pages_for_tokens(spec.tokens, layout.page_size)
        n_dst = pages_for_tokens(spec.tokens + args.draft_tokens, layout.page_size)
        if fault == "small":  # one page short of prompt + drafts (when a page can be spared)
            n_dst -= 1
            fault = fault if n_dst else ""
            n_dst = n_dst or 1
        dst = fixed[spec.index][1] if fixed else await pages.take(n_dst)
        wire_pages = dst
        version = None
        if fault == "out_of_range":
            wire_pages = dst.copy()
            wire_pages[-1] = layout.num_pages
        elif fault == "stale":
            version = kv.version + 1
        t0 = time.perf_counter()
        try:
            slot = await _alloc_slot(client)
            client.aux.payload(slot)[:] = 0
            t_call = time.monotonic()
            try:
                await client.expect(spec.room, args.bootstrap, wire_pages, slot, num_draft_tokens=args.draft_tokens, memory_version=version,
                                    prefill_sizes=prefill_sizes, wait=False)
                status = await client.wait(spec.room, timeout=args.room_timeout)
            except errors.PdxferError:  # refused (or lost): the slot may never have been bound
                await _give_back(client, slot)
                raise
            timings.append((spec.room, t_call, time.monotonic(), status.state is RoomState.SUCCESS))
            if status.state is RoomState.SUCCESS:
                latencies.append(time.perf_counter() - t0)
                ok = client.aux.read(slot, spec.room) == record_of(records, spec)
                if fixed and ok:
                    to_check.append((spec, dst[:n_src]))
                elif ok:
                    ok = check(spec, dst[:n_src])
                if not ok:
                    mismatches += 1
                    print(f"room {spec.room}: destination bytes differ from the source", file=sys.stderr)
                moved += n_src * region_bytes + AUX_RECORD_BYTES
                key = "success"
            else:
                key = f"failed:{status.code.value}"
                if not fault:
                    print(f"room {spec.room}: failed [{status.code.value}] {status.reason}", file=sys.stderr)
            await client.release(spec.room, wait=False)
        except errors.PdxferError as exc:
            key = f"error:{exc.code.value}"
            if not fault:
                print(f"room {spec.room}: {exc}", file=sys.stderr)
        outcome[key] = outcome.get(key, 0) + 1
        bucket = by_fault.setdefault(fault or "none", {})
        bucket[key] = bucket.get(key, 0) + 1
        if not fixed:
            await pages.give(dst)
        report.emit("progress", done=sum(outcome.values()), total=len(specs), bytes=moved, mismatches=mismatches)

    await run_rooms(specs, args.in_flight, one, _lockstep(args))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    for spec, dst in to_check:  # planned pages were never reused: check them now, outside the timed rooms
        if not check(spec, dst):
            mismatches += 1
            print(f"room {spec.room}: destination bytes differ from the source", file=sys.stderr)
    await client.close()
    kv.close()
    _save_timings(args.timings, timings)
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "event": "summary",
        "role": "decode",
        "rooms": len(specs),
        "outcome": outcome,
        "by_fault": by_fault,
        "mismatches": mismatches,
        "bytes": moved,
        "seconds": elapsed,
        "cpu_s": cpu,
        "gbps": moved / elapsed / 1e9 if elapsed else 0.0,
        "p50_ms": float(np.percentile(lat, 50)),
        "p90_ms": float(np.percentile(lat, 90)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


def _lockstep(args) -> Lockstep | None:
    return Lockstep(args.lockstep, args.tp, args.rank) if args.lockstep else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdxfer.tools.sim", description="A simulated prefill or decode engine driving a pdxfer daemon.")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--engine", required=True, help="the daemon's engine endpoint")
    p.add_argument("--bootstrap", default="", help="decode: the prefill daemon's bootstrap address (host:port)")
    p.add_argument("--rooms", type=int, default=400)
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--layout", default="mha", choices=[x.value for x in Layout])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-bytes", type=int, default=512, help="bytes per token per layer in each of K and V of this rank's pool")
    p.add_argument("--tp", type=int, default=1, help="TP size of this engine: one process per rank")
    p.add_argument("--rank", type=int, default=0, help="this process's TP rank")
    p.add_argument("--prefill-tp", type=int, default=1, help="decode: TP size of the prefill engine")
    p.add_argument("--heads", type=int, default=1, help="KV heads of the model, split over the TP ranks")
    p.add_argument("--page-order", default=PageOrder.TOKEN_MAJOR.value, choices=[x.value for x in PageOrder],
                   help="how a page of this rank's pool holds its heads' tokens")
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--draft-tokens", type=int, default=0, help="decode: speculative draft tokens reserved per room")
    p.add_argument("--slots", type=int, default=128, help="aux slots")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a daemon reply")
    p.add_argument("--room-timeout", type=float, default=120.0, help="seconds to wait for a room to settle")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:EVERY",
                   help=f"decode: make every EVERY-th room faulty; KIND is one of {', '.join(FAULTS)}")
    p.add_argument("--plan", default="", metavar="FILE",
                   help="take the rooms and both sides' page lists from a benchmark plan file (pdxfer.tools.bench.plan) instead of "
                   "--rooms/--max-tokens/--seed; its pages are never reused, so the prefill fills every source page before "
                   "its first send() and the decode checks destination pages after its last room")
    p.add_argument("--timings", default="", metavar="FILE",
                   help="write each room's id, the monotonic time of its send()/expect() call and of its settled wait() to FILE (.npz)")
    p.add_argument("--start-on-stdin", action="store_true",
                   help="after the 'ready' line, wait for a line on stdin before the first room (the benchmark samples "
                   "the daemons in between)")
    p.add_argument("--lockstep", default="", metavar="FILE",
                   help="admit rooms in step with the engine's other ranks, as one scheduler does: FILE holds --tp int64 "
                   "zeros, shared by the ranks (the benchmark makes it)")
    p.add_argument("--corrupt", action="store_true",
                   help="decode, testing aid: flip one destination byte of the first successful room before it is checked")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runner = run_prefill if args.role == "prefill" else run_decode
    summary = run_uvloop(runner(args))
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 1 if summary.get("mismatches") else 0


if __name__ == "__main__":
    sys.exit(main())
