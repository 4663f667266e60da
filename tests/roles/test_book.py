"""RoomBook on its own (roles/book.py): the room table, the aux slot a room holds, the
engine told of every change, fencing and letting rooms go, and the timeouts. The role
behind it is pieces.BookParts, which records what the book asks of it; the port records
what the engine hears; time is the fake clock."""

from __future__ import annotations

from pdxfer.core.protocol import ErrorCode, Role, RoomState
from pdxfer.core.rooms import Event
from pdxfer.core.slots import SlotState
from pdxfer.roles.book import RoomBook

from .pieces import made_book
from .rig import ENGINE, status

B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED)
FENCE = 10.0  # s: the slot fence of a prefill's book (its config's fence_timeout)


def slotted(book: RoomBook, key: int, engine: bytes = ENGINE, writers=(), state: RoomState = T):
    """A room with an aux slot bound, moved to ``state`` (B, W or T), its engine ``engine``,
    ``writers`` in flight; the engine's hearing of it so far is forgotten. The room and its slot."""
    port = book.port
    room = book.create(key, Role.DECODE, 0, peer="tcp://10.0.0.1:8998")
    grant = book.lanes[0].aux.slots.allocate(port.clock())
    book.bind_slot(room, grant.index, grant.generation)
    book.parts.engines[key] = engine
    if state is not B:
        book.advance(room, Event.BOOTSTRAPPED)
    if state is T:
        book.advance(room, Event.INPUT_READY)
    room.writers.update(writers)
    port.take()
    return room, book.lanes[0].aux.slots.slots[grant.index]


# --- moving rooms


def test_a_room_is_created_on_its_lane_and_its_engine_hears_each_change_of_state():
    book = made_book()
    port = book.port
    room = book.create(7, Role.DECODE, 0, peer="tcp://p:1")
    assert (room.id, room.lane, room.peer, room.state) == (7, 0, "tcp://p:1", B)
    assert port.transitions == [(7, None, B)]
    book.advance(room, Event.BOOTSTRAPPED)
    assert room.state is W and port.take() == []  # no engine yet: nobody to tell
    book.parts.engines[7] = ENGINE
    book.advance(room, Event.INPUT_READY)
    assert port.take() == [("engine", ENGINE, status(7, T, fenced=False))]
    assert port.transitions == [(7, None, B), (7, B, W), (7, W, T)]


def test_an_event_that_changes_no_state_tells_the_engine_nothing():
    book = made_book()
    room = book.create(8, Role.DECODE, 0)
    book.parts.engines[8] = ENGINE
    book.advance(room, Event.INPUT_READY)  # the input came before the room was bootstrapped
    assert (room.state, room.has_input) == (B, True) and book.port.take() == []
    book.advance(room, Event.BOOTSTRAPPED)  # with its input in, straight to transferring
    assert book.port.take() == [("engine", ENGINE, status(8, T, fenced=False))]


def test_a_binding_arms_the_rooms_slot_for_its_generation():
    book = made_book()
    room, slot = slotted(book, 7)
    assert (room.slot, room.generation) == (slot.index, slot.generation)
    assert (slot.state, slot.room) == (SlotState.ARMED, 7)


def test_success_is_counted_pushed_and_fences_the_room_and_a_finished_room_ignores_it():
    book = made_book()
    room, _ = slotted(book, 7)
    assert book.succeed(room, Event.AUX_LANDED)
    assert (room.state, room.fenced, book.outcomes["success"]) == (S, True, 1)
    assert book.port.take() == [("engine", ENGINE, status(7, S, fenced=True))]
    assert not book.succeed(room, Event.AUX_LANDED) and book.outcomes["success"] == 1


def test_a_settled_room_whose_engine_sends_no_release_goes_once_its_status_is_pushed():
    book = made_book()
    room, slot = slotted(book, 7)
    room.release_when_settled = True
    book.succeed(room, Event.AUX_LANDED)
    assert book.port.take() == [("engine", ENGINE, status(7, S, fenced=True))]
    assert book.parts.take() == [("release", 7, None), ("forget", 7, None)]
    assert book.rooms.find(7) is None and book.finished[7] == (S, None, "") and slot.state is SlotState.FREE


def test_a_failed_room_whose_engine_sends_no_release_goes_only_once_fenced():
    book = made_book()
    room, _ = slotted(book, 7, writers={"leg"})
    room.release_when_settled = True
    book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    assert book.rooms.find(7) is room  # failed, not settled: its pages may still be written
    assert [call[0] for call in book.parts.take()] == ["stop_writes"]
    book.writer_done(room, "leg")
    assert book.parts.take() == [("fenced", 7, True), ("release", 7, None), ("forget", 7, None)]
    assert book.rooms.find(7) is None


# --- failing and fencing


def test_a_failure_quarantines_the_slot_stops_the_writes_and_waits_for_every_writer():
    book = made_book(slot_fence=FENCE)
    port = book.port
    room, slot = slotted(book, 7, writers={"leg-a", "leg-b"})
    assert book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    assert (slot.state, slot.fence_deadline) == (SlotState.QUARANTINED, port.clock() + FENCE)
    assert book.parts.take() == [("stop_writes", 7, frozenset({"leg-a", "leg-b"}))]  # told what may still land
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=False, code=ErrorCode.TRANSFER_FAILED, reason="write failed"))]
    assert (book.failures["transfer_failed"], book.outcomes["failed"]) == (1, 1)
    assert book.fence_pending() == [room] and book.fence_pending("tcp://10.0.0.1:8998") == [room] and book.fence_pending("tcp://other:1") == []

    assert not book.fail(room, ErrorCode.TIMEOUT, "again")  # finished already: nothing changes
    assert (room.code, book.outcomes["failed"], book.parts.take()) == (ErrorCode.TRANSFER_FAILED, 1, [])

    book.writer_done(room, "leg-a")
    assert not room.fenced and slot.state is SlotState.QUARANTINED and port.take() == [] and book.parts.take() == []
    book.writer_done(room, "leg-b")
    assert room.fenced and slot.state is SlotState.FREE
    assert book.parts.take() == [("fenced", 7, True)]
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.TRANSFER_FAILED, reason="write failed"))]
    assert book.fence_pending() == [] and book.rooms.find(7) is room  # its engine still has to release it


def test_a_room_nothing_writes_for_is_fenced_as_it_fails_and_its_engine_hears_once():
    book = made_book()
    room, slot = slotted(book, 7)
    book.fail(room, ErrorCode.ABORTED, "aborted")
    assert room.fenced and slot.state is SlotState.FREE
    assert book.parts.take() == [("stop_writes", 7, frozenset()), ("fenced", 7, True)]
    assert book.port.take() == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.ABORTED, reason="aborted"))]


def test_a_fenced_failed_room_without_an_engine_goes_at_once_and_its_outcome_is_remembered():
    book = made_book()
    room, slot = slotted(book, 7, engine=b"")
    book.fail(room, ErrorCode.PEER_DEAD, "gone")
    assert book.rooms.find(7) is None and book.finished[7] == (F, ErrorCode.PEER_DEAD, "gone")
    assert book.parts.take() == [("stop_writes", 7, frozenset()), ("fenced", 7, True), ("forget", 7, None)]
    assert slot.state is SlotState.FREE and book.port.take() == []


def test_a_room_with_copies_running_is_fenced_by_the_last_copy_not_by_its_writers_going():
    book = made_book()
    room, slot = slotted(book, 7, writers={"leg"})
    book.rooms.copy_started(room)
    book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    book.parts.take()
    book.writers_gone(room)
    assert room.writers == set() and not room.fenced and slot.state is SlotState.QUARANTINED
    book.copy_done(room)
    assert room.fenced and slot.state is SlotState.FREE and book.parts.take() == [("fenced", 7, True)]


def test_writers_gone_by_a_local_deadline_alone_is_said_unproven():
    book = made_book()
    room, _ = slotted(book, 7, writers={"a", "b"})
    book.fail(room, ErrorCode.TIMEOUT, "slow")
    book.parts.take()
    book.writers_gone(room, proven=False)
    assert room.fenced and book.parts.take() == [("fenced", 7, False)]


def test_writers_done_for_a_live_room_fence_nothing():
    book = made_book()
    room, slot = slotted(book, 7, writers={"leg"})
    book.writer_done(room, "leg")
    assert room.writers == set() and not room.fenced and slot.state is SlotState.ARMED and book.parts.take() == []


# --- letting rooms go


def test_a_room_released_before_its_fence_stays_until_fenced_then_goes_unannounced():
    book = made_book()
    room, slot = slotted(book, 7, writers={"leg"})
    book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    book.port.take(), book.parts.take()
    book.release(room)
    assert room.released and book.rooms.find(7) is room and slot.state is SlotState.QUARANTINED
    book.writer_done(room, "leg")
    assert book.rooms.find(7) is None and slot.state is SlotState.FREE
    assert book.parts.take() == [("fenced", 7, True), ("forget", 7, None)]
    assert book.port.take() == []  # its engine let it go: nobody to tell
    assert book.finished[7] == (F, ErrorCode.TRANSFER_FAILED, "write failed")


def test_a_released_succeeded_room_goes_at_once_and_its_slot_is_free():
    book = made_book()
    room, slot = slotted(book, 7)
    book.succeed(room, Event.AUX_LANDED)
    generation = slot.generation
    book.release(room)
    assert book.rooms.find(7) is None and (slot.state, slot.generation) == (SlotState.FREE, generation)
    assert book.finished[7] == (S, None, "")


def test_a_drop_leaves_a_slot_another_room_holds_now_alone():
    book = made_book()
    room, slot = slotted(book, 7)
    book.fail(room, ErrorCode.ABORTED, "aborted")  # fenced at once: its slot free for another room
    slots, now = book.lanes[0].aux.slots, book.port.clock()
    while (grant := slots.allocate(now)).index != slot.index:  # the least recently freed goes first: it comes last
        pass
    other = book.create(8, Role.DECODE, 0)
    book.bind_slot(other, grant.index, grant.generation)
    assert grant.generation == room.generation + 1
    book.drop(room)
    assert (slot.state, slot.room, slot.generation) == (SlotState.ARMED, 8, room.generation + 1)


def test_outcomes_are_remembered_up_to_max_rooms_oldest_out_first():
    book = made_book(max_rooms=2)
    for key in (7, 8, 9):
        book.drop(book.create(key, Role.DECODE, 0))
    assert list(book.finished) == [8, 9] and book.finished[9] == (B, None, "")
    book.remember(10, F, ErrorCode.ABORTED, "late")
    assert list(book.finished) == [9, 10] and book.finished[10] == (F, ErrorCode.ABORTED, "late")


# --- time


def test_the_tick_returns_rooms_stuck_past_their_deadline_once_without_failing_them():
    book = made_book(bootstrap_timeout=1.0, transfer_timeout=2.0)
    port = book.port
    stuck = book.create(7, Role.DECODE, 0)
    moving, _ = slotted(book, 8)
    port.advance(999)
    assert book.tick() == []
    port.advance(1)
    assert book.tick() == [stuck] and stuck.state is B  # at its deadline; the role fails it (its reason, its peer told)
    port.advance(999)
    assert book.tick() == []
    port.advance(1)
    assert book.tick() == [moving]
    port.advance(10_000)
    assert book.tick() == []  # said once: the role failed them or moved them on


def test_the_tick_drops_finished_fenced_rooms_never_released_and_keeps_those_waiting_for_their_fence():
    book = made_book(retention=5.0)
    port = book.port
    done, _ = slotted(book, 7)
    book.succeed(done, Event.AUX_LANDED)
    waiting, slot = slotted(book, 8, writers={"leg"})
    book.fail(waiting, ErrorCode.TRANSFER_FAILED, "write failed")
    book.parts.take()
    port.advance(5_001)
    assert book.tick() == []
    assert book.rooms.find(7) is None and book.finished[7] == (S, None, "")
    assert book.rooms.find(8) is waiting and waiting.released and slot.state is SlotState.QUARANTINED
    assert book.parts.take() == [("forget", 7, None)]
    book.writer_done(waiting, "leg")  # its proof at last: it goes, released
    assert book.rooms.find(8) is None and book.parts.take() == [("fenced", 8, True), ("forget", 8, None)]


def test_a_slot_fence_deadline_passing_fences_its_room_unproven():
    book = made_book(slot_fence=FENCE)
    port = book.port
    room, slot = slotted(book, 7, writers={"job"})
    book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    book.parts.take(), port.take()
    port.advance(round(FENCE * 1000) - 1)
    book.tick()
    assert slot.state is SlotState.QUARANTINED and not room.fenced
    port.advance(1)
    book.tick()
    assert slot.state is SlotState.FREE and room.fenced and room.writers == set()
    assert book.parts.take() == [("fenced", 7, False)]  # a local deadline proves nothing to the peer
    assert port.take() == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.TRANSFER_FAILED, reason="write failed"))]


def test_a_timeout_names_the_limit_the_state_and_the_peer_and_what_it_waited_for():
    book = made_book(bootstrap_timeout=30.0, transfer_timeout=2.5)
    room = book.create(7, Role.DECODE, 0)
    assert book.timeout_reason(room) == "no progress for 30s in bootstrapping (peer unknown)"
    room.peer, room.reason = "tcp://10.0.0.1:8998", "waiting for prefill tcp://10.0.0.1:8998: connection refused"
    assert book.timeout_reason(room) == ("no progress for 30s in bootstrapping, "
                                         "waiting for prefill tcp://10.0.0.1:8998: connection refused")
    room.reason = ""
    book.advance(room, Event.BOOTSTRAPPED)
    book.advance(room, Event.INPUT_READY)
    assert book.timeout_reason(room) == "no progress for 2.5s in transferring (peer tcp://10.0.0.1:8998)"


def test_stats_count_rooms_by_state_slots_by_state_and_failures():
    book = made_book()
    slotted(book, 7)
    failed, _ = slotted(book, 8, writers={"leg"})
    book.fail(failed, ErrorCode.PEER_DEAD, "gone")
    book.count_failure("internal", 2)
    stats = book.stats(req=4, peers=3)
    assert (stats.req, stats.peers) == (4, 3)
    assert (stats.rooms["transferring"], stats.rooms["failed"], stats.rooms["success"]) == (1, 1, 0)
    assert (stats.slots["armed"], stats.slots["quarantined"], stats.slots["free"]) == (1, 1, 6)
    assert stats.failures == {"peer_dead": 1, "internal": 2}
