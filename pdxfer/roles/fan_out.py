"""A prefill rank whose KV goes to several decode ranks (fan-out: decode TP above the
prefill's) keeps a room part per decode rank: the first, made by the engine's
announce or send or by the first request, and one per later decode rank's request,
keyed ``topology.fan_key``. The engine hears one status for them all, the parts fail
together, and the first part's engine speaks for every part."""

from __future__ import annotations

from ..core.protocol import ErrorCode, RoomState, RoomStatus
from ..core.rooms import Event, Room
from ..core.topology import fan_key, prefill_rank_of, room_key, room_of
from .prefill_state import PrefillWork


class FanOutParts:
    """PrefillService's room parts (a mixin over RoomService: status, fail and drop see
    every part)."""

    def _fan(self, first: Room, room: Room, w: PrefillWork) -> None:
        """A fan-out room takes its first room's memory version, aux slot and every chunk handed
        over so far; its engine stays the first room's (_head)."""
        head = self.work[first.id]
        head.fans.append(room.id)
        room.lane, w.first_room = first.lane, first.id
        w.memory_version, w.aux_slot = head.memory_version, head.aux_slot
        for chunk in head.handed:
            self._take(room, w, chunk)
        if head.handed:
            self.advance(room, Event.INPUT_READY)

    def _fans(self, room: Room) -> list[Room]:
        w = self.work.get(room.id)
        return [fan for key in (w.fans if w is not None else ()) if (fan := self.rooms.find(key)) is not None]

    def _group(self, room: Room) -> list[Room]:
        """A prefill rank's parts of a room: its first, and its fan-out rooms."""
        w = self.work.get(room.id)
        first = self.rooms.find(w.first_room) if w is not None and w.first_room else room
        return [first, *self._fans(first)] if first is not None else [room]

    def _leg_key(self, room_id: int, leg: int) -> int:
        """The room-table key of the prefill part a decode daemon's message about a leg is for."""
        key = room_key(room_id, prefill_rank_of(leg))
        w = self.work.get(key)
        return fan_key(room_id, leg) if w is not None and w.request is not None and w.request.leg != leg else key

    def _head(self, room: Room) -> PrefillWork | None:
        """The work of the room's first part: its engine speaks for every part, including
        parts whose request came before the engine announced or sent."""
        w = self.work.get(room.id)
        return self.work.get(w.first_room) if w is not None and w.first_room else w

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        """What the engine hears of its room: of every part, when it writes to several
        decode ranks (fan_out). Failed if one part failed (fenced once all are), Success
        once every decode rank's part is there and succeeded, else the least advanced
        part's state."""
        group = self._group(room)
        first = group[0]
        w = self.work.get(first.id)
        missing = (w.request.fan_out if w is not None and w.request is not None else 1) - len(group)  # parts whose request is still to come
        if len(group) == 1 and missing <= 0:
            return super().status(first, req)
        failed = [part for part in group if part.state is RoomState.FAILED]
        pages, skip = self.room_pages(first)
        if failed:
            fenced = all(part.finished and part.fenced for part in group)  # parts still to come were never asked for: nothing to fence
            return RoomStatus(req=req, room=room_of(first.id), state=RoomState.FAILED, code=failed[0].code, reason=failed[0].reason,
                              fenced=fenced, pages=pages, skip_pages=skip)
        order = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS)
        state = min((part.state for part in group), key=order.index)
        if state is RoomState.SUCCESS and missing > 0:
            state = RoomState.TRANSFERRING  # its other decode ranks have not asked yet
        return RoomStatus(req=req, room=room_of(first.id), state=state, fenced=state is RoomState.SUCCESS, pages=pages, skip_pages=skip)

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """A part failing fails the others: the engine's room as a whole failed."""
        if not super().fail(room, code, reason):
            return False
        for part in self._group(room):
            if part is not room:
                super().fail(part, code, f"{reason} (the part for another decode rank)")
        return True

    def drop(self, room: Room) -> None:
        """The engine's room goes: every finished part of it (a live one goes when it fails)."""
        for part in self._group(room):
            if part is room or part.finished:
                super().drop(part)
