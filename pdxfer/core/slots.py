"""Generation-tagged aux slot allocator with quarantine (invariants S1-S3).

    FREE --allocate--> GRANTED --bind(room)--> ARMED --written--> WRITTEN
      ^                   |                      |                  |
      +----release--------+                      +--quarantine--+---+
      +----release (after Success) ------------- ARMED/WRITTEN  |
      +----fence / fence deadline ---------- QUARANTINED <-------+

* Every allocation of a slot increases its generation; every call after that names
  the generation it means, and a mismatch raises StaleSlot (S1).
* A slot whose room failed is QUARANTINED: it goes back to FREE only once fenced
  (the writer acknowledged, was declared dead, or the fence deadline passed), so no
  slot is handed out while a write aimed at it may still land (S2).
* Free slots are handed out least-recently-freed first, which maximises the time
  between two owners of one slot.

Pure: no clock, no I/O; times are passed in.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .errors import Busy, StaleSlot


class SlotState(str, enum.Enum):
    FREE = "free"
    GRANTED = "granted"  # handed to the engine, not yet bound to a room
    ARMED = "armed"  # bound to a room; its aux is in flight
    WRITTEN = "written"  # decode: the verified aux landed; the engine reads it
    QUARANTINED = "quarantined"  # its room failed; waiting to be fenced


@dataclass(eq=False)
class Slot:
    index: int
    generation: int = 0
    state: SlotState = SlotState.FREE
    room: int = 0
    since: float = 0.0
    fence_deadline: float = 0.0


class Fenced(NamedTuple):
    """A slot freed by its fence deadline, and the room it was quarantined for."""

    index: int
    generation: int
    room: int


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self._free: deque[int] = deque(range(num_slots))
        self._quarantined: set[int] = set()

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def counts(self) -> dict[SlotState, int]:
        counts = {state: 0 for state in SlotState}
        for slot in self.slots:
            counts[slot.state] += 1
        return counts

    def allocate(self, now: float) -> Slot:
        if not self._free:
            quarantined = len(self._quarantined)
            raise Busy(
                f"no free aux slot ({len(self.slots)} slots, {quarantined} quarantined)",
                retry_after_ms=20,
            )
        slot = self.slots[self._free.popleft()]
        slot.generation += 1
        slot.state = SlotState.GRANTED
        slot.room = 0
        slot.since = now
        return slot

    def _owned(self, index: int, generation: int, *states: SlotState) -> Slot:
        if not 0 <= index < len(self.slots):
            raise StaleSlot(f"slot {index} out of range (0..{len(self.slots) - 1})")
        slot = self.slots[index]
        if slot.generation != generation:
            raise StaleSlot(
                f"slot {index} generation {generation} is stale (current generation {slot.generation})"
            )
        if slot.state not in states:
            expected = "/".join(s.value for s in states)
            raise StaleSlot(f"slot {index} generation {generation} is {slot.state.value}, not {expected}")
        return slot

    def bind(self, index: int, generation: int, room: int, now: float) -> Slot:
        slot = self._owned(index, generation, SlotState.GRANTED)
        slot.state = SlotState.ARMED
        slot.room = room
        slot.since = now
        return slot

    def expected(self, index: int) -> Slot | None:
        """The slot if it is ARMED, i.e. waiting for exactly one (room, generation)."""
        if 0 <= index < len(self.slots) and self.slots[index].state is SlotState.ARMED:
            return self.slots[index]
        return None

    def mark_written(self, index: int, generation: int, now: float) -> None:
        slot = self._owned(index, generation, SlotState.ARMED)
        slot.state = SlotState.WRITTEN
        slot.since = now

    def release(self, index: int, generation: int, now: float) -> None:
        """The engine is done with a slot whose room succeeded (or never started)."""
        slot = self._owned(index, generation, SlotState.GRANTED, SlotState.ARMED, SlotState.WRITTEN)
        self._free_slot(slot, now)

    def give_back(self, index: int, generation: int, now: float) -> None:
        """The engine returns a granted slot it never bound to a room."""
        self._free_slot(self._owned(index, generation, SlotState.GRANTED), now)

    def quarantine(self, index: int, generation: int, now: float, fence_deadline: float) -> None:
        """The slot's room failed; a write may still be on its way."""
        slot = self._owned(index, generation, SlotState.ARMED, SlotState.WRITTEN)
        slot.state = SlotState.QUARANTINED
        slot.since = now
        slot.fence_deadline = fence_deadline
        self._quarantined.add(index)

    def fence(self, index: int, generation: int, now: float) -> bool:
        """No write aimed at this (slot, generation) can land any more. Returns
        whether the slot was freed (False if it had already moved on)."""
        slot = self.slots[index] if 0 <= index < len(self.slots) else None
        if slot is None or slot.generation != generation or slot.state is not SlotState.QUARANTINED:
            return False
        self._free_slot(slot, now)
        return True

    def reclaim_granted(self, older_than: float) -> list[int]:
        """Free slots granted before ``older_than`` and never bound: an engine took
        them and went away. Returns their indices."""
        stale = [s for s in self.slots if s.state is SlotState.GRANTED and s.since < older_than]
        for slot in stale:
            self._free_slot(slot, older_than)
        return [s.index for s in stale]

    def expire_fences(self, now: float) -> list[Fenced]:
        """Free quarantined slots whose fence deadline passed; say whose they were."""
        due = sorted((self.slots[i] for i in self._quarantined if self.slots[i].fence_deadline <= now), key=lambda s: s.fence_deadline)
        done = [Fenced(s.index, s.generation, s.room) for s in due]
        for slot in due:
            self._free_slot(slot, now)
        return done

    def _free_slot(self, slot: Slot, now: float) -> None:
        self._quarantined.discard(slot.index)
        slot.state = SlotState.FREE
        slot.room = 0
        slot.since = now
        slot.fence_deadline = 0.0
        self._free.append(slot.index)
