"""The transfer pump: the one thread that calls the transport.

The event loop hands it jobs (one room's blocks to one peer); the pump submits them
in FIFO order per peer, never keeping more than ``window`` blocks in flight to one
peer (the transfer engine rejects a peer's queue past its limit), polls completions
oldest first, and reports each job back on the event loop exactly once, after every
block it submitted has settled. That last point is what fencing relies on: when a
job's callback runs, no write of that job can still land.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .plan import Blocks
from .transport import Status, Transport

log = logging.getLogger("pdxfer.pump")

IDLE_POLL_MAX = 0.001  # longest sleep between polls while writes are in flight


@dataclass(eq=False)
class Job:
    id: int
    peer: str
    blocks: Blocks
    on_done: Callable[["Job"], None]  # runs on the event loop
    next: int = 0  # next block to submit
    in_flight: int = 0
    error: str = ""
    cancelled: bool = False
    queued: bool = False  # still has blocks waiting in its peer's queue
    abandoned: bool = False  # the pump failed; writes of this job may still land
    settled: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and not self.cancelled

    def _finished(self) -> bool:
        return self.in_flight == 0 and (self.next >= len(self.blocks) or bool(self.error) or self.cancelled)


@dataclass(eq=False)
class _Peer:
    jobs: deque = field(default_factory=deque)  # jobs with blocks still to submit
    in_flight: deque = field(default_factory=deque)  # (handle, job), oldest first


class TransferPump:
    def __init__(self, transport: Transport, window: int, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.window = window
        self.loop = loop
        self.blocks_submitted = 0
        self.bytes_done = 0
        self._inbox: deque[Job] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._peers: dict[str, _Peer] = {}
        self._finished: list[Job] = []  # settled this round, to hand to the event loop
        self._cancels = False  # a job was cancelled since the last round

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdxfer-pump", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._inbox.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Submit no more of ``job``; its callback still waits for what is in flight."""
        job.cancelled = True
        self._cancels = True
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        pause = 0.0
        while not self._stopping:
            try:
                progressed = self._round()
            except Exception:  # never let the pump die silently (H1); fail what it held
                log.exception("transfer pump round failed; failing its in-flight jobs")
                self._fail_everything("transfer pump error (see daemon log)")
                progressed = True
            self._flush()
            busy = any(p.in_flight or p.jobs for p in self._peers.values())
            if progressed:
                pause = 0.0
            elif busy:
                pause = min(IDLE_POLL_MAX, pause * 2 or 0.00005)
                time.sleep(pause)
            else:
                self._wake.wait()
                self._wake.clear()

    def _round(self) -> bool:
        progressed = False
        while self._inbox:
            job = self._inbox.popleft()
            self._peers.setdefault(job.peer, _Peer()).jobs.append(job)
            job.queued = True
            progressed = True
        if self._cancels:
            self._cancels = False
            progressed |= self._drop_cancelled()
        for peer_name, peer in self._peers.items():
            progressed |= self._fill(peer_name, peer)
            progressed |= self._drain(peer)
        return progressed

    def _drop_cancelled(self) -> bool:
        """Take cancelled jobs out of their queues now, not when they reach the front."""
        dropped = False
        for peer in self._peers.values():
            keep = deque()
            for job in peer.jobs:
                if job.cancelled:
                    job.queued = False
                    dropped = True
                    if job._finished():
                        self._finished.append(job)
                else:
                    keep.append(job)
            peer.jobs = keep
        return dropped

    def _flush(self) -> None:
        if self._finished:
            self.loop.call_soon_threadsafe(_deliver, self._finished)
            self._finished = []

    def _fill(self, peer_name: str, peer: _Peer) -> bool:
        progressed = False
        while peer.jobs and len(peer.in_flight) < self.window:
            job = peer.jobs[0]
            if job.cancelled or job.error or job.next >= len(job.blocks):
                peer.jobs.popleft()
                job.queued = False
                if job._finished():
                    self._finished.append(job)
                continue
            start = job.next
            end = min(len(job.blocks), start + self.window - len(peer.in_flight))
            b = job.blocks
            handles = self.transport.submit(
                peer_name, b.src[start:end].tolist(), b.dst[start:end].tolist(), b.length[start:end].tolist()
            )
            job.next = end
            self.blocks_submitted += end - start
            for offset, handle in enumerate(handles):
                if handle == 0:
                    job.error = job.error or f"transfer engine refused block {start + offset} to {peer_name}"
                else:
                    peer.in_flight.append((handle, job, int(b.length[start + offset])))
                    job.in_flight += 1
            progressed = True
        return progressed

    def _drain(self, peer: _Peer) -> bool:
        progressed = False
        while peer.in_flight:
            handle, job, nbytes = peer.in_flight[0]
            status = self.transport.poll(handle)
            if status is Status.PENDING:
                break
            peer.in_flight.popleft()
            job.in_flight -= 1
            progressed = True
            if status is Status.FAILED:
                job.error = job.error or f"transfer engine reported a failed write to {job.peer}"
            else:
                self.bytes_done += nbytes
            if job._finished() and not job.queued:
                self._finished.append(job)
        return progressed

    def _fail_everything(self, reason: str) -> None:
        for peer in self._peers.values():
            jobs = {id(j): j for j in peer.jobs}
            jobs.update({id(j): j for _, j, _ in peer.in_flight})
            for job in jobs.values():
                job.error = job.error or reason
                job.abandoned = True
                self._finished.append(job)
            peer.jobs.clear()
            peer.in_flight.clear()


def _deliver(jobs: list[Job]) -> None:
    for job in jobs:
        if job.settled:
            continue
        job.settled = True
        try:
            job.on_done(job)
        except Exception:
            log.exception("job %d completion handler failed", job.id)
