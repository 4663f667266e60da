"""The transfer pump: window per peer, FIFO per peer, exactly-once completion on the
event loop after every submitted block settled (the fence property), and survival of
transport faults (H1).

These tests use FakeTransport below, not Mooncake. It is a fake on purpose: it lets a
test decide, block by block, when a write completes and how (done, failed, refused at
submission, or an exception from poll), which the real transfer engine cannot be made
to do deterministically. Tests that claim bytes move use the real engine elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import defaultdict

import pytest

from pdxfer.core.plan import Blocks
from pdxfer.transport import Job, Peer, Status, label
from pdxfer.transport.pump import RETRY_BUDGET, TransferPump

WAIT = 5.0  # generous upper bound for the pump thread to act; never a speed assertion
STAND_STILL = 0.4  # seconds a "stand_still" poll holds the pump thread


class FakeTransport:
    """Implements the Transport protocol. Each block is identified by its source
    address; ``behaviour[src]`` says what happens to it:

    * "done" (default): DONE on the first poll;
    * "fail": FAILED on every poll that settles it (it fails each time it is written);
    * "fail1": FAILED the first time it is written, DONE after;
    * "refuse": submit() returns handle 0 for it;
    * "hold": PENDING until the test calls release(src), then DONE (never, if it
      is not released: a wedged session);
    * "raise": poll() raises, as a broken transport would;
    * "stand_still": the first poll takes STAND_STILL seconds, as if the pump's process
      had been stopped inside it, then "hold".

    It also checks the pump's side of the contract as it runs: never more than
    ``window`` writes in flight to one peer, never a poll of a consumed handle.
    A breach is recorded in ``violations`` (and raised): an assertion raised on the
    pump thread would only be logged, so tests check ``violations`` instead."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.lock = threading.Lock()
        self.behaviour: dict[int, str] = {}
        self.released: set[int] = set()
        self.handles: dict[int, tuple[str, int]] = {}  # live handle -> (peer, src)
        self.in_flight: dict[str, int] = defaultdict(int)
        self.max_in_flight: dict[str, int] = defaultdict(int)
        self.submitted: list[tuple[str, int]] = []  # (peer, src), in submission order
        self.settled: dict[int, Status] = {}  # src -> how it ended
        self.polls = 0
        self.resets = 0
        self.probes: list[str] = []  # peers probed, in order
        self.dead: set[str] = set()  # peers whose probe fails
        self.violations: list[str] = []
        self._ids = itertools.count(1)

    # --- Transport

    def start(self) -> Peer:
        return ("fake:0",)

    def register(self, address: int, length: int, populate: bool = True) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def close(self) -> None:
        pass

    def probe(self, sessions: Peer, dst: int) -> bool:
        peer = label(sessions)  # the fake's peers have one session each, and are named by it
        self.probes.append(peer)
        return peer not in self.dead

    def reset(self) -> Peer:
        """A new engine: writes held by the old one are out of the pump's hands."""
        with self.lock:
            self.resets += 1
            self.handles.clear()
            self.in_flight.clear()
            return (f"fake:{self.resets}",)

    def submit(self, sessions: Peer, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        peer = label(sessions)
        with self.lock:
            if not (len(src) == len(dst) == len(length)) or not src:
                self._violation(f"bad batch {src} {dst} {length}")
            handles = []
            for s in src:
                self.submitted.append((peer, s))
                if self.behaviour.get(s) == "refuse":
                    handles.append(0)
                    self.settled[s] = Status.FAILED
                    continue
                handle = next(self._ids)
                self.handles[handle] = (peer, s)
                self.in_flight[peer] += 1
                self.max_in_flight[peer] = max(self.max_in_flight[peer], self.in_flight[peer])
                if self.in_flight[peer] > self.window:
                    self._violation(f"{self.in_flight[peer]} writes in flight to {peer}, window {self.window}")
                handles.append(handle)
            return handles

    def poll(self, handle: int) -> Status:
        with self.lock:
            self.polls += 1
            if handle not in self.handles:
                self._violation(f"poll of unknown or consumed handle {handle}")
            peer, src = self.handles[handle]
            what = self.behaviour.get(src, "done")
            if what == "raise":
                # The pump abandons everything in flight after this; so does the fake,
                # so its window accounting keeps matching the pump's.
                self.behaviour[src] = "done"
                for h, (p, s) in list(self.handles.items()):
                    self.settled.setdefault(s, Status.FAILED)
                    del self.handles[h]
                self.in_flight.clear()
                raise RuntimeError("transport exploded")
            if what == "stand_still":  # the caller's process stops here a while (SIGSTOP, a paused host)
                self.behaviour[src] = "hold"
                time.sleep(STAND_STILL)
                return Status.PENDING
            if what == "hold" and src not in self.released:
                return Status.PENDING
            status = Status.FAILED if what in ("fail", "fail1") else Status.DONE
            if what == "fail1":
                self.behaviour[src] = "done"
            del self.handles[handle]
            self.in_flight[peer] -= 1
            self.settled[src] = status
            return status

    # --- test controls

    def release(self, *srcs: int) -> None:
        with self.lock:
            self.released.update(srcs)

    def sent_to(self, peer: str) -> list[int]:
        with self.lock:
            return [s for p, s in self.submitted if p == peer]

    def _violation(self, what: str) -> None:
        self.violations.append(what)
        raise AssertionError(what)


async def until(predicate, timeout: float = WAIT) -> None:
    """Wait for the pump thread to make ``predicate`` true (polling, since it runs on
    another thread)."""

    async def wait():
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(wait(), timeout)


async def rounds(fake: FakeTransport, n: int = 5) -> None:
    """Let the pump run at least ``n`` more polls, then let the loop run callbacks it
    may have scheduled: evidence that something did NOT happen is only meaningful
    after the pump had every chance to do it."""
    start = fake.polls
    await until(lambda: fake.polls >= start + n)
    for _ in range(5):
        await asyncio.sleep(0)


class Harness:
    def __init__(self, window: int, stall_timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.fake = FakeTransport(window)
        self.failed_to: list[Peer] = []  # what the pump told of failed writes, in order
        self.pump = TransferPump(self.fake, window, self.loop, stall_timeout, on_write_failed=self._write_failed)
        self.calls: dict[int, int] = defaultdict(int)  # job id -> on_done calls
        self.order: list[int] = []  # job ids in completion order
        self.problems: list[str] = []  # checks made inside on_done
        self._ids = itertools.count(1)

    def job(self, peer: str, n_blocks: int, **behaviour: str) -> tuple[Job, asyncio.Future]:
        """A job of ``n_blocks`` blocks; block i of job k has source address
        k * 1000 + i. ``behaviour`` maps 'b<i>' to a FakeTransport behaviour."""
        job_id = next(self._ids)
        srcs = [job_id * 1000 + i for i in range(n_blocks)]
        for key, what in behaviour.items():
            self.fake.behaviour[srcs[int(key[1:])]] = what
        blocks = Blocks.of(srcs, [s + 500_000 for s in srcs], [64] * n_blocks)
        future = self.loop.create_future()

        def on_done(job: Job) -> None:
            self.calls[job.id] += 1
            self.order.append(job.id)
            if threading.get_ident() != self.loop_thread:
                self.problems.append(f"job {job.id} completed off the event loop")
            # The fence property: nothing this job submitted may still be in flight
            # (unless the pump says so by marking the job abandoned).
            sent = [s for _, s in self.fake.submitted if s // 1000 == job.id]
            unsettled = [s for s in sent if s not in self.fake.settled]
            if unsettled and not job.abandoned:
                self.problems.append(f"job {job.id} completed with blocks {unsettled} in flight")
            if job.in_flight and not job.abandoned:
                self.problems.append(f"job {job.id} completed with in_flight={job.in_flight}")
            if not future.done():
                future.set_result(job)

        return Job(job_id, (peer,), blocks, on_done), future

    def _write_failed(self, sessions: Peer) -> None:
        if threading.get_ident() != self.loop_thread:
            self.problems.append(f"a failed write to {sessions} told off the event loop")
        self.failed_to.append(sessions)

    def srcs(self, job: Job) -> list[int]:
        return job.blocks.src.tolist()

    def check(self) -> None:
        assert self.fake.violations == []
        assert self.problems == []
        assert all(n == 1 for n in self.calls.values()), dict(self.calls)


@pytest.fixture
async def make_harness():
    made: list[Harness] = []

    def make(window: int = 4, stall_timeout: float = 60.0) -> Harness:
        h = Harness(window, stall_timeout)
        made.append(h)
        return h

    yield make
    for h in made:
        h.pump.stop(timeout=WAIT)
        assert h.pump._thread is None or not h.pump._thread.is_alive()


async def test_never_more_than_window_in_flight_per_peer(make_harness):
    h = make_harness(window=3)
    jobs = []
    for peer in ("a", "b"):
        for _ in range(3):
            jobs.append(h.job(peer, 7, **{f"b{i}": "hold" for i in range(7)}))
    h.pump.start()
    for job, _ in jobs:
        h.pump.submit(job)
    await until(lambda: h.fake.in_flight["a"] == 3 and h.fake.in_flight["b"] == 3)
    await rounds(h.fake, 20)
    # The window is full on both peers: the pump keeps polling but submits nothing more.
    assert len(h.fake.sent_to("a")) == len(h.fake.sent_to("b")) == 3
    h.fake.release(*(s for job, _ in jobs for s in h.srcs(job)))
    await asyncio.wait_for(asyncio.gather(*(f for _, f in jobs)), WAIT)
    assert all(job.ok for job, _ in jobs)
    assert h.fake.max_in_flight == {"a": 3, "b": 3}  # reached, never exceeded
    assert len(h.fake.submitted) == 6 * 7
    assert h.pump.blocks_submitted == 42 and h.pump.bytes_done == 42 * 64
    h.check()


async def test_fifo_per_peer(make_harness):
    h = make_harness(window=2)
    a1, a2, a3 = h.job("p", 3), h.job("p", 2), h.job("p", 4)
    q1 = h.job("q", 3)
    for job, _ in (a1, q1, a2, a3):
        h.pump.submit(job)
    h.pump.start()
    await asyncio.wait_for(asyncio.gather(*(f for _, f in (a1, a2, a3, q1))), WAIT)
    # Blocks go out in job order, each job's blocks in order, per peer.
    assert h.fake.sent_to("p") == h.srcs(a1[0]) + h.srcs(a2[0]) + h.srcs(a3[0])
    assert h.fake.sent_to("q") == h.srcs(q1[0])
    # And the jobs of one peer complete in the order they were submitted.
    p_ids = [a1[0].id, a2[0].id, a3[0].id]
    assert [i for i in h.order if i in p_ids] == p_ids
    h.check()


async def test_on_done_runs_once_on_the_loop_after_every_block_settled(make_harness):
    h = make_harness(window=2)
    job, done = h.job("p", 5, b3="hold")
    h.pump.start()
    h.pump.submit(job)
    await until(lambda: 1003 in h.fake.sent_to("p"))
    await rounds(h.fake)
    assert not done.done()  # block 3 is still in flight
    h.fake.release(1003)
    finished = await asyncio.wait_for(done, WAIT)
    assert finished is job and job.ok and job.settled
    assert job.next == 5 and job.in_flight == 0
    # Give a second delivery every chance to happen; it must not.
    follow, follow_done = h.job("p", 1)
    h.pump.submit(follow)
    await asyncio.wait_for(follow_done, WAIT)
    await rounds(h.fake, 0)
    assert h.calls[job.id] == 1
    h.check()


async def test_empty_job_completes(make_harness):
    h = make_harness()
    job, done = h.job("p", 0)
    h.pump.start()
    h.pump.submit(job)
    assert (await asyncio.wait_for(done, WAIT)).ok
    assert h.fake.submitted == []
    h.check()


async def test_a_block_that_failed_once_is_written_again_and_the_job_succeeds(make_harness):
    h = make_harness(window=3)
    job, done = h.job("p", 8, b1="fail1")
    h.pump.start()
    h.pump.submit(job)
    await asyncio.wait_for(done, WAIT)
    # Writes are idempotent (same bytes, same place), so a failed block is simply
    # written again; the job never saw the fault.
    assert job.ok and job.retries == 1
    assert h.failed_to == [("p",)]  # told on the loop, though the pump dealt with it
    assert h.fake.sent_to("p").count(1001) == 2
    assert sorted(set(h.fake.sent_to("p"))) == list(range(1000, 1008))
    h.check()


async def test_a_block_that_keeps_failing_fails_the_job_after_its_retry_budget(make_harness):
    h = make_harness(window=3)
    job, done = h.job("p", 8, b1="fail", b2="hold")
    after, after_done = h.job("p", 2)
    h.pump.start()
    h.pump.submit(job)
    h.pump.submit(after)
    await until(lambda: 1001 in h.fake.settled)
    await rounds(h.fake)
    # A failed write makes the peer suspect: nothing more goes to it (not even the
    # retry) until what is in flight has drained and the session was checked.
    assert h.fake.sent_to("p").count(1001) == 1 and not done.done()
    h.fake.release(1002)
    await asyncio.wait_for(done, WAIT)
    assert not job.ok and "reported failed block 1 to p" in job.error and not job.abandoned
    assert h.fake.sent_to("p").count(1001) == RETRY_BUDGET + 1
    # The next job on that peer is not held back by the failure.
    assert (await asyncio.wait_for(after_done, WAIT)).ok
    h.check()


async def test_a_stalled_session_abandons_the_jobs_in_flight_and_is_recreated(make_harness):
    h = make_harness(window=2, stall_timeout=0.2)
    stuck, stuck_done = h.job("p", 3, b0="hold", b1="hold", b2="hold")  # never released
    queued, queued_done = h.job("p", 2)
    elsewhere, elsewhere_done = h.job("q", 1)
    h.pump.start()
    for job in (stuck, queued, elsewhere):
        h.pump.submit(job)
    assert (await asyncio.wait_for(elsewhere_done, WAIT)).ok
    await asyncio.wait_for(stuck_done, WAIT)
    # Its two writes in flight may still land some day: the room must fence by lease.
    assert stuck.abandoned and "stalled: none of 2 writes completed in 0.2s" in stuck.error
    assert h.fake.sent_to("p")[:2] == [1000, 1001] and 1002 not in h.fake.sent_to("p")
    # The job queued behind it goes through the re-created session.
    assert (await asyncio.wait_for(queued_done, WAIT)).ok and not queued.abandoned
    assert h.fake.resets == 1 and h.pump.stalls == 1 and h.pump.resets == 1
    h.check()


async def test_time_the_pump_stood_still_does_not_count_towards_a_stall(make_harness):
    """Frozen (SIGSTOP) with its transfer engine, the pump watched nothing: on waking,
    the writes in flight had no more time to complete than before the freeze. Only
    time the pump was awake counts, so they are not abandoned as stalled (an abandoned
    room's decode side waits for a proof that never comes)."""
    h = make_harness(window=2, stall_timeout=0.2)
    job, done = h.job("p", 1, b0="stand_still")
    h.pump.start()
    h.pump.submit(job)
    await rounds(h.fake, 3)  # past the stand-still, 0.4 s, twice the stall timeout
    assert h.pump.stalls == 0 and not done.done()
    h.fake.release(1000)
    assert (await asyncio.wait_for(done, WAIT)).ok and not job.abandoned
    h.check()


async def test_a_big_write_gets_longer_before_it_counts_as_a_stall(make_harness):
    h = make_harness(window=2, stall_timeout=0.05)
    big, big_done = h.job("p", 1, b0="hold")
    big.blocks = Blocks.of([1000], [501_000], [1 << 30])  # 1 GiB: ~21 s more at STALL_MIN_RATE
    small, small_done = h.job("q", 1, b0="hold")
    h.pump.start()
    h.pump.submit(big)
    h.pump.submit(small)
    await asyncio.wait_for(small_done, WAIT)  # a 64-byte write held past 0.05 s is a stall
    assert small.abandoned and h.pump.stalls == 1
    await rounds(h.fake, 50)
    assert not big_done.done() and not big.abandoned
    h.fake.release(1000)
    assert (await asyncio.wait_for(big_done, WAIT)).ok
    h.check()


async def test_failed_writes_and_probes_are_told_on_the_loop_for_their_peer_only(make_harness):
    """What lets a prefill fail a dead decode daemon's rooms at once (prefill.py): each
    failed write and failed probe is told, by peer, before the jobs they ended."""
    h = make_harness(window=4)
    h.fake.dead.add("p")
    job, done = h.job("p", 3, b0="fail", b1="fail", b2="fail")
    job.probe = 1
    healthy, healthy_done = h.job("q", 2)
    told_before_done = []
    on_done = job.on_done
    job.on_done = lambda j: told_before_done.append(list(h.failed_to)) or on_done(j)
    h.pump.start()
    h.pump.submit(job)
    h.pump.submit(healthy)
    assert (await asyncio.wait_for(healthy_done, WAIT)).ok
    await asyncio.wait_for(done, WAIT)
    assert "broken" in job.error and h.fake.probes == ["p", "p"]
    assert told_before_done[0] and set(told_before_done[0]) == {("p",)}
    assert set(h.failed_to) == {("p",)}  # never the healthy peer
    h.check()


async def test_a_failed_peer_with_nothing_left_to_send_is_neither_probed_nor_reset(make_harness):
    """A decode daemon died: a write to it failed and its room was cancelled. With
    nothing left for it, the pump neither probes it nor re-creates the engine (which
    would pause every other peer); a later job for it is probed first."""
    h = make_harness(window=2)
    h.fake.dead.add("p")
    job, done = h.job("p", 3, b0="fail", b1="hold")
    job.probe = 1  # where the probe writes; without one the pump trusts the session
    h.pump.start()
    h.pump.submit(job)
    await until(lambda: 1000 in h.fake.settled)
    h.pump.cancel(job)
    h.fake.release(1001)
    await asyncio.wait_for(done, WAIT)
    await asyncio.sleep(0.2)  # nothing in flight, so no polls to count: time for a probe that must not come
    assert h.fake.probes == [] and h.fake.resets == 0
    later, later_done = h.job("p", 1)
    h.pump.submit(later)
    await asyncio.wait_for(later_done, WAIT)
    assert h.fake.probes == ["p", "p"] and h.fake.resets == 1  # probed, reset, probed again
    assert "broken" in later.error and h.fake.sent_to("p") == [1000, 1001]
    h.check()


async def test_cancel_stops_submission_but_on_done_waits_for_in_flight(make_harness):
    h = make_harness(window=2)
    job, done = h.job("p", 6, **{f"b{i}": "hold" for i in range(6)})
    h.pump.start()
    h.pump.submit(job)
    await until(lambda: h.fake.in_flight["p"] == 2)
    h.pump.cancel(job)
    await rounds(h.fake)
    assert not done.done()  # two writes may still land: no callback yet
    h.fake.release(1000)
    await until(lambda: 1000 in h.fake.settled)
    await rounds(h.fake)
    assert not done.done()  # one write may still land
    h.fake.release(1001)
    await asyncio.wait_for(done, WAIT)
    assert job.cancelled and not job.ok and job.error == ""
    assert h.fake.sent_to("p") == [1000, 1001]  # nothing submitted after cancel
    h.check()


async def test_a_block_refused_every_time_fails_the_job(make_harness):
    h = make_harness(window=4)
    job, done = h.job("p", 5, b1="refuse", b2="hold")
    h.pump.start()
    h.pump.submit(job)
    await until(lambda: len(h.fake.sent_to("p")) >= 3)
    await rounds(h.fake)
    assert not done.done()  # block 2 was accepted and is still in flight
    h.fake.release(1002)
    await asyncio.wait_for(done, WAIT)
    assert not job.ok and "refused block 1 to p" in job.error
    assert h.fake.sent_to("p").count(1001) == RETRY_BUDGET + 1
    h.check()


async def test_only_block_refused(make_harness):
    h = make_harness(window=4)
    job, done = h.job("p", 1, b0="refuse")
    h.pump.start()
    h.pump.submit(job)
    await asyncio.wait_for(done, WAIT)
    assert "refused block 0" in job.error
    h.check()


async def test_exception_in_poll_does_not_kill_the_pump(make_harness, caplog):
    h = make_harness(window=4)
    broken, broken_done = h.job("a", 3, b0="raise")
    bystander, bystander_done = h.job("b", 2, b0="hold")
    h.pump.start()
    h.pump.submit(bystander)
    await until(lambda: h.fake.in_flight["b"] == 1 or len(h.fake.sent_to("b")) == 2)
    with caplog.at_level(logging.ERROR, logger="pdxfer.pump"):
        h.pump.submit(broken)
        await asyncio.wait_for(broken_done, WAIT)
        await asyncio.wait_for(bystander_done, WAIT)
    for job in (broken, bystander):
        # Its writes may still land: the caller must fence it some other way.
        assert job.abandoned and not job.ok and "transfer pump error" in job.error
    assert any("transfer pump round failed" in r.getMessage() for r in caplog.records)
    assert h.pump._thread.is_alive()
    # Later jobs go through as before.
    later, later_done = h.job("a", 3)
    h.pump.submit(later)
    assert (await asyncio.wait_for(later_done, WAIT)).ok and not later.abandoned
    h.check()


async def test_exception_in_on_done_does_not_stop_other_deliveries(make_harness):
    h = make_harness(window=4)
    first, first_done = h.job("p", 1)
    second, second_done = h.job("p", 1)

    original = first.on_done

    def explode(job):
        original(job)
        raise RuntimeError("engine handler bug")

    first.on_done = explode
    h.pump.submit(first)
    h.pump.submit(second)
    h.pump.start()
    await asyncio.wait_for(asyncio.gather(first_done, second_done), WAIT)
    assert first.ok and second.ok
    h.check()


async def test_job_finished_in_the_round_that_raised_is_still_delivered(make_harness):
    h = make_harness(window=4)
    ok_job, ok_done = h.job("p", 1)  # completes at its first poll ...
    bad_job, bad_done = h.job("p", 1, b0="raise")  # ... and the next poll, same round, raises
    h.pump.submit(ok_job)
    h.pump.submit(bad_job)
    h.pump.start()  # both jobs in the first round, deterministically
    await asyncio.wait_for(bad_done, WAIT)
    assert bad_job.abandoned
    await asyncio.wait_for(ok_done, 2.0)  # never resolves today
    assert h.calls[ok_job.id] == 1
