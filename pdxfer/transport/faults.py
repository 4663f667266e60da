"""A fault-injecting wrapper around a real transport. Testing only.

The real engine moves every byte; this wrapper only changes *when* it does and what
it reports, to produce faults the engine cannot be made to produce on demand:

* ``delay=P:MS``  with probability P, report a completed write up to MS late, so
  completions arrive out of order;
* ``early=P:MS``  report the write done at once but perform it up to MS later: the
  visibility race of asynchronous NVLink paths;
* ``ghost=P:MS``  after a small write (an aux record, <= 4 KiB), write the same bytes
  to the same place again up to MS later: a late write for a slot that may have been
  reused since;
* ``fail=P``      report the block failed without writing it;
* ``raise=P``     raise from poll(), as a bug in a transport binding would;
* ``break_after=N`` after N blocks, push an over-limit batch through the real
  engine's batch API (the same block, so nothing but its own bytes can land). Here
  that sometimes leaves the engine's session to the peer broken: a real fault;
* ``broken_after=N`` after N blocks, fail every write and probe until ``reset``: the
  broken session, deterministically.

Spec: comma-separated, e.g. ``delay=0.3:5,ghost=0.2:20,fail=0.01``. Seeded, so a
failing run can be repeated with ``seed=S``. Late writes are issued by a thread of
the wrapper's own, so they land on time even while the pump is idle.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import Peer, Status, Transport

log = logging.getLogger("pdxfer.faults")

GHOST_MAX = 4096
GHOST_SLOTS = 256
_FAKE_BASE = 1 << 62  # fake handles live above any address the engine hands out


@dataclass(frozen=True)
class FaultSpec:
    delay: tuple[float, float] = (0.0, 0.0)  # (probability, seconds)
    early: tuple[float, float] = (0.0, 0.0)
    ghost: tuple[float, float] = (0.0, 0.0)
    fail: float = 0.0
    raise_: float = 0.0
    break_after: int = 0
    broken_after: int = 0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        fields: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name in ("delay", "early", "ghost"):
                p, _, ms = value.partition(":")
                fields[name] = (float(p), float(ms or 0) / 1000)
            elif name in ("fail", "raise"):
                fields[name.replace("raise", "raise_")] = float(value)
            elif name in ("break_after", "broken_after", "seed"):
                fields[name] = int(value)
            else:
                raise ValueError(f"unknown fault {name!r} in {text!r} (known: delay, early, ghost, fail, raise, break_after, broken_after, seed)")
        return cls(**fields)


class FaultInjectingTransport:
    def __init__(self, inner: Transport, spec: FaultSpec, repaired: bool = False) -> None:
        self.inner = inner
        self.spec = spec
        self.injected: dict[str, int] = {"delay": 0, "early": 0, "ghost": 0, "fail": 0, "raise": 0, "break": 0, "broken": 0}
        self._rng = random.Random(spec.seed)
        self._fake = itertools.count(_FAKE_BASE)
        self._fake_status: dict[int, Status] = {}
        self._held: dict[int, float] = {}  # real handle -> report no completion before this time
        self._settled: dict[int, Status] = {}  # real handles the engine finished while held
        self._later: list[tuple[float, int, Peer, int, int, int]] = []  # (due, seq, peer, src, dst, len)
        self._seq = itertools.count()
        self._background: list[int] = []  # handles of delayed/ghost writes nobody waits for
        self._ghost_buf = np.zeros(GHOST_MAX * GHOST_SLOTS, np.uint8)
        self._ghost_next = 0
        self._blocks = 0
        self._repaired = repaired  # a reset (or a new engine process) ends the broken_after fault
        self._lock = threading.Lock()  # guards _later; the late-write thread shares the engine
        self._due = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._late_writes, name="pdxfer-faults", daemon=True)

    @property
    def scratch(self) -> int:
        return self.inner.scratch

    def start(self) -> Peer:
        sessions = self.inner.start()
        self.inner.register(int(self._ghost_buf.ctypes.data), self._ghost_buf.nbytes)
        self._thread.start()
        log.warning("TESTING ONLY: injecting transport faults %s", self.spec)
        return sessions

    def register(self, address: int, length: int, populate: bool = True) -> None:
        self.inner.register(address, length, populate)

    def unregister(self, address: int) -> None:
        self.inner.unregister(address)

    def _roll(self, pair: tuple[float, float]) -> float | None:
        p, seconds = pair
        if p and self._rng.random() < p:
            return self._rng.uniform(0, seconds)
        return None

    def submit(self, peer: Peer, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        handles = []
        now = time.monotonic()
        for s, d, n in zip(src, dst, length):
            self._blocks += 1
            if self.spec.break_after and self._blocks == self.spec.break_after:
                self._break(peer, s, d, n)
            if self.spec.broken_after and self._blocks >= self.spec.broken_after and not self._repaired:
                handles.append(self._fake_handle(Status.FAILED, "broken"))
                continue
            if self.spec.fail and self._rng.random() < self.spec.fail:
                handles.append(self._fake_handle(Status.FAILED, "fail"))
                continue
            early = self._roll(self.spec.early)
            if early is not None:
                self._schedule(now + early, peer, s, d, n)
                handles.append(self._fake_handle(Status.DONE, "early"))
                continue
            if n <= GHOST_MAX:
                ghost = self._roll(self.spec.ghost)
                if ghost is not None:
                    self._schedule(now + ghost, peer, self._snapshot(s, n), d, n)
                    self.injected["ghost"] += 1
            (handle,) = self.inner.submit(peer, [s], [d], [n])
            delay = self._roll(self.spec.delay)
            if handle and delay is not None:
                self._held[handle] = now + delay
                self.injected["delay"] += 1
            handles.append(handle)
        return handles

    def poll(self, handle: int) -> Status:
        if self.spec.raise_ and self._rng.random() < self.spec.raise_:
            self.injected["raise"] += 1
            raise RuntimeError("injected fault: transport poll raised")
        if handle >= _FAKE_BASE:
            return self._fake_status.pop(handle)
        status = self._settled.pop(handle, None) or self.inner.poll(handle)
        until = self._held.get(handle)
        if until is not None:
            if status is not Status.PENDING and time.monotonic() < until:
                self._settled[handle] = status  # the engine is done; we report it later
                return Status.PENDING
            if status is not Status.PENDING:
                del self._held[handle]
        return status

    def probe(self, peer: Peer, dst: int) -> bool:
        if self.spec.broken_after and self._blocks >= self.spec.broken_after and not self._repaired:
            return False
        return self.inner.probe(peer, dst)

    def rotate(self) -> Peer:
        return self.inner.rotate()

    def end(self, sessions: Peer) -> None:
        self.inner.end(sessions)

    def reset(self) -> Peer:
        self._repaired = True
        return self.inner.reset()

    def close(self) -> None:
        self._stopping = True
        self._due.set()
        self._thread.join(2)
        log.warning("TESTING ONLY: injected faults %s", self.injected)
        self.inner.close()

    # --- internals

    def _fake_handle(self, status: Status, kind: str) -> int:
        handle = next(self._fake)
        self._fake_status[handle] = status
        self.injected[kind] += 1
        return handle

    def _snapshot(self, src: int, n: int) -> int:
        """Copy the bytes as they are now, so the late write carries the old record."""
        at = (self._ghost_next % GHOST_SLOTS) * GHOST_MAX
        self._ghost_next += 1
        address = int(self._ghost_buf.ctypes.data) + at
        ctypes.memmove(address, src, n)
        return address

    def _schedule(self, due: float, peer: Peer, src: int, dst: int, n: int) -> None:
        with self._lock:
            heapq.heappush(self._later, (due, next(self._seq), peer, src, dst, n))
        self._due.set()

    def _late_writes(self) -> None:
        while not self._stopping:
            with self._lock:
                now = time.monotonic()
                due = []
                while self._later and self._later[0][0] <= now:
                    due.append(heapq.heappop(self._later))
                wait = self._later[0][0] - now if self._later else None
            for _, _, peer, src, dst, n in due:
                self._background.extend(h for h in self.inner.submit(peer, [src], [dst], [n]) if h)
            self._background = [h for h in self._background if self.inner.poll(h) is Status.PENDING]
            if self._background:
                wait = 0.0005 if wait is None else min(wait, 0.0005)
            self._due.wait(wait)
            self._due.clear()

    def _break(self, peer: Peer, src: int, dst: int, n: int) -> None:
        """Push a batch far over the engine's per-peer queue through its batch API, and
        return while it is still queued, so that pdxfer's next writes meet a full queue.
        It repeats one real block, so whatever of it lands late writes the right bytes.
        The first engine and the peer's first session: the pair every stripe list starts with."""
        engines = getattr(self.inner, "_engines", None)
        if not engines:
            return
        engine, count = engines[0], 4096
        batch = engine.batch_transfer_async_write(peer[0], [src] * count, [dst] * count, [n] * count)
        if batch:  # reaped elsewhere: the status call blocks until the whole batch is done
            threading.Thread(target=engine.get_batch_transfer_status, args=([batch],), name="pdxfer-faults-break", daemon=True).start()
        self.injected["break"] += 1
        log.warning("TESTING ONLY: pushed an over-limit batch of %d writes to %s", count, peer[0])
