"""SlotAllocator against a model of invariants S1/S2: a hypothesis state machine
drives allocate/bind/write/release/quarantine/fence in random orders and checks the
allocator against a simple reference model after every step."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdxfer.core import errors
from pdxfer.core.protocol import ErrorCode
from pdxfer.core.slots import SlotAllocator, SlotState

FREE = SlotState.FREE
GRANTED = SlotState.GRANTED
ARMED = SlotState.ARMED
WRITTEN = SlotState.WRITTEN
QUARANTINED = SlotState.QUARANTINED

NUM_SLOTS = 4


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(NUM_SLOTS)
        self.now = 0.0
        # The model: per slot (state, generation, room, fence deadline), and the free
        # queue in the order slots were freed.
        self.state = [FREE] * NUM_SLOTS
        self.gen = [0] * NUM_SLOTS
        self.room = [0] * NUM_SLOTS
        self.deadline = [0.0] * NUM_SLOTS
        self.free = deque(range(NUM_SLOTS))
        self.issued: set[tuple[int, int]] = set()  # every (slot, generation) ever granted
        self.next_room = 1

    # --- helpers

    def _in(self, *states):
        return [i for i in range(NUM_SLOTS) if self.state[i] in states]

    def _freed(self, i: int) -> None:
        self.state[i] = FREE
        self.room[i] = 0
        self.deadline[i] = 0.0
        self.free.append(i)

    # --- rules

    @rule(dt=st.floats(0, 5, allow_nan=False))
    def tick(self, dt):
        self.now += dt

    @precondition(lambda self: self._in(QUARANTINED))
    @rule(data=st.data())
    def tick_to_a_fence_deadline(self, data):
        # Land exactly on a deadline: the boundary random float times never hit.
        i = data.draw(st.sampled_from(self._in(QUARANTINED)))
        self.now = max(self.now, self.deadline[i])

    @rule()
    def allocate(self):
        if not self.free:
            with pytest.raises(errors.Busy) as info:
                self.alloc.allocate(self.now)
            quarantined = len(self._in(QUARANTINED))
            assert f"{quarantined} quarantined" in str(info.value)
            assert info.value.code is ErrorCode.BUSY
            return
        slot = self.alloc.allocate(self.now)
        # Least-recently-freed first.
        expected = self.free.popleft()
        assert slot.index == expected
        # Never a slot that someone still owns or that a write may still hit.
        assert self.state[expected] is FREE
        # S1: the generation increases on every allocation, so no (slot, generation)
        # pair is ever issued twice.
        assert slot.generation == self.gen[expected] + 1
        assert (slot.index, slot.generation) not in self.issued
        self.issued.add((slot.index, slot.generation))
        assert slot.state is GRANTED and slot.room == 0
        self.gen[expected] = slot.generation
        self.state[expected] = GRANTED

    @precondition(lambda self: self._in(GRANTED))
    @rule(data=st.data())
    def bind(self, data):
        candidates = self._in(GRANTED)
        i = data.draw(st.sampled_from(candidates))
        room = self.next_room
        self.next_room += 1
        slot = self.alloc.bind(i, self.gen[i], room, self.now)
        assert slot.state is ARMED and slot.room == room
        assert self.alloc.expected(i) is slot
        self.state[i] = ARMED
        self.room[i] = room

    @precondition(lambda self: self._in(ARMED))
    @rule(data=st.data())
    def mark_written(self, data):
        candidates = self._in(ARMED)
        i = data.draw(st.sampled_from(candidates))
        self.alloc.mark_written(i, self.gen[i], self.now)
        self.state[i] = WRITTEN

    @precondition(lambda self: self._in(GRANTED, ARMED, WRITTEN))
    @rule(data=st.data())
    def release(self, data):
        candidates = self._in(GRANTED, ARMED, WRITTEN)
        i = data.draw(st.sampled_from(candidates))
        self.alloc.release(i, self.gen[i], self.now)
        self._freed(i)

    @precondition(lambda self: self._in(GRANTED))
    @rule(data=st.data())
    def give_back(self, data):
        candidates = self._in(GRANTED)
        i = data.draw(st.sampled_from(candidates))
        self.alloc.give_back(i, self.gen[i], self.now)
        self._freed(i)

    @precondition(lambda self: self._in(ARMED, WRITTEN))
    @rule(data=st.data(), wait=st.floats(0, 10, allow_nan=False))
    def quarantine(self, data, wait):
        candidates = self._in(ARMED, WRITTEN)
        i = data.draw(st.sampled_from(candidates))
        self.alloc.quarantine(i, self.gen[i], self.now, self.now + wait)
        self.state[i] = QUARANTINED
        self.deadline[i] = self.now + wait

    @precondition(lambda self: self._in(QUARANTINED))
    @rule(data=st.data())
    def fence(self, data):
        i = data.draw(st.sampled_from(self._in(QUARANTINED)))
        assert self.alloc.fence(i, self.gen[i], self.now) is True
        self._freed(i)

    @rule(data=st.data(), right=st.booleans())
    def fence_that_frees_nothing(self, data, right):
        # Quarantined slots with a wrong generation (a late fence for an older owner
        # must not free the new owner's slot), or any other slot at all.
        quarantined = self._in(QUARANTINED)
        if quarantined and not right:
            i = data.draw(st.sampled_from(quarantined))
            generation = data.draw(st.sampled_from([self.gen[i] - 1, self.gen[i] + 1]))
        else:
            others = self._in(FREE, GRANTED, ARMED, WRITTEN)
            if not others:
                return
            i = data.draw(st.sampled_from(others))
            generation = self.gen[i]
        before = self._snapshot()
        assert self.alloc.fence(i, generation, self.now) is False
        assert self._snapshot() == before

    @rule()
    def expire_fences(self):
        due = {i for i in self._in(QUARANTINED) if self.deadline[i] <= self.now}
        done = self.alloc.expire_fences(self.now)
        assert {s.index for s in done} == due
        for slot in done:  # freed in the order returned
            self._freed(slot.index)

    @rule(
        data=st.data(),
        op=st.sampled_from(["bind", "mark_written", "release", "give_back", "quarantine"]),
        delta=st.sampled_from([-1, 1]),
    )
    def stale_generation_is_refused(self, data, op, delta):
        i = data.draw(st.integers(0, NUM_SLOTS - 1))
        before = self._snapshot()
        with pytest.raises(errors.StaleSlot) as info:
            self._call(op, i, self.gen[i] + delta)
        assert info.value.code is ErrorCode.STALE_SLOT
        assert f"slot {i}" in str(info.value)
        assert self._snapshot() == before

    @rule(data=st.data(), op=st.sampled_from(["bind", "mark_written", "release", "give_back", "quarantine"]))
    def wrong_state_is_refused(self, data, op):
        allowed = {
            "bind": (GRANTED,),
            "mark_written": (ARMED,),
            "release": (GRANTED, ARMED, WRITTEN),
            "give_back": (GRANTED,),
            "quarantine": (ARMED, WRITTEN),
        }[op]
        candidates = [i for i in range(NUM_SLOTS) if self.state[i] not in allowed]
        if not candidates:
            return
        i = data.draw(st.sampled_from(candidates))
        before = self._snapshot()
        with pytest.raises(errors.StaleSlot):
            self._call(op, i, self.gen[i])
        assert self._snapshot() == before

    @rule(index=st.sampled_from([-1, NUM_SLOTS, NUM_SLOTS + 100]))
    def out_of_range_index(self, index):
        with pytest.raises(errors.StaleSlot):
            self.alloc.bind(index, 1, 99, self.now)
        assert self.alloc.fence(index, 1, self.now) is False
        assert self.alloc.expected(index) is None

    def _call(self, op, i, generation):
        if op == "bind":
            return self.alloc.bind(i, generation, 999_999, self.now)
        if op == "quarantine":
            return self.alloc.quarantine(i, generation, self.now, self.now + 1)
        return getattr(self.alloc, op)(i, generation, self.now)

    def _snapshot(self):
        return [(s.state, s.generation, s.room, s.fence_deadline) for s in self.alloc.slots], self.alloc.free_count

    # --- invariants

    @invariant()
    def matches_model(self):
        for i, slot in enumerate(self.alloc.slots):
            assert slot.index == i
            assert slot.state is self.state[i]
            assert slot.generation == self.gen[i]
            # One owner at a time: the room bound to the slot is the model's, and a
            # slot not bound to a room names none.
            assert slot.room == (self.room[i] if self.state[i] in (ARMED, WRITTEN, QUARANTINED) else 0)

    @invariant()
    def counts_consistent(self):
        counts = self.alloc.counts()
        assert counts == {s: len(self._in(s)) for s in SlotState}
        assert sum(counts.values()) == len(self.alloc) == NUM_SLOTS
        assert self.alloc.free_count == counts[FREE] == len(self.free)

    @invariant()
    def expected_only_for_armed(self):
        for i in range(NUM_SLOTS):
            slot = self.alloc.expected(i)
            assert (slot is not None) == (self.state[i] is ARMED)


SlotMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlotMachine = SlotMachine.TestCase


# --- a few fixed scenarios, readable on their own


def test_quarantined_slot_is_not_reallocated_until_fenced():
    alloc = SlotAllocator(1)
    slot = alloc.allocate(0.0)
    gen = slot.generation  # Slot objects are live views; keep the number
    alloc.bind(0, gen, room=7, now=0.0)
    alloc.quarantine(0, gen, now=1.0, fence_deadline=11.0)
    with pytest.raises(errors.Busy) as info:
        alloc.allocate(2.0)
    assert "1 quarantined" in str(info.value)
    assert alloc.expire_fences(10.999) == []
    assert alloc.fence(0, gen + 1, 3.0) is False  # wrong generation
    assert alloc.fence(0, gen, 3.0) is True
    again = alloc.allocate(4.0)
    assert (again.index, again.generation) == (0, gen + 1)


def test_fence_deadline_frees_the_slot():
    alloc = SlotAllocator(2)
    a = alloc.allocate(0.0)
    alloc.bind(a.index, a.generation, 1, 0.0)
    alloc.quarantine(a.index, a.generation, 0.0, fence_deadline=5.0)
    assert alloc.expire_fences(4.9) == []
    assert alloc.expire_fences(5.0) == [(a.index, a.generation, 1)]  # whose slot it was
    assert a.state is FREE
    # A fence that arrives after the deadline already freed the slot changes nothing.
    assert alloc.fence(a.index, a.generation, 6.0) is False


def test_least_recently_freed_first():
    alloc = SlotAllocator(3)
    s = [alloc.allocate(0.0) for _ in range(3)]
    for slot in (s[2], s[0], s[1]):
        alloc.release(slot.index, slot.generation, 1.0)
    assert [alloc.allocate(2.0).index for _ in range(3)] == [2, 0, 1]
