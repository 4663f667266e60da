"""The decode role's SessionRotation on its own (roles/decode/rotation.py): when a room
waits for proof that nothing of it can land, new transfer sessions are asked for (its
prefill silent past the heartbeat bound, or half the fence bound waited); every prefill
hears of them; the old sessions end once every live prefill said it drained them, or
at the rotation's deadline; then the failed rooms no live generation can receive a
write for are fenced. Built as DecodeService builds it (pieces.decode_parts); the port
records the sessions asked for and ended, and the test answers as the daemon would."""

from __future__ import annotations

from pdxfer.core.generations import Span
from pdxfer.core.protocol import ErrorCode, RoomState
from pdxfer.roles.decode.state import PrefillLink

from .pieces import DecodeParts, decode_parts, decode_room
from .rig import DECODE_SESSIONS, ENDPOINT

OLD, NEW, NEWER = DECODE_SESSIONS, ("10.0.0.2:16101",), ("10.0.0.2:16201",)
OTHER = "tcp://10.0.0.3:8998"
BOUND = 15.0  # s: the fence bound; heartbeats every second, five missed: dead after 5 s


def made() -> DecodeParts:
    return decode_parts(heartbeat_interval=1.0, heartbeat_misses=5, fence_bound=BOUND)


def waiting(parts: DecodeParts, room_id: int, endpoint: str = ENDPOINT, span: Span = Span(1, 1)):
    """A failed room of the prefill at ``endpoint`` whose write is still in flight: waiting for proof."""
    room = decode_room(parts, room_id, endpoint=endpoint, span=span)
    parts.book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    parts.book.parts.take()
    assert parts.book.fence_pending() and not room.fenced
    return room


def tick(parts: DecodeParts, ms: int, *speaking: str) -> None:
    """``ms`` pass; the prefills at ``speaking`` said something just now; the rotation's tick."""
    parts.port.advance(ms)
    for endpoint in speaking:
        parts.state.links[endpoint].last_word = parts.port.clock()
    parts.sessions.tick(parts.port.clock())


def rotated(parts: DecodeParts, sessions=NEW) -> None:
    """The daemon answers the rotation asked for: new engines at ``sessions``."""
    parts.sessions.rotated(sessions)


def fenced(parts: DecodeParts) -> list[int]:
    return [key for what, key, _ in parts.book.parts.take() if what == "fenced"]


# --- when a rotation is asked for


def test_a_room_of_a_live_prefill_asks_for_new_sessions_once_it_waited_half_the_fence_bound():
    parts = made()
    waiting(parts, 7)
    tick(parts, 7_499, ENDPOINT)
    assert parts.port.rotations == 0
    tick(parts, 1, ENDPOINT)
    assert parts.port.rotations == 1
    assert parts.sessions.asked == (f"a room of prefill {ENDPOINT} waited 7.5s for its writes to drain, "
                                    "with rooms waiting for proof that nothing of theirs can land")
    tick(parts, 1_000, ENDPOINT)
    assert parts.port.rotations == 1  # asked once


def test_a_silent_prefills_room_asks_for_new_sessions_past_the_heartbeat_bound():
    parts = made()
    waiting(parts, 7)
    tick(parts, 5_000)  # silent for exactly the bound: it still lives
    assert parts.port.rotations == 0
    tick(parts, 1)
    assert parts.port.rotations == 1 and parts.sessions.asked.startswith(f"prefill {ENDPOINT} silent for 5.0s")


def test_live_rooms_and_fenced_ones_ask_for_nothing():
    parts = made()
    decode_room(parts, 7)  # transferring, for ever
    done = waiting(parts, 8)
    parts.book.writer_done(done, 0)  # its prefill's word: fenced
    tick(parts, 60_000)
    assert parts.port.rotations == 0 and parts.book.fence_pending() == []


# --- a rotation


def test_a_rotation_tells_every_prefill_and_waits_for_the_live_ones_alone_to_drain():
    parts = made()
    now = parts.port.clock()
    room = waiting(parts, 7, OTHER)
    parts.state.links[OTHER].last_word = now - 10.0  # silent: it drains nothing
    decode_room(parts, 8)  # ENDPOINT: live, speaking
    parts.state.links["tcp://10.0.0.4:8998"] = PrefillLink("tcp://10.0.0.4:8998", last_heard=now, last_word=now)  # never welcomed
    parts.sessions.ask("test")
    rotated(parts)
    assert parts.hellos == [now] and parts.sessions.sessions == NEW and parts.sessions.generations.current == 2
    rotation = parts.sessions.rotation
    assert (rotation.old, rotation.sessions, rotation.reason, rotation.waiting) == (1, OLD, "test", {ENDPOINT})
    assert rotation.deadline == now - 10.0 + BOUND - 0.5  # ends before the silent prefill's room is due to be fenced
    assert parts.port.ended == [] and not room.fenced

    parts.sessions.drained(parts.state.links[ENDPOINT], NEW)  # not the sessions it retires
    assert parts.port.ended == []
    parts.sessions.drained(parts.state.links[ENDPOINT], OLD)
    assert parts.port.ended == [OLD]
    tick(parts, 10_000)
    assert parts.port.ended == [OLD]  # asked once


def test_the_old_sessions_end_at_the_rotations_deadline_when_a_live_prefill_never_drains():
    parts = made()
    waiting(parts, 7)
    parts.sessions.ask("test")
    rotated(parts)
    deadline = parts.sessions.rotation.deadline
    assert deadline == parts.port.clock() + BOUND - 0.5
    tick(parts, round((deadline - parts.port.clock()) * 1000) - 1, ENDPOINT)
    assert parts.port.ended == []
    tick(parts, 1, ENDPOINT)
    assert parts.port.ended == [OLD]


def test_a_rotation_gives_live_prefills_a_moment_even_when_a_room_is_overdue():
    parts = made()
    waiting(parts, 7)
    parts.state.links[ENDPOINT].last_word -= 60.0  # its room's fence was due long ago
    parts.sessions.ask("test")
    decode_room(parts, 8, endpoint=OTHER)
    rotated(parts)
    assert parts.sessions.rotation.deadline == parts.port.clock() + 0.2 and parts.sessions.rotation.waiting == {OTHER}


def test_a_prefill_that_goes_away_during_a_rotation_is_waited_for_no_longer():
    parts = made()
    waiting(parts, 7)
    decode_room(parts, 8, endpoint=OTHER)
    parts.sessions.ask("test")
    rotated(parts)
    assert parts.sessions.rotation.waiting == {ENDPOINT, OTHER}
    parts.sessions.drained(parts.state.links[OTHER], OLD)
    tick(parts, 1, ENDPOINT)
    assert parts.port.ended == []
    parts.state.links[ENDPOINT].connected = False
    tick(parts, 1)
    assert parts.port.ended == [OLD]


# --- the end of sessions fences


def test_the_end_of_the_old_sessions_fences_the_rooms_no_live_generation_can_receive_and_answers_the_cut():
    parts = made()
    old_only, moved = waiting(parts, 7), waiting(parts, 8, span=Span(1, 2))  # 8 was listed live in a hello for the new sessions
    live = decode_room(parts, 9)
    answers = []
    parts.sessions.cut("operator cut", answers.append)
    assert parts.port.rotations == 1 and answers == []
    rotated(parts)
    parts.sessions.drained(parts.state.links[ENDPOINT], OLD)
    assert not old_only.fenced  # not before they ended
    parts.sessions.ended(OLD)
    assert fenced(parts) == [old_only.id] and old_only.fenced and not moved.fenced and live.state is RoomState.TRANSFERRING
    assert answers == [1] and parts.sessions.rotation is None
    assert (parts.sessions.rotations, parts.sessions.cuts, parts.sessions.fenced) == (1, 1, 1)
    parts.sessions.ended(NEW)  # say their engine process died: nothing can land in either now
    assert fenced(parts) == [moved.id] and parts.sessions.fenced == 2 and answers == [1]


def test_sessions_that_end_by_themselves_fence_at_once_and_their_successor_waits_for_no_drain():
    parts = made()
    room = waiting(parts, 7)
    parts.sessions.ended(OLD)
    assert fenced(parts) == [room.id] and parts.sessions.rotations == 0
    rotated(parts)
    assert parts.sessions.rotation is None and parts.port.ended == [] and len(parts.hellos) == 1


def test_sessions_no_generation_has_end_without_fencing_anything():
    parts = made()
    waiting(parts, 7)
    parts.sessions.ended(NEWER)
    assert fenced(parts) == [] and parts.sessions.fenced == 0 and parts.sessions.generations.live == {1: OLD}


def test_a_rotation_asked_for_while_one_runs_follows_it():
    parts = made()
    waiting(parts, 7)
    parts.sessions.ask("first")
    parts.sessions.ask("ignored: one is asked")
    rotated(parts)
    parts.sessions.ask("second")
    assert parts.port.rotations == 1 and parts.sessions.asked == "second"
    parts.sessions.drained(parts.state.links[ENDPOINT], OLD)
    parts.sessions.ended(OLD)
    assert parts.port.rotations == 2  # the one asked meanwhile starts now
    rotated(parts, NEWER)
    assert parts.sessions.rotation.reason == "second" and parts.sessions.rotation.sessions == NEW


def test_new_sessions_that_fail_to_start_are_asked_for_again_a_second_later():
    parts = made()
    waiting(parts, 7)
    tick(parts, 7_500, ENDPOINT)
    assert parts.port.rotations == 1
    parts.sessions.failed("no free port")
    assert parts.book.failures["rotation_failed"] == 1 and parts.sessions.asked == ""
    tick(parts, 999, ENDPOINT)
    assert parts.port.rotations == 1
    tick(parts, 1, ENDPOINT)
    assert parts.port.rotations == 2


def test_each_prefill_is_told_when_its_waiting_rooms_are_fenced_at_the_latest():
    parts = made()
    waiting(parts, 7)
    waiting(parts, 8, OTHER)
    parts.state.links[OTHER].last_word -= 4.0  # it went silent before its room failed
    parts.port.advance(3_000)
    assert parts.sessions.fence_in(parts.port.clock()) == {ENDPOINT: BOUND - 3.0, OTHER: BOUND - 7.0}
    waiting(parts, 9, OTHER)  # a later room of the same prefill is due no sooner
    assert parts.sessions.fence_in(parts.port.clock()) == {ENDPOINT: BOUND - 3.0, OTHER: BOUND - 7.0}


def test_rooms_overdue_for_their_fence_read_as_due_now_not_as_none_waiting():
    parts = made()
    waiting(parts, 7)
    parts.port.advance(round(BOUND * 1000) + 8_000)  # no rotation ran (no tick): 8 s overdue
    assert parts.sessions.fence_in(parts.port.clock()) == {ENDPOINT: 0.0}


def test_a_cut_asked_while_a_rotation_runs_is_answered_once_the_rotation_after_it_ended():
    parts = made()
    room = decode_room(parts, 8)
    parts.sessions.ask("another room's prefill went silent")
    rotated(parts)
    parts.state.work[room.id].span = Span(1, 2)  # the rotation's hello listed it live: it may be written into the new sessions
    parts.book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    answers = []
    parts.sessions.cut("operator cut", answers.append)
    assert parts.port.rotations == 1  # it follows the running one
    parts.sessions.drained(parts.state.links[ENDPOINT], OLD)
    parts.sessions.ended(OLD)
    assert not room.fenced and parts.port.rotations == 2
    assert answers == []  # its rotation has not run yet
    rotated(parts, NEWER)
    parts.sessions.drained(parts.state.links[ENDPOINT], NEW)
    parts.sessions.ended(NEW)
    assert room.fenced and answers == [1]


def test_a_cut_whose_new_sessions_failed_to_start_is_tried_again():
    parts = made()
    decode_room(parts, 7)  # nothing fence-pending: the operator cuts anyway
    answers = []
    parts.sessions.cut("operator cut", answers.append)
    assert parts.port.rotations == 1
    parts.sessions.failed("no free port")
    tick(parts, 1_000, ENDPOINT)
    assert parts.port.rotations == 2
