"""The transfer pump: the one thread that calls the transport.

The event loop hands it jobs (one room's blocks to one peer); the pump submits them
in FIFO order per peer, keeps at most a window of blocks in flight to each peer,
polls completions oldest first, and reports each job back on the event loop exactly
once, after every block it submitted has settled. That last point is what fencing
relies on: when a job's callback runs, no write of that job can still land.

Faults. The transfer engine rejects writes past a peer's queue limit, and a session
can break inside it. A failed write halves that peer's window (it grows back by one
per window of completed writes) and marks the peer suspect: once its writes drained,
the pump probes it with a small write before it sends it more; if the probe fails,
it drains every peer, re-creates the transport (``Transport.reset``) and probes
again. A failed block is written again (writes are idempotent: same bytes, same
place) up to a per-job budget; a job that exhausts it fails, and only its room fails.

A session can also wedge: after an over-limit batch this engine sometimes leaves
every later write to that peer pending, never done nor failed. When no write to a
peer completes for ``stall_timeout`` seconds while some are in flight, the jobs with
writes in flight fail as *abandoned* (a wedged write might still land, so their rooms
wait for another proof of fencing), the transport is re-created, and the peer's queued
jobs go on through the new session. A big block gets longer: stall_timeout plus its
size at STALL_MIN_RATE. Only time the pump was awake counts: a process frozen with its
engine resumes with its writes as they were.

Every failed write, and every failed probe, is also told to ``on_write_failed(sessions)``
on the event loop, once per peer per round: a write that fails to a decode daemon whose
bootstrap connection also closed is evidence that it is gone (roles/prefill/service.py), and its rooms
need not wait for the retries, the probe and a reset of the transport to fail.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..core.topology import key_label
from ..host.cpu_yield import normal_policy
from . import Job, Peer, Status, Transport, label

log = logging.getLogger("pdxfer.pump")

# Polling: with a few writes in flight (a small room, where latency is the point) spin
# for SPIN_SECONDS, then sleep from IDLE_POLL_MIN, doubling up to IDLE_POLL_MAX, between
# polls; with many (bulk transfers, where the engine's threads need the cores) from
# BULK_POLL_MIN up to BULK_POLL_MAX. A full window holds milliseconds of work, so the
# longer bulk sleeps never leave the engine idle: on medium rooms they cut the pump from
# ~28% to ~20% of a core, and the engine's sending thread got the difference.
SPIN_BELOW = 16
SPIN_SECONDS = 0.0001  # a small write completes in ~50 us
IDLE_POLL_MIN, IDLE_POLL_MAX = 0.00002, 0.0002
BULK_POLL_MIN, BULK_POLL_MAX = 0.0001, 0.001
RETRY_BUDGET = 16  # failure episodes (a failed write, then a probe) a job may outlive
STALL_MIN_RATE = 50e6  # bytes/s: a write slower than this counts as stalled (big blocks get longer)
STOOD_STILL = 0.1  # seconds between two rounds past which the pump is taken to have stood still


@dataclass(eq=False)
class _Peer:
    window: int
    jobs: deque = field(default_factory=deque)  # jobs with blocks still to submit
    in_flight: deque = field(default_factory=deque)  # (handle, job, block index, bytes), oldest first
    suspect: bool = False  # a write failed: probe before submitting more
    probe: int = 0
    credit: int = 0  # completions since the window last grew
    progress_at: float = 0.0  # monotonic time of its last completion, or of a submission into an empty pipe


class TransferPump:
    def __init__(
        self,
        transport: Transport,
        window: int,
        loop: asyncio.AbstractEventLoop,
        stall_timeout: float = 5.0,
        *,
        on_write_failed: Callable[[Peer], None],  # runs on the event loop
        on_reset: Callable[[Peer], None] = lambda sessions: None,  # after a stall or failed probe re-created the transport; on the loop
    ) -> None:
        self.transport = transport
        self.window = window
        self.loop = loop
        self.stall_timeout = stall_timeout
        self.on_write_failed = on_write_failed
        self.on_reset = on_reset
        self.blocks_submitted = 0
        self.bytes_done = 0
        self.failed_writes = 0
        self.stalls = 0
        self.resets = 0
        # Jobs written whole, and the seconds they waited for their first write (queued
        # behind other jobs to the peer) and then took until every write settled.
        self.jobs_written = 0
        self.job_queue_seconds = 0.0
        self.job_write_seconds = 0.0
        self._inbox: deque[Job] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._peers: dict[Peer, _Peer] = {}
        self._finished: list[Job] = []  # settled this round, to hand to the event loop
        self._failed_to: set[Peer] = set()  # peers a write or probe failed to this round, to tell the event loop
        self._cancels = False  # a job was cancelled since the last round
        self._reset_wanted: Peer = ()  # the peer whose probe failed, until the transport is reset
        self._idle_actions: list[tuple[Callable[[Transport], object], concurrent.futures.Future]] = []  # waiting for nothing in flight
        self._last_round = time.monotonic()

    def start(self) -> None:
        # At the normal policy even in a daemon that yields the cores (cpu_yield.py):
        # submitting takes a lock the engine's sending thread needs, and a SCHED_IDLE
        # holder preempted mid-call stalls that thread behind it.
        self._thread = threading.Thread(target=self._run, name="pdxfer-pump", daemon=True)
        with normal_policy():
            self._thread.start()

    def submit(self, job: Job) -> None:
        job.queued_at = time.monotonic()
        self._inbox.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Submit no more of ``job``; its callback still waits for what is in flight."""
        job.cancelled = True
        self._cancels = True
        self._wake.set()

    def when_idle(self, action: Callable[[Transport], object]) -> concurrent.futures.Future:
        """Run ``action(transport)`` on this thread (the only one that calls the
        transport) once nothing is in flight; resolves to what it returns, or raises what
        it raised. How a daemon rotates, ends and resets its sessions."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._idle_actions.append((action, future))
        self._wake.set()
        return future

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def depths(self) -> dict[str, int]:
        """Writes in flight and jobs waiting, over all peers (read from another thread: a snapshot)."""
        peers = list(self._peers.values())
        return {
            "writes_in_flight": sum(len(p.in_flight) for p in peers),
            "jobs_waiting": sum(len(p.jobs) for p in peers) + len(self._inbox),
        }

    def _run(self) -> None:
        pause = 0.0
        idle_since = 0.0
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
                pause = idle_since = 0.0
            elif busy:
                now = time.monotonic()
                idle_since = idle_since or now
                few = sum(len(p.in_flight) for p in self._peers.values()) <= SPIN_BELOW
                if not few or now - idle_since > SPIN_SECONDS:  # polls release the GIL: a short spin is cheap
                    if self._windows_full():  # milliseconds of work queued in the engine: no hurry
                        pause = BULK_POLL_MAX
                    else:
                        pause = min(pause * 2, IDLE_POLL_MAX if few else BULK_POLL_MAX) or (IDLE_POLL_MIN if few else BULK_POLL_MIN)
                    time.sleep(pause)
            else:
                self._wake.wait()
                self._wake.clear()

    def _windows_full(self) -> bool:
        return all(len(p.in_flight) >= p.window for p in self._peers.values() if p.in_flight or p.jobs)

    def _round(self) -> bool:
        progressed = False
        while self._inbox:
            job = self._inbox.popleft()
            peer = self._peers.setdefault(job.peer, _Peer(self.window))
            peer.jobs.append(job)
            peer.probe = job.probe or peer.probe
            job.queued = True
            progressed = True
        if self._cancels:
            self._cancels = False
            progressed |= self._drop_cancelled()
        now = time.monotonic()
        self._skip_time_stood_still(now)
        for sessions, peer in self._peers.items():
            progressed |= self._drain(peer)
            if peer.in_flight and self._is_stalled(peer, now) and not self._reset_wanted:
                self._stalled(sessions, peer)
                progressed = True
            # Checked only with jobs waiting for it: a peer whose rooms all ended (a
            # decode daemon that died) would cost a failed probe, then a reset that
            # pauses every peer and leaves one more retired engine.
            if peer.suspect and peer.jobs and not peer.in_flight and not self._reset_wanted:
                self._check(sessions, peer)
                progressed = True
            if not peer.suspect and not self._reset_wanted:
                progressed |= self._fill(sessions, peer)
        if self._reset_wanted and not any(p.in_flight for p in self._peers.values()):
            self._reset()
            progressed = True
        if self._idle_actions and not any(p.in_flight for p in self._peers.values()):
            self._run_idle_actions()
            progressed = True
        return progressed

    def _skip_time_stood_still(self, now: float) -> None:
        """A stall is judged on time the pump was awake. Rounds come a millisecond apart
        while writes are in flight; a longer gap means this process stood still (SIGSTOP,
        a paused host, starvation) and, most often, its transfer engine with it. Writes
        then had no time to complete, and abandoning them as stalled would leave their
        rooms' decode sides waiting for a proof of fencing that never comes."""
        gap, self._last_round = now - self._last_round, now
        if gap > STOOD_STILL:
            for peer in self._peers.values():
                if peer.in_flight:
                    peer.progress_at += gap

    def _run_idle_actions(self) -> None:
        actions, self._idle_actions = self._idle_actions, []
        for action, future in actions:
            try:
                future.set_result(action(self.transport))
            except Exception as exc:  # the caller waits for it
                future.set_exception(exc)

    def _fill(self, sessions: Peer, peer: _Peer) -> bool:
        progressed = False
        now = time.monotonic()
        while peer.jobs and len(peer.in_flight) < peer.window and not peer.suspect:
            job = peer.jobs[0]
            unsent = len(job.blocks) - job.next + len(job.retry)
            if job.deadline and now > job.deadline and not job.error and unsent:
                job.error = f"lease expired with {unsent} of {len(job.blocks)} blocks unsent"
            if job.cancelled or job.error or not unsent:
                peer.jobs.popleft()
                job.queued = False
                if job.finished():
                    self._finished.append(job)
                continue
            room = peer.window - len(peer.in_flight)
            b = job.blocks
            if job.retry:  # rare: fancy indexing is fine here
                indices = [job.retry.popleft() for _ in range(min(room, len(job.retry)))]
                src, dst, length = b.src[indices].tolist(), b.dst[indices].tolist(), b.length[indices].tolist()
            else:  # the hot path: slices, no index arrays built
                end = min(len(job.blocks), job.next + room)
                indices = range(job.next, end)
                src, dst, length = b.lists(job.next, end)
                job.next = end
            if not peer.in_flight:
                peer.progress_at = now
            job.started_at = job.started_at or now
            handles = self.transport.submit(sessions, src, dst, length)
            self.blocks_submitted += len(indices)
            for index, handle, nbytes in zip(indices, handles, length):
                if handle == 0:
                    self._write_failed(sessions, peer, job, index, "refused")
                else:
                    peer.in_flight.append((handle, job, index, nbytes))
                    job.in_flight += 1
            progressed = True
        return progressed

    def _drain(self, peer: _Peer) -> bool:
        progressed = False
        while peer.in_flight:
            handle, job, index, nbytes = peer.in_flight[0]
            status = self.transport.poll(handle)
            if status is Status.PENDING:
                break
            peer.in_flight.popleft()
            job.in_flight -= 1
            progressed = True
            if status is Status.FAILED:
                self._write_failed(job.peer, peer, job, index, "reported failed")
            else:
                self.bytes_done += nbytes
                peer.credit += 1
                if peer.credit >= peer.window:  # additive increase: one block per window completed
                    peer.credit = 0
                    peer.window = min(self.window, peer.window + 1)
            if not job.in_flight and not job.queued and job.finished():
                self._finished.append(job)
        if progressed:
            peer.progress_at = time.monotonic()
        return progressed

    def _write_failed(self, sessions: Peer, peer: _Peer, job: Job, index: int, how: str) -> None:
        """A block was refused or failed: write it again if the job's budget allows
        (nothing was or will be written twice to another place), else fail the job."""
        self.failed_writes += 1
        self._failed_to.add(sessions)
        first = not peer.suspect  # the first failure of an episode; the rest share its cause
        if first:
            peer.window = max(1, peer.window // 2)
            peer.credit = 0
            log.warning("a write to %s %s: window down to %d, probing the session once writes drain", label(sessions), how, peer.window)
        peer.suspect = True
        if job.error or job.cancelled:
            return
        if job.retries < RETRY_BUDGET:
            job.retries += first
            job.retry.append(index)
            if not job.queued:
                peer.jobs.appendleft(job)
                job.queued = True
            return
        job.error = f"transfer engine {how} block {index} to {label(sessions)}, {job.retries} blocks already written again"

    def _stall_allowance(self, peer: _Peer) -> float:
        nbytes = peer.in_flight[0][3]
        return self.stall_timeout + nbytes / STALL_MIN_RATE

    def _is_stalled(self, peer: _Peer, now: float) -> bool:
        idle = now - peer.progress_at
        return idle > self.stall_timeout and idle > self._stall_allowance(peer)  # the cheap test first: this runs every round

    def _stalled(self, sessions: Peer, peer: _Peer) -> None:
        """No write to the peer completed for stall_timeout: give up on those in flight
        and re-create the transport. Jobs still queued go on after the reset."""
        self.stalls += 1
        reason = f"transfer session to {label(sessions)} stalled: none of {len(peer.in_flight)} writes completed in {self._stall_allowance(peer):.3g}s"
        log.warning("%s; failing the jobs they belong to and re-creating the transport", reason)
        self._abandon({id(j): j for _, j, _, _ in peer.in_flight}.values(), reason)
        peer.in_flight.clear()
        peer.jobs = deque(job for job in peer.jobs if not job.abandoned)
        peer.suspect = True
        self._reset_wanted = sessions

    def _check(self, sessions: Peer, peer: _Peer) -> None:
        """A suspect peer with nothing in flight: is its session still usable?"""
        if not peer.probe or self.transport.probe(sessions, peer.probe):
            peer.suspect = False
            return
        self._failed_to.add(sessions)
        log.warning("probe of the transfer session to %s failed (jobs of rooms %s waiting for it); re-creating the transport",
                    label(sessions), ", ".join(key_label(key) for key in sorted({job.id for job in peer.jobs})))
        self._reset_wanted = sessions

    def _reset(self) -> None:
        sessions, self._reset_wanted = self._reset_wanted, ()
        renewed = self.transport.reset()
        self.resets += 1
        self.loop.call_soon_threadsafe(self.on_reset, renewed)
        peer = self._peers[sessions]
        if self.transport.probe(sessions, peer.probe):
            peer.suspect = False
            peer.window = self.window
            log.warning("transfer session to %s works again after the reset", label(sessions))
            return
        self._failed_to.add(sessions)
        reason = f"transfer session to {label(sessions)} is broken: a probe failed even after re-creating the transport"
        log.error("%s; failing its queued jobs", reason)
        for job in peer.jobs:
            job.error = job.error or reason
            job.queued = False
            if job.finished():
                self._finished.append(job)
        peer.jobs.clear()
        peer.suspect = False  # later jobs try again

    def _drop_cancelled(self) -> bool:
        """Take cancelled jobs out of their queues now, not when they reach the front."""
        dropped = False
        for peer in self._peers.values():
            keep = deque()
            for job in peer.jobs:
                if job.cancelled:
                    job.queued = False
                    dropped = True
                    if job.finished():
                        self._finished.append(job)
                else:
                    keep.append(job)
            peer.jobs = keep
        return dropped

    def _flush(self) -> None:
        # Failures first: rooms failed for their peer's death fail with that reason,
        # not with the error of a job settled in the same round.
        if self._failed_to:
            self.loop.call_soon_threadsafe(_report, self.on_write_failed, self._failed_to)
            self._failed_to = set()
        if self._finished:
            now = time.monotonic()
            for job in self._finished:
                if job.ok and job.started_at:
                    self.jobs_written += 1
                    self.job_queue_seconds += job.started_at - job.queued_at
                    self.job_write_seconds += now - job.started_at
            self.loop.call_soon_threadsafe(_deliver, self._finished)
            self._finished = []

    def _fail_everything(self, reason: str) -> None:
        """After an unexpected error the pump no longer knows what is in flight: fail
        every job as abandoned (their rooms fence only by lease) and probe every
        session before using it again."""
        for peer in self._peers.values():
            peer.suspect = True
            jobs = {id(j): j for j in peer.jobs}
            jobs.update({id(j): j for _, j, _, _ in peer.in_flight})
            self._abandon(jobs.values(), reason)
            peer.jobs.clear()
            peer.in_flight.clear()

    def _abandon(self, jobs, reason: str) -> None:
        """Fail jobs whose writes may still land: their rooms fence only by lease."""
        for job in jobs:
            job.error = job.error or reason
            job.abandoned = True
            job.in_flight = 0
            job.queued = False
            self._finished.append(job)


def _report(on_write_failed: Callable[[Peer], None], peers: set[Peer]) -> None:
    for sessions in peers:
        try:
            on_write_failed(sessions)
        except Exception:
            log.exception("handling a failed write to %s failed", label(sessions))


def _deliver(jobs: list[Job]) -> None:
    for job in jobs:
        if job.settled:
            continue
        job.settled = True
        try:
            job.on_done(job)
        except Exception:
            log.exception("job %d completion handler failed", job.id)
