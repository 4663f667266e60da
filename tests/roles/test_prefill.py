"""PrefillService driven directly: decode daemons' messages and the engine's handed in,
every message, write and cancellation it makes read back from a recording port, time
moved by hand in milliseconds. No process, no socket, no transfer engine."""

from __future__ import annotations

import zlib

from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    Announce,
    AuxRecord,
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    Ok,
    PeerRefused,
    PeerWelcome,
    RoomAccepted,
    RoomAck,
    RoomFailed,
    LegRequest,
    RoomRequest,
    RoomState,
    Send,
    SessionsDrained,
    TransferStarted,
    pack_legs,
)
from pdxfer.core.slots import SlotState
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.roles.prefill import PrefillService
from pdxfer.transport import Job

from .port import seconds
from .rig import (
    DECODE,
    DECODE_INCARNATION,
    DECODE_SESSIONS,
    DST_AUX,
    DST_KV,
    DST_PROBE,
    ENGINE,
    PAGE_BYTES,
    PREFILL_INCARNATION,
    PREFILL_SESSIONS,
    SLOT_BYTES,
    TICK,
    call,

    decode_hello,
    grant,
    prefill,
    run,
    send,
    status,
    wired,
)

TRANSFER = 30_000  # ms: the default transfer timeout, so a room's default lease


def hello(service: PrefillService, identity: bytes = DECODE, incarnation: str = DECODE_INCARNATION, **fields) -> None:
    """A decode daemon says hello and is welcomed."""
    port = service.port
    service.on_peer(identity, incarnation, *wired(decode_hello(incarnation=incarnation, **fields)))
    assert port.take() == [("peer", identity, PeerWelcome(
        version=PROTOCOL_VERSION, incarnation=PREFILL_INCARNATION, session=PREFILL_SESSIONS[0], clock=port.clock(), stages=True))]


def peer(service: PrefillService, message, identity: bytes = DECODE, incarnation: str = DECODE_INCARNATION) -> None:
    service.on_peer(identity, incarnation, *wired(message))


def request(room: int, pages: list[int], *, slot: int = 3, generation: int = 1, lease_ms: int = TRANSFER, writes_until: float = 0.0,
            skip_pages: int = 0) -> RoomRequest:
    leg = LegRequest(pages=pages_to_bytes(pages), slot=slot, generation=generation, memory_version=1, skip_pages=skip_pages)
    return RoomRequest(room=room, legs=(leg,), lease_ms=lease_ms, writes_until=writes_until)


def chunk(room: int, first: int, pages: list[int]) -> Send:
    """A chunk of ``room`` that is not its last (engine.send(room, pages, first_page=first, last=False))."""
    return Send(req=10, room=room, pages=pages_to_bytes(pages), memory_version=1, first_page=first, last=False)


def blocks(job: Job) -> list[tuple[int, int, int]]:
    return list(zip(job.blocks.src.tolist(), job.blocks.dst.tolist(), job.blocks.length.tolist()))


def settle(job: Job, error: str = "") -> None:
    """The pump's report: every block it submitted of ``job`` has settled."""
    job.error, job.settled = error, True
    job.on_done(job)


def transferring(service: PrefillService, room: int, identity: bytes = DECODE, incarnation: str = DECODE_INCARNATION) -> Job:
    """A room requested and sent, its KV write submitted; its job."""
    peer(service, request(room, [room]), identity, incarnation)
    slot = grant(service)
    assert call(service, send(room, [room], slot)) == Ok(req=10)
    service.port.take()
    return service.port.submitted[-1]


# --- out-of-order accept


def test_a_request_before_the_send_is_accepted_waiting_and_its_writes_start_with_the_send():
    service = prefill()
    port = service.port
    hello(service)
    leave = seconds(port.ms + 60_000)
    peer(service, request(7, [5, 6], writes_until=leave))
    assert port.take() == [("peer", DECODE, RoomAccepted(room=7, input_ready=False, legs=(0,)))]
    assert service.rooms.get(7).state is RoomState.WAITING_FOR_INPUT and port.submitted == []

    slot = grant(service)
    port.advance(3)
    assert call(service, send(7, [1, 2], slot, aux_bytes=9)) == Ok(req=10)
    # The engine hears of every change of state (B6), with the positions the decode wants.
    assert port.take() == [("engine", ENGINE, status(7, RoomState.TRANSFERRING, fenced=False, pages=2)),
                           ("peer", DECODE, TransferStarted(room=7))]
    (job,) = port.submitted
    # Pages 1,2 here are contiguous, and 5,6 there: one block of two pages.
    assert blocks(job) == [(service.lanes[0].kv.bases[0] + 1 * PAGE_BYTES, DST_KV + 5 * PAGE_BYTES, 2 * PAGE_BYTES)]
    assert (job.id, job.peer, job.probe) == (7, DECODE_SESSIONS, DST_PROBE)
    assert job.deadline == port.clock() + 30.0  # its lease: sooner than the leave to write

    # The KV landed: the aux record goes (A3), its payload read from the engine's slot.
    service.lanes[0].aux.memory.array[slot.slot * SLOT_BYTES + HEADER_BYTES:][:9] = list(b"aux bytes")
    settle(job)
    assert port.take() == [("peer", DECODE, AuxRecord(
        room=7, slot=3, generation=1, length=9, checksum=zlib.crc32(b"aux bytes"), payload=b"aux bytes", kv_pages=2))]
    assert service.rooms.get(7).state is RoomState.TRANSFERRING  # not before the decode side verified it (A1)

    peer(service, RoomAck(room=7))
    assert port.take() == [("engine", ENGINE, status(7, RoomState.SUCCESS, fenced=True, pages=2))]
    assert service.book.outcomes["success"] == 1 and port.cancelled == []


def test_a_send_before_the_request_waits_and_the_request_is_accepted_with_input_ready():
    service = prefill()
    port = service.port
    hello(service)
    slot = grant(service)
    assert call(service, send(7, [1, 2], slot)) == Ok(req=10)
    assert port.take() == [] and service.rooms.get(7).state is RoomState.BOOTSTRAPPING

    peer(service, request(7, [8, 10]))
    assert port.take() == [("engine", ENGINE, status(7, RoomState.TRANSFERRING, fenced=False, pages=2)),
                           ("peer", DECODE, RoomAccepted(room=7, input_ready=True, legs=(0,)))]
    (job,) = port.submitted
    base = service.lanes[0].kv.bases[0]
    assert blocks(job) == [(base + 1 * PAGE_BYTES, DST_KV + 8 * PAGE_BYTES, PAGE_BYTES),
                           (base + 2 * PAGE_BYTES, DST_KV + 10 * PAGE_BYTES, PAGE_BYTES)]
    assert service.rooms.get(7).state is RoomState.TRANSFERRING


def test_an_inline_room_sends_its_aux_record_with_its_kv_at_once_and_no_other_notice():
    """A few pages ride the aux record: the decode side hears neither room_accepted
    nor transfer_started for the room, only its record (decode's tests take it from there)."""
    service = prefill()
    port = service.port
    hello(service, inline_kv_bytes=64 * 1024)
    for page in (1, 2):
        service.lanes[0].kv.buffers[0].array[page * PAGE_BYTES:][:PAGE_BYTES] = page
    slot = grant(service)
    assert call(service, send(7, [1, 2], slot)) == Ok(req=10)
    peer(service, request(7, [5, 6]))
    kv = bytes([1] * PAGE_BYTES + [2] * PAGE_BYTES)
    assert port.take() == [("engine", ENGINE, status(7, RoomState.TRANSFERRING, fenced=False, pages=2)),
                           ("peer", DECODE, AuxRecord(room=7, slot=3, generation=1, length=0, checksum=0, kv_pages=2, kv=kv))]
    assert port.submitted == [] and (service.writer.kv_inline_rooms, service.writer.kv_inline_bytes) == (1, 2 * PAGE_BYTES)


# --- lease and leave to write


def test_no_write_is_submitted_once_the_leave_to_write_ran_out_to_the_millisecond():
    service = prefill()
    port = service.port
    hello(service)
    leave_ms = port.ms + 2_000
    peer(service, request(7, [5], writes_until=seconds(leave_ms)))
    peer(service, request(8, [6], slot=4, writes_until=seconds(leave_ms)))
    port.take()

    port.advance(1_999)  # a millisecond before it: the write goes, bounded by the leave
    assert call(service, send(7, [1], grant(service))) == Ok(req=10)
    (job,) = port.submitted
    assert job.deadline == seconds(leave_ms)
    assert port.take() == [("engine", ENGINE, status(7, RoomState.TRANSFERRING, fenced=False, pages=1)),
                           ("peer", DECODE, TransferStarted(room=7))]

    port.advance(1)  # at it: nothing more is written to that decode daemon
    assert call(service, send(8, [2], grant(service))) == Ok(req=10)
    assert port.submitted == [job]
    room = service.rooms.get(8)
    assert room.code is ErrorCode.LEASE_EXPIRED and room.reason.startswith("the decode daemon's leave to write ran out 0.0s ago")
    assert port.take() == [
        ("engine", ENGINE, status(8, RoomState.TRANSFERRING, fenced=False, pages=1)),
        ("peer", DECODE, RoomFailed(room=8, code=ErrorCode.LEASE_EXPIRED, reason=room.reason, fenced=True)),
        ("engine", ENGINE, status(8, RoomState.FAILED, fenced=True, code=ErrorCode.LEASE_EXPIRED, reason=room.reason, pages=1)),
    ]


def test_a_heartbeat_renews_the_leave_to_write_and_an_older_one_never_shortens_it():
    service = prefill()
    port = service.port
    hello(service)
    first = seconds(port.ms + 1_000)
    peer(service, request(7, [5], writes_until=first))
    later = seconds(port.ms + 5_000)
    peer(service, Heartbeat(seq=1, wall=0.0, writes_until=later))
    peer(service, Heartbeat(seq=2, wall=0.0, writes_until=first))  # reordered renewals: the newest leave stands
    assert port.take()[1:] == [("peer", DECODE, HeartbeatAck(seq=1, wall=port.wall(), clock=port.clock())),
                               ("peer", DECODE, HeartbeatAck(seq=2, wall=port.wall(), clock=port.clock()))]
    port.advance(4_000)  # past the first leave, inside the renewed one
    assert call(service, send(7, [1], grant(service))) == Ok(req=10)
    (job,) = port.submitted
    assert job.deadline == later


def test_a_room_is_leased_the_shorter_of_its_transfer_timeouts_and_its_aux_write_shares_the_lease():
    """The decode side's lease_ms, when shorter than ours, bounds the writes; the aux
    record, written by the transfer engine after the KV, gets no more time than they had."""
    service = prefill(aux_path="transfer_engine")
    port = service.port
    hello(service)
    peer(service, request(7, [5], lease_ms=2_500))
    assert call(service, send(7, [1], grant(service))) == Ok(req=10)
    (kv_job,) = port.submitted
    assert kv_job.deadline == port.clock() + 2.5
    port.advance(2_000)
    settle(kv_job)
    aux_job = port.submitted[-1]
    assert aux_job is not kv_job and aux_job.deadline == kv_job.deadline
    assert blocks(aux_job) == [(service.lanes[0].aux.slot_address(service.rooms.get(7).slot), DST_AUX + 3 * SLOT_BYTES, HEADER_BYTES)]

    peer(service, request(8, [6], slot=4))  # no lease_ms, no leave to write: our own transfer timeout
    assert call(service, send(8, [2], grant(service))) == Ok(req=10)
    assert port.submitted[-1].deadline == port.clock() + TRANSFER / 1000


# --- fencing on the decode side's failure


def failed_by_its_decode_side(service: PrefillService) -> Job:
    """Room 7, its KV write in flight, failed by its decode side; the write's job."""
    hello(service)
    job = transferring(service, 7)
    peer(service, RoomFailed(room=7, code=ErrorCode.TIMEOUT, reason="no progress", fenced=True))
    return job


def test_a_room_failed_by_its_decode_side_is_fenced_only_once_its_writes_in_flight_settled():
    service = prefill()
    port = service.port
    job = failed_by_its_decode_side(service)
    reason = "decode side: no progress"
    assert port.cancelled == [job]
    assert port.take() == [
        ("peer", DECODE, RoomFailed(room=7, code=ErrorCode.TIMEOUT, reason=reason, fenced=False)),
        ("engine", ENGINE, status(7, RoomState.FAILED, fenced=False, code=ErrorCode.TIMEOUT, reason=reason, pages=1)),
    ]
    slot = service.lanes[0].aux.slots.slots[service.rooms.get(7).slot]
    assert slot.state is SlotState.QUARANTINED

    settle(job, error="cancelled")
    assert port.take() == [
        ("peer", DECODE, RoomFailed(room=7, code=ErrorCode.TIMEOUT, reason=reason, fenced=True)),
        ("engine", ENGINE, status(7, RoomState.FAILED, fenced=True, code=ErrorCode.TIMEOUT, reason=reason, pages=1)),
    ]
    assert slot.state is SlotState.FREE


def test_writes_the_pump_abandoned_for_a_failed_room_are_no_proof():
    service = prefill()
    port = service.port
    job = failed_by_its_decode_side(service)
    port.take()
    job.abandoned = True  # a wedged session: its writes may still land
    settle(job, error="stalled")
    assert port.take() == [] and not service.rooms.get(7).fenced
    assert service.lanes[0].aux.slots.slots[service.rooms.get(7).slot].state is SlotState.QUARANTINED


def test_a_live_room_whose_writes_the_pump_abandoned_fails_unfenced():
    """A stalled session: the pump gives up on the room's writes, which may still land.
    The room fails, and its decode side must not hear fenced (S2)."""
    service = prefill()
    port = service.port
    hello(service)
    job = transferring(service, 7)
    job.abandoned = True
    settle(job, error="stalled")
    room = service.rooms.get(7)
    assert room.state is RoomState.FAILED and not room.fenced
    assert port.take() == [
        ("peer", DECODE, RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="stalled", fenced=False)),
        ("engine", ENGINE, status(7, RoomState.FAILED, fenced=False, code=ErrorCode.TRANSFER_FAILED, reason="stalled", pages=1)),
    ]
    assert port.cancelled == []  # settled: nothing left to cancel


def test_stopping_confirms_fenced_the_rooms_whose_writes_were_abandoned():
    """Once this daemon's transfer engines are closed, abandoned writes cannot land:
    transport_closed() tells each such room's decode side fenced, live-failed rooms too."""
    service = prefill()
    port = service.port
    job = failed_by_its_decode_side(service)
    job.abandoned = True
    settle(job, error="stalled")
    other = transferring(service, 8)
    other.abandoned = True
    settle(other, error="stalled")
    port.take()
    assert service.transport_closed() == 2
    assert sorted((m.room, m.fenced) for kind, _, m in port.take() if isinstance(m, RoomFailed)) == [(7, True), (8, True)]
    assert service.rooms.get(7).fenced and service.rooms.get(8).fenced


def test_room_failed_for_a_room_with_nothing_in_flight_is_acknowledged_fenced_at_once():
    service = prefill()
    port = service.port
    hello(service)
    peer(service, RoomFailed(room=9, code=ErrorCode.ABORTED, reason="engine gave up", fenced=True))
    assert port.take() == [("peer", DECODE, RoomFailed(room=9, code=ErrorCode.ABORTED, reason="no write in flight", fenced=True))]
    # The request never came; a later send() for the room hears why.
    reply = call(service, send(9, [1], grant(service)))
    assert (reply.code, reply.message) == (ErrorCode.ABORTED, "room 9 already failed before send(): decode side: engine gave up")


# --- heartbeats


def test_a_silent_decode_daemon_is_declared_dead_after_the_heartbeat_bound_and_exactly_its_rooms_fail():
    service = prefill(heartbeat_interval=1.0, heartbeat_misses=5)
    port = service.port
    other, other_incarnation = b"decode-b", "e" * 16
    hello(service)
    hello(service, other, other_incarnation, name="host/e")
    peer(service, request(7, [5]))
    peer(service, request(8, [6]), other, other_incarnation)
    assert port.take() == [("peer", DECODE, RoomAccepted(room=7, input_ready=False, legs=(0,))),
                           ("peer", other, RoomAccepted(room=8, input_ready=False, legs=(0,)))]
    heard = port.ms
    for _ in range(5):  # b answers every second; a says nothing
        run(service, 1_000)
        peer(service, Heartbeat(seq=1), other, other_incarnation)
    assert port.ms == heard + 5_000  # silent for exactly the bound: not yet
    service.tick()
    assert DECODE in service.state.peers
    port.take()

    port.advance(1)
    service.tick()
    reason = "decode daemon host/d sent nothing for 5.0s (5 heartbeats missed)"
    # No engine joined room 7 yet: nothing can land, so it is fenced and gone at once.
    assert port.take() == [("peer", DECODE, RoomFailed(room=7, code=ErrorCode.PEER_DEAD, reason=reason, fenced=True))]
    assert set(service.state.peers) == {other} and service.rooms.find(7) is None
    assert service.rooms.get(8).state is RoomState.WAITING_FOR_INPUT
    assert service.book.failures["peers_declared_dead"] == 1
    # It says hello again: a new peer, with no rooms.
    hello(service)
    assert service.state.peers[DECODE].rooms == set()


def test_silence_while_this_daemon_itself_stood_still_is_not_the_peers():
    service = prefill(heartbeat_interval=1.0, heartbeat_misses=5)
    port = service.port
    hello(service)
    run(service, 1_000)
    port.advance(6_000)  # frozen (SIGSTOP, swap): no tick for longer than half the bound
    service.tick()
    assert DECODE in service.state.peers
    run(service, 5_000)  # its clock started again at the tick after the stall
    assert DECODE in service.state.peers
    run(service, TICK)
    assert DECODE not in service.state.peers


def test_a_restarted_decode_daemon_fails_and_fences_its_predecessors_rooms():
    """The same name under a new incarnation: the old process is gone. Its rooms fail
    now; each is fenced once its writes in flight settled."""
    service = prefill()
    port = service.port
    hello(service)
    job = transferring(service, 7)
    successor, incarnation = b"decode-a2", "f" * 16
    service.on_peer(successor, incarnation, *wired(decode_hello(incarnation=incarnation)))
    reason = f"decode daemon host/d restarted (incarnation {DECODE_INCARNATION} -> {incarnation})"
    assert port.cancelled == [job]
    assert port.take() == [
        ("peer", DECODE, RoomFailed(room=7, code=ErrorCode.PEER_DEAD, reason=reason, fenced=False)),
        ("engine", ENGINE, status(7, RoomState.FAILED, fenced=False, code=ErrorCode.PEER_DEAD, reason=reason, pages=1)),
        ("peer", successor, PeerWelcome(version=PROTOCOL_VERSION, incarnation=PREFILL_INCARNATION, session=PREFILL_SESSIONS[0], clock=port.clock(), stages=True)),
    ]
    assert set(service.state.peers) == {successor}
    settle(job, error="cancelled")
    assert port.take() == [
        ("peer", DECODE, RoomFailed(room=7, code=ErrorCode.PEER_DEAD, reason=reason, fenced=True)),
        ("engine", ENGINE, status(7, RoomState.FAILED, fenced=True, code=ErrorCode.PEER_DEAD, reason=reason, pages=1)),
    ]


# --- announce, chunks and a prefix the decode holds (protocol 4)


def test_an_announced_room_hears_waiting_for_input_with_the_decodes_positions_when_its_request_comes():
    service = prefill()
    port = service.port
    hello(service)
    assert call(service, Announce(req=20, room=7)) == Ok(req=20)
    assert port.take() == []  # nothing to tell yet: bootstrapping
    peer(service, request(7, [5, 6, 7], skip_pages=4))
    assert port.take() == [("engine", ENGINE, status(7, RoomState.WAITING_FOR_INPUT, fenced=False, pages=7, skip_pages=4)),
                           ("peer", DECODE, RoomAccepted(room=7, input_ready=False, legs=(0,)))]
    # Announced after the request came: the status at once, before the ok.
    peer(service, request(8, [9], slot=4))
    port.take()
    assert call(service, Announce(req=21, room=8)) == Ok(req=21)
    assert port.take() == [("engine", ENGINE, status(8, RoomState.WAITING_FOR_INPUT, fenced=False, pages=1))]


def test_chunks_are_written_as_they_come_and_the_aux_record_follows_every_chunks_writes():
    """12 positions, the decode holding the first 2: a chunk handed over before the
    decode's request waits for it, and writes only the positions it does not skip; the
    next ones are written as they come; the aux record waits for the last write."""
    service = prefill()
    port = service.port
    hello(service)
    base = service.lanes[0].kv.bases[0]
    assert call(service, chunk(7, 0, [1, 2, 3, 4])) == Ok(req=10)
    assert port.submitted == [] and service.rooms.get(7).state is RoomState.BOOTSTRAPPING
    peer(service, request(7, list(range(4, 14)), skip_pages=2))
    assert port.take() == [("engine", ENGINE, status(7, RoomState.TRANSFERRING, fenced=False, pages=12, skip_pages=2)),
                           ("peer", DECODE, RoomAccepted(room=7, input_ready=True, legs=(0,)))]
    (first,) = port.submitted  # positions 2 and 3 (pages 3, 4) to the decode's first two pages
    assert blocks(first) == [(base + 3 * PAGE_BYTES, DST_KV + 4 * PAGE_BYTES, 2 * PAGE_BYTES)]
    assert call(service, chunk(7, 4, [9, 10, 11, 12])) == Ok(req=10)
    second = port.submitted[-1]
    assert blocks(second) == [(base + 9 * PAGE_BYTES, DST_KV + 6 * PAGE_BYTES, 4 * PAGE_BYTES)]
    slot = grant(service)
    last = Send(req=10, room=7, pages=pages_to_bytes([13, 14, 15, 0]), first_page=8, num_tokens=47, slot=slot.slot,
                generation=slot.generation, memory_version=1)
    assert call(service, last) == Ok(req=10)
    third = port.submitted[-1]
    assert blocks(third) == [(base + 13 * PAGE_BYTES, DST_KV + 10 * PAGE_BYTES, 3 * PAGE_BYTES), (base, DST_KV + 13 * PAGE_BYTES, PAGE_BYTES)]
    assert port.take() == []
    for job in (third, first):
        settle(job)
        assert port.take() == []  # a chunk's writes are still out
    settle(second)
    assert port.take() == [("peer", DECODE, AuxRecord(room=7, slot=3, generation=1, length=0, checksum=zlib.crc32(b""), kv_pages=10))]
    assert service.rooms.get(7).bytes_moved == 10 * PAGE_BYTES


def test_a_chunk_with_a_gap_is_refused_and_a_room_whose_chunks_end_short_of_the_decodes_fails_naming_both():
    service = prefill()
    port = service.port
    hello(service)
    peer(service, request(7, [4, 5, 6, 7]))
    assert call(service, chunk(7, 0, [1, 2])) == Ok(req=10)
    gap = call(service, chunk(7, 3, [4]))
    assert gap.code is ErrorCode.BAD_MESSAGE and "starts at position 3, but the chunks before it end at 2" in gap.message
    (job,) = port.submitted
    port.take()
    slot = grant(service)
    assert call(service, Send(req=10, room=7, pages=pages_to_bytes([3]), first_page=2, num_tokens=12, slot=slot.slot,
                              generation=slot.generation, memory_version=1)) == Ok(req=10)
    room = service.rooms.get(7)
    reason = "the prefill's room has 3 page positions but the decode expects 4 (0 skipped + 4 pages)"
    assert (room.code, room.reason) == (ErrorCode.BAD_MESSAGE, reason)
    assert len(port.submitted) == 1 and port.cancelled == [job]  # the last chunk wrote nothing; the first's write is stopped
    assert port.take() == [("peer", DECODE, RoomFailed(room=7, code=ErrorCode.BAD_MESSAGE, reason=reason, fenced=False)),
                           ("engine", ENGINE, status(7, RoomState.FAILED, fenced=False, code=ErrorCode.BAD_MESSAGE, reason=reason, pages=4))]
    settle(job, error="cancelled")  # fenced once the first chunk's write settled
    assert port.take() == [("peer", DECODE, RoomFailed(room=7, code=ErrorCode.BAD_MESSAGE, reason=reason, fenced=True)),
                           ("engine", ENGINE, status(7, RoomState.FAILED, fenced=True, code=ErrorCode.BAD_MESSAGE, reason=reason, pages=4))]


# --- a decode daemon's new sessions (protocol 5)


NEW_SESSIONS = ("10.0.0.2:16101",)


def test_a_hello_with_new_sessions_moves_the_listed_parts_fails_the_others_and_says_drained_once_old_writes_settle():
    """The decode daemon rotated its sessions: its hello lists room 7 live, not room 8
    (failed there; its room_failed lost with a connection). Room 8 fails here before any
    write of it could go to the new sessions; room 7's next chunk goes there; once the
    writes still in flight through the old sessions settled, the decode hears so."""
    service = prefill()
    port = service.port
    hello(service)
    peer(service, request(7, list(range(4, 12))))
    assert call(service, chunk(7, 0, [1, 2, 3, 4])) == Ok(req=10)
    job8 = transferring(service, 8)
    (job7, _) = port.submitted
    assert job7.peer == job8.peer == DECODE_SESSIONS
    peer(service, decode_hello(sessions=NEW_SESSIONS, session=NEW_SESSIONS[0], live_legs=pack_legs([(7, 0)])))
    sent = port.take()
    assert ("peer", DECODE, RoomFailed(room=8, code=ErrorCode.PEER_DEAD, fenced=False, reason=(
        "decode daemon host/d no longer holds this room live (its peer_hello left it out)"))) in sent
    assert not any(isinstance(m, SessionsDrained) for _, _, m in sent)  # two jobs still in flight through the old sessions
    assert service.rooms.get(7).state is RoomState.TRANSFERRING and service.state.work[7].sessions == NEW_SESSIONS
    assert call(service, chunk(7, 4, [5, 6])) == Ok(req=10)
    assert port.submitted[-1].peer == NEW_SESSIONS  # the moved room's next writes
    settle(job8, error="cancelled")
    assert not any(isinstance(m, SessionsDrained) for _, _, m in port.take())
    settle(job7)
    assert ("peer", DECODE, SessionsDrained(sessions=DECODE_SESSIONS)) in port.take()


def test_a_hello_with_new_sessions_and_nothing_in_flight_is_answered_drained_at_once():
    service = prefill()
    port = service.port
    hello(service)
    peer(service, decode_hello(sessions=NEW_SESSIONS, session=NEW_SESSIONS[0]))
    assert ("peer", DECODE, SessionsDrained(sessions=DECODE_SESSIONS)) in port.take()
    assert service.state.peers[DECODE].sessions == NEW_SESSIONS and not service.state.peers[DECODE].retiring


def test_writes_the_pump_gave_up_on_keep_the_old_sessions_undrained():
    """An abandoned job's writes may still land: no sessions_drained for the sessions it wrote to."""
    service = prefill()
    port = service.port
    hello(service)
    job = transferring(service, 7)
    peer(service, decode_hello(sessions=NEW_SESSIONS, session=NEW_SESSIONS[0], live_legs=pack_legs([(7, 0)])))
    port.take()
    job.abandoned = True
    settle(job, error="stalled")
    assert not any(isinstance(m, SessionsDrained) for _, _, m in port.take())
    assert service.state.peers[DECODE].retiring == {DECODE_SESSIONS}


def test_a_hello_with_a_torn_live_leg_list_is_refused():
    service = prefill()
    port = service.port
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(decode_hello(live_legs=b"\0" * 15)))
    ((_, _, refused),) = port.take()
    assert isinstance(refused, PeerRefused) and "16-byte" in refused.reason
