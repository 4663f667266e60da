"""The rooms a role holds, as both roles keep them: the room table (core/rooms.py, with
its fencing facts), the outcomes of rooms let go, the engine told of every change, the
aux slot each room holds, and the timeouts. A role hands the book what only it knows of
its rooms (``RoomParts``); the book does no I/O but through the port.
"""

from __future__ import annotations

import collections
import logging
from typing import Protocol

from ..core.config import Config
from ..core.protocol import ErrorCode, RoomState, RoomStatus, Stats
from ..core.rooms import Event, Room, RoomTable, Timeouts
from ..core.slots import SlotState
from ..core.topology import key_label, room_of
from .lanes import Lanes
from .ports import Port

log = logging.getLogger("pdxfer.service")


class RoomParts(Protocol):
    """What a role tells the book of its rooms."""

    def engine_of(self, room: Room) -> bytes:
        """The engine connection that hears of the room (b"": none any more)."""

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        """What the room's engine hears of it."""

    def stop_writes(self, room: Room) -> None:
        """The room failed: stop whatever may still write for it and tell its peer
        (what is left of ``room.writers`` is what still may land)."""

    def fenced(self, room: Room, proven: bool) -> None:
        """Nothing more can land for the failed room: let go of what was held for it.
        ``proven``: its writers are done (not only a local fence deadline passed)."""

    def forget(self, room: Room) -> None:
        """The room left the table: drop what the role keeps of it."""

    def release(self, room: Room) -> None:
        """A settled room whose engine sends no release goes (RoomBook.release, for every part of it)."""


def settled(status: RoomStatus) -> bool:
    return status.state is RoomState.SUCCESS or (status.state is RoomState.FAILED and status.fenced)


class RoomBook:
    """``slot_fence``: seconds after which a failed room's quarantined slot is released
    though its writer never confirmed (prefill: its own source slots; decode: never)."""

    def __init__(self, config: Config, port: Port, lanes: Lanes, parts: RoomParts, slot_fence: float) -> None:
        self.config = config
        self.port = port
        self.lanes = lanes
        self.parts = parts
        self.slot_fence = slot_fence
        self.rooms = RoomTable(
            config.max_rooms,
            Timeouts(config.bootstrap_timeout, config.waiting_timeout, config.transfer_timeout, config.retention),
        )
        self.rooms.observer = port.observe
        self.finished: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # rooms let go: (state, code, reason)
        self.failures: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()  # rooms finished: success / failed

    # --- moving rooms

    def create(self, key: int, role, lane: int, peer: str = "") -> Room:
        room = self.rooms.create(key, role, self.port.clock(), peer=peer)
        room.lane = lane
        return room

    def advance(self, room: Room, event: Event) -> None:
        """Move a live room by ``event``; its engine hears of a change of state (B6)."""
        if self.rooms.apply(room, event, self.port.clock()):
            self.push(room)

    def push(self, room: Room) -> None:
        """Tell the room's engine its status; a room whose engine sends no release goes once settled."""
        engine = self.parts.engine_of(room)
        if engine:
            status = self.parts.status(room)
            self.port.send_engine(engine, status)
            if room.release_when_settled and settled(status) and self.rooms.find(room.id) is room:
                self.parts.release(room)

    def bind_slot(self, room: Room, slot: int, generation: int) -> None:
        self.lanes[room.lane].registered_aux().slots.bind(slot, generation, room.id, self.port.clock())
        room.slot, room.generation = slot, generation

    def succeed(self, room: Room, event: Event) -> bool:
        """``event`` ends the room well: the decode side's ack (prefill), or the verified aux record (decode)."""
        if not self.rooms.apply(room, event, self.port.clock()):
            return False
        self.outcomes["success"] += 1
        self.push(room)
        return True

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """Fail a live room: quarantine its slot, let the role stop its writes and tell
        its peer, tell the engine; fenced at once if nothing may write for it. Returns
        False if the room had already finished."""
        now = self.port.clock()
        if not self.rooms.apply(room, Event.FAIL, now, code=code, reason=reason):
            return False
        self.count_failure(code.value)
        self.outcomes["failed"] += 1
        log.warning("room %s failed [%s] peer=%s: %s", key_label(room.id), code.value, room.peer or "-", reason,
                    extra={"room": room_of(room.id), "peer": room.peer or None})
        slots = self.lanes.slots_of(room.lane)
        if room.slot >= 0 and slots is not None:
            slot = slots.slots[room.slot]
            if slot.generation == room.generation and slot.state in (SlotState.ARMED, SlotState.WRITTEN):
                slots.quarantine(room.slot, room.generation, now, now + self.slot_fence)
        self.parts.stop_writes(room)
        if self.rooms.fence_if_done(room):
            self._fenced(room, True)
        elif self.parts.engine_of(room):
            self.push(room)
        return True

    # --- fencing (core/rooms.py keeps the facts)

    def writer_done(self, room: Room, writer) -> None:
        """``writer`` has nothing in flight for the room any more."""
        if self.rooms.writer_done(room, writer):
            self._fenced(room, True)

    def writers_gone(self, room: Room, proven: bool = True) -> None:
        """Nothing any writer of the room sent can land any more (``proven``; false: a
        local fence deadline says so, which no peer is told)."""
        if self.rooms.writers_gone(room):
            self._fenced(room, proven)

    def copy_done(self, room: Room) -> None:
        if self.rooms.copy_done(room):
            self._fenced(room, True)

    def _fenced(self, room: Room, proven: bool) -> None:
        """The failed room became fenced: its slot goes back, the role lets go of what it
        held, and its engine hears; a room its engine released, or never joined, goes."""
        slots = self.lanes.slots_of(room.lane)
        if room.slot >= 0 and slots is not None:
            slots.fence(room.slot, room.generation, self.port.clock())
        self.parts.fenced(room, proven)
        if room.released or not self.parts.engine_of(room):
            if self.rooms.find(room.id) is room:
                self.drop(room)
        else:
            self.push(room)

    def fence_pending(self, peer: str = "") -> list[Room]:
        """Failed rooms (of ``peer``) still waiting for proof that nothing of them can land."""
        return [room for room in self.rooms if room.state is RoomState.FAILED and not room.fenced and (not peer or room.peer == peer)]

    # --- letting rooms go

    def release(self, room: Room) -> None:
        """The engine is done with a finished room: it goes, or, failed and not fenced yet,
        stays until it is (its pages and slot are not the engine's to reuse before)."""
        if room.fenced:
            self.drop(room)
        else:
            room.released = True

    def drop(self, room: Room) -> None:
        """Forget a room; its slot returns to the pool unless quarantined. Its outcome is
        remembered for a while (bounded), so a peer asking about it late gets an answer
        instead of a new, orphan room."""
        self.rooms.remove(room.id)
        self.parts.forget(room)
        self.remember(room.id, room.state, room.code, room.reason)
        slots = self.lanes.slots_of(room.lane)
        if room.slot >= 0 and slots is not None:
            slot = slots.slots[room.slot]
            if slot.generation == room.generation and slot.state in (SlotState.GRANTED, SlotState.ARMED, SlotState.WRITTEN):
                slots.release(room.slot, room.generation, self.port.clock())

    def remember(self, room_id: int, state: RoomState, code: ErrorCode | None, reason: str) -> None:
        """Keep a finished room's outcome (bounded, oldest out first) for a peer or engine asking late."""
        self.finished[room_id] = (state, code, reason)
        if len(self.finished) > self.config.max_rooms:
            self.finished.popitem(last=False)

    # --- time

    def tick(self) -> list[Room]:
        """Apply timeouts: drop finished rooms never released (those still waiting for
        their fence stay, released, until it comes), let replaced mappings and unused
        slots go, fence rooms whose slot's fence deadline passed. Returns the live rooms
        stuck past their state's deadline, for the role to fail."""
        now = self.port.clock()
        stuck = []
        for room in self.rooms.expired(now):
            if not room.finished:
                stuck.append(room)
            elif room.fenced:
                log.info("room %s dropped: finished %.0fs ago and never released", key_label(room.id), now - room.entered, extra={"room": room_of(room.id)})
                self.drop(room)
            else:
                room.released = True
        self.lanes.release_retired(now)
        for slot in self.lanes.reclaim_slots(now):
            room = self.rooms.find(slot.room)  # the room it was quarantined for, not its new state
            log.warning("aux slot %d generation %d released by fence timeout (room %s)", slot.index, slot.generation, key_label(slot.room),
                        extra={"room": room_of(slot.room)})
            if room is not None and room.generation == slot.generation:
                self.writers_gone(room, proven=False)
        return stuck

    def timeout_reason(self, room: Room) -> str:
        waiting = f", {room.reason}" if room.reason else f" (peer {room.peer or 'unknown'})"  # what it waited for, where its role said
        return f"no progress for {self.rooms.timeouts.for_state(room.state):g}s in {room.state.value}{waiting}"

    # --- counting

    def count_failure(self, reason: str, n: int = 1) -> None:
        self.failures[reason] += n

    def stats(self, req: int, peers: int) -> Stats:
        return Stats(
            req=req,
            rooms={state.value: n for state, n in self.rooms.counts().items()},
            slots={state.value: n for state, n in self.lanes.slot_counts().items()},
            failures=dict(self.failures),
            peers=peers,
        )
