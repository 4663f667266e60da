"""Peer death with real daemon processes (H2): a daemon killed with SIGKILL, hung
with SIGSTOP, or replaced by a new incarnation fails exactly its own rooms, within
the stated bound, on the daemons that outlive it; those keep serving, and rooms with
healthy peers move every byte.

The prefill daemons run with ``--inject-faults delay=1.0:MS``: the transfer engine
still moves every byte at once, but each completion is reported up to MS late, so
rooms stay Transferring long enough to kill a peer in the middle of them.

Bounds are liveness bounds: the stated one (heartbeat interval x misses + a 0.05 s
tick, see roomkit) plus a generous slack for this loaded 2-core machine. Timings
are measured from the signal, in the test process, with CLOCK_MONOTONIC (shared by
every process on the host).

The last tests each pin a bug found while writing these (now fixed).
"""

from __future__ import annotations

import asyncio
import collections
import signal
import threading
import time

import pytest

from pdxfer.client import AsyncClient, Client
from pdxfer.core import errors
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    Codec,
    ErrorCode,
    PeerError,
    PeerHello,
    PeerWelcome,
    RoomAccepted,
    RoomRequest,
    RoomState,
)
from pdxfer.ops.inspection import daemon_counters
from pdxfer.wire.seal import Seal

from .conftest import needs_mooncake, small_layout
from .peersocket import PeerListener
from .roomkit import (
    HB_BOUND, HB_FLAGS, HB_INTERVAL, SLACK, Freezer, all_in, assert_nothing_written, engine, free_port, kill, reuse_pages,
    room_ids, send_room, start_room, statuses, wait_until,
)

pytestmark = [needs_mooncake, pytest.mark.integration, pytest.mark.timeout(90)]

DELAY_MS = 4000
HOLD = ("--inject-faults", f"delay=1.0:{DELAY_MS},seed=3", "--stall-timeout", "60")  # held writes are not a stall
T = RoomState.TRANSFERRING
S = RoomState.SUCCESS
F = RoomState.FAILED


def pages(i: int, n: int = 2) -> list[int]:
    """Distinct, contiguous pages for room number i."""
    return list(range(2 + 4 * i, 2 + 4 * i + n))


def start_room_decode_only(cd, bootstrap: str, room: int) -> None:
    cd.expect(room, bootstrap, pages(0), cd.alloc_slot())


class FakePrefill:
    """The bootstrap endpoint of a prefill daemon, played by the test, so the order in
    which its replies reach the decode daemon can be chosen exactly."""

    def __init__(self, port: int, incarnation: str) -> None:
        self.codec = Codec()
        self.seal = Seal(incarnation)
        self.incarnation = incarnation
        self.sock = PeerListener(port)
        self._received: collections.deque = collections.deque()

    def recv(self, timeout: float = 10.0):
        """The next message, in order; one batch may carry several."""
        if not self._received:
            assert self.sock.poll(int(timeout * 1000)), "the decode daemon sent nothing"
            identity, *frames = self.sock.recv_multipart()
            _, payloads = self.seal.open(frames)
            self._received.extend((identity, self.codec.peer_messages.decode(payload)) for payload in payloads)
        return self._received.popleft()

    def recv_kind(self, kind, timeout: float = 10.0):
        """Skip heartbeats and other messages until one of type ``kind``."""
        deadline = time.monotonic() + timeout
        while True:
            identity, msg = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return identity, msg

    def send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, *self.seal.seal([self.codec.encode(msg)])])

    def drain(self, seconds: float) -> list:
        """Every message that arrives within ``seconds``."""
        got, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._received or self.sock.poll(int(left * 1000)):
                got.append(self.recv()[1])
        return got

    def welcome(self, identity: bytes, clock: float | None = None) -> None:
        """Accept the decode daemon, telling it our clock (this host's, unless given)."""
        clock = time.monotonic() if clock is None else clock
        self.send(identity, PeerWelcome(version=PROTOCOL_VERSION, incarnation=self.incarnation, session="127.0.0.1:1", clock=clock))

    def close(self) -> None:
        self.sock.close(0)


# --- (a) a decode daemon killed mid-transfer


def test_decode_killed_mid_transfer_fails_exactly_its_rooms(daemons):
    p = daemons("prefill", *HB_FLAGS, *HOLD, name="p")
    d1 = daemons("decode", *HB_FLAGS, name="d1")
    d2 = daemons("decode", *HB_FLAGS, name="d2")
    cp, c1, c2 = engine(p), engine(d1), engine(d2)
    try:
        victims = [start_room(cp, c1, p.bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(4)]
        healthy = [start_room(cp, c2, p.bootstrap, 200 + i, pages(4 + i), pages(i), seed=10 + i) for i in range(4)]
        everything = room_ids(victims + healthy)
        wait_until(lambda: all_in(cp, everything, T), 10 + SLACK, "every room Transferring on the prefill")
        before = cp.stats()
        assert before.peers == 2, before

        t_kill = kill(d1)
        failed = wait_until(lambda: all_in(cp, room_ids(victims), F), HB_BOUND + SLACK, "the victim's rooms to fail on the prefill")
        elapsed = time.monotonic() - t_kill
        assert elapsed <= HB_BOUND + SLACK, elapsed
        for status in failed.values():
            assert status.code in ("peer_dead", "transfer_failed"), status
            if status.code == "peer_dead":
                assert "d1" in status.reason, status.reason
        assert p.alive(), "the prefill daemon died with its peer"

        # The healthy decode's rooms all succeed with every byte in place.
        for case in healthy:
            assert c2.wait(case.id).state is S
            case.check_bytes()
            assert cp.wait(case.id).state is S
        # The victim's rooms stay failed (none revived by a late completion) and get fenced on the prefill.
        for case in victims:
            status = cp.wait(case.id, timeout=DELAY_MS / 1000 + 10)
            assert status.state is F and status.fenced, status

        after = cp.stats()
        assert after.peers == 1, after
        assert after.rooms["failed"] == before.rooms["failed"] + len(victims), after
        assert after.rooms["success"] == before.rooms["success"] + len(healthy), after
        assert sum(after.failures.get(code, 0) for code in ("peer_dead", "transfer_failed")) >= len(victims), after
        assert after.slots["quarantined"] == 0, after  # every failed room got fenced

        # New rooms to the healthy decode succeed afterwards.
        for case in victims + healthy:
            cp.release(case.id)
        for case in healthy:
            c2.release(case.id)
        fresh = [start_room(cp, c2, p.bootstrap, 300 + i, pages(8 + i), pages(4 + i), seed=20 + i) for i in range(3)]
        for case in fresh:
            assert c2.wait(case.id).state is S
            case.check_bytes()
            assert cp.wait(case.id).state is S
        assert p.alive() and d2.alive()
    finally:
        for client in (cp, c1, c2):
            client.close()


# The same with the default heartbeats (1 s x 5): a kill resets the decode daemon's
# bootstrap connection, and the writes to it then fail; the two together end its rooms.
KILL_BOUND = 1.5  # seconds: a liveness bound, generous, well under the 5 s heartbeat bound
STREAM = ("--inject-faults", "delay=1.0:100,seed=3", "--peer-window", "8", "--stall-timeout", "60")


def spread(i: int) -> list[int]:
    """32 pages, no two adjacent: one write per page and KV region (256 for the room)."""
    return [64 * i + 2 * j for j in range(32)]


def test_rooms_being_written_to_a_killed_decode_fail_at_once_not_at_the_heartbeat_bound(daemons):
    """Writes are held up to 0.1 s and at most 8 are in flight, so the victim's rooms
    are still being written, a few blocks at a time, when it dies. Its rooms fail on
    the prefill as peer_dead within KILL_BOUND of the SIGKILL (before this, after
    1.1-2.1 s as transfer_failed, once the prefill had probed the session and
    re-created its transport; with every write in flight, at the 5 s heartbeat bound),
    and exactly its rooms: the other decode daemon's succeed."""
    p = daemons("prefill", *STREAM, name="p")
    d1 = daemons("decode", name="d1")
    d2 = daemons("decode", name="d2")
    cp, c1, c2 = engine(p), engine(d1), engine(d2)
    try:
        victims = [start_room(cp, c1, p.bootstrap, 100 + i, spread(i), spread(i), seed=i) for i in range(4)]
        wait_until(lambda: all_in(cp, room_ids(victims), T), 10 + SLACK, "the victim's rooms Transferring on the prefill")
        t_kill = kill(d1)
        healthy = [start_room(cp, c2, p.bootstrap, 200 + i, [250 + i], [i], seed=10 + i) for i in range(2)]
        failed = wait_until(lambda: all_in(cp, room_ids(victims), F), 10 + SLACK, "the victim's rooms to fail on the prefill")
        elapsed = time.monotonic() - t_kill
        for status in failed.values():
            assert status.code == "peer_dead", status
            assert "d1" in status.reason and "bootstrap connection closed" in status.reason and "write" in status.reason, status.reason
        assert elapsed <= KILL_BOUND, f"the victim's rooms failed {elapsed:.2f}s after the kill"
        print(f"\nrooms failed {elapsed:.3f}s after the kill")
        assert p.alive(), "the prefill daemon died with its peer"
        assert daemon_counters(p.ready["admin"])["failed_writes"] >= 1
        for case in healthy:
            assert c2.wait(case.id).state is S
            case.check_bytes()
            assert cp.wait(case.id).state is S
        for case in victims:  # their cancelled writes settle: fenced, none revived
            status = cp.wait(case.id, timeout=5 + SLACK)
            assert status.state is F and status.fenced, status
    finally:
        for client in (cp, c1, c2):
            client.close()


# --- (b) a prefill daemon killed mid-transfer


def test_prefill_killed_mid_transfer_fails_exactly_the_rooms_on_its_link(daemons):
    p1 = daemons("prefill", *HB_FLAGS, *HOLD, name="p1")
    p2 = daemons("prefill", *HB_FLAGS, *HOLD, name="p2")
    d = daemons("decode", *HB_FLAGS, name="d")
    c1, c2, cd = engine(p1), engine(p2), engine(d)
    try:
        victims = [start_room(c1, cd, p1.bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(4)]
        healthy = [start_room(c2, cd, p2.bootstrap, 200 + i, pages(i), pages(4 + i), seed=10 + i) for i in range(4)]
        wait_until(lambda: all_in(cd, room_ids(victims + healthy), T), 10 + SLACK, "every room Transferring on the decode")

        t_kill = kill(p1)
        failed = wait_until(lambda: all_in(cd, room_ids(victims), F), HB_BOUND + SLACK, "the rooms on the dead prefill's link to fail")
        assert time.monotonic() - t_kill <= HB_BOUND + SLACK
        for status in failed.values():
            assert status.code == "peer_dead", status
            assert p1.bootstrap in status.reason, status.reason
        assert d.alive(), "the decode daemon died with its peer"

        for case in healthy:
            assert cd.wait(case.id).state is S
            case.check_bytes()
            assert c2.wait(case.id).state is S
        # Still failed, not revived.
        assert all(s.state is F for s in statuses(cd, room_ids(victims)).values())

        stats = cd.stats()
        assert stats.rooms["failed"] == len(victims) and stats.rooms["success"] == len(healthy), stats
        assert stats.failures.get("peer_dead", 0) >= len(victims), stats

        for case in healthy:
            cd.release(case.id)
            c2.release(case.id)
        fresh = [start_room(c2, cd, p2.bootstrap, 300 + i, pages(4 + i), pages(8 + i), seed=20 + i) for i in range(3)]
        for case in fresh:
            assert cd.wait(case.id).state is S
            case.check_bytes()
        assert d.alive() and p2.alive()
    finally:
        for client in (c1, c2, cd):
            client.close()


# --- (c) a prefill daemon hung (SIGSTOP): no disconnect, only silence


def test_hung_prefill_is_declared_dead_by_silence_and_serves_again_after_sigcont(daemons):
    p = daemons("prefill", *HB_FLAGS, *HOLD, name="p")
    # A lease far away: here only the prefill's own confirmation may fence the rooms.
    d = daemons("decode", *HB_FLAGS, "--transfer-timeout", "20", "--fence-timeout", "10", name="d")
    cp, cd = engine(p), engine(d)
    freezer = Freezer(p)
    try:
        t_start = time.monotonic()
        cases = [start_room(cp, cd, p.bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(3)]
        wait_until(lambda: all_in(cd, room_ids(cases), T), 10 + SLACK, "every room Transferring on the decode")

        t_stop = freezer.stop()
        failed = wait_until(lambda: all_in(cd, room_ids(cases), F), HB_BOUND + SLACK, "the hung prefill's rooms to fail")
        assert time.monotonic() - t_stop <= HB_BOUND + SLACK
        for status in failed.values():
            assert status.code == "peer_dead", status
            assert "heartbeats missed" in status.reason, status.reason
            assert not status.fenced, f"a hung writer may still write, yet room {status.room} was fenced: {status}"
        time.sleep(HB_BOUND)  # hung for longer still: nothing changes while it cannot confirm
        for status in statuses(cd, room_ids(cases)).values():
            assert status.state is F and not status.fenced, status
        stats = cd.stats()
        assert stats.slots["quarantined"] == len(cases), stats
        assert d.alive()
        assert time.monotonic() < t_start + 20, "the lease may have run out; the unfenced window proves nothing"

        freezer.resume()
        # It resumes, fails the rooms too, and confirms that nothing of theirs is in flight.
        for case in cases:
            status = cd.wait(case.id, timeout=DELAY_MS / 1000 + SLACK)
            assert status.state is F and status.fenced, status
            assert cp.wait(case.id, timeout=DELAY_MS / 1000 + SLACK).state is F
        assert cd.stats().slots["quarantined"] == 0
        for case in cases:
            cd.release(case.id)
            cp.release(case.id)
        # New rooms with it succeed. Messages the hang held back (heartbeats answered
        # with unknown_peer after the prefill declared this decode dead in turn) are
        # drained first, so a new room is not caught by one of them.
        wait_until(lambda: cp.stats().peers == 1, HB_BOUND + SLACK, "the decode to be known to the prefill again")
        time.sleep(2 * HB_BOUND)
        fresh = [start_room(cp, cd, p.bootstrap, 200 + i, pages(4 + i), pages(4 + i), seed=10 + i) for i in range(3)]
        for case in fresh:
            assert cd.wait(case.id, timeout=DELAY_MS / 1000 + 20).state is S
            case.check_bytes()
            assert cp.wait(case.id).state is S
        assert p.alive() and d.alive()
    finally:
        freezer.thaw()
        for client in (cp, cd):
            client.close()


LEASE_T, LEASE_F = 3.0, 1.0


def test_lease_expiry_does_not_fence_the_rooms_of_a_hung_prefill_the_end_of_its_sessions_does(daemons):
    """A timer is no proof (S2): the hung prefill's rooms are fenced because the decode
    ended the transfer sessions they could be written into (a rotation, once the prefill
    went silent), not because their lease and fence timeout ran out. (tests/test_fencing.py
    shows why, bytes and all.)"""
    p = daemons("prefill", *HB_FLAGS, *HOLD, name="p")
    d = daemons("decode", *HB_FLAGS, "--transfer-timeout", str(LEASE_T), "--fence-timeout", str(LEASE_F), name="d")
    cp, cd = engine(p), engine(d)
    freezer = Freezer(p)
    try:
        cases = [start_room(cp, cd, p.bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(2)]
        wait_until(lambda: all_in(cd, room_ids(cases), T), 10 + SLACK, "every room Transferring on the decode")
        freezer.stop()
        failed = wait_until(lambda: all_in(cd, room_ids(cases), F), HB_BOUND + SLACK, "the hung prefill's rooms to fail")
        assert all(s.code in ("peer_dead", "timeout") for s in failed.values()), failed
        for case in cases:
            assert cd.wait(case.id, timeout=LEASE_T + SLACK).fenced
        counters = daemon_counters(d.ready["admin"])
        assert counters["session_rotations"] == 1 and counters["rooms_fenced_by_session_end"] == len(cases), counters
        assert cd.stats().slots["quarantined"] == 0
        freezer.resume()
        for case in cases:
            assert cp.wait(case.id, timeout=DELAY_MS / 1000 + SLACK).state is F
    finally:
        freezer.thaw()
        for client in (cp, cd):
            client.close()


# --- (d) a prefill daemon restarted: a new incarnation at the same address


def test_prefill_restarted_with_new_incarnation_fences_its_old_rooms_at_once(daemons):
    port = free_port()
    lease = ("--transfer-timeout", "20", "--fence-timeout", "10")
    p1 = daemons("prefill", *HB_FLAGS, *HOLD, "--bootstrap-port", str(port), name="p1")
    d = daemons("decode", *HB_FLAGS, *lease, name="d")
    c1, cd = engine(p1), engine(d)
    c1b = None
    try:
        t_start = time.monotonic()
        cases = [start_room(c1, cd, p1.bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(3)]
        wait_until(lambda: all_in(cd, room_ids(cases), T), 10 + SLACK, "every room Transferring on the decode")
        old_incarnation = c1.welcome.incarnation

        kill(p1)
        p1.proc.wait()
        c1.close()
        failed = wait_until(lambda: all_in(cd, room_ids(cases), F), HB_BOUND + SLACK, "the dead prefill's rooms to fail")
        assert all(s.code == "peer_dead" for s in failed.values()), failed

        p1b = daemons("prefill", *HB_FLAGS, "--bootstrap-port", str(port), name="p1")
        assert p1b.bootstrap == p1.bootstrap
        c1b = engine(p1b)
        assert c1b.welcome.incarnation != old_incarnation
        t_new = time.monotonic()
        # The decode learns of the new incarnation and fences the old rooms at once.
        for case in cases:
            status = cd.wait(case.id, timeout=HB_BOUND + SLACK)
            assert status.state is F and status.fenced, status
        fenced_at = time.monotonic()
        assert fenced_at - t_new <= HB_BOUND + SLACK
        assert fenced_at < t_start + 20 + 10, "fenced by the lease, not by the restart"
        assert cd.stats().slots["quarantined"] == 0

        for case in cases:
            cd.release(case.id)
        # Let the replies to what the decode sent before its new hello drain first: each
        # is an unknown_peer error that fails every room then on the link (see
        # test_a_stale_unknown_peer_reply_does_not_fail_a_room_made_after_the_new_hello).
        wait_until(lambda: c1b.stats().peers == 1, HB_BOUND + SLACK, "the decode to say hello to the new prefill")
        time.sleep(2 * HB_BOUND)
        fresh = [start_room(c1b, cd, p1b.bootstrap, 200 + i, pages(4 + i), pages(4 + i), seed=10 + i) for i in range(3)]
        for case in fresh:
            assert cd.wait(case.id).state is S
            case.check_bytes()
            assert c1b.wait(case.id).state is S
        assert d.alive() and p1b.alive()
    finally:
        for client in (c1, cd, c1b):
            if client is not None:
                client.close()


# --- bugs met on the way, each pinned by a test


def test_a_dead_prefill_is_declared_dead_once(daemons):
    """A prefill that answered, then went silent (frozen): declared dead once, not
    again every heartbeat bound while its failed rooms wait for release."""
    p = daemons("prefill", *HB_FLAGS, name="p")
    d = daemons("decode", *HB_FLAGS, name="d")
    cp, cd = engine(p), engine(d)
    try:
        start_room_decode_only(cd, p.bootstrap, 100)
        wait_until(lambda: cd.poll(100).state is RoomState.WAITING_FOR_INPUT, SLACK, "the room to be accepted")
        p.proc.send_signal(signal.SIGSTOP)
        try:
            failed = wait_until(lambda: all_in(cd, [100], F), HB_BOUND + SLACK, "the room to fail by heartbeat silence")
            assert failed[100].code == "peer_dead", failed
            before = cd.stats().failures.get("peers_declared_dead", 0)
            assert before == 1
            time.sleep(4 * HB_BOUND)
            after = cd.stats().failures.get("peers_declared_dead", 0)
            assert after == before, f"declared dead {after - before} more times with no new failure"
        finally:
            p.proc.send_signal(signal.SIGCONT)
    finally:
        cp.close()
        cd.close()


def test_a_push_to_a_departed_engine_is_dropped_quietly(daemons):
    d = daemons("decode", *HB_FLAGS, "--bootstrap-timeout", "1", name="d")
    cd = engine(d)
    start_room_decode_only(cd, f"127.0.0.1:{free_port()}", 100)
    cd.close()  # the engine goes away; the room's failure is pushed to nobody
    probe = Client(d.engine, timeout=20.0)
    probe.connect()
    try:
        wait_until(lambda: probe.stats().rooms["failed"] == 1, HB_BOUND + SLACK, "the room to fail")
        assert d.alive()
    finally:
        probe.close()
    assert d.stop() == 0  # asyncio reports a lost Future's exception when it is collected, at the latest on exit
    log = open(d.log_path).read()
    assert "Future exception was never retrieved" not in log, log[log.find("Future exception") :][:600]


def test_a_decode_daemon_tells_the_prefill_its_transfer_engine_release(daemons):
    """So that a prefill can refuse an engine whose tcp writes are not acknowledged (A3)."""
    from pdxfer.transport.mooncake import installed_release

    port = free_port()
    d = daemons("decode", name="release")
    cd = engine(d)
    fake = FakePrefill(port, "rel0000000000000")
    try:
        cd.expect(300, f"127.0.0.1:{port}", pages(0), cd.alloc_slot())
        _, hello = fake.recv_kind(PeerHello)
        assert hello.engine_release and hello.engine_release == installed_release()
    finally:
        fake.close()
        cd.close()


def test_a_stale_unknown_peer_reply_does_not_fail_a_room_made_after_the_new_hello(daemons):
    """A prefill that forgot this decode daemon (it declared it dead) answers what it
    reads up to the decode's new hello with unknown_peer. The first such answer fails
    the rooms there and the decode says hello again; a later one answers a message sent
    before that hello, and fails no room made after it. (A restarted prefill no longer
    sees messages before a hello: every new connection opens with one.)"""
    port = free_port()
    # Heartbeat silence never decides here; the fake answers none.
    d = daemons("decode", "--heartbeat-interval", "0.1", "--heartbeat-misses", "200", name="d")
    cd = engine(d)
    fake = FakePrefill(port, "fake000000000000")
    try:
        cd.expect(100, f"127.0.0.1:{port}", pages(0), cd.alloc_slot())
        identity, _ = fake.recv_kind(PeerHello)
        fake.welcome(identity)
        fake.recv_kind(RoomRequest)
        unknown = PeerError(code=ErrorCode.UNKNOWN_PEER, message="this prefill daemon does not know you: say peer_hello")
        fake.send(identity, unknown)  # its answer to a heartbeat, once it forgot the decode
        status = wait_until(lambda: all_in(cd, [100], F), SLACK, "room 100 to fail when the prefill forgot the decode")[100]
        assert "no longer knows this daemon" in status.reason, status
        # The engine makes a new room at once; the decode said hello again, then asks for it.
        cd.expect(200, f"127.0.0.1:{port}", pages(1), cd.alloc_slot())
        fake.send(identity, unknown)  # its answer to another heartbeat sent before that hello
        fake.recv_kind(PeerHello)
        fake.welcome(identity)
        _, request = fake.recv_kind(RoomRequest)
        assert request.room == 200
        fake.send(identity, RoomAccepted(room=200, input_ready=False, legs=tuple(leg.leg for leg in request.legs)))
        time.sleep(0.5)
        status = statuses(cd, [200])[200]
        assert status.state is not F, f"room 200, made after the new hello and accepted by the prefill, failed: {status}"
    finally:
        fake.close()
        cd.close()


async def test_an_engine_waiting_on_its_killed_daemon_hears_so_at_once(daemons):
    """The engine's own daemon dies: wait() and calls in flight raise DaemonGone when
    the connection drops, not at their (here 60 s) timeouts."""
    d = daemons("decode", *HB_FLAGS, "--bootstrap-timeout", "60", name="d")
    cd = AsyncClient(d.engine, timeout=60.0)
    await cd.connect()
    try:
        await cd.create_kv_pool(small_layout())
        await cd.create_aux_buffer(4, 64)
        await cd.expect(100, f"127.0.0.1:{free_port()}", pages(0), await cd.alloc_slot())
        waiting = asyncio.create_task(cd.wait(100, timeout=60))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        killed = kill(d)
        with pytest.raises(errors.DaemonGone, match="went away"):
            await waiting
        assert time.monotonic() - killed < 30  # a liveness bound, far below the 60 s timeout
    finally:
        await cd.close()


def test_a_sync_engine_waiting_on_its_killed_daemon_hears_so_at_once(daemons):
    """As above, for the synchronous client: its wait() polls the connection too."""
    d = daemons("decode", *HB_FLAGS, "--bootstrap-timeout", "60", name="d")
    cd = Client(d.engine, timeout=60.0)
    cd.connect()
    try:
        cd.create_kv_pool(small_layout())
        cd.create_aux_buffer(4, 64)
        cd.expect(100, f"127.0.0.1:{free_port()}", pages(0), cd.alloc_slot())
        killed = kill(d)
        with pytest.raises(errors.DaemonGone, match="went away"):
            cd.wait(100, timeout=60)
        assert time.monotonic() - killed < 30  # a liveness bound, far below the 60 s timeout
    finally:
        cd.close()


def welcome_then_close(fake: FakePrefill) -> None:
    """Welcome the decode daemon that says hello, take its first room request, and go
    away: that daemon knows this prefill's clock, so it posts later room requests to the
    link at once (where they wait while the link is down) instead of holding them."""
    identity, _ = fake.recv_kind(PeerHello)
    fake.welcome(identity)
    fake.recv_kind(RoomRequest)
    fake.close()


async def test_a_room_request_that_cannot_be_queued_for_an_unreachable_prefill_fails_its_room_at_once(daemons):
    """While its prefill cannot be reached, a decode daemon holds room requests up to
    twice --max-message-bytes. A request past that is dropped, and its room fails then
    (peer_unreachable) instead of waiting out a 60 s bootstrap timeout, fenced at once
    since the prefill never heard of it; the rooms whose requests wait are untouched,
    and no heartbeat is queued behind them while the link is down."""
    d = daemons("decode", *HB_FLAGS, "--max-message-bytes", "4096", "--bootstrap-timeout", "60", name="d")
    cd = AsyncClient(d.engine, timeout=60.0)
    await cd.connect()
    try:
        await cd.create_kv_pool(small_layout(num_pages=1024))
        await cd.create_aux_buffer(4, 64)
        port = free_port()
        nowhere = f"127.0.0.1:{port}"
        fake = FakePrefill(port, "gone000000000000")
        await cd.expect(100, nowhere, [1000], await cd.alloc_slot())
        await asyncio.get_running_loop().run_in_executor(None, welcome_then_close, fake)
        while (await cd.poll(100)).state is not RoomState.FAILED:  # the connection closed: peer_dead
            await asyncio.sleep(0.02)
        many = list(range(900))  # a 3.6 KB page list: two requests wait, the third is over 8 KiB
        for room in (101, 102, 103):
            await cd.expect(room, nowhere, many, await cd.alloc_slot())
        started = time.monotonic()
        status = await cd.wait(103, timeout=60)
        assert time.monotonic() - started < 5  # far below the 60 s bootstrap and the 10 s fence timeouts
        assert (status.state, status.code, status.fenced) == (RoomState.FAILED, ErrorCode.PEER_UNREACHABLE, True)
        assert "could not be sent to the peer daemon" in status.reason
        assert [(await cd.poll(room)).state for room in (101, 102)] == [RoomState.BOOTSTRAPPING] * 2
        await asyncio.sleep(5 * HB_INTERVAL)
        assert (await cd.stats()).failures["dropped:peer-message"] == 1  # no heartbeat queued (and dropped) while the link is down
    finally:
        await cd.close()


def test_a_room_request_queued_while_the_prefill_was_unreachable_is_not_sent_once_its_room_ended(daemons):
    """A decode daemon keeps what it posts to an unreachable prefill and sends it on
    connecting. A room_request whose room ended meanwhile must not go: once the engine
    released the room, its pages may be another room's. A failed room whose request
    never left is fenced on connecting (the prefill never heard of it), not after its
    60 s lease and fence timeout."""
    port = free_port()
    d = daemons("decode", *HB_FLAGS, "--transfer-timeout", "60", "--fence-timeout", "60", name="d")
    cd = engine(d)
    try:
        fake = FakePrefill(port, "gone000000000000")
        cd.expect(99, f"127.0.0.1:{port}", pages(3), cd.alloc_slot())
        welcome_then_close(fake)
        wait_until(lambda: cd.poll(99).state is F, SLACK, "room 99 to fail with its connection")
        for room in (100, 101, 102):
            cd.expect(room, f"127.0.0.1:{port}", pages(room - 100), cd.alloc_slot())
        cd.abort(100, "the engine gave up")  # failed, not fenced: its request might have left
        cd.abort(101, "the engine gave up")
        assert (cd.poll(100).state, cd.poll(100).fenced) == (F, False)
        fake = FakePrefill(port, "late000000000000")
        try:
            _, request = fake.recv_kind(RoomRequest)
            assert request.room == 102  # 100's and 101's requests stayed behind
            assert cd.wait(100, timeout=5).fenced and cd.wait(101, timeout=5).fenced
            later, deadline = [], time.monotonic() + 1.0
            while time.monotonic() < deadline:
                later.append(fake.recv(timeout=1.0)[1])  # heartbeats keep coming: never empty
            assert not [m for m in later if isinstance(m, RoomRequest)], later
        finally:
            fake.close()
    finally:
        cd.close()


def test_a_prefill_that_never_got_a_rooms_request_still_refuses_its_send_with_the_decode_sides_reason(daemons):
    """The request of a room aborted while its prefill was unreachable is never sent
    (above); the room_failed that follows it still is, and the prefill keeps it as a
    tombstone, so its engine's send() for that room hears why at once instead of
    waiting out the bootstrap timeout."""
    port = free_port()
    d = daemons("decode", *HB_FLAGS, name="d")
    cd = engine(d)
    try:
        cd.expect(300, f"127.0.0.1:{port}", pages(0), cd.alloc_slot())
        cd.abort(300, "the user went away")
        p = daemons("prefill", *HB_FLAGS, "--bootstrap-port", str(port), name="p")
        cp = engine(p)
        try:
            assert cd.wait(300, timeout=5).fenced

            def failed_there() -> bool:
                try:
                    return cp.poll(300).state is F
                except errors.UnknownRoom:
                    return False

            wait_until(failed_there, 5, "the prefill to learn of the decode side's failure")
            with pytest.raises(errors.PdxferError, match="already failed.*the user went away"):
                cp.send(300, pages(1), 8, cp.alloc_slot())
        finally:
            cp.close()
    finally:
        cd.close()


def test_a_prefill_frozen_past_the_leave_to_write_writes_nothing_into_released_pages(daemons):
    """A prefill daemon stands still (SIGSTOP) with a room's request in its socket and
    its engine's send() on the way. The decode side declares it dead, fences the room by
    lease, and its engine refills the pages. On SIGCONT the prefill sees it was frozen,
    not its peer silent, so it keeps the decode daemon, and reads the request and the
    send() in either order: whichever, the request's leave to write is over, and not one
    block may be written. (The room_failed right behind the request also stops the
    writes here, as it did before the leave existed, except when the pump thread wins
    the race between the two messages; test_write_leave.py and test_network_faults.py
    pin the leave itself.)"""
    p = daemons("prefill", *HB_FLAGS, "--bootstrap-timeout", "30", name="p")
    d = daemons("decode", *HB_FLAGS, "--transfer-timeout", "1", "--fence-timeout", "0.5", name="d")  # leave: 1.5 s
    cp, cd = engine(p), engine(d)
    freezer = Freezer(p)
    try:
        warm = start_room(cp, cd, p.bootstrap, 100, pages(0), pages(0), seed=0)  # the link knows the prefill's clock
        assert cd.wait(warm.id).state is S and cp.wait(warm.id).state is S
        blocks_before = daemon_counters(p.ready["admin"])["blocks_submitted"]

        t_stop = freezer.stop()
        late = start_room(cp, cd, p.bootstrap, 101, pages(1), pages(1), seed=1, send=False)
        sent: list = []
        sender = threading.Thread(target=lambda: sent.append(_outcome(send_room, late)))
        sender.start()  # blocks until the prefill answers
        wait_until(lambda: (s := cd.poll(late.id)).state is F and s, HB_BOUND + SLACK, "the decode to fail the room")
        reused = reuse_pages(late, 0x5A)  # sentinel bytes in the held pages: any write that lands shows
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t_stop)))
        freezer.resume()

        sender.join(SLACK)
        assert sent and sent[0] in ("ok", "refused"), sent
        wait_until(lambda: cp.poll(late.id).state is F, SLACK, "the prefill to fail the late room")
        assert_nothing_written(p, blocks_before, late, reused)
        assert cd.wait(late.id, timeout=SLACK).fenced  # the prefill confirmed: it wrote nothing
        assert p.alive() and d.alive()
    finally:
        freezer.thaw()
        for client in (cp, cd):
            client.close()


def _outcome(call, *args) -> str:
    """'ok', or 'refused' when the daemon answered with an error."""
    try:
        call(*args)
        return "ok"
    except errors.PdxferError:
        return "refused"
