"""Ranks in the roles (issue 27 step 2), with the recording port and the fake clock:
the decode side gathers its ranks' expects of a room into one request (A5), waiting at
most expect_batch_ms for the ones that have not expected yet; the prefill side answers a
request once, and a prefill rank that writes to two decode ranks (fan-out) keeps a room
part per decode rank behind one status for its engine."""

from __future__ import annotations

from pdxfer.core.plan import pages_to_bytes
from msgspec.structs import replace

from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Announce,
    EngineHello,
    ErrorCode,
    Expect,
    PeerError,
    LegRequest,
    PeerRefused,
    PeerWelcome,
    Rank,
    Role,
    RoomAccepted,
    RoomAck,
    RoomFailed,
    RoomRequest,
    RoomState,
    RoomStatus,
    Send,
    Welcome,
)
from pdxfer.core.topology import fan_key, room_key

from .rig import (
    DECODE,
    DECODE_INCARNATION,
    ENDPOINT,
    PAGE_BYTES,
    PREFILL_INCARNATION,
    PREFILL_SESSIONS,
    call,

    decode,
    decode_hello,
    grant,
    prefill,
    register,
    wire,
    wired,
)
from .test_prefill import hello

PREFILL_CLOCK = 5_000.0
B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED)


def rank(service, identity: bytes, tp: int, tp_size: int, role: Role) -> None:
    """Engine rank ``tp`` of ``tp_size`` says hello on connection ``identity`` and registers."""
    reply = call(service, EngineHello(req=1, version=PROTOCOL_VERSION, engine_id="e", role=role, rank=Rank(tp=tp), sizes=Rank(tp=tp_size)), identity)
    assert isinstance(reply, Welcome), reply
    register(service, identity)


def expect(service, identity: bytes, room: int, pages: list[int], prefill_tp: int):
    slot = grant(service, identity)
    reply = call(service, Expect(req=11, room=room, bootstrap="10.0.0.1:8998", pages=pages_to_bytes(pages), slot=slot.slot,
                                 generation=slot.generation, memory_version=1, prefill_sizes=Rank(tp=prefill_tp)), identity)
    assert type(reply).__name__ == "Ok", reply
    return slot


def requests(service) -> list[RoomRequest]:
    return [m for _, _, m in service.port.take() if isinstance(m, RoomRequest)]


def two_rank_decode(**options):
    service = decode(registered=False, **options)
    rank(service, b"d0", 0, 2, Role.DECODE)
    rank(service, b"d1", 1, 2, Role.DECODE)
    return service


def test_the_ranks_expects_of_a_room_leave_as_one_request():
    service = two_rank_decode()
    expect(service, b"d0", 7, [1, 2], prefill_tp=2)
    welcomed(service)
    assert requests(service) == []  # rank 1 has not expected the room yet
    expect(service, b"d1", 7, [3, 4], prefill_tp=2)
    (request,) = requests(service)
    assert request.room == 7
    assert [(leg.leg, leg.lane, leg.pages) for leg in request.legs] == [
        (0, 0, pages_to_bytes([1, 2])), ((1 << 32) | 1, 1, pages_to_bytes([3, 4]))]
    assert all(leg.real and leg.carries_aux and leg.head_count == 0 for leg in request.legs)  # equal TP: whole pages
    # One answer for both ranks' rooms.
    service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(RoomAccepted(room=7, input_ready=True, legs=(0, (1 << 32) | 1))))
    assert [service.rooms.get(room_key(7, code)).state for code in (0, 1)] == [T, T]


def welcomed(service) -> None:
    service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(PeerWelcome(version=PROTOCOL_VERSION, incarnation=PREFILL_INCARNATION,
                                                                            session=PREFILL_SESSIONS[0], clock=PREFILL_CLOCK)))


def test_a_rank_that_does_not_expect_holds_the_request_back_at_most_expect_batch_ms():
    service = two_rank_decode(expect_batch_ms=40)
    expect(service, b"d0", 8, [5], prefill_tp=2)
    welcomed(service)
    service.port.advance(39)
    assert requests(service) == []
    service.port.advance(1)
    (request,) = requests(service)
    assert [leg.lane for leg in request.legs] == [0]
    # Rank 1's expect, later, goes in a request of its own.
    expect(service, b"d1", 8, [6], prefill_tp=2)
    (late,) = requests(service)
    assert [leg.lane for leg in late.legs] == [1]


def test_an_aborted_rank_leaves_the_request_it_was_gathered_in():
    """A rank's room failed before its request left: its legs leave it, and nothing of it
    can land (fenced at once); the other rank's legs still go."""
    service = two_rank_decode()
    expect(service, b"d0", 9, [5], prefill_tp=2)
    welcomed(service)
    assert type(call(service, Abort(req=12, room=9), b"d0")).__name__ == "Ok"
    assert service.rooms.get(9).fenced
    expect(service, b"d1", 9, [6], prefill_tp=2)
    service.port.advance(1)
    (request,) = requests(service)
    assert [leg.lane for leg in request.legs] == [1]


# --- fan-out: one prefill rank, two decode ranks


def leg(code: int, lane: int, pages: list[int], generation: int = 1) -> LegRequest:
    return LegRequest(leg=code, lane=lane, pages=pages_to_bytes(pages), slot=lane, generation=generation, memory_version=1)


def two_lane_hello(service) -> None:
    """A decode daemon with two ranks (lanes 0 and 1), each with the rig's pools."""
    (lane,) = decode_hello().lanes
    hello(service, lanes=(lane, replace(lane, index=1, rank=Rank(tp=1), region_bases=(lane.region_bases[0] + (1 << 32),),
                                        aux_base=lane.aux_base + (1 << 32))))


def test_a_prefill_rank_writing_to_two_decode_ranks_has_a_part_for_each_behind_one_status():
    """TP1 -> TP2: chunks handed over before the second decode rank's leg came are
    written for it too, every part writes into its own rank's pool, and the engine hears
    Success only once both decode ranks acknowledged."""
    service = prefill()
    port = service.port
    two_lane_hello(service)
    port.take()
    slot = grant(service)
    call(service, Announce(req=0, room=7))
    d0, d1 = 0, 1  # leg codes: prefill rank 0 to decode rank 0, and to decode rank 1
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=7, legs=(leg(d0, 0, [5, 6]),), lease_ms=30_000)))
    call(service, Send(req=10, room=7, pages=pages_to_bytes([1]), memory_version=1, first_page=0, last=False))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=7, legs=(leg(d1, 1, [8, 9]),), lease_ms=30_000)))
    call(service, Send(req=10, room=7, pages=pages_to_bytes([2]), memory_version=1, first_page=1, last=True, num_tokens=8,
                       slot=slot.slot, generation=slot.generation))
    jobs = port.submitted
    dsts = sorted(int(job.blocks.dst[0]) for job in jobs)
    base = service.state.peers[DECODE].lanes[0].region_bases[0]
    other = service.state.peers[DECODE].lanes[1].region_bases[0]
    # Page 1 -> page 5 and page 2 -> page 6 on rank 0; the same pages -> 8, 9 on rank 1.
    assert dsts == sorted([base + 5 * PAGE_BYTES, base + 6 * PAGE_BYTES, other + 8 * PAGE_BYTES, other + 9 * PAGE_BYTES])
    for job in jobs:
        job.settled = True
        job.on_done(job)
    statuses = [m for kind, _, m in port.take() if isinstance(m, RoomStatus)]
    assert statuses[-1].state is T and S not in [s.state for s in statuses]
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=7, leg=d0)))
    assert [m.state for _, _, m in port.take() if isinstance(m, RoomStatus)] == [T]  # one part done, the other not
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=7, leg=d1)))
    assert [m.state for _, _, m in port.take() if isinstance(m, RoomStatus)] == [S]
    assert service.rooms.get(fan_key(7, d1)).state is S


def test_a_failed_part_fails_the_prefill_ranks_whole_room():
    service = prefill()
    port = service.port
    two_lane_hello(service)
    call(service, Announce(req=0, room=8))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=8, legs=(leg(0, 0, [5]), leg(1, 1, [6])), lease_ms=30_000)))
    port.take()
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomFailed(room=8, code=ErrorCode.ABORTED, reason="client went away", leg=1)))
    sent = port.take()
    assert service.rooms.get(8).state is F and service.rooms.get(fan_key(8, 1)).state is F
    told = [m for kind, _, m in sent if kind == "peer" and isinstance(m, RoomFailed)]
    # The failed part confirms nothing of it is in flight; the other decode rank hears its part failed too.
    assert sorted((m.leg, m.fenced) for m in told) == [(0, True), (1, True)]
    final = [m for kind, _, m in sent if isinstance(m, RoomStatus)][-1]
    assert (final.state, final.code, final.fenced) == (F, ErrorCode.ABORTED, True)


# --- a chunk that waits for its CUDA event


def test_a_chunk_waits_for_its_cuda_event_and_later_chunks_wait_behind_it():
    """A11: the engine hands a chunk over with the IPC handle of an event recorded after
    the work that wrote its pages; nothing of it (nor of the chunks after it) is written
    before the daemon sees the event complete."""
    service = prefill()
    port = service.port
    hello(service)
    call(service, Announce(req=0, room=7))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=7, legs=(leg(0, 0, [5, 6]),), lease_ms=30_000)))
    slot = grant(service)
    call(service, Send(req=10, room=7, pages=pages_to_bytes([1]), memory_version=1, first_page=0, last=False, cuda_event=b"e" * 64))
    call(service, Send(req=10, room=7, pages=pages_to_bytes([2]), memory_version=1, first_page=1, last=True, num_tokens=8,
                       slot=slot.slot, generation=slot.generation))
    assert port.submitted == []  # the first chunk's event has not completed, and the second waits behind it
    ((handle, done),) = port.events
    assert handle == b"e" * 64
    done("")
    base = service.state.peers[DECODE].lanes[0].region_bases[0]
    assert sorted(int(job.blocks.dst[0]) for job in port.submitted) == [base + 5 * PAGE_BYTES, base + 6 * PAGE_BYTES]


def send_with_cuda_event(service, room_id: int):
    """A one-chunk room, requested and sent with a CUDA event; its room."""
    hello(service)
    call(service, Announce(req=0, room=room_id))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=room_id, legs=(leg(0, 0, [5]),), lease_ms=30_000)))
    slot = grant(service)
    call(service, Send(req=10, room=room_id, pages=pages_to_bytes([1]), memory_version=1, num_tokens=4, slot=slot.slot,
                       generation=slot.generation, cuda_event=b"e" * 64))
    return service.rooms.get(room_id)


def test_a_cuda_event_that_cannot_be_waited_on_fails_the_room():
    service = prefill()
    room = send_with_cuda_event(service, 8)
    ((_, done),) = service.port.events
    done("this daemon runs on cpu, not a CUDA device")
    assert (room.state, room.code) == (F, ErrorCode.TRANSFER_FAILED)
    assert "CUDA event" in room.reason and "not a CUDA device" in room.reason
    assert service.port.submitted == []


def test_a_cuda_event_refused_at_once_still_fails_the_room():
    """A CPU daemon answers a CUDA event at once: the chunk it came with must already be
    the room's, or its error is lost and the chunk written without waiting."""
    service = prefill()
    service.port.event_error = "this daemon runs on cpu, not a CUDA device"
    room = send_with_cuda_event(service, 9)
    assert (room.state, room.code) == (F, ErrorCode.TRANSFER_FAILED) and "not a CUDA device" in room.reason, room
    assert service.port.submitted == []


def test_a_decode_with_another_page_size_is_refused_at_the_handshake():
    """A9: pages move whole; the refusal names both page sizes, and the decode daemon is
    not taken as a peer."""
    service = prefill()
    (lane,) = decode_hello().lanes
    other = replace(lane, compat=replace(lane.compat, page_size=lane.compat.page_size * 2))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(decode_hello(lanes=(other,))))
    (refusal,) = [m for _, _, m in service.port.take() if isinstance(m, PeerRefused)]
    assert refusal.code is ErrorCode.COMPAT_MISMATCH
    assert f"page_size: prefill={lane.compat.page_size} decode={2 * lane.compat.page_size}" in refusal.reason
    assert DECODE not in service.state.peers


def test_requests_held_for_the_prefills_clock_gather_every_ranks_legs():
    """Rank 0's request left its window before rank 1 expected, but the link had no clock
    yet: rank 1's legs join the held request instead of replacing it."""
    service = two_rank_decode(expect_batch_ms=5)
    expect(service, b"d0", 12, [5], prefill_tp=2)
    service.port.advance(10)
    expect(service, b"d1", 12, [6], prefill_tp=2)
    assert requests(service) == []
    welcomed(service)
    (request,) = requests(service)
    assert sorted(leg.lane for leg in request.legs) == [0, 1]


def test_a_room_a_request_made_before_its_rank_registered_writes_from_that_ranks_memory():
    """TP2 -> TP4: the decode's request for prefill rank 1's legs (to decode ranks 2 and 3)
    comes while only rank 0 has registered. Once rank 1 announces and sends, both of its
    room's parts write from rank 1's pool, not the lane guessed before."""
    service = prefill(registered=False)
    port = service.port
    rank(service, b"p0", 0, 2, Role.PREFILL)
    (lane,) = decode_hello().lanes
    four = tuple(replace(lane, index=i, rank=Rank(tp=i), region_bases=(lane.region_bases[0] + (i << 32),)) for i in range(4))
    hello(service, lanes=four)
    rank1 = (1 << 32)  # prefill rank (pp 0, tp 1) in a leg code's upper half
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=13, legs=(
        leg(rank1 | 2, 2, [5], generation=1), leg(rank1 | 3, 3, [6], generation=1)), lease_ms=30_000)))
    rank(service, b"p1", 1, 2, Role.PREFILL)
    port.take()
    slot = grant(service, b"p1")
    call(service, Announce(req=0, room=13), b"p1")
    call(service, Send(req=10, room=13, pages=pages_to_bytes([4]), memory_version=1, num_tokens=4, slot=slot.slot,
                       generation=slot.generation), b"p1")
    own = service.lanes[1].kv.bases[0]
    assert sorted(int(job.blocks.src[0]) for job in port.submitted) == [own + 4 * PAGE_BYTES] * 2


def test_a_fan_out_part_asked_for_after_the_first_part_succeeded_still_gets_the_pages():
    """TP1 -> TP2, the two decode ranks' legs in two requests (a rank expected late): the
    first part succeeds alone, yet the engine hears Success only once the second decode
    rank's part, made later from every chunk handed over, succeeded too."""
    service = prefill()
    port = service.port
    two_lane_hello(service)
    slot = grant(service)
    call(service, Announce(req=0, room=9))
    first = replace(leg(0, 0, [5]), fan_out=2)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=9, legs=(first,), lease_ms=30_000)))
    call(service, Send(req=10, room=9, pages=pages_to_bytes([1]), memory_version=1, num_tokens=4, slot=slot.slot, generation=slot.generation))
    for job in port.submitted:
        job.settled = True
        job.on_done(job)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=9, leg=0)))
    assert service.rooms.get(9).state is S
    assert [m.state for _, _, m in port.take() if isinstance(m, RoomStatus)][-1] is T  # the other decode rank has not asked
    port.submitted.clear()
    second = replace(leg(1, 1, [8]), fan_out=2)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=9, legs=(second,), lease_ms=30_000)))
    other = service.state.peers[DECODE].lanes[1].region_bases[0]
    assert [int(job.blocks.dst[0]) for job in port.submitted] == [other + 8 * PAGE_BYTES]
    for job in port.submitted:
        job.settled = True
        job.on_done(job)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=9, leg=1)))
    assert [m.state for _, _, m in port.take() if isinstance(m, RoomStatus)][-1] is S


def test_fan_out_parts_asked_for_before_the_engine_sent_report_to_it_and_go_when_settled():
    """TP1 -> TP2 without announce(): both decode ranks' requests come before the
    engine's send (release_when_settled). The part that succeeds last still tells the
    engine, and the settled room goes, freeing its aux slot: before, a part made ahead of
    the engine had no engine to tell, so the room stayed and its slot with it."""
    service = prefill()
    port = service.port
    two_lane_hello(service)
    slot = grant(service)
    for code in (0, 1):
        part = replace(leg(code, code, [5 + code]), fan_out=2)
        service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=12, legs=(part,), lease_ms=30_000)))
    port.take()
    call(service, Send(req=10, room=12, pages=pages_to_bytes([1]), memory_version=1, num_tokens=4, slot=slot.slot,
                       generation=slot.generation, release_when_settled=True))
    for job in port.submitted:
        job.settled = True
        job.on_done(job)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=12, leg=0)))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomAck(room=12, leg=1)))
    assert [m.state for _, _, m in port.take() if isinstance(m, RoomStatus)][-1] is S
    assert service.rooms.find(12) is None and service.rooms.find(fan_key(12, 1)) is None
    assert service.lanes[0].aux.slots.slots[slot.slot].state.value == "free"


# --- layouts checked when the request comes


def test_an_incompatible_decode_rank_fails_the_room_when_it_asks_not_after_the_prefill_computed():
    """A registered prefill rank checks a leg's destination as its request comes: the
    decode daemon hears the mismatch at once (a PeerError naming the field), and the
    engine's send, which comes only after its compute, hears that the room failed."""
    service = prefill()
    port = service.port
    (lane,) = decode_hello().lanes
    hello(service, lanes=(replace(lane, compat=replace(lane.compat, dtype="float16")),))
    slot = grant(service)
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=14, legs=(leg(0, 0, [5]),), lease_ms=30_000)))
    (refused,) = [m for kind, _, m in port.take() if kind == "peer"]
    assert isinstance(refused, PeerError) and refused.code is ErrorCode.COMPAT_MISMATCH, refused
    assert "dtype" in refused.message and refused.leg == 0, refused.message
    reply = call(service, Send(req=10, room=14, pages=pages_to_bytes([1]), memory_version=1, num_tokens=4, slot=slot.slot,
                               generation=slot.generation))
    assert type(reply).__name__ == "Error" and "dtype" in reply.message, reply
    assert port.submitted == []


def test_whole_pages_asked_between_ranks_of_different_shares_name_the_prefill_sizes():
    """A decode engine that did not name the prefill's TP (its daemon then plans whole
    pages, as for equal TP) toward a rank holding another share of the heads: refused,
    saying which sizes to pass, not only that the regions differ."""
    service = prefill()
    port = service.port
    (lane,) = decode_hello().lanes
    doubled = tuple((layer, kind, page_bytes * 2) for layer, kind, page_bytes in lane.compat.regions)  # twice the heads a page
    hello(service, lanes=(replace(lane, heads_local=lane.heads_local * 2, compat=replace(lane.compat, regions=doubled)),))
    call(service, Announce(req=0, room=15))
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=15, legs=(leg(0, 0, [5]),), lease_ms=30_000)))
    (refused,) = [m for kind, _, m in port.take() if kind == "peer"]
    assert isinstance(refused, PeerError) and refused.code is ErrorCode.COMPAT_MISMATCH, refused
    assert "prefill_sizes" in refused.message, refused.message
    assert service.rooms.get(15).state is F  # the announced room fails: its engine hears it now


def test_a_request_for_a_rank_two_engines_share_is_checked_against_the_engine_that_sends():
    """Two prefill engines of rank 0 on one daemon (a TP1 and a TP2 server): a request
    names the rank, not the engine, so it cannot tell whose memory it reads. Nothing is
    checked early against a guess (a TP2 -> TP2 room failed so against the TP1 engine's
    layout); the check runs once an engine sends, against that engine's memory."""
    service = prefill(registered=False)
    port = service.port
    for identity, engine in ((b"p0", "tp1-server"), (b"p1", "tp2-server")):
        reply = call(service, EngineHello(req=1, version=PROTOCOL_VERSION, engine_id=engine, role=Role.PREFILL), identity)
        assert isinstance(reply, Welcome), reply
        register(service, identity)
    (lane,) = decode_hello().lanes
    hello(service, lanes=(replace(lane, compat=replace(lane.compat, dtype="float16")),))
    slot = grant(service, b"p1")
    service.on_peer(DECODE, DECODE_INCARNATION, *wired(RoomRequest(room=16, legs=(leg(0, 0, [5]),), lease_ms=30_000)))
    assert [type(m).__name__ for kind, _, m in port.take() if kind == "peer"] == ["RoomAccepted"]
    call(service, Send(req=10, room=16, pages=pages_to_bytes([1]), memory_version=1, num_tokens=4, slot=slot.slot,
                       generation=slot.generation), b"p1")
    room = service.rooms.get(16)
    assert (room.state, room.code) == (F, ErrorCode.COMPAT_MISMATCH) and "dtype" in room.reason, room
    assert service.lanes[room.lane].engine_id == "tp2-server"
