"""The benchmark's two references: pairs of processes that move the blocks of a plan
file (pdxfer.tools.bench.plan) from a source pool into a destination pool, both made the
way engines make them (pdxfer.client.KVPool: /dev/shm, pre-faulted) and filled and
checked with the simulated engines' pattern (pdxfer.tools.sim):

* baseline: two raw Mooncake transfer engines. ``te-target`` registers the
  destination pools (one per decode rank) and waits; ``te-writer`` registers the
  source pools (one per prefill rank) and writes every room's blocks, every leg's,
  exactly as the prefill daemon plans them, with one of the engine's APIs (``--api``), at most
  ``--in-flight`` rooms and ``--window`` writes in flight. A room is done when its
  last write completed at the writer. ``--engines N`` gives each process N engines
  and spreads the writes over them as pdxfer's daemons do (pdxfer.core.paths.stripes):
  one engine each is how engines run today, several is pdxfer's way without pdxfer.
* wire: one TCP stream on loopback. ``wire-send`` sends every block of every room,
  gathered with sendmsg(); ``wire-recv`` scatters them into their destinations with
  recvmsg_into(). This is the most the box's network path carries, with no protocol.

    python -m pdxfer.tools.bench.raw te-target --plan FILE
    python -m pdxfer.tools.bench.raw te-writer --plan FILE --peer HOST:PORT[,HOST:PORT...] --dst-base ADDR[,ADDR...] [...]

Each prints JSON lines on stdout: ``ready`` (with what its peer needs), ``progress``
and one ``summary``. Destinations are checked after the timed window; every room
whose bytes differ counts as a mismatch, and the process exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from collections import deque

import numpy as np

from ...client import KVPool
from ...core.paths import stripes
from ..sim import Reporter, corrupt_one_byte, fill_pages, pages_match
from .plan import Plan

APIS = ("submit", "submit_spin", "batch_async", "batch_sync")
POLL_MIN, POLL_MAX = 0.00005, 0.001  # backoff between status polls when nothing completed
# With the window full (tens of milliseconds of writes queued in the engine) a longer
# sleep leaves the cores to the engine's threads, as the pump does. Medium rooms,
# interleaved runs: 2.29-2.44 GB/s backing off from POLL_MIN as when the window has
# room, 2.93-3.00 sleeping 1 ms once it is full; medians of three runs sleeping 1, 2
# and 4 ms: 2.83, 2.90 and 2.99.
FULL_WINDOW_PAUSE = 0.004
SYNC_THREADS_MAX = 16  # batch_sync: one thread per room in flight, at most this many
IOV_MAX = 512  # buffers per sendmsg()/recvmsg_into() call
SOCKET_BUFFER = 8 * 2**20


def proc_sample(pid: int | str = "self") -> dict:
    """CPU seconds (all threads, user + system) and memory of a process, from /proc:
    VmRSS, VmHWM (peak), RssAnon (private memory, without mapped pools), in bytes."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    out = {"cpu_s": (int(fields[11]) + int(fields[12])) / ticks}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def save_timings(path: str, rooms, starts, ends) -> None:
    if path:
        np.savez(path, room=np.asarray(rooms, np.uint64), start=np.asarray(starts, np.float64),
                 end=np.asarray(ends, np.float64), ok=np.ones(len(rooms), bool))


def check_rooms(plan: Plan, pools: list[KVPool], corrupt: bool) -> int:
    """Rooms whose destination pages (in every decode rank's pool) do not hold their pattern."""
    ranks = [(pool.arrays(), plan.workload.share("decode", d)) for d, pool in enumerate(pools)]
    if corrupt and plan.rooms:
        corrupt_one_byte(ranks[0][0], plan.rooms[0].dst)
    bad = 0
    for r in plan.rooms:
        if not all(pages_match(arrays, r.room, r.dst, share) for arrays, share in ranks):
            bad += 1
            print(f"room {r.room}: destination bytes differ from the source", file=sys.stderr)
    return bad


def source_pools(plan: Plan) -> list[KVPool]:
    """A pool per prefill rank, holding its heads of every room's pattern."""
    pools = []
    try:
        for p in range(plan.workload.prefill_tp):
            pools.append(pool := KVPool.create(plan.rank_layout("prefill")))
            arrays, share = pool.arrays(), plan.workload.share("prefill", p)
            for r in plan.rooms:
                fill_pages(arrays, r.room, r.src, share)
    except BaseException:
        close_all(pools)
        raise
    return pools


def destination_pools(plan: Plan) -> list[KVPool]:
    pools = []
    try:
        for _ in range(plan.workload.decode_tp):
            pools.append(KVPool.create(plan.rank_layout("decode")))
    except BaseException:
        close_all(pools)
        raise
    return pools


def close_all(pools: list[KVPool]) -> None:
    for pool in pools:
        pool.close()


def start_engines(count: int) -> list[tuple[object, str]]:
    """``count`` started engines with their sessions."""
    from mooncake.engine import TransferEngine

    out = []
    for _ in range(count):
        engine = TransferEngine()
        rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"transfer engine failed to initialise (code {rc})")
        out.append((engine, f"127.0.0.1:{engine.get_rpc_port()}"))
    return out


def register(engines: list[tuple[object, str]], pools: list[KVPool]) -> None:
    for engine, _ in engines:
        for pool in pools:
            rc = engine.register_memory(pool.memory.address, pool.memory.size)
            if rc != 0:
                raise SystemExit(f"transfer engine refused to register {pool.memory.size} bytes (code {rc})")


def routes(engines: list[tuple[object, str]], peer: list[str]) -> list[tuple[object, str]]:
    """(our engine, the peer's session) per stripe, taken in turn."""
    return [(engines[e][0], peer[s]) for e, s in stripes(len(engines), len(peer))]


# --- baseline: raw transfer engines


def te_target(args) -> int:
    plan = Plan.load(args.plan)
    engines = start_engines(args.engines)
    idle = proc_sample()
    pools = destination_pools(plan)
    try:
        register(engines, pools)
        emit("ready", sessions=[session for _, session in engines], bases=[pool.memory.address for pool in pools], idle=idle)
        if sys.stdin.readline().strip() != "verify":  # the bench went away
            return 1
        bad = check_rooms(plan, pools, args.corrupt)
    finally:
        close_all(pools)
    emit("summary", role="te-target", rooms=len(plan.rooms), mismatches=bad)
    return 1 if bad else 0


class Tally:
    """Per-room start and end times, and the progress line."""

    def __init__(self, plan: Plan) -> None:
        self.starts = np.zeros(len(plan.rooms))
        self.ends = np.zeros(len(plan.rooms))
        self.sizes = plan.room_bytes()
        self.done = 0
        self.bytes = 0
        self.report = Reporter()

    def start(self, i: int) -> None:
        self.starts[i] = time.monotonic()

    def end(self, i: int) -> None:
        self.ends[i] = time.monotonic()
        self.done += 1
        self.bytes += int(self.sizes[i])
        self.report.emit("progress", done=self.done, bytes=self.bytes, mismatches=0)


def write_submit(ways: list, jobs: list, in_flight: int, window: int, tally: Tally, spin: bool = False) -> int:
    """One transfer_submit_write per block, the routes in turn, transfer_check_status
    on the oldest write, a sleep when nothing completed (none with ``spin``): short
    while the window has room, FULL_WINDOW_PAUSE once it is full. Returns the writes
    submitted."""
    calls = [(engine.transfer_submit_write, engine.transfer_check_status, session) for engine, session in ways]
    turn = 0
    left = [len(j[0]) for j in jobs]
    queue: deque[list[int]] = deque()  # [room, next block] of admitted rooms with blocks to submit
    writes: deque[tuple[object, int, int]] = deque()  # (its status call, handle, room), oldest first
    admitted = live = submitted = 0
    pause = 0.0
    while tally.done < len(jobs):
        progressed = False
        while admitted < len(jobs) and live < in_flight:
            tally.start(admitted)
            queue.append([admitted, 0])
            admitted += 1
            live += 1
        while queue and len(writes) < window:
            entry = queue[0]
            room, first = entry
            src, dst, length = jobs[room]
            last = min(len(src), first + window - len(writes))
            for b in range(first, last):
                write, check, session = calls[turn]
                turn = (turn + 1) % len(calls)
                handle = write(session, src[b], dst[b], length[b])
                if handle == 0:
                    raise SystemExit(f"transfer engine refused write {b} of room {room}")
                writes.append((check, handle, room))
            submitted += last - first
            entry[1] = last
            if last == len(src):
                queue.popleft()
            progressed = True
        while writes:
            check, handle, room = writes[0]
            status = check(handle)
            if status == 0:
                break
            if status != 1:
                raise SystemExit(f"a write of room {room} failed (status {status})")
            writes.popleft()
            left[room] -= 1
            if not left[room]:
                tally.end(room)
                live -= 1
            progressed = True
        if progressed or spin:
            pause = 0.0
        else:
            pause = FULL_WINDOW_PAUSE if len(writes) >= window else min(POLL_MAX, pause * 2 or POLL_MIN)
            time.sleep(pause)
    return submitted


def write_submit_spin(ways: list, jobs: list, in_flight: int, window: int, tally: Tally) -> int:
    """As write_submit, polling without sleeping: lowest latency, a core busy."""
    return write_submit(ways, jobs, in_flight, window, tally, spin=True)


def _chunks(job, size: int):
    src, dst, length = job
    return [(src[a : a + size], dst[a : a + size], length[a : a + size]) for a in range(0, len(src), size)]


def write_batch_async(ways: list, jobs: list, in_flight: int, window: int, tally: Tally) -> int:
    """batch_transfer_async_write per room (in chunks of half the window, so two are
    in flight; chunks take the routes in turn), get_batch_transfer_status on the
    oldest batch (it returns once the batch is done)."""
    size = max(1, window // 2)
    parts = [len(_chunks(j, size)) for j in jobs]
    pending: deque[tuple[int, tuple]] = deque()  # (room, chunk) of admitted rooms, not yet submitted
    batches: deque[tuple[object, int, int, int]] = deque()  # (engine, batch id, room, writes)
    admitted = live = in_writes = submitted = turn = 0
    while tally.done < len(jobs):
        while admitted < len(jobs) and live < in_flight:
            tally.start(admitted)
            pending.extend((admitted, c) for c in _chunks(jobs[admitted], size))
            admitted += 1
            live += 1
        while pending and (not batches or in_writes + len(pending[0][1][0]) <= window):
            room, (src, dst, length) = pending.popleft()
            engine, session = ways[turn]
            turn = (turn + 1) % len(ways)
            batch = engine.batch_transfer_async_write(session, src, dst, length)
            if batch == 0:
                raise SystemExit(f"transfer engine refused a batch of room {room}")
            batches.append((engine, batch, room, len(src)))
            in_writes += len(src)
            submitted += len(src)
        engine, batch, room, n = batches.popleft()
        rc = engine.get_batch_transfer_status([batch])
        if rc != 0:
            raise SystemExit(f"a batch of room {room} failed (code {rc})")
        in_writes -= n
        parts[room] -= 1
        if not parts[room]:
            tally.end(room)
            live -= 1
    return submitted


def write_batch_sync(ways: list, jobs: list, in_flight: int, window: int, tally: Tally) -> int:
    """batch_transfer_sync_write, one thread per room in flight (at most
    SYNC_THREADS_MAX), the threads taking the routes in turn; each call returns when
    its batch is done."""
    threads = max(1, min(in_flight, SYNC_THREADS_MAX))
    size = max(1, window // threads)
    lock = threading.Lock()
    order = iter(range(len(jobs)))
    failures: list[str] = []

    def worker(engine, session: str) -> None:
        while not failures:
            with lock:
                room = next(order, None)
                if room is None:
                    return
                tally.start(room)
            for src, dst, length in _chunks(jobs[room], size):
                rc = engine.batch_transfer_sync_write(session, src, dst, length)
                if rc != 0:
                    failures.append(f"a batch of room {room} failed (code {rc})")
                    return
            with lock:
                tally.end(room)

    pool = [threading.Thread(target=worker, args=ways[i % len(ways)]) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if failures:
        raise SystemExit(failures[0])
    return sum(len(j[0]) for j in jobs)


WRITERS = {"submit": write_submit, "submit_spin": write_submit_spin, "batch_async": write_batch_async, "batch_sync": write_batch_sync}


def te_writer(args) -> int:
    plan = Plan.load(args.plan)
    engines = start_engines(args.engines)
    idle = proc_sample()
    pools = source_pools(plan)
    try:
        register(engines, pools)
        dst_bases = tuple(int(x) for x in args.dst_base.split(","))
        jobs = [(b.src.tolist(), b.dst.tolist(), b.length.tolist())
                for b in plan.blocks(tuple(pool.memory.address for pool in pools), dst_bases)]
        emit("ready", idle=idle)
        if sys.stdin.readline().strip() != "go":
            return 1
        before = proc_sample()
        tally = Tally(plan)
        ways = routes(engines, args.peer.split(","))
        submitted = WRITERS[args.api](ways, jobs, args.in_flight, args.window, tally)
        after = proc_sample()
    finally:
        close_all(pools)
    save_timings(args.timings, [r.room for r in plan.rooms], tally.starts, tally.ends)
    emit("summary", role="te-writer", api=args.api, rooms=len(jobs), done=tally.done, bytes=tally.bytes, blocks=submitted,
         before=before, after=after)
    return 0


# --- wire: one TCP stream


def _advance(views: list[memoryview], at: int, count: int) -> int:
    """Consume ``count`` bytes from views[at:]; return the first unfinished index."""
    while count:
        n = views[at].nbytes
        if count >= n:
            count -= n
            at += 1
        else:
            views[at] = views[at][count:]
            count = 0
    return at


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    at = 0
    while at < len(views):
        at = _advance(views, at, sock.sendmsg(views[at : at + IOV_MAX]))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    at = 0
    while at < len(views):
        n = sock.recvmsg_into(views[at : at + IOV_MAX])[0]
        if n == 0:
            raise SystemExit("the sender closed the stream early")
        at = _advance(views, at, n)


def _views(memory: memoryview, starts: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    return [memory[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist())]


def wire_recv(args) -> int:
    plan = Plan.load(args.plan)
    pools = destination_pools(plan)
    try:
        return _wire_recv(args, plan, pools)
    finally:
        close_all(pools)


def _wire_recv(args, plan: Plan, pools: list[KVPool]) -> int:
    """One stream into one pool: the wire runs between one rank on each side."""
    memory = memoryview(pools[0].memory.array)
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    emit("ready", port=server.getsockname()[1])
    conn, _ = server.accept()
    header = bytearray(8)
    recv_views(conn, [memoryview(header)])
    (started,) = struct.unpack("<d", header)
    tally = Tally(plan)
    for i, blocks in enumerate(plan.blocks()):
        tally.starts[i] = started
        recv_views(conn, _views(memory, blocks.dst, blocks.length))
        tally.end(i)
    conn.close()
    save_timings(args.timings, [r.room for r in plan.rooms], tally.starts, tally.ends)
    del memory
    bad = check_rooms(plan, pools, args.corrupt)
    emit("summary", role="wire-recv", rooms=len(plan.rooms), done=tally.done, bytes=tally.bytes,
         blocks=int(sum(len(b) for b in plan.blocks())), mismatches=bad)
    return 1 if bad else 0


def wire_send(args) -> int:
    plan = Plan.load(args.plan)
    pools = source_pools(plan)
    try:
        memory = memoryview(pools[0].memory.array)
        sock = socket.create_connection(("127.0.0.1", args.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rooms = [_views(memory, b.src, b.length) for b in plan.blocks()]
        sock.sendall(struct.pack("<d", time.monotonic()))
        for views in rooms:
            send_views(sock, views)
        sock.close()
    finally:
        close_all(pools)
    emit("summary", role="wire-send", rooms=len(plan.rooms))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdxfer.tools.bench.raw", description="The benchmark's reference transfers (see pdxfer bench).")
    sub = p.add_subparsers(dest="role", required=True)
    for name, text in (("te-target", "raw transfer engine owning the destination pool"),
                       ("te-writer", "raw transfer engine writing every block into te-target's pool"),
                       ("wire-recv", "socket receiver scattering blocks into the destination pool"),
                       ("wire-send", "socket sender of every block")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--plan", required=True, metavar="FILE", help="plan file written by pdxfer.tools.bench.plan")
        s.add_argument("--timings", default="", metavar="FILE", help="write each room's start and end times here (.npz)")
        if name in ("te-target", "te-writer"):
            s.add_argument("--engines", type=int, default=1, help="transfer engines in this process, writes spread over them (default: 1)")
        if name in ("te-target", "wire-recv"):
            s.add_argument("--corrupt", action="store_true", help="flip one destination byte before the check (testing aid)")
        if name == "te-writer":
            s.add_argument("--peer", required=True, help="te-target's transfer engine sessions, host:port[,host:port...]")
            s.add_argument("--dst-base", required=True, help="addresses of te-target's destination pools, one per decode rank (comma-separated)")
            s.add_argument("--api", choices=APIS, default="submit", help="transfer engine API to write with")
            s.add_argument("--in-flight", type=int, default=1, help="rooms in flight")
            s.add_argument("--window", type=int, default=512, help="writes in flight to the peer (its queue holds 1024)")
        if name == "wire-send":
            s.add_argument("--port", type=int, required=True, help="wire-recv's port on 127.0.0.1")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = {"te-target": te_target, "te-writer": te_writer, "wire-recv": wire_recv, "wire-send": wire_send}[args.role]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
