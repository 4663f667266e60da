"""The decode side's leave to write (protocol.Heartbeat): a prefill that reads a room's
request late (it stood still, or sat behind a partition) must not write into pages
the decode side may have released meanwhile.

Pure: the decode side's bound of the prefill's clock never runs ahead of the truth.
Real processes: a real prefill daemon played against by a fake decode daemon (so the
leave it reads can be chosen exactly), and a real decode daemon played against by a
fake prefill (so the leave it gives can be read). Every daemon on this host reads the
same CLOCK_MONOTONIC as the test.
"""

from __future__ import annotations

import collections
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import (
    Codec,
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    LegRequest,
    PeerHello,
    PeerWelcome,
    RoomFailed,
    RoomRequest,
    RoomState,
    TransferStarted,
)
from pdxfer.ops.inspection import daemon_counters
from pdxfer.roles.decode.state import OFFSET_SAMPLES, PrefillLink
from pdxfer.wire.seal import Seal

from .conftest import needs_mooncake
from .peersocket import PeerSocket, decode_hello
from .roomkit import SLACK, engine, free_port, wait_until
from .test_peer_death import FakePrefill

# --- pure: the offset bound


@given(
    offset=st.floats(min_value=-1e6, max_value=1e6),
    transits=st.lists(st.tuples(st.floats(0, 0.5), st.floats(0, 0.5)), min_size=1, max_size=30),
)
def test_the_leave_is_never_later_than_send_time_plus_span_on_the_prefills_clock(offset, transits):
    """Each answer is read on the prefill's clock some time before it arrives here;
    whatever those delays, the leave computed from the answers is a lower bound."""
    link = PrefillLink("tcp://p:1", last_heard=0.0)
    now = 1000.0
    for before, after in transits:  # the prefill reads its clock, the answer travels `after`
        now += before
        link.clock_sample(now + offset, now + after)
        now += after
        assert link.writes_until(now, 9.0) <= now + offset + 9.0 + 1e-6 * max(1.0, abs(offset))
    exact = PrefillLink("tcp://p:1", last_heard=0.0)
    exact.clock_sample(now + offset, now)  # an answer that took no time: the bound is the truth
    assert exact.writes_until(now, 9.0) == pytest.approx(now + offset + 9.0)


def test_no_leave_before_the_prefills_clock_was_seen_and_old_samples_age_out():
    link = PrefillLink("tcp://p:1", last_heard=0.0)
    assert link.writes_until(5.0, 9.0) == 0.0
    link.clock_sample(0.0, 5.0)  # an answer without a clock says nothing
    assert link.writes_until(5.0, 9.0) == 0.0
    link.clock_sample(110.0, 10.0)  # a clock 100 s ahead; then it drifts back by 1 s
    for i in range(OFFSET_SAMPLES):
        link.clock_sample(99.0 + 11.0 + i, 11.0 + i)
        expected = 100.0 if i < OFFSET_SAMPLES - 1 else 99.0
        assert link.writes_until(20.0, 9.0) == pytest.approx(20.0 + expected + 9.0)


# --- a real prefill daemon, a fake decode daemon



def real(test):
    """Marks for a test with real daemon processes."""
    return needs_mooncake(pytest.mark.integration(pytest.mark.timeout(90)(test)))


# Heartbeats too slow to matter: the fake decode sends only what a test says.
QUIET = ("--heartbeat-interval", "5", "--heartbeat-misses", "6")
SRC, DST = [10, 11], [20, 21]
ROOM = 4242


class FakeDecode:
    """The bootstrap side of a decode daemon, played by the test against a real prefill.
    Its session names nothing, so writes it lets through fail; what matters here is
    whether the prefill starts them."""

    def __init__(self, prefill, client) -> None:
        self.codec = Codec()
        self.seal = Seal("fakedecode000000")
        self.sock = PeerSocket(prefill.bootstrap)
        self._received: collections.deque = collections.deque()
        self.hello = decode_hello(client, "fakedecode000000", "fake/decode")

    def send(self, *messages) -> None:
        self.sock.send_multipart(self.seal.seal([self.codec.encode(m) for m in messages]))

    def recv(self, timeout: float = SLACK):
        if not self._received:
            assert self.sock.poll(int(timeout * 1000)), "the prefill daemon sent nothing"
            _, payloads = self.seal.open(self.sock.recv_multipart())
            self._received.extend(self.codec.peer_messages.decode(p) for p in payloads)
        return self._received.popleft()

    def recv_until(self, kinds, timeout: float = SLACK) -> list:
        """Every message up to and including the first of one of ``kinds``."""
        seen = [self.recv(timeout)]
        while not isinstance(seen[-1], kinds):
            seen.append(self.recv(timeout))
        return seen

    def request(self, writes_until: float) -> RoomRequest:
        leg = LegRequest(pages=pages_to_bytes(DST), slot=0, generation=1, memory_version=1)
        return RoomRequest(room=ROOM, legs=(leg,), lease_ms=30_000, writes_until=writes_until)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def prefill_and_fake(daemons):
    daemon = daemons("prefill", *QUIET, name="p")
    client = engine(daemon)
    fake = FakeDecode(daemon, client)
    try:
        before = time.monotonic()
        fake.send(fake.hello)
        (welcome,) = fake.recv_until(PeerWelcome)
        assert before <= welcome.clock <= time.monotonic(), "the welcome carries the prefill's monotonic clock"
        yield daemon, client, fake
    finally:
        fake.close()
        client.close()


def _send_room(client) -> None:
    client.send(ROOM, SRC, num_tokens=2 * client.kv.layout.page_size, slot=client.alloc_slot())


@real
def test_a_request_whose_leave_ran_out_before_its_writes_could_start_writes_nothing(prefill_and_fake):
    daemon, client, fake = prefill_and_fake
    fake.send(fake.request(writes_until=time.monotonic() - 1.0))  # read a second after the decode side's bound
    _send_room(client)
    seen = fake.recv_until(RoomFailed)
    assert not any(isinstance(m, TransferStarted) for m in seen), seen
    failed = seen[-1]
    assert failed.code is ErrorCode.LEASE_EXPIRED and failed.fenced, failed
    status = client.wait(ROOM, timeout=SLACK)
    assert status.state is RoomState.FAILED and status.code == "lease_expired", status
    assert "leave to write ran out" in status.reason, status.reason
    assert daemon_counters(daemon.ready["admin"])["blocks_submitted"] == 0


@real
def test_a_later_heartbeat_renews_the_leave_for_every_room_not_failed_before_it(prefill_and_fake):
    """The same stale request, then a heartbeat sent later: the decode side had not
    failed the room when it sent that (a failure would have come first), so it starts."""
    daemon, client, fake = prefill_and_fake
    fake.send(fake.request(writes_until=time.monotonic() - 1.0))
    fake.send(Heartbeat(seq=1, writes_until=time.monotonic() + 30.0))
    (*_, ack) = fake.recv_until(HeartbeatAck)
    assert ack.seq == 1 and ack.clock > 0, ack
    _send_room(client)
    seen = fake.recv_until((TransferStarted, RoomFailed))
    assert isinstance(seen[-1], TransferStarted), seen
    wait_until(lambda: daemon_counters(daemon.ready["admin"])["blocks_submitted"] > 0, SLACK, "the room's writes to be submitted")


# --- a real decode daemon, a fake prefill

SPAN_FLAGS = ("--transfer-timeout", "7", "--fence-timeout", "2")  # its leave: 9 s past sending
AHEAD = 1000.0  # the fake prefill's clock runs this far ahead, as another host's might


@real
def test_a_decode_daemon_holds_room_requests_until_it_knows_the_prefills_clock(daemons):
    port = free_port()
    d = daemons("decode", *SPAN_FLAGS, "--heartbeat-interval", "0.2", "--heartbeat-misses", "200", name="d")
    cd = engine(d)
    fake = FakePrefill(port, "ahead00000000000")
    try:
        cd.expect(ROOM, f"127.0.0.1:{port}", DST, cd.alloc_slot())
        identity, _ = fake.recv_kind(PeerHello)
        early = fake.drain(0.5)
        assert not any(isinstance(m, RoomRequest) for m in early), "a room request left before the prefill's clock was known"
        assert all(m.writes_until == 0 for m in early if isinstance(m, Heartbeat)), early
        sent = time.monotonic()
        fake.welcome(identity, clock=sent + AHEAD)
        _, request = fake.recv_kind(RoomRequest)
        arrived = time.monotonic()
        assert request.room == ROOM
        assert sent + AHEAD + 9.0 - SLACK <= request.writes_until <= arrived + AHEAD + 9.0, (sent, arrived, request)
        beat = Heartbeat(seq=0)
        while not beat.writes_until:  # one may have left before the welcome arrived
            _, beat = fake.recv_kind(Heartbeat)
        assert time.monotonic() + AHEAD + 9.0 - SLACK <= beat.writes_until <= time.monotonic() + AHEAD + 9.0, beat
    finally:
        fake.close()
        cd.close()


@real
def test_a_room_that_fails_while_its_request_is_held_is_fenced_at_once_and_never_requested(daemons):
    port = free_port()
    d = daemons("decode", "--bootstrap-timeout", "0.5", "--heartbeat-interval", "0.2", "--heartbeat-misses", "200", name="d")
    cd = engine(d)
    fake = FakePrefill(port, "late000000000000")
    try:
        cd.expect(ROOM, f"127.0.0.1:{port}", DST, cd.alloc_slot())
        identity, _ = fake.recv_kind(PeerHello)
        status = cd.wait(ROOM, timeout=0.5 + SLACK)
        assert status.state is RoomState.FAILED and status.code == "timeout", status
        assert status.fenced, "the prefill never heard of the room: nothing of it can land"
        assert cd.stats().slots["quarantined"] == 0
        fake.welcome(identity)
        later = fake.drain(1.0)
        assert not [m for m in later if isinstance(m, RoomRequest)], f"the failed room was requested after all: {later}"
        # Only its failure goes, so that the prefill engine's send() for it hears why.
        (told,) = [m for m in later if isinstance(m, RoomFailed)]
        assert told.room == ROOM and told.code is ErrorCode.TIMEOUT and told.fenced, told
    finally:
        fake.close()
        cd.close()
