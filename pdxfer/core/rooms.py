"""The room state machine, as a table, and the bounded table of rooms a daemon holds.

No I/O and no clock: every call that depends on time takes ``now``.

    Bootstrapping --bootstrapped--> WaitingForInput --input_ready--> Transferring --done--> Success
         |  (input_ready first: remembered; bootstrapped then goes straight to Transferring)
         +------------------------ fail, from any live state ------------------------> Failed

On the decode side the verified aux record (aux_landed) ends a room from any live state:
it may be the first the decode side hears of the room's transfer, and it implies the
notices it did not get (IMPLIED); the room passes every state on the way.

Success and Failed are terminal and sticky: a late event for a finished room changes
nothing (a completion that arrives after the room failed must not revive it). Any
other move not in the table is a bug and raises IllegalTransition.

Fencing (S2) is kept here too. A room knows what may still write into this side's
memory for it (``writers``: on the decode side the legs whose prefill rank has not said
it has nothing in flight, on the prefill side its jobs the pump has not settled or gave
up on) and the copies into its pages still running (decode). A failed room is *fenced*
the moment neither is left: when a writer is done (``writer_done``), all of them are
gone at once (``writers_gone``: a restarted peer, ended sessions, a closed transport)
or a copy ends. A succeeded room is fenced with its success. A room its engine released
before its fence (``released``) stays in the table, and goes once fenced.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from .errors import Busy, DuplicateRoom, IllegalTransition, UnknownRoom
from .protocol import TERMINAL_STATES, ErrorCode, Role, RoomState
from .topology import room_of

B = RoomState.BOOTSTRAPPING
W = RoomState.WAITING_FOR_INPUT
T = RoomState.TRANSFERRING
S = RoomState.SUCCESS
F = RoomState.FAILED


class Event(str, enum.Enum):
    BOOTSTRAPPED = "bootstrapped"  # both halves of the room are known to this daemon
    INPUT_READY = "input_ready"  # prefill: the engine's send; decode: the prefill began writing
    DONE = "done"  # prefill: the decode side acknowledged the aux record
    AUX_LANDED = "aux_landed"  # decode: the aux record verified (its stamp, and the KV digest if asked)
    FAIL = "fail"


TRANSITIONS: dict[tuple[RoomState, Event], RoomState] = {
    (B, Event.BOOTSTRAPPED): W,
    (B, Event.INPUT_READY): B,
    (W, Event.INPUT_READY): T,
    (T, Event.DONE): S,
    (T, Event.AUX_LANDED): S,
    (B, Event.FAIL): F,
    (W, Event.FAIL): F,
    (T, Event.FAIL): F,
}


# Events that stand for others the room has not seen yet. The prefill sends a room's aux
# record only once it had both halves and wrote the KV, so the record says the room was
# bootstrapped and its input ready: an inline room's record (its KV inside), or the record
# of a room whose prefill had its input first, is the first the decode side hears of the
# room's transfer. Before the event itself, the room takes the implied event of each state
# it is in (each moves it on), so its history and the observer see every state, as if the
# notices had come.
IMPLIED: dict[tuple[RoomState, Event], Event] = {
    (B, Event.AUX_LANDED): Event.BOOTSTRAPPED,
    (W, Event.AUX_LANDED): Event.INPUT_READY,
}


def next_state(state: RoomState, event: Event, has_input: bool) -> RoomState | None:
    """The state after ``event``; None when the room is finished and ignores it."""
    if state in TERMINAL_STATES:
        return None
    try:
        target = TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"no transition from {state.value} on {event.value}") from None
    if target is W and has_input:
        return T
    return target


@dataclass(frozen=True)
class Timeouts:
    """Seconds a room may spend in each state; ``retention`` is how long a finished
    room the engine never released is kept before it is dropped."""

    bootstrap: float = 30.0
    waiting: float = 120.0
    transfer: float = 30.0
    retention: float = 300.0

    def for_state(self, state: RoomState) -> float:
        if state is B:
            return self.bootstrap
        if state is W:
            return self.waiting
        if state is T:
            return self.transfer
        return self.retention


@dataclass(eq=False)
class Room:
    id: int
    role: Role
    state: RoomState
    created: float
    entered: float
    deadline: float
    has_input: bool = False
    fenced: bool = False  # no write for this room can land in this side's memory any more
    # What may still write into this side's memory for the room: leg codes (decode) or
    # jobs (prefill); and the copies into its pages still running (decode, staged legs).
    writers: set = field(default_factory=set)
    copies: int = 0
    released: bool = False  # its engine released it before it was fenced: dropped once it is
    release_when_settled: bool = False  # the engine sends no release: drop the room once its settled status is pushed
    code: ErrorCode | None = None
    reason: str = ""
    peer: str = ""
    lane: int = 0  # the engine rank (roles.lanes.Lane index) whose memory and slot the room uses
    slot: int = -1
    generation: int = 0
    bytes_planned: int = 0
    bytes_moved: int = 0
    history: list[tuple[RoomState, float]] = field(default_factory=list)
    ticket: int = 0  # identifies the room's live deadline entry
    due: float = 0.0  # that entry's time: never after ``deadline`` (see RoomTable.expired)
    # In a terminal state (Success or Failed): kept by RoomTable.apply, read on every path
    # (a field, not a property: it is asked a dozen times per room).
    finished: bool = False


class RoomTable:
    """At most ``capacity`` rooms, live or finished-but-unreleased."""

    def __init__(self, capacity: int, timeouts: Timeouts) -> None:
        self.capacity = capacity
        self.timeouts = timeouts
        # Told of every state change, with debug logging: (room, the state it left, now).
        self.observer: Callable[[Room, RoomState | None, float], None] | None = None
        # Every state change, for the metrics to take (take_moves): (state entered, state
        # left or None, seconds spent in it, seconds since the room was created). A tuple
        # appended, not a call, on the hot path.
        self.moves: list[tuple[RoomState, RoomState | None, float, float]] = []
        self._rooms: dict[int, Room] = {}
        # (due, ticket, room id); an entry counts only while it holds its room's
        # current ticket, so stale entries (removed rooms, a later room reusing the id)
        # are skipped. A move to a later deadline pushes no entry: the live one, due
        # earlier, is pushed again at its time (most rooms end within their first
        # state's limit, so a short room costs one push, not one per state).
        self._deadlines: list[tuple[float, int, int]] = []
        self._tickets = itertools.count(1)
        self._limits = {state: timeouts.for_state(state) for state in RoomState}  # read on every transition

    def __len__(self) -> int:
        return len(self._rooms)

    def __iter__(self):
        return iter(self._rooms.values())

    def __contains__(self, room_id: int) -> bool:
        return room_id in self._rooms

    def create(self, room_id: int, role: Role, now: float, peer: str = "") -> Room:
        if room_id in self._rooms:
            raise DuplicateRoom(f"room {room_of(room_id)} already exists", room=room_of(room_id))
        if len(self._rooms) >= self.capacity:
            raise Busy(f"room table full ({self.capacity} rooms)", room=room_of(room_id))
        room = Room(room_id, role, B, created=now, entered=now, deadline=now + self.timeouts.bootstrap, peer=peer)
        room.history.append((B, now))
        self._rooms[room_id] = room
        self._schedule(room)
        self.moves.append((B, None, 0.0, 0.0))
        if self.observer is not None:
            self.observer(room, None, now)
        return room

    def take_moves(self) -> list[tuple[RoomState, RoomState | None, float, float]]:
        moves, self.moves = self.moves, []
        return moves

    def _schedule(self, room: Room) -> None:
        room.ticket, room.due = next(self._tickets), room.deadline
        heapq.heappush(self._deadlines, (room.due, room.ticket, room.id))

    def get(self, room_id: int) -> Room:
        try:
            return self._rooms[room_id]
        except KeyError:
            raise UnknownRoom(f"unknown room {room_of(room_id)}", room=room_of(room_id)) from None

    def find(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

    def apply(
        self,
        room: Room,
        event: Event,
        now: float,
        *,
        code: ErrorCode | None = None,
        reason: str = "",
    ) -> bool:
        """Move ``room`` by ``event``, after the events it implies (IMPLIED). Returns
        whether its state changed."""
        implied = IMPLIED.get((room.state, event))
        if implied is not None:  # each moves the room on, so this ends
            self.apply(room, implied, now)
            self.apply(room, event, now, code=code, reason=reason)
            return True
        target = next_state(room.state, event, room.has_input)
        if target is None:
            return False
        if event is Event.INPUT_READY:
            room.has_input = True
        if target is room.state:
            return False
        if target is F:
            room.code = code or ErrorCode.INTERNAL
            room.reason = reason or "failed"
        elif target is S:
            room.fenced = True  # it ended well: its writers are done
        left = room.state
        self.moves.append((target, left, now - room.entered, now - room.created))
        room.state = target
        room.finished = target in TERMINAL_STATES
        room.entered = now
        room.deadline = now + self._limits[target]
        room.history.append((target, now))
        if room.deadline < room.due:
            self._schedule(room)
        if self.observer is not None:
            self.observer(room, left, now)
        return True

    # --- fencing

    @staticmethod
    def fence_if_done(room: Room) -> bool:
        """Fence a failed room nothing may write for any more; whether it became fenced now."""
        if room.state is not F or room.fenced or room.writers or room.copies:
            return False
        room.fenced = True
        return True

    @staticmethod
    def writer_started(room: Room, writer) -> None:
        room.writers.add(writer)

    def writer_done(self, room: Room, writer) -> bool:
        """``writer`` has nothing in flight for the room any more; whether it became fenced."""
        room.writers.discard(writer)
        return self.fence_if_done(room)

    def writers_gone(self, room: Room) -> bool:
        """Nothing any writer of the room sent can land any more; whether it became fenced."""
        room.writers.clear()
        return self.fence_if_done(room)

    @staticmethod
    def copy_started(room: Room) -> None:
        room.copies += 1

    def copy_done(self, room: Room) -> bool:
        room.copies -= 1
        return self.fence_if_done(room)

    def remove(self, room_id: int) -> Room | None:
        room = self._rooms.pop(room_id, None)
        # Entries of removed rooms stay in the heap until their deadline; rebuild it
        # when they dominate, so a fast stream of short rooms cannot grow it.
        if len(self._deadlines) > 4 * len(self._rooms) + 1024:
            for r in self._rooms.values():
                r.due = r.deadline
            self._deadlines = [(r.due, r.ticket, r.id) for r in self._rooms.values()]
            heapq.heapify(self._deadlines)
        return room

    def expired(self, now: float) -> list[Room]:
        """Rooms whose deadline for their current state has passed: live ones to be
        failed with a timeout, finished ones to be dropped."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, ticket, room_id = heapq.heappop(heap)
            room = self._rooms.get(room_id)
            if room is None or room.ticket != ticket:
                continue
            if room.deadline > now:  # it moved to a later deadline since: due again then
                self._schedule(room)
            else:
                room.due = math.inf  # no live entry: its next move pushes one
                out.append(room)
        return out

    def live(self) -> int:
        """Rooms not finished yet."""
        return sum(1 for room in self._rooms.values() if not room.finished)

    def counts(self) -> dict[RoomState, int]:
        counts = {state: 0 for state in RoomState}
        for room in self._rooms.values():
            counts[room.state] += 1
        return counts
