"""The prefill role's RoomParts on its own (roles/prefill/parts.py): a prefill rank's
parts of one room. At TP 1:1 a room is its only part; a rank writing to several decode
ranks (fan-out) keeps a part per decode rank, with one status for them all, failing
together, released together. Built as PrefillService builds it (pieces.prefill_parts)."""

from __future__ import annotations

from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import ErrorCode, LegRequest, RoomState, RoomStatus
from pdxfer.core.rooms import Event
from pdxfer.core.topology import fan_key, room_key

from .pieces import PrefillParts, chunk, hand_over, prefill_parts, prefill_room

B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED)
SECOND = fan_key(7, 1)  # the part of room 7 for decode rank 1 (leg code 1: prefill rank 0 to decode TP rank 1)


def request(leg: int = 0, fan_out: int = 1, pages=(5, 6), skip: int = 0) -> LegRequest:
    return LegRequest(leg=leg, pages=pages_to_bytes(list(pages)), slot=3, generation=1, memory_version=1, fan_out=fan_out, skip_pages=skip)


def fanned(parts: PrefillParts, handed: bool = True):
    """Room 7 of prefill rank 0 writing to decode ranks 0 and 1: its first part, whose
    input came if ``handed``, then the part for rank 1 made by its request."""
    first, head = prefill_room(parts, 7, request=request(0, fan_out=2))
    if handed:
        hand_over(parts, first, head, chunk(0, [1, 2]))
    second, w = prefill_room(parts, 7, request=request(1, fan_out=2, pages=(8, 9)), key=SECOND, bind=False)
    parts.parts.fan(first, second, w)
    parts.port.take()
    return first, second


def test_at_tp_one_to_one_a_room_is_its_only_part_and_its_status_its_own():
    parts = prefill_parts()
    room, w = prefill_room(parts, 7, request=request(skip=1))
    assert parts.parts.group(room) == [room] and parts.parts.fans(room) == [] and parts.parts.head(room) is w
    assert not w.fans_out() and parts.parts.leg_key(7, 0) == 7
    assert parts.parts.status(room, req=4) == w.status(room, req=4) == RoomStatus(req=4, room=7, state=W, pages=3, skip_pages=1)
    assert parts.parts.fail(room, ErrorCode.ABORTED, "aborted") and room.state is F
    assert [what for what, key, _ in parts.book.parts.calls if key == 7][:1] == ["stop_writes"]


def test_a_request_saying_more_decode_ranks_follow_makes_the_room_fan_out_before_they_come():
    parts = prefill_parts()
    room, w = prefill_room(parts, 7, request=request(fan_out=2))
    assert w.fans_out()
    hand_over(parts, room, w, chunk(0, [1, 2]))
    parts.book.succeed(room, Event.DONE)
    assert parts.parts.status(room).state is T  # its other decode rank has not asked yet
    assert parts.parts.status(room) == RoomStatus(req=0, room=7, state=T, fenced=False, pages=2)


def test_a_fan_out_part_takes_the_first_parts_lane_slot_and_every_chunk_handed_over_so_far():
    parts = prefill_parts()
    first, second = fanned(parts)
    head, w = parts.state.work[first.id], parts.state.work[second.id]
    assert head.fans == [SECOND] and w.first_room == first.id and second.lane == first.lane
    assert (w.aux_slot, w.memory_version) == (head.aux_slot, head.memory_version) and w.aux_slot >= 0
    assert w.handed == head.handed and len(w.handed) == 1 and w.last
    assert second.state is T  # its input is in: it moved on with its request
    assert parts.parts.group(second) == parts.parts.group(first) == [first, second]
    assert parts.parts.fans(first) == [second] and parts.parts.head(second) is head
    assert parts.parts.leg_key(7, 0) == room_key(7, 0) and parts.parts.leg_key(7, 1) == SECOND
    assert head.fans_out() and w.fans_out()


def test_a_fan_out_part_asked_for_before_any_input_waits_for_it():
    parts = prefill_parts()
    _, second = fanned(parts, handed=False)
    assert second.state is W and parts.state.work[second.id].handed == []


def test_the_engine_hears_the_least_advanced_part_and_success_once_every_part_succeeded():
    parts = prefill_parts()
    first, second = fanned(parts, handed=False)
    assert parts.parts.status(second) == RoomStatus(req=0, room=7, state=W, pages=2)  # the first part's positions
    hand_over(parts, first, parts.state.work[first.id], chunk(0, [1, 2]))
    parts.book.advance(second, Event.INPUT_READY)
    parts.book.succeed(first, Event.DONE)
    assert parts.parts.status(first).state is T
    parts.book.succeed(second, Event.DONE)
    assert parts.parts.status(first) == RoomStatus(req=0, room=7, state=S, fenced=True, pages=2)


def test_a_failed_part_fails_the_others_and_the_room_reads_fenced_only_once_every_part_is():
    parts = prefill_parts()
    first, second = fanned(parts)
    first.writers.add("job")
    assert parts.parts.fail(second, ErrorCode.TRANSFER_FAILED, "write failed")
    assert (second.state, second.reason) == (F, "write failed")
    assert (first.state, first.code, first.reason) == (F, ErrorCode.TRANSFER_FAILED, "write failed (the part for another decode rank)")
    assert second.fenced and not first.fenced
    status = parts.parts.status(second)
    assert (status.state, status.code, status.fenced) == (F, ErrorCode.TRANSFER_FAILED, False)
    assert not parts.parts.fail(first, ErrorCode.TIMEOUT, "again")
    parts.book.writer_done(first, "job")
    assert parts.parts.status(second).fenced


def test_a_failed_part_with_parts_still_to_come_reads_fenced_once_those_asked_for_are():
    parts = prefill_parts()
    first, _ = prefill_room(parts, 7, request=request(0, fan_out=3))
    second, w = prefill_room(parts, 7, request=request(1, fan_out=3, pages=(8, 9)), key=SECOND, bind=False)
    parts.parts.fan(first, second, w)
    parts.parts.fail(first, ErrorCode.ABORTED, "aborted")
    assert parts.parts.status(first).fenced  # the third decode rank never asked: nothing of it to fence


def test_release_lets_go_of_every_finished_part_and_leaves_a_live_one():
    parts = prefill_parts()
    first, second = fanned(parts)
    parts.book.succeed(first, Event.DONE)
    parts.parts.release(first)
    assert parts.book.rooms.find(first.id) is None and parts.book.rooms.find(SECOND) is second
    assert parts.parts.group(second) == [second]  # its first part went
    parts.book.succeed(second, Event.DONE)
    parts.parts.release(second)
    assert parts.book.rooms.find(SECOND) is None


def test_releasing_a_failed_room_releases_each_part_and_each_goes_once_fenced():
    parts = prefill_parts()
    first, second = fanned(parts)
    second.writers.add("job")
    parts.parts.fail(first, ErrorCode.ABORTED, "aborted")
    parts.parts.release(first)
    assert parts.book.rooms.find(first.id) is None and second.released and parts.book.rooms.find(SECOND) is second
    parts.book.writer_done(second, "job")
    assert parts.book.rooms.find(SECOND) is None
