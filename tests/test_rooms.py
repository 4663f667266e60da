"""The room state machine, driven through its table (in the style of h11's
tests/test_state.py), and the bounded RoomTable with its deadline heap.

Time is always passed in; nothing here reads a clock.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.core import errors
from pdxfer.core.protocol import ErrorCode, Role, RoomState
from pdxfer.core.rooms import IMPLIED, TRANSITIONS, Event, RoomTable, Timeouts, next_state

B = RoomState.BOOTSTRAPPING
W = RoomState.WAITING_FOR_INPUT
T = RoomState.TRANSFERRING
S = RoomState.SUCCESS
F = RoomState.FAILED
LIVE = (B, W, T)
TERMINAL = (S, F)

# Distinct per-state timeouts, so a test can tell which one a deadline came from.
TIMEOUTS = Timeouts(bootstrap=10.0, waiting=20.0, transfer=30.0, retention=100.0)

# The table the design describes, written out independently of rooms.TRANSITIONS so
# an accidental edit to the table is caught.
EXPECTED_TABLE = {
    (B, Event.BOOTSTRAPPED): W,
    (B, Event.INPUT_READY): B,  # remembered, not a state change
    (W, Event.INPUT_READY): T,
    (T, Event.DONE): S,
    (T, Event.AUX_LANDED): S,
    (B, Event.FAIL): F,
    (W, Event.FAIL): F,
    (T, Event.FAIL): F,
}
# The decode side's verified aux record stands for the notices it may come before.
EXPECTED_IMPLIED = {
    (B, Event.AUX_LANDED): Event.BOOTSTRAPPED,
    (W, Event.AUX_LANDED): Event.INPUT_READY,
}


def new_table(capacity: int = 16, timeouts: Timeouts = TIMEOUTS) -> RoomTable:
    return RoomTable(capacity, timeouts)


def room_in(table: RoomTable, state: RoomState, room_id: int = 1, now: float = 0.0):
    """A room driven into ``state`` through legal events only."""
    room = table.create(room_id, Role.PREFILL, now)
    path = {
        B: [],
        W: [Event.BOOTSTRAPPED],
        T: [Event.BOOTSTRAPPED, Event.INPUT_READY],
        S: [Event.BOOTSTRAPPED, Event.INPUT_READY, Event.DONE],
        F: [Event.FAIL],
    }[state]
    for event in path:
        table.apply(room, event, now, code=ErrorCode.ABORTED, reason="test")
    assert room.state is state
    return room


# --- the table itself


def test_transition_table_is_exactly_the_designed_one():
    assert TRANSITIONS == EXPECTED_TABLE
    assert IMPLIED == EXPECTED_IMPLIED


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED_TABLE, key=str))
def test_every_legal_transition(state, event):
    table = new_table()
    room = room_in(table, state)
    changed = table.apply(room, event, 5.0, code=ErrorCode.TIMEOUT, reason="why")
    target = EXPECTED_TABLE[(state, event)]
    assert room.state is target
    assert changed is (target is not state)
    if changed:
        assert room.entered == 5.0
        assert room.history[-1] == (target, 5.0)
        assert room.deadline == 5.0 + TIMEOUTS.for_state(target)


ILLEGAL = [
    (state, event)
    for state, event in itertools.product(LIVE, Event)
    if (state, event) not in EXPECTED_TABLE and (state, event) not in EXPECTED_IMPLIED
]


def test_illegal_pairs_are_the_expected_ones():
    # Guards the parametrisation below against silently testing nothing.
    assert set(ILLEGAL) == {
        (B, Event.DONE),
        (W, Event.BOOTSTRAPPED),
        (W, Event.DONE),
        (T, Event.BOOTSTRAPPED),
        (T, Event.INPUT_READY),
    }


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: getattr(v, "value", v))
def test_illegal_transition_raises_and_changes_nothing(state, event):
    table = new_table()
    room = room_in(table, state)
    before = (room.state, room.has_input, room.deadline, list(room.history), room.code, room.reason)
    with pytest.raises(errors.IllegalTransition) as info:
        table.apply(room, event, 7.0)
    assert state.value in str(info.value) and event.value in str(info.value)
    assert (room.state, room.has_input, room.deadline, list(room.history), room.code, room.reason) == before
    # It is our bug, not the engine's: reported as internal.
    assert info.value.code is ErrorCode.INTERNAL


@pytest.mark.parametrize("state", TERMINAL)
@pytest.mark.parametrize("event", list(Event))
def test_terminal_states_are_sticky(state, event):
    table = new_table()
    room = room_in(table, state)
    before = (room.state, room.deadline, list(room.history), room.code, room.reason, room.has_input)
    assert next_state(state, event, has_input=False) is None
    assert table.apply(room, event, 50.0, code=ErrorCode.TIMEOUT, reason="late") is False
    # A late completion must not revive a failed room, nor a late failure undo success.
    assert (room.state, room.deadline, list(room.history), room.code, room.reason, room.has_input) == before


@pytest.mark.parametrize(("state", "path"), [(B, [W, T, S]), (W, [T, S]), (T, [S])], ids=lambda v: getattr(v, "value", None))
def test_the_aux_record_lands_a_room_from_any_live_state_through_every_state_after_it(state, path):
    """Whatever notices came before it (room_accepted, transfer_started), the verified aux
    record ends the room; the states it implies are each entered, at the same time."""
    table = new_table()
    seen = []
    table.observer = lambda room, left, now: seen.append((left, room.state, now))
    room = room_in(table, state)
    assert table.apply(room, Event.AUX_LANDED, 4.0) is True
    before = [B, W, T][: [B, W, T].index(state) + 1]
    assert room.history == [(s, 0.0) for s in before] + [(target, 4.0) for target in path]
    assert seen[-len(path):] == [(left, target, 4.0) for left, target in zip([state, *path], path)]
    assert room.has_input and room.deadline == 4.0 + TIMEOUTS.retention


def test_an_aux_record_after_early_input_skips_waiting_as_bootstrapped_would():
    table = new_table()
    room = table.create(1, Role.DECODE, 0.0)
    table.apply(room, Event.INPUT_READY, 1.0)
    assert table.apply(room, Event.AUX_LANDED, 2.0) is True
    assert room.history == [(B, 0.0), (T, 2.0), (S, 2.0)]


def test_early_input_ready_then_bootstrapped_goes_straight_to_transferring():
    table = new_table()
    room = table.create(1, Role.DECODE, 0.0)
    assert table.apply(room, Event.INPUT_READY, 1.0) is False  # remembered only
    assert room.state is B and room.has_input
    assert room.deadline == 0.0 + TIMEOUTS.bootstrap  # the bootstrap deadline still holds
    assert table.apply(room, Event.INPUT_READY, 1.5) is False  # a repeat is harmless
    assert table.apply(room, Event.BOOTSTRAPPED, 2.0) is True
    assert room.state is T
    assert [s for s, _ in room.history] == [B, T]
    assert room.deadline == 2.0 + TIMEOUTS.transfer


def test_next_state_without_early_input_waits():
    assert next_state(B, Event.BOOTSTRAPPED, has_input=False) is W
    assert next_state(B, Event.BOOTSTRAPPED, has_input=True) is T


def test_fail_records_code_and_reason_and_defaults():
    table = new_table()
    a = table.create(1, Role.PREFILL, 0.0)
    table.apply(a, Event.FAIL, 1.0, code=ErrorCode.PEER_UNREACHABLE, reason="peer gone")
    assert (a.code, a.reason) == (ErrorCode.PEER_UNREACHABLE, "peer gone")
    b = table.create(2, Role.PREFILL, 0.0)
    table.apply(b, Event.FAIL, 1.0)
    # A failure always carries a code and a reason, even when the caller gave none.
    assert b.code is ErrorCode.INTERNAL and b.reason


# --- deadlines


@pytest.mark.parametrize(
    ("state", "timeout"),
    [(B, TIMEOUTS.bootstrap), (W, TIMEOUTS.waiting), (T, TIMEOUTS.transfer)],
)
def test_live_room_expires_at_its_state_deadline(state, timeout):
    table = new_table()
    room = room_in(table, state, now=100.0)
    assert table.expired(100.0 + timeout - 0.001) == []
    assert table.expired(100.0 + timeout) == [room]  # the deadline itself counts
    assert table.expired(100.0 + timeout + 1000) == []  # reported once


def test_moving_on_resets_the_deadline():
    table = new_table()
    room = table.create(1, Role.PREFILL, 0.0)
    table.apply(room, Event.BOOTSTRAPPED, 9.0)  # just before the bootstrap deadline (10)
    # The stale bootstrap deadline must not fire for a room now waiting.
    assert table.expired(10.0) == []
    assert table.expired(9.0 + TIMEOUTS.waiting) == [room]


def test_a_move_to_an_earlier_deadline_expires_at_it_and_later_ones_wait_for_the_first_entry():
    table = RoomTable(10, Timeouts(bootstrap=10.0, waiting=50.0, transfer=5.0, retention=100.0))
    room = table.create(1, Role.PREFILL, 0.0)
    table.apply(room, Event.BOOTSTRAPPED, 1.0)  # deadline 51: the entry due at 10 stands for it
    assert len(table._deadlines) == 1  # (private: one heap push for the two states)
    assert table.expired(10.0) == []  # due, but not expired: pushed again for 51
    table.apply(room, Event.INPUT_READY, 20.0)  # deadline 25, before the entry due at 51
    assert table.expired(24.9) == []
    assert table.expired(25.0) == [room]


@pytest.mark.parametrize("state", TERMINAL)
def test_finished_room_expires_after_retention(state):
    table = new_table()
    room = room_in(table, state, now=3.0)
    assert table.expired(3.0 + TIMEOUTS.retention - 0.001) == []
    assert table.expired(3.0 + TIMEOUTS.retention) == [room]


def test_caller_fails_expired_room_then_it_is_retained():
    table = new_table()
    room = table.create(1, Role.PREFILL, 0.0)
    (expired,) = table.expired(10.0)
    table.apply(expired, Event.FAIL, 10.0, code=ErrorCode.TIMEOUT, reason="bootstrap timed out")
    assert room.state is F
    assert table.expired(10.0 + TIMEOUTS.retention - 0.001) == []
    assert table.expired(10.0 + TIMEOUTS.retention) == [room]


def test_removed_room_never_expires():
    table = new_table()
    table.create(1, Role.PREFILL, 0.0)
    table.remove(1)
    assert table.expired(1e9) == []


def test_reused_room_id_does_not_inherit_the_old_deadline():
    table = new_table()
    table.create(1, Role.PREFILL, 0.0)  # deadline 10
    table.remove(1)
    room = table.create(1, Role.PREFILL, 5.0)  # deadline 15
    assert table.expired(10.0) == []
    assert table.expired(15.0) == [room]


# --- capacity and lookup


def test_capacity_is_busy_and_counts_finished_rooms():
    table = new_table(capacity=2)
    table.create(1, Role.PREFILL, 0.0)
    finished = room_in(table, S, room_id=2)
    with pytest.raises(errors.Busy) as info:
        table.create(3, Role.PREFILL, 0.0)
    assert info.value.code is ErrorCode.BUSY and "2" in str(info.value)
    assert 3 not in table and len(table) == 2
    table.remove(finished.id)
    assert table.create(3, Role.PREFILL, 0.0).id == 3


def test_duplicate_room_is_refused_and_keeps_the_original():
    table = new_table()
    first = table.create(1, Role.PREFILL, 0.0)
    with pytest.raises(errors.DuplicateRoom) as info:
        table.create(1, Role.DECODE, 1.0)
    assert info.value.room == 1 and info.value.code is ErrorCode.DUPLICATE_ROOM
    assert table.get(1) is first and first.role is Role.PREFILL


def test_unknown_room():
    table = new_table()
    with pytest.raises(errors.UnknownRoom) as info:
        table.get(42)
    assert info.value.room == 42 and "42" in str(info.value)
    assert table.find(42) is None
    assert table.remove(42) is None


def test_counts_and_iteration():
    table = new_table()
    for i, state in enumerate([B, W, T, S, F, F], start=1):
        room_in(table, state, room_id=i)
    counts = table.counts()
    assert counts == {B: 1, W: 1, T: 1, S: 1, F: 2}
    assert table.live() == 3  # bootstrapping, waiting, transferring
    assert sorted(r.id for r in table) == [1, 2, 3, 4, 5, 6]


def test_heap_compaction_on_remove_keeps_expiry_correct():
    table = RoomTable(10_000, TIMEOUTS)
    # Many short rooms that each leave a heap entry, then are released.
    for i in range(1, 1001):
        room = table.create(i, Role.PREFILL, 0.0)
        for event in (Event.BOOTSTRAPPED, Event.INPUT_READY, Event.DONE):
            table.apply(room, event, 1.0)
    keep = {}
    for i in range(1001, 1011):  # survivors with distinct deadlines
        keep[i] = table.create(i, Role.PREFILL, float(i - 1000))
    for i in range(1, 1001):
        table.remove(i)
    # The heap was rebuilt: stale entries of released rooms do not pile up. (Private
    # attribute: the only way to observe that the bound holds.)
    assert len(table._deadlines) <= 4 * len(table) + 1024
    # And expiry is still exact: each survivor at its own deadline, released ones never.
    for i, room in keep.items():
        deadline = float(i - 1000) + TIMEOUTS.bootstrap
        assert table.expired(deadline - 0.001) == []
        assert table.expired(deadline) == [room]
    assert table.expired(1e9) == []


# --- property: random events and times


RANK = {B: 0, W: 1, T: 2, S: 3}

ops = st.lists(
    st.tuples(
        st.sampled_from(["create", "event", "drop"]),
        st.integers(0, 5),  # which room (index into rooms created so far)
        st.sampled_from(list(Event)),
        st.floats(0, 60, allow_nan=False),  # time advance before the op
    ),
    max_size=60,
)


def sweep(table: RoomTable, now: float, dropped: set[int]) -> None:
    """What the daemon does on a tick: fail expired live rooms, drop expired finished ones."""
    for room in table.expired(now):
        assert room.deadline <= now  # never early
        if room.finished:
            table.remove(room.id)
            dropped.add(room.id)
        else:
            assert table.apply(room, Event.FAIL, now, code=ErrorCode.TIMEOUT, reason="timed out")


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_random_events_keep_rooms_monotonic_and_every_room_ends(ops):
    table = RoomTable(8, TIMEOUTS)
    rooms = []  # every room ever created, dropped or not
    dropped: set[int] = set()
    next_id = itertools.count(1)
    now = 0.0
    for op, which, event, dt in ops:
        now += dt
        sweep(table, now, dropped)
        if op == "create":
            try:
                rooms.append(table.create(next(next_id), Role.DECODE, now))
            except errors.Busy:
                assert len(table) == 8
        elif rooms:
            room = rooms[which % len(rooms)]
            if op == "drop":
                table.remove(room.id)
                dropped.add(room.id)
                continue
            before = room.state
            try:
                changed = table.apply(room, event, now, code=ErrorCode.ABORTED, reason="random")
            except errors.IllegalTransition:
                assert (before, event) not in EXPECTED_TABLE and not before.terminal
                assert room.state is before
                continue
            assert changed is (room.state is not before)
            if before.terminal:
                assert room.state is before  # sticky
    # Let every deadline pass; the caller fails whatever is still live.
    for _ in range(3):
        now += max(TIMEOUTS.bootstrap, TIMEOUTS.waiting, TIMEOUTS.transfer) + 1
        sweep(table, now, dropped)
    for room in rooms:
        states = [s for s, _ in room.history]
        times = [t for _, t in room.history]
        assert times == sorted(times)
        # Monotonic along B -> W -> T -> S, with Failed only ever last.
        assert F not in states[:-1]
        ranks = [RANK[s] for s in states if s is not F]
        assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
        assert states[0] is B
        if room.id in dropped and not room.finished:
            continue  # released by the engine while live: no longer the table's concern
        assert room.state in TERMINAL, room
        if room.state is F:
            assert room.code is not None and room.reason
