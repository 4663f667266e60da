"""What both roles answer their engines the same way: hello, registrations, slots, polls,
releases, aborts and stats; and an engine process that exited (A10). The messages only
one role takes (send and announce on a prefill daemon, expect on a decode daemon) go to
the role's ``EngineRequests``. A message comes decoded; the reply is returned, or for a
registration (which maps memory off the event loop) an awaitable of it, or None when
the engine asked for no reply.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Mapping, Protocol

from ..core import errors
from ..core.errors import PdxferError
from ..core.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AllocSlot,
    Announce,
    Busy,
    EngineHello,
    Error,
    ErrorCode,
    Expect,
    FreeSlot,
    GetStats,
    Message,
    Ok,
    Poll,
    RegisterAux,
    RegisterKV,
    Release,
    Role,
    RoomState,
    RoomStatus,
    Send,
    SlotGrant,
    Stats,
    Welcome,
)
from ..core.rooms import Room
from ..core.topology import room_key
from .book import RoomBook
from .lanes import Lane, Lanes, Replaced
from .ports import Port

log = logging.getLogger("pdxfer.service")


class EngineRequests(Protocol):
    """What a role does for its engines that the other does not."""

    room_messages: Mapping[type, Callable[[bytes, Message], Message]]
    """The role's handlers of the messages that open or feed a room, by type: send and
    announce on a prefill daemon, expect on a decode daemon."""

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """Fail a room (and whatever the role fails with it)."""

    def status(self, room: Room, req: int = 0) -> RoomStatus: ...

    def memory_version(self, room: Room) -> int:
        """The memory version the room was planned against (C3)."""

    def registered(self) -> None:
        """An engine rank registered (again)."""

    def disown(self, room: Room) -> None:
        """The room's engine is gone: nobody is told of it or releases it any more."""

    def engine_of(self, room: Room) -> bytes: ...

    def release(self, room: Room) -> None:
        """The engine is done with a finished room (book.release, for every part of it)."""

    def peer_count(self) -> int: ...


class EngineDesk:
    def __init__(self, role: Role, incarnation: str, bootstrap: str, fence_bound: float, port: Port, lanes: Lanes,
                 book: RoomBook, requests: EngineRequests) -> None:
        self.role = role
        self.incarnation = incarnation
        self.bootstrap = bootstrap  # where peer daemons reach this one ("" on decode)
        self.fence_bound = fence_bound  # Welcome.fence_bound (0 on prefill)
        self.port = port
        self.lanes = lanes
        self.book = book
        self.requests = requests
        self.room_handlers = requests.room_messages
        self.messages = 0  # engine messages received (clients answer poll() from pushed statuses: B6)
        self.draining = False  # shutting down, no new rooms

    def on_engine(self, identity: bytes, msg: Message) -> Message | Awaitable[Message] | None:
        self.messages += 1
        room_handler = self.room_handlers.get(type(msg))  # the messages of every room first: one lookup
        try:
            if room_handler is not None:
                if self.draining:  # new rooms are refused while the daemon drains for shutdown
                    raise errors.Busy("this daemon is draining for shutdown; send the request to another worker", retry_after_ms=1000, room=msg.room)
                reply = room_handler(identity, msg)
            elif isinstance(msg, (RegisterKV, RegisterAux)):
                return self._registration(self.lanes.of(identity), msg)
            else:
                reply = self._dispatch(identity, msg)
        except Exception as exc:
            reply = self.error_reply(msg, exc)
        if msg.req == 0:  # the engine did not wait for an answer: no ok
            if isinstance(reply, Ok):
                return None
            if isinstance(msg, (Release, FreeSlot)):  # fire and forget: nobody would read the error
                log.warning("%s without a reply failed: %s", type(msg).__name__, reply)
                return None
        return reply

    async def _registration(self, lane: Lane, msg: RegisterKV | RegisterAux) -> Message:
        try:
            if isinstance(msg, RegisterKV):
                await self.lanes.register_kv(lane, msg, self._replaced)
            else:
                await self.lanes.register_aux(lane, msg, self._replaced)
        except Exception as exc:
            return self.error_reply(msg, exc)
        self.requests.registered()
        return Ok(req=msg.req)

    def _replaced(self, lane: Lane, replaced: Replaced) -> None:
        """C3: the lane's live rooms planned against a replaced registration fail before more bytes move."""
        for room in list(self.book.rooms):
            if room.lane == lane.index and not room.finished and (replaced.version is None or self.requests.memory_version(room) <= replaced.version):
                self.requests.fail(room, ErrorCode.STALE_MEMORY_VERSION, f"{replaced.reason} while this room was {room.state.value}")

    def error_reply(self, msg: Message, exc: Exception) -> Message:
        """What the engine hears when handling ``msg`` raised ``exc``."""
        if isinstance(exc, errors.Busy):
            return Busy(req=msg.req, reason=exc.message, retry_after_ms=exc.retry_after_ms, room=exc.room)
        if isinstance(exc, PdxferError):
            return Error(req=msg.req, code=exc.code, message=exc.message, room=exc.room)
        # H1: a bug answers this request and nothing else.
        room = getattr(msg, "room", 0)
        self.book.count_failure("internal")
        log.error("internal error handling %s for room %s", type(msg).__name__, room, exc_info=exc, extra={"room": room or None})
        return Error(req=msg.req, code=ErrorCode.INTERNAL, message=f"internal error: {exc!r}", room=room)

    def _dispatch(self, identity: bytes, msg: Message) -> Message:
        if isinstance(msg, (Send, Expect, Announce)):  # the other role's
            other = "decode" if self.role is Role.PREFILL else "prefill"
            raise errors.BadMessage(f"{type(msg).__name__.lower()}() goes to a {other} daemon; this one is {self.role.value}", room=msg.room)
        if isinstance(msg, Release):
            room = self.book.rooms.get(room_key(msg.room, self.lanes.of(identity).code))
            state = self.requests.status(room).state
            if state not in (RoomState.SUCCESS, RoomState.FAILED):
                raise errors.BadMessage(f"room {msg.room} is {state.value}; abort it before releasing it", room=msg.room)
            self.requests.release(room)
            return Ok(req=msg.req)
        if isinstance(msg, AllocSlot):
            aux, now = self.lanes.of(identity).registered_aux(), self.port.clock()
            first = aux.slots.allocate(now)
            more = tuple((s.index, s.generation) for s in (aux.slots.allocate(now) for _ in range(min(msg.count - 1, aux.slots.free_count))))
            return SlotGrant(req=msg.req, slot=first.index, generation=first.generation, payload_bytes=aux.payload_bytes, more=more)
        if isinstance(msg, Poll):
            key = room_key(msg.room, self.lanes.of(identity).code)
            room = self.book.rooms.find(key)
            if room is None and key in self.book.finished:  # released, or failed with no engine to tell
                state, code, reason = self.book.finished[key]
                return RoomStatus(req=msg.req, room=msg.room, state=state, code=code, reason=reason, fenced=True)
            return self.requests.status(self.book.rooms.get(key), msg.req)
        if isinstance(msg, FreeSlot):
            self.lanes.of(identity).registered_aux().slots.give_back(msg.slot, msg.generation, self.port.clock())
            return Ok(req=msg.req)
        if isinstance(msg, Abort):
            lane = self.lanes.of(identity)
            room = self.book.rooms.find(room_key(msg.room, lane.code))
            if room is None:  # a tombstone, so the peer learns of the abort when it asks
                room = self.book.create(room_key(msg.room, lane.code), self.role, lane.index)
            self.requests.fail(room, ErrorCode.ABORTED, f"aborted by the {self.role.value} engine: {msg.reason}")
            return Ok(req=msg.req)
        if isinstance(msg, GetStats):
            return self.stats(msg.req)
        if isinstance(msg, EngineHello):
            if msg.version != PROTOCOL_VERSION:
                raise errors.VersionMismatch(f"engine speaks protocol {msg.version}, this daemon speaks {PROTOCOL_VERSION}", side=errors.Side.ENGINE)
            self.lanes.hello(identity, msg)
            if msg.pid:
                self.port.watch_engine(identity, msg.pid, msg.pid_namespace)
            return Welcome(req=msg.req, version=PROTOCOL_VERSION, role=self.role, incarnation=self.incarnation, bootstrap=self.bootstrap,
                           fence_bound=self.fence_bound)
        raise errors.BadMessage(f"unexpected message {type(msg).__name__}")

    def stats(self, req: int = 0) -> Stats:
        return self.book.stats(req, self.requests.peer_count())

    def engine_gone(self, identity: bytes, reason: str) -> int:
        """The process behind an engine connection exited: its live rooms fail now, with
        their peers told, and none waits for it to release them (A10: only that rank's
        rooms). Its lane, and the memory it registered, stay for a successor. Returns
        how many rooms failed."""
        lane = self.lanes.gone(identity)
        name = lane.name if lane else "the engine"
        failed = 0
        for room in [room for room in self.book.rooms if self.requests.engine_of(room) == identity]:
            self.requests.disown(room)
            failed += self.requests.fail(room, ErrorCode.ENGINE_GONE, f"{name}: {reason}")
            if room.finished and room.fenced and self.book.rooms.find(room.id) is room:
                self.book.drop(room)
        # An engine that exits between requests is routine; one that takes rooms with it is not.
        (log.warning if failed else log.info)("%s: %s; %d of its rooms failed", lane.name if lane else "an engine", reason, failed)
        return failed

    def counters(self) -> dict[str, float]:
        """What both roles count of their rooms, engines and lanes."""
        return {
            "rooms_succeeded": float(self.book.outcomes["success"]),
            "rooms_failed": float(self.book.outcomes["failed"]),
            "engine_messages": float(self.messages),
            "lanes": float(len(self.lanes)),
        }

    def start_draining(self) -> None:
        """The daemon shuts down: admit no new rooms from now on."""
        self.draining = True

    def fail_live(self, code: ErrorCode, reason: str) -> int:
        """Fail every live room (shutdown); returns how many."""
        live = [room for room in self.book.rooms if not room.finished]
        for room in live:
            self.requests.fail(room, code, reason)
        return len(live)
