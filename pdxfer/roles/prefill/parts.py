"""A prefill rank's parts of a room. Usually one: the room. A rank whose KV goes to
several decode ranks (fan-out: decode TP above the prefill's) keeps a part per decode
rank: the first, made by the engine's announce or send or by the first request, and one
per later decode rank's request, keyed ``topology.fan_key``. The engine hears one status
for them all, the parts fail together, and the first part's engine speaks for every
part. Every rule that spans parts lives here."""

from __future__ import annotations

from ...core.protocol import ErrorCode, RoomState, RoomStatus
from ...core.rooms import Event, Room
from ...core.topology import fan_key, prefill_rank_of, room_key, room_of
from ..book import RoomBook
from .state import PrefillState, PrefillWork

_ORDER = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS)


class RoomParts:
    def __init__(self, book: RoomBook, state: PrefillState) -> None:
        self.book = book
        self.state = state

    def fan(self, first: Room, room: Room, w: PrefillWork) -> None:
        """A fan-out part takes its first part's memory version, aux slot and every chunk
        handed over so far; its engine stays the first part's (head)."""
        head = self.state.work[first.id]
        head.fans.append(room.id)
        room.lane, w.first_room = first.lane, first.id
        w.memory_version, w.aux_slot = head.memory_version, head.aux_slot
        for chunk in head.handed:
            w.take(room, chunk)
        if head.handed:
            self.book.advance(room, Event.INPUT_READY)

    def fans(self, room: Room) -> list[Room]:
        """A first part's fan-out parts."""
        w = self.state.work.get(room.id)
        return [fan for key in (w.fans if w is not None else ()) if (fan := self.book.rooms.find(key)) is not None]

    def group(self, room: Room) -> list[Room]:
        """A prefill rank's parts of a room: its first, and its fan-out parts."""
        w = self.state.work.get(room.id)
        first = self.book.rooms.find(w.first_room) if w is not None and w.first_room else room
        return [first, *self.fans(first)] if first is not None else [room]

    def leg_key(self, room_id: int, leg: int) -> int:
        """The room-table key of the part a decode daemon's message about a leg is for."""
        key = room_key(room_id, prefill_rank_of(leg))
        w = self.state.work.get(key)
        return fan_key(room_id, leg) if w is not None and w.request is not None and w.request.leg != leg else key

    def head(self, room: Room) -> PrefillWork | None:
        """The work of the room's first part: its engine speaks for every part, including
        parts whose request came before the engine announced or sent."""
        w = self.state.work.get(room.id)
        return self.state.work.get(w.first_room) if w is not None and w.first_room else w

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        """What the engine hears of its room: of every part when it writes to several
        decode ranks (fan_out). Failed if one part failed (fenced once all are), Success
        once every decode rank's part is there and succeeded, else the least advanced
        part's state. A part's request says the positions the decode wants."""
        group = self.group(room)
        first = group[0]
        w = self.state.work.get(first.id)
        if w is None:
            return RoomStatus(req=req, room=room_of(first.id), state=first.state, code=first.code, reason=first.reason, fenced=first.fenced)
        missing = (w.request.fan_out if w.request is not None else 1) - len(group)  # parts whose request is still to come
        if len(group) == 1 and missing <= 0:
            return w.status(first, req)
        pages, skip = (w.request.skip_pages + w.dst_pages.size, w.request.skip_pages) if w.request is not None else (0, 0)
        failed = [part for part in group if part.state is RoomState.FAILED]
        if failed:
            fenced = all(part.finished and part.fenced for part in group)  # parts still to come were never asked for: nothing to fence
            return RoomStatus(req=req, room=room_of(first.id), state=RoomState.FAILED, code=failed[0].code, reason=failed[0].reason,
                              fenced=fenced, pages=pages, skip_pages=skip)
        state = min((part.state for part in group), key=_ORDER.index)
        if state is RoomState.SUCCESS and missing > 0:
            state = RoomState.TRANSFERRING  # its other decode ranks have not asked yet
        return RoomStatus(req=req, room=room_of(first.id), state=state, fenced=state is RoomState.SUCCESS, pages=pages, skip_pages=skip)

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """A part failing fails the others: the engine's room as a whole failed."""
        if not self.book.fail(room, code, reason):
            return False
        for part in self.group(room):
            if part is not room:
                self.book.fail(part, code, f"{reason} (the part for another decode rank)")
        return True

    def release(self, room: Room) -> None:
        """The engine's room goes: every finished part of it (a live one goes when it fails)."""
        for part in self.group(room):
            if part is room or part.finished:
                self.book.release(part)
