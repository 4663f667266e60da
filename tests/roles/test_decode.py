"""DecodeService driven directly: the engine's expect() and prefill daemons' messages
handed in, every message, link and timer it makes read back from a recording port,
time moved by hand in milliseconds. No process, no socket, no transfer engine."""

from __future__ import annotations

import zlib

import msgspec

from pdxfer.core.protocol import (
    Abort,
    AuxRecord,
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    Ok,
    PeerHello,
    PeerWelcome,
    PROTOCOL_VERSION,
    Release,
    RoomAccepted,
    RoomAck,
    RoomFailed,
    LegRequest,
    RoomRequest,
    RoomState,
    RoomStatus,
    SessionsDrained,
    TransferStarted,
    unpack_legs,
)
from pdxfer.core.generations import Span
from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.slots import SlotState
from pdxfer.core.stamp import Stamp
from pdxfer.roles.decode import DecodeService

from .port import START_MS, seconds
from .rig import (
    DECODE_SESSIONS,
    DST_PROBE,
    ENDPOINT,
    ENGINE,
    PAGE_BYTES,
    PREFILL_INCARNATION,
    PREFILL_SESSIONS,
    TICK,
    call,

    decode,
    expect,
    grant,
    run,
    status,
    wire,
)

SPAN = 40.0  # s: leave to write for a room sent now, transfer timeout (30) + fence timeout (10)
PREFILL_CLOCK = 5_000.25  # the prefill's monotonic clock in its welcome: 4000.25 s ahead of ours at START_MS
OTHER, OTHER_ENDPOINT, OTHER_INCARNATION = "10.0.0.3:8998", "tcp://10.0.0.3:8998", "q" * 16
B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED)


def link(service: DecodeService, message, endpoint: str = ENDPOINT, incarnation: str = PREFILL_INCARNATION) -> None:
    service.on_link(endpoint, incarnation, wire(message))


def welcome(clock: float = PREFILL_CLOCK, incarnation: str = PREFILL_INCARNATION) -> PeerWelcome:
    return PeerWelcome(version=PROTOCOL_VERSION, incarnation=incarnation, session=PREFILL_SESSIONS[0], clock=clock)


def expecting(service: DecodeService, room: int, pages: list[int], bootstrap: str = "10.0.0.1:8998",
              endpoint: str = ENDPOINT, incarnation: str = PREFILL_INCARNATION) -> RoomRequest:
    """The engine expects ``room``; the prefill welcomes the link if it is new. The room's request."""
    new = endpoint not in service.state.links
    assert call(service, expect(room, pages, grant(service), bootstrap)) == Ok(req=11)
    if new:
        link(service, welcome(incarnation=incarnation), endpoint, incarnation)
    (sent,) = [m for kind, to, m in service.port.take() if isinstance(m, RoomRequest)]
    return sent


def accepted(service: DecodeService, room: int, input_ready: bool = True, endpoint: str = ENDPOINT,
             incarnation: str = PREFILL_INCARNATION) -> None:
    """The prefill accepts ``room``; the engine hears of each state it moves to (B6)."""
    link(service, RoomAccepted(room=room, input_ready=input_ready, legs=(0,)), endpoint, incarnation)
    states = (W, T) if input_ready else (W,)
    assert service.port.take() == [("engine", ENGINE, status(room, state, fenced=False)) for state in states]


def record(request: RoomRequest, payload: bytes = b"", **fields) -> AuxRecord:
    """The prefill's aux record for ``request``, carrying ``payload``."""
    (leg,) = request.legs
    return AuxRecord(room=request.room, slot=leg.slot, generation=leg.generation, length=len(payload),
                     checksum=zlib.crc32(payload), payload=payload, **fields)


# --- the link, and the leave to write


def test_an_expect_opens_a_link_says_hello_and_holds_the_request_until_the_prefills_clock_is_known():
    service = decode()
    port = service.port
    slot = grant(service)
    assert call(service, expect(7, [5, 6], slot)) == Ok(req=11)
    assert port.links == [("open", ENDPOINT)]
    hello = service.hello(ENDPOINT)
    assert (hello.name, hello.sessions, hello.session, hello.probe_base) == ("host/d", DECODE_SESSIONS, DECODE_SESSIONS[0], DST_PROBE)
    assert [(lane.index, lane.aux_base, lane.region_bases) for lane in hello.lanes] == [(0, service.lanes[0].aux.memory.address, (service.lanes[0].kv.buffers[0].address,))]
    assert unpack_legs(hello.live_legs) == {(7, 0)}  # the room's one leg, live: any hello from now on names it
    # The first hello left as the link opened, before the room joined it; the request waits: its leave to write needs the prefill's clock.
    assert port.take() == [("link", ENDPOINT, msgspec.structs.replace(hello, live_legs=b""))]

    port.advance(7)
    link(service, welcome())
    offset = PREFILL_CLOCK - seconds(START_MS + 7)
    leg = LegRequest(pages=pages_to_bytes([5, 6]), slot=slot.slot, generation=slot.generation, memory_version=1)
    assert port.take() == [("link", ENDPOINT, RoomRequest(room=7, legs=(leg,), lease_ms=30_000, writes_until=port.clock() + offset + SPAN))]
    assert service.state.links[ENDPOINT].ready


def test_the_leave_to_write_follows_the_best_clock_offset_the_prefills_answers_bound():
    """Each answer bounds the prefill's clock from below (read there before it left,
    here after it arrived); the largest bound of the recent ones counts."""
    service = decode(heartbeat_interval=1.0)
    port = service.port
    expecting(service, 7, [5])
    service.on_connection(ENDPOINT, "connected")
    service.tick()  # the first heartbeat: the offset from the welcome
    (beat,) = [m for _, _, m in port.take()]
    assert beat == Heartbeat(seq=1, wall=port.wall(), writes_until=port.clock() + (PREFILL_CLOCK - seconds(START_MS)) + SPAN)
    port.advance(2)
    link(service, HeartbeatAck(seq=1, wall=0.0, clock=PREFILL_CLOCK + 0.5))  # 0.498 s further ahead than the welcome said
    run(service, 1_000)
    (beat,) = [m for _, _, m in port.take()]
    better = PREFILL_CLOCK + 0.5 - seconds(START_MS + 2)
    assert beat == Heartbeat(seq=2, wall=port.wall(), writes_until=port.clock() + better + SPAN)
    assert service.state.links[ENDPOINT].rtt == seconds(START_MS + 2) - seconds(START_MS)


# --- out-of-order accept and aux record


def test_an_aux_record_before_any_notice_lands_the_room_through_every_state():
    """An inline room's record is the first the decode side hears of its transfer: it
    stands for room_accepted and transfer_started."""
    service = decode()
    port = service.port
    request = expecting(service, 7, [5, 6])
    kv = bytes([1] * PAGE_BYTES + [2] * PAGE_BYTES)
    port.advance(4)
    link(service, record(request, b"first token", kv_pages=2, kv=kv))
    assert port.take() == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7))]
    room = service.rooms.get(7)
    assert [state for state, _ in room.history] == [B, W, T, S]
    assert [(left, to) for r, left, to in port.transitions if r == 7] == [(None, B), (B, W), (W, T), (T, S)]
    assert service.lanes[0].kv.buffers[0].array[5 * PAGE_BYTES:7 * PAGE_BYTES].tobytes() == kv
    assert service.lanes[0].aux.payload(request.legs[0].slot, 11) == b"first token"
    assert service.lanes[0].aux.slots.slots[request.legs[0].slot].state is SlotState.WRITTEN
    assert service.verifier.bytes_received == room.bytes_moved > len(kv)


def test_an_aux_record_after_room_accepted_but_before_transfer_started_lands_the_room():
    service = decode()
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7, input_ready=False)
    assert service.rooms.get(7).state is W
    link(service, record(request, b"x", kv_pages=1, kv=bytes(PAGE_BYTES)))
    assert port.take() == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7))]
    assert [state for state, _ in service.rooms.get(7).history] == [B, W, T, S]


def test_the_notices_then_the_record_land_the_room_in_order():
    service = decode()
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7, input_ready=False)
    link(service, TransferStarted(room=7))
    assert service.rooms.get(7).state is T and port.take() == [("engine", ENGINE, status(7, T, fenced=False))]
    link(service, record(request, b"aux", kv_pages=1))
    assert port.take() == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7))]
    assert [state for state, _ in service.rooms.get(7).history] == [B, W, T, S]


def test_a_stamp_written_by_the_transfer_engine_is_checked_again_until_it_is_visible():
    service = decode(visibility_grace=0.05)
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7)
    start = port.ms
    link(service, record(request, b"aux", kv_pages=1, via_transfer_engine=True))
    assert port.take() == [] and port.timers() == [start + 1]  # not visible yet: look again soon
    port.advance(3)
    assert port.timers() == [start + 4] and service.rooms.get(7).state is T
    service.lanes[0].aux.write(request.legs[0].slot, Stamp(7, request.legs[0].generation, 3, zlib.crc32(b"aux")), b"aux")  # it lands
    port.advance(1)
    assert port.take() == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7))]
    assert port.timers() == []


def test_a_stamp_that_never_becomes_visible_fails_the_room_after_the_grace():
    service = decode(visibility_grace=0.05)
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7)
    link(service, record(request, b"aux", kv_pages=1, via_transfer_engine=True))
    port.advance(49)
    assert service.rooms.get(7).state is T
    port.advance(2)
    room = service.rooms.get(7)
    assert room.code is ErrorCode.AUX_STAMP_MISMATCH and port.timers() == []
    # The record came after the prefill's writes completed: nothing more can land.
    assert port.take() == [("link", ENDPOINT, RoomFailed(room=7, code=ErrorCode.AUX_STAMP_MISMATCH, reason=room.reason, fenced=True)),
                           ("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.AUX_STAMP_MISMATCH, reason=room.reason))]


# --- fencing: the prefill's word, its restart, or a cut; never a clock


def test_a_failed_room_stays_fence_pending_until_the_prefill_says_nothing_is_in_flight():
    service = decode()
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7)
    assert call(service, Abort(req=12, room=7, reason="client went away")) == Ok(req=12)
    reason = "aborted by the decode engine: client went away"
    assert port.take() == [("link", ENDPOINT, RoomFailed(room=7, code=ErrorCode.ABORTED, reason=reason, fenced=True)),
                           ("engine", ENGINE, status(7, F, fenced=False, code=ErrorCode.ABORTED, reason=reason))]
    slot = service.lanes[0].aux.slots.slots[request.legs[0].slot]
    run(service, 200_000)  # twenty fence timeouts: no clock fences (S2)
    assert slot.state is SlotState.QUARANTINED and not service.rooms.get(7).fenced
    assert [p.fence_pending for p in service.peer_infos(port.clock(), 0.0)] == [1]
    port.take()

    link(service, RoomFailed(room=7, code=ErrorCode.ABORTED, reason="no write in flight", fenced=True))
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.ABORTED, reason=reason))]
    assert slot.state is SlotState.FREE


def test_a_released_room_keeps_its_slot_quarantined_until_the_prefills_proof():
    service = decode()
    port = service.port
    request = expecting(service, 7, [5])
    accepted(service, 7)
    link(service, RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="write failed", fenced=False))
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=False, code=ErrorCode.TRANSFER_FAILED, reason="prefill side: write failed"))]
    assert call(service, Release(req=13, room=7)) == Ok(req=13)
    slot = service.lanes[0].aux.slots.slots[request.legs[0].slot]
    assert service.rooms.find(7).released and slot.state is SlotState.QUARANTINED  # it stays, released, until fenced
    link(service, RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="write failed", fenced=True))
    assert slot.state is SlotState.FREE and service.rooms.find(7) is None and port.take() == []


def test_a_cut_ends_the_old_sessions_once_the_live_prefill_drained_them_then_fences_what_waited():
    """An operator cut is a rotation: new sessions, a hello to every prefill with the
    legs it may move there (none: the one room failed), and the old sessions end only
    once the connected prefill said it drained them; then the room waiting for proof is
    fenced and the operator answered."""
    service = decode()
    port = service.port
    expecting(service, 7, [5])
    service.on_connection(ENDPOINT, "connected")
    accepted(service, 7)
    call(service, Abort(req=12, room=7))
    port.take()
    answers = []
    service.cut("10.0.0.1", answers.append)
    assert port.rotations == 1 and answers == []
    service.sessions_rotated(("10.0.0.2:16101",))
    hello = service.hello(ENDPOINT)
    assert port.take() == [("link", ENDPOINT, hello)]
    assert hello.sessions == ("10.0.0.2:16101",) and unpack_legs(hello.live_legs) == set()  # room 7 failed: not live
    assert port.ended == [] and service.sessions.rotation.waiting == {ENDPOINT}
    link(service, SessionsDrained(sessions=DECODE_SESSIONS))
    assert port.ended == [DECODE_SESSIONS]
    assert service.rooms.get(7).fenced is False  # not before they ended
    service.sessions_ended(DECODE_SESSIONS)
    reason = "aborted by the decode engine: aborted by engine"
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.ABORTED, reason=reason))]
    assert answers == [1] and service.sessions.cuts == 1 and service.sessions.rotation is None


# --- fencing by the end of sessions (core/generations.py)

NEW = ("10.0.0.2:16101",)


def two_prefills(service: DecodeService) -> None:
    """Room 7 from ENDPOINT and room 8 from OTHER, both transferring, both links connected."""
    expecting(service, 7, [5])
    expecting(service, 8, [6], OTHER, OTHER_ENDPOINT, OTHER_INCARNATION)
    for endpoint, incarnation, room in ((ENDPOINT, PREFILL_INCARNATION, 7), (OTHER_ENDPOINT, OTHER_INCARNATION, 8)):
        service.on_connection(endpoint, "connected")
        accepted(service, room, endpoint=endpoint, incarnation=incarnation)


def only_other_answers(service: DecodeService, ms: int) -> None:
    """``ms`` pass, ticking; the other prefill answers every heartbeat, ENDPOINT nothing."""
    port = service.port
    for _ in range(ms // TICK):
        port.advance(TICK)
        service.tick()
        for kind, to, message in port.take():
            if isinstance(message, Heartbeat) and to == OTHER_ENDPOINT:
                link(service, HeartbeatAck(seq=message.seq, clock=PREFILL_CLOCK), OTHER_ENDPOINT, OTHER_INCARNATION)


def test_a_silent_prefills_rooms_are_fenced_by_a_rotation_that_waits_for_the_live_prefill_alone():
    """ENDPOINT goes silent with room 7 in flight: past the heartbeat bound the room
    fails, and a rotation starts at once; the live prefill hears the new sessions with
    room 8 still its to write, says it drained the old ones, and only then do they end
    and room 7 is fenced: well within the fence bound of ENDPOINT's last word."""
    service = decode(heartbeat_interval=1.0, heartbeat_misses=5, fence_bound=15.0)
    port = service.port
    two_prefills(service)
    last_word = port.ms
    only_other_answers(service, 5_125)
    assert service.rooms.get(7).state is F and port.rotations == 1
    (info,) = [p for p in service.peer_infos(port.clock(), 0.0) if p.address == ENDPOINT]
    assert (info.state, info.fence_pending) == ("silent", 1) and info.fence_in == seconds(last_word + 15_000 - port.ms)
    service.sessions_rotated(NEW)
    hellos = {to: m for _, to, m in port.take() if isinstance(m, PeerHello)}
    assert unpack_legs(hellos[OTHER_ENDPOINT].live_legs) == {(8, 0)} and hellos[OTHER_ENDPOINT].sessions == NEW
    assert unpack_legs(hellos[ENDPOINT].live_legs) == set()
    assert service.sessions.rotation.waiting == {OTHER_ENDPOINT} and service.state.work[service.rooms.get(8).id].span == Span(1, 2)
    only_other_answers(service, 1_000)
    assert port.ended == []  # the live prefill has not said it drained: its writes in flight would fail
    link(service, SessionsDrained(sessions=DECODE_SESSIONS), OTHER_ENDPOINT, OTHER_INCARNATION)
    assert port.ended == [DECODE_SESSIONS]
    service.sessions_ended(DECODE_SESSIONS)
    assert service.rooms.get(7).fenced and service.rooms.get(8).state is T
    assert port.ms - last_word < 15_000 and service.sessions.fenced == 1 and service.sessions.rotations == 1


def test_a_rotation_ends_the_old_sessions_at_its_deadline_when_a_live_prefill_never_says_it_drained():
    service = decode(heartbeat_interval=1.0, heartbeat_misses=5, fence_bound=15.0)
    port = service.port
    two_prefills(service)
    last_word = port.ms
    only_other_answers(service, 5_125)
    service.sessions_rotated(NEW)
    deadline = service.sessions.rotation.deadline
    assert deadline == seconds(last_word + 15_000 - 500)
    only_other_answers(service, round((deadline - port.clock()) * 1000) - TICK)
    assert port.ended == []
    only_other_answers(service, 2 * TICK)
    assert port.ended == [DECODE_SESSIONS]
    service.sessions_ended(DECODE_SESSIONS)
    assert service.rooms.get(7).fenced and port.ms - last_word <= 15_000


def test_a_room_listed_live_when_the_sessions_changed_waits_for_the_new_ones_too():
    """Room 8 was live when the hello moved it to the new sessions: failing later, it is
    not fenced by the end of the old ones alone (its prefill may write it into the new)."""
    service = decode()
    port = service.port
    two_prefills(service)
    service.cut("10.0.0.3", lambda fenced: None)
    service.sessions_rotated(NEW)
    link(service, RoomFailed(room=8, code=ErrorCode.TRANSFER_FAILED, reason="write failed", fenced=False), OTHER_ENDPOINT, OTHER_INCARNATION)
    link(service, SessionsDrained(sessions=DECODE_SESSIONS), OTHER_ENDPOINT, OTHER_INCARNATION)
    link(service, SessionsDrained(sessions=DECODE_SESSIONS))
    assert port.ended == [DECODE_SESSIONS]
    service.sessions_ended(DECODE_SESSIONS)
    assert not service.rooms.get(8).fenced
    service.sessions_ended(NEW)  # say its engine process died
    assert service.rooms.get(8).fenced


def test_the_transfer_engine_process_dying_fences_at_once_and_its_successor_is_announced():
    service = decode()
    port = service.port
    expecting(service, 7, [5])
    service.on_connection(ENDPOINT, "connected")
    accepted(service, 7)
    link(service, RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="write failed", fenced=False))
    port.take()
    service.sessions_ended(DECODE_SESSIONS)
    assert service.rooms.get(7).fenced
    assert [m.fenced for _, _, m in port.take()] == [True]  # the engine hears it
    service.sessions_rotated(NEW)
    assert port.take() == [("link", ENDPOINT, service.hello(ENDPOINT))] and service.sessions.rotation is None and port.ended == []


# --- heartbeats and dead prefills


def test_a_silent_prefill_is_declared_dead_after_the_heartbeat_bound_and_exactly_its_rooms_fail():
    service = decode(heartbeat_interval=1.0, heartbeat_misses=5)
    port = service.port
    expecting(service, 7, [5])
    expecting(service, 8, [6], OTHER, OTHER_ENDPOINT, OTHER_INCARNATION)
    for endpoint, incarnation, room in ((ENDPOINT, PREFILL_INCARNATION, 7), (OTHER_ENDPOINT, OTHER_INCARNATION, 8)):
        service.on_connection(endpoint, "connected")
        accepted(service, room, endpoint=endpoint, incarnation=incarnation)
    heard = port.ms
    beats = 0
    for _ in range(5 * 1000 // TICK):  # the other prefill answers every heartbeat; this one nothing
        port.advance(TICK)
        service.tick()
        for kind, to, message in port.take():
            assert isinstance(message, Heartbeat), message
            if to == OTHER_ENDPOINT:
                link(service, HeartbeatAck(seq=message.seq, clock=PREFILL_CLOCK), OTHER_ENDPOINT, OTHER_INCARNATION)
            else:
                beats += 1
                assert message.seq == beats and port.ms == heard + TICK + (beats - 1) * 1000  # one a second
    assert port.ms == heard + 5_000 and service.rooms.get(7).state is T  # silent for exactly the bound: not yet
    assert service.heartbeat_misses == 4  # every beat after the first went unanswered

    port.advance(1)
    service.tick()
    reason = f"prefill {ENDPOINT} answered nothing for 5.0s (5 heartbeats missed)"
    assert port.take() == [("link", ENDPOINT, RoomFailed(room=7, code=ErrorCode.PEER_DEAD, reason=reason, fenced=True)),
                           ("engine", ENGINE, status(7, F, fenced=False, code=ErrorCode.PEER_DEAD, reason=reason))]
    assert service.rooms.get(8).state is T and service.book.failures["peers_declared_dead"] == 1
    assert ENDPOINT in service.state.links  # the link stays: a prefill that recovers gets new rooms


def test_a_prefill_that_closes_its_connection_with_live_rooms_is_declared_dead():
    service = decode()
    port = service.port
    expecting(service, 7, [5])
    service.on_connection(ENDPOINT, "connected")
    accepted(service, 7)
    service.on_connection(ENDPOINT, "disconnected")
    reason = f"prefill {ENDPOINT} closed its connection"
    assert port.take() == [("link", ENDPOINT, RoomFailed(room=7, code=ErrorCode.PEER_DEAD, reason=reason, fenced=True)),
                           ("engine", ENGINE, status(7, F, fenced=False, code=ErrorCode.PEER_DEAD, reason=reason))]


def test_a_restarted_prefill_fails_and_fences_its_predecessors_rooms_at_once():
    """A new incarnation answers at the link's address: the old process is gone, so
    nothing it sent can land any more. Its rooms failed when its connection went;
    they are fenced now. A room asked for after the connection went was sent to the
    new process (the link says hello first on a new connection): it stays live."""
    service = decode()
    port = service.port
    expecting(service, 7, [5])
    expecting(service, 8, [6])
    service.on_connection(ENDPOINT, "connected")
    accepted(service, 7)
    accepted(service, 8)
    service.on_connection(ENDPOINT, "disconnected")
    lost = f"prefill {ENDPOINT} closed its connection"
    assert sorted((m.room, m.fenced) for _, _, m in port.take() if isinstance(m, RoomStatus)) == [(7, False), (8, False)]
    assert service.rooms.get(7).reason == lost
    assert call(service, expect(9, [7], grant(service))) == Ok(req=11)
    (request,) = [m for _, _, m in port.take() if isinstance(m, RoomRequest)]  # queued for the next connection
    assert request.room == 9
    new = "n" * 16
    service.on_connection(ENDPOINT, "connected")
    link(service, welcome(clock=9_000.0, incarnation=new), incarnation=new)
    sent = port.take()
    assert sorted((m.room, m.state, m.fenced) for _, _, m in sent if isinstance(m, RoomStatus)) == [(7, F, True), (8, F, True)]
    assert not any(isinstance(m, RoomFailed) for _, _, m in sent)  # those two were told when the connection went
    assert service.rooms.get(9).state is B  # the new process has its request
    assert ("link", ENDPOINT, service.hello(ENDPOINT)) in sent
    assert all(s.state is not SlotState.QUARANTINED for s in service.lanes[0].aux.slots.slots)
    assert service.state.links[ENDPOINT].incarnation == new and service.state.links[ENDPOINT].ready


def test_a_prefill_the_registry_says_was_replaced_has_its_rooms_failed_and_fenced():
    service = decode()
    port = service.port
    port.registry = {"prefill-0": ("10.0.0.1:8998", "n" * 16)}
    expecting(service, 7, [5], bootstrap="prefill-0")  # by name, through the registry
    accepted(service, 7)
    port.take()

    class Gone:  # the registry record that went: the old incarnation
        name, bootstrap, incarnation = "prefill-0", "10.0.0.1:8998", PREFILL_INCARNATION

    service.peer_gone(Gone, "its registry lease lapsed")
    room = service.rooms.get(7)
    assert (room.code, room.fenced) == (ErrorCode.PEER_DEAD, True)
    assert room.reason == f"prefill {ENDPOINT} restarted (incarnation {PREFILL_INCARNATION} -> {'n' * 16})"


def test_a_name_the_registry_does_not_know_is_refused_naming_the_room():
    service = decode()
    service.port.registry = {}
    reply = call(service, expect(7, [5], grant(service), "prefill-9"))
    assert (reply.code, reply.room) == (ErrorCode.UNKNOWN_PEER, 7)
    service.port.registry = None  # no registry at all: a name is no address
    reply = call(service, expect(8, [5], grant(service), "prefill-9"))
    assert (reply.code, reply.room) == (ErrorCode.BAD_MESSAGE, 0)
