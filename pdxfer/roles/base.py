"""What both daemon roles share: the engine conversation, registrations, the room
table, failure and fencing, and timeouts.

A service does no I/O itself. It replies by returning messages, and does everything
else (to its engine, its peers, the pump, host memory, timers) through the port it is
built with (ports.py); tests drive it directly with one that records.
"""

from __future__ import annotations

import collections
import logging
from typing import Awaitable

import msgspec

from ..core import errors, paths
from ..core.config import Config
from ..core.errors import PdxferError
from ..core.plan import check_memory_version, check_registration
from ..core.protocol import (
    UNDECODABLE,
    PROTOCOL_VERSION,
    Abort,
    AllocSlot,
    Announce,
    Busy,
    Codec,
    EngineHello,
    Error,
    ErrorCode,
    Expect,
    FreeSlot,
    GetStats,
    ONE_RANK,
    Message,
    Ok,
    Poll,
    Rank,
    RegisterAux,
    RegisterKV,
    Release,
    Role,
    RoomState,
    RoomStatus,
    Send,
    ShmHandle,
    SlotGrant,
    Stats,
    Welcome,
    tag_of,
)
from ..core.rooms import Event, Room, RoomTable, Timeouts
from ..core.slots import SlotState
from ..core.topology import key_label, room_key, room_of
from ..transport import Peer
from .pools import Lane, MappedAux, MappedKV
from .ports import Mapping, Port

log = logging.getLogger("pdxfer.service")


def _rank_text(rank: Rank) -> str:
    return " ".join(f"{dim}={getattr(rank, dim)}" for dim in Rank.__struct_fields__)


def loose_req(raw: bytes) -> int:
    """The request id of a message that failed validation, if it has a usable one,
    so the engine can match the error to its request."""
    try:
        req = msgspec.msgpack.decode(raw).get("req", 0)
    except (msgspec.DecodeError, AttributeError, ValueError, TypeError):  # garbage of any shape
        return 0
    return req if type(req) is int and 0 <= req < 2**63 else 0


class RoomService:
    role: Role

    def __init__(self, config: Config, incarnation: str, port: Port, *, sessions: Peer, bootstrap_address: str) -> None:
        self.config = config
        self.incarnation = incarnation
        self.port = port
        self.clock = port.clock
        self.codec = Codec()
        self.rooms = RoomTable(
            config.max_rooms,
            Timeouts(config.bootstrap_timeout, config.waiting_timeout, config.transfer_timeout, config.retention),
        )
        self.rooms.observer = port.observe
        self.lanes: list[Lane] = []  # every engine rank that said hello or registered, by index
        self.engine_lanes: dict[bytes, Lane] = {}  # engine connection -> its lane
        # Replaced mappings, (release time, mapping): writes of the rooms failed with
        # them may still touch them until their lease and fence ran out.
        self.retired: list[tuple[float, Mapping]] = []
        self.finished: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # released rooms: (state, code, reason)
        # Our transfer engines' sessions: a plain value the role reads, which a transport
        # reset replaces (through new_sessions, never by assignment from outside).
        self.sessions: Peer = sessions
        self.bootstrap_address = bootstrap_address
        self.failures: collections.Counter[str] = collections.Counter()
        self.engines: set[bytes] = set()  # engine connections that said hello
        self.engine_messages = 0  # engine messages received (clients answer poll() from pushed statuses: B6)
        self.peer_messages: collections.Counter[str] = collections.Counter()  # peer messages received, by kind (A5 counts requests)
        self.outcomes: collections.Counter[str] = collections.Counter()  # rooms finished: success / failed
        self.heartbeats = config.heartbeats
        self.heartbeat_misses = 0
        self.bytes_received = 0  # decode: KV and aux bytes of rooms that succeeded
        self.kv_inline_rooms = self.kv_inline_bytes = 0  # prefill: rooms whose KV rode their aux record, and its bytes
        self.staging = None  # prefill and decode: their staging buffer (pools.Staging), if they have one
        self._last_tick = 0.0
        self.draining = False  # shutting down, no new rooms: a flag the daemon raises through start_draining

    @property
    def staging_full(self) -> int:
        """Legs (decode) or chunks (prefill) that would have gained from a staging extent
        but found none free, so wrote between the pages."""
        return self.staging.full if self.staging is not None else 0

    @property
    def staging_taken_bytes(self) -> int:
        """Bytes of the staging buffer held by legs or chunks now."""
        return self.staging.arena.taken_bytes if self.staging is not None else 0

    # --- engine conversation

    def on_engine(self, identity: bytes, raw: bytes) -> Message | Awaitable[Message] | None:
        """Handle one engine message: the reply; for a registration (which maps and
        registers memory off the event loop) an awaitable of it; None when the
        engine asked for no reply."""
        self.engine_messages += 1
        if len(raw) > self.config.max_message_bytes:
            return Error(req=0, code=ErrorCode.BAD_MESSAGE, message=f"message of {len(raw)} bytes exceeds the {self.config.max_message_bytes}-byte limit")
        try:
            msg = self.codec.engine_requests.decode(raw)
        except UNDECODABLE as exc:
            return Error(req=loose_req(raw), code=ErrorCode.BAD_MESSAGE, message=f"cannot decode engine message: {exc}")
        if isinstance(msg, (RegisterKV, RegisterAux)):
            return self._registration(self.lane_for(identity), msg)
        try:
            reply = self._dispatch(identity, msg)
        except Exception as exc:
            reply = self._error_reply(msg, exc)
        if msg.req == 0:  # the engine did not wait for an answer: no ok
            if isinstance(reply, Ok):
                return None
            if isinstance(msg, (Release, FreeSlot)):  # fire and forget: nobody would read the error
                log.warning("%s without a reply failed: %s", type(msg).__name__, reply)
                return None
        return reply

    async def _registration(self, lane: Lane, msg: RegisterKV | RegisterAux) -> Message:
        try:
            return await (self._register_kv(lane, msg) if isinstance(msg, RegisterKV) else self._register_aux(lane, msg))
        except Exception as exc:
            return self._error_reply(msg, exc)

    def _error_reply(self, msg: Message, exc: Exception) -> Message:
        """What the engine hears when handling ``msg`` raised ``exc``."""
        if isinstance(exc, errors.Busy):
            return Busy(req=msg.req, reason=exc.message, retry_after_ms=exc.retry_after_ms, room=exc.room)
        if isinstance(exc, PdxferError):
            return Error(req=msg.req, code=exc.code, message=exc.message, room=exc.room)
        # H1: a bug answers this request and nothing else.
        room = getattr(msg, "room", 0)
        self.count_failure("internal")
        log.error("internal error handling %s for room %s", type(msg).__name__, room, exc_info=exc, extra={"room": room or None})
        return Error(req=msg.req, code=ErrorCode.INTERNAL, message=f"internal error: {exc!r}", room=room)

    def _dispatch(self, identity: bytes, msg: Message) -> Message:
        # The messages of every room first: each isinstance test costs every message after it.
        if isinstance(msg, (Send, Expect)):
            self.admit(msg.room)
            return self.on_send(identity, msg) if isinstance(msg, Send) else self.on_expect(identity, msg)
        if isinstance(msg, Announce):
            self.admit(msg.room)
            return self.on_announce(identity, msg)
        if isinstance(msg, Release):
            room = self.rooms.get(self.engine_key(identity, msg.room))
            state = self.status(room).state
            if state not in (RoomState.SUCCESS, RoomState.FAILED):
                raise errors.BadMessage(f"room {msg.room} is {state.value}; abort it before releasing it", room=msg.room)
            self.drop(room)
            return Ok(req=msg.req)
        if isinstance(msg, AllocSlot):
            aux, now = self.lane_for(identity).registered_aux(), self.clock()
            first = aux.slots.allocate(now)
            more = tuple((s.index, s.generation) for s in (aux.slots.allocate(now) for _ in range(min(msg.count - 1, aux.slots.free_count))))
            return SlotGrant(req=msg.req, slot=first.index, generation=first.generation, payload_bytes=aux.payload_bytes, more=more)
        if isinstance(msg, Poll):
            key = self.engine_key(identity, msg.room)
            room = self.rooms.find(key)
            if room is None and key in self.finished:  # released, or failed with no engine to tell
                state, code, reason = self.finished[key]
                return RoomStatus(req=msg.req, room=msg.room, state=state, code=code, reason=reason, fenced=True)
            return self.status(self.rooms.get(key), msg.req)
        if isinstance(msg, FreeSlot):
            self.lane_for(identity).registered_aux().slots.give_back(msg.slot, msg.generation, self.clock())
            return Ok(req=msg.req)
        if isinstance(msg, Abort):
            lane = self.lane_for(identity)
            room = self.rooms.find(room_key(msg.room, lane.code))
            if room is None:  # a tombstone, so the peer learns of the abort when it asks
                room = self.rooms.create(room_key(msg.room, lane.code), self.role, self.clock())
                room.lane = lane.index
            self.fail(room, ErrorCode.ABORTED, f"aborted by the {self.role.value} engine: {msg.reason}")
            return Ok(req=msg.req)
        if isinstance(msg, GetStats):
            return self.stats(msg.req)
        if isinstance(msg, EngineHello):
            if msg.version != PROTOCOL_VERSION:
                raise errors.VersionMismatch(f"engine speaks protocol {msg.version}, this daemon speaks {PROTOCOL_VERSION}", side=errors.Side.ENGINE)
            self.engine_lanes[identity] = self._check_rank(msg)
            self.engines.add(identity)
            if msg.pid:
                self.port.watch_engine(identity, msg.pid, msg.pid_namespace)
            return Welcome(req=msg.req, version=PROTOCOL_VERSION, role=self.role, incarnation=self.incarnation, bootstrap=self.bootstrap_address)
        raise errors.BadMessage(f"unexpected message {type(msg).__name__}")

    def start_draining(self) -> None:
        """The daemon shuts down: admit no new rooms from now on."""
        self.draining = True

    def new_sessions(self, sessions: Peer) -> None:
        """The transport was re-created: peers reach this daemon's engines at ``sessions`` now."""
        self.sessions = sessions

    def _check_rank(self, hello: EngineHello) -> Lane:
        """A1: an engine rank of this daemon's role, without CP; its lane (made on first sight)."""
        who = f"engine {hello.engine_id!r}" if hello.engine_id else "the engine"
        if hello.role is not None and hello.role is not self.role:
            raise errors.Unsupported(f"{who} is a {hello.role.value} engine but this daemon is a {self.role.value} daemon: connect it to a {hello.role.value} daemon")
        if hello.sizes.cp > 1:
            raise errors.Unsupported(f"{who} runs context parallelism (CP size {hello.sizes.cp}), which pdxfer does not support yet: run it with CP 1")
        sizes = Rank(**{dim: getattr(hello.sizes, dim) or 1 for dim in Rank.__struct_fields__})  # a size left 0 is 1
        for dim in Rank.__struct_fields__:
            rank, size = getattr(hello.rank, dim), getattr(sizes, dim)
            if not rank < size:
                raise errors.BadMessage(f"{who}: rank {dim}={rank} is not below its size {dim}={size}")
        lane = self._lane(hello.engine_id, hello.rank)
        if lane.sizes != sizes and lane.ready:
            log.warning("%s now says sizes %s (was %s): it was redeployed", lane.name, _rank_text(sizes), _rank_text(lane.sizes))
        lane.sizes = sizes
        return lane

    def _lane(self, engine_id: str, rank: Rank) -> Lane:
        for lane in self.lanes:
            if lane.engine_id == engine_id and (lane.rank.dp, lane.rank.pp, lane.rank.tp) == (rank.dp, rank.pp, rank.tp):
                return lane
        lane = Lane(len(self.lanes), engine_id, Rank(dp=rank.dp, pp=rank.pp, tp=rank.tp), ONE_RANK)
        self.lanes.append(lane)
        return lane

    def lane_for(self, identity: bytes) -> Lane:
        """The lane of an engine connection: the one its hello named, else rank 0 of an
        unnamed engine (a client that never said hello)."""
        lane = self.engine_lanes.get(identity)
        return lane if lane is not None else self._lane("", Rank())

    def engine_key(self, identity: bytes, room: int) -> int:
        """The room-table key of ``room`` as this engine connection's rank knows it."""
        return room_key(room, self.lane_for(identity).code)

    def lane_of(self, room: Room) -> Lane:
        return self.lanes[room.lane]

    def engine_gone(self, identity: bytes, reason: str) -> int:
        """The process behind an engine connection exited: its live rooms fail now, with
        their peers told, and none waits for it to release them (A10: only that rank's
        rooms). Its lane, and the memory it registered, stay for a successor. Returns
        how many rooms failed."""
        self.engines.discard(identity)
        lane = self.engine_lanes.pop(identity, None)
        mine = [room for room in self.rooms if self.engine_of(room) == identity]
        failed = 0
        for room in mine:
            self.disown(room)
            failed += self.fail(room, ErrorCode.ENGINE_GONE, f"{lane.name if lane else 'the engine'}: {reason}")
            if room.finished and room.fenced and self.rooms.find(room.id) is room:
                self.drop(room)
        # An engine that exits between requests is routine; one that takes rooms with it is not.
        (log.warning if failed else log.info)("%s: %s; %d of its rooms failed", lane.name if lane else "an engine", reason, failed)
        return failed

    def disown(self, room: Room) -> None:
        """Hook: the room's engine is gone; nobody is told of it or releases it any more."""
        raise NotImplementedError

    def on_announce(self, identity: bytes, msg: Announce) -> Message:
        raise errors.BadMessage(f"announce() goes to a prefill daemon; this one is {self.role.value}", room=msg.room)

    def admit(self, room: int) -> None:
        """New rooms are refused while the daemon drains for shutdown."""
        if self.draining:
            raise errors.Busy("this daemon is draining for shutdown; send the request to another worker", retry_after_ms=1000, room=room)

    def on_send(self, identity: bytes, msg: Send) -> Message:
        raise errors.BadMessage(f"send() goes to a prefill daemon; this one is {self.role.value}", room=msg.room)

    def on_expect(self, identity: bytes, msg: Expect) -> Message:
        raise errors.BadMessage(f"expect() goes to a decode daemon; this one is {self.role.value}", room=msg.room)

    # --- registrations

    async def _register_kv(self, lane: Lane, msg: RegisterKV) -> Message:
        kinds = sorted({tag_of(handle) for handle in msg.buffers})
        if len(kinds) > 1:
            raise errors.Unsupported(f"the buffers of one KV registration must be of one kind, not {', '.join(kinds)}")
        paths.check_pool(self.config.protocol, self.config.device, kinds[0])
        check_registration([handle.size for handle in msg.buffers], msg.spec, msg.regions)
        old = lane.kv
        # A mapping is kept for a handle registered again only while it names the same memory.
        kept = {h: m for h, m in old.mappings.items() if self.port.same_memory(h, m)} if old is not None else {}
        same = old is not None and old.handles == msg.buffers and all(h in kept for h in msg.buffers)
        if same and msg.memory_version <= old.version:
            raise errors.StaleMemoryVersion(
                f"re-registering the same KV buffers needs a memory version above {old.version}, got {msg.memory_version} "
                f"(a new Client of a restarted rank registering its predecessor's memory: pass memory_version={old.version + 1} or above)"
            )
        mappings = await self._map_all(msg.buffers, kept)
        for handle, mapping in (old.mappings.items() if old is not None else ()):
            if mappings.get(handle) is not mapping:
                self._retire(mapping)  # never freed: a replaced buffer is unmapped once writes aimed at it are over
        lane.kv = MappedKV(mappings, msg.buffers, msg.spec, msg.regions, msg.memory_version, kinds[0])
        if same:
            self._fail_stale_rooms(lane, f"the engine re-registered its KV cache (memory version {old.version} -> {msg.memory_version})", old.version)
        elif old is not None:
            self._fail_stale_rooms(lane, "the engine registered new KV memory (a restarted engine?)")
        log.info("%s registered its KV cache: %d buffers, %d regions of %d pages (%d tokens each), layers %d-%d of %d, memory version %d",
                 lane.name, len(mappings), len(msg.regions), lane.kv.num_pages, msg.spec.page_size, *msg.spec.layers, msg.spec.num_layers_total, msg.memory_version)
        self.on_kv_registered()
        return Ok(req=msg.req)

    async def _map_all(self, handles, kept: dict) -> dict:
        """Each distinct handle mapped once: kept ones as they are, the others mapped and
        registered now. If one fails, those mapped here are let go again."""
        mappings: dict = {}
        try:
            for handle in dict.fromkeys(handles):
                mappings[handle] = kept[handle] if handle in kept else await self.port.map_memory(handle)
        except BaseException:
            for handle, mapping in mappings.items():
                if handle not in kept:
                    self.port.release_mapping(mapping)
            raise
        return mappings

    async def _register_aux(self, lane: Lane, msg: RegisterAux) -> Message:
        if not isinstance(msg.memory, ShmHandle):
            raise errors.Unsupported("aux buffers live in host shared memory (shm handles only)")
        if msg.memory.size < msg.num_slots * msg.slot_bytes:
            raise errors.InsufficientCapacity(
                f"{msg.num_slots} slots of {msg.slot_bytes} bytes need {msg.num_slots * msg.slot_bytes} bytes, the buffer has {msg.memory.size}"
            )
        mapped = await self.port.map_memory(msg.memory)
        if lane.aux is not None:
            # The old slots' rooms cannot finish; late writes land in the retired mapping.
            self._fail_stale_rooms(lane, "the engine registered a new aux buffer (a restarted engine?)")
            self._retire(lane.aux.memory)
        lane.aux = MappedAux(mapped, msg.num_slots, msg.slot_bytes)
        log.info("%s registered its aux buffer: %d slots of %d bytes", lane.name, msg.num_slots, msg.slot_bytes)
        self.on_kv_registered()
        return Ok(req=msg.req)

    def _retire(self, mapping: Mapping) -> None:
        grace = self.config.transfer_timeout + self.config.fence_timeout
        self.retired.append((self.clock() + grace, mapping))

    def on_kv_registered(self) -> None:
        """Hook: the decode role re-announces its pools to its peers."""

    def _fail_stale_rooms(self, lane: Lane, reason: str, version: int | None = None) -> None:
        """C3: the lane's live rooms planned against a replaced registration (all of them,
        or those at or below ``version``) fail before more bytes move."""
        for room in list(self.rooms):
            if room.lane == lane.index and not room.finished and (version is None or self.room_memory_version(room) <= version):
                self.fail(room, ErrorCode.STALE_MEMORY_VERSION, f"{reason} while this room was {room.state.value}")

    def room_memory_version(self, room: Room) -> int:
        raise NotImplementedError

    def mappings(self) -> list[Mapping]:
        """Every engine buffer mapped now (KV and aux), each once."""
        out = []
        for lane in self.lanes:
            out += list(lane.kv.mappings.values()) if lane.kv is not None else []
            out += [lane.aux.memory] if lane.aux is not None else []
        return out

    def _kv(self, room: Room) -> MappedKV:
        return self.lane_of(room).registered_kv()

    def _aux(self, room: Room) -> MappedAux:
        return self.lane_of(room).registered_aux()

    def _slots_of(self, room: Room):
        """The room's lane's slot allocator, or None before it registered an aux buffer."""
        aux = self.lanes[room.lane].aux if room.lane < len(self.lanes) else None
        return aux.slots if aux is not None else None

    @staticmethod
    def check_local_version(lane: Lane, used: int, room: int) -> None:
        check_memory_version(used, lane.registered_kv().version, "local", room)

    # --- rooms

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        pages, skip = self.room_pages(room)
        return RoomStatus(
            req=req, room=room_of(room.id), state=room.state, code=room.code, reason=room.reason, fenced=room.fenced,
            pages=pages, skip_pages=skip,
        )

    def room_pages(self, room: Room) -> tuple[int, int]:
        """(positions the decode wants, positions it skips) as the room's status tells them; (0, 0) where unknown."""
        return 0, 0

    def advance(self, room: Room, event: Event) -> None:
        """Move a live room by ``event``; its engine hears of a change of state (B6).
        Success and failure are pushed by succeed() and fail()."""
        if self.rooms.apply(room, event, self.clock()):
            self.push(room, self.engine_of(room))

    def push(self, room: Room, engine: bytes) -> None:
        if engine:
            status = self.status(room)
            self.port.send_engine(engine, status)
            settled = status.state is RoomState.SUCCESS or (status.state is RoomState.FAILED and status.fenced)
            if room.release_when_settled and settled and self.rooms.find(room.id) is room:
                self.drop(room)

    def engine_of(self, room: Room) -> bytes:
        raise NotImplementedError

    def bind_slot(self, room: Room, slot: int, generation: int) -> None:
        self._aux(room).slots.bind(slot, generation, room.id, self.clock())
        room.slot, room.generation = slot, generation

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """Fail a live room: quarantine its slot, let the role tell its peer and stop
        its writes, tell the engine. Returns False if the room had already finished."""
        now = self.clock()
        if not self.rooms.apply(room, Event.FAIL, now, code=code, reason=reason):
            return False
        self.count_failure(code.value)
        self.outcomes["failed"] += 1
        log.warning("room %s failed [%s] peer=%s: %s", key_label(room.id), code.value, room.peer or "-", reason,
                    extra={"room": room_of(room.id), "peer": room.peer or None})
        slots = self._slots_of(room)
        if room.slot >= 0 and slots is not None:
            slot = slots.slots[room.slot]
            if slot.generation == room.generation and slot.state in (SlotState.ARMED, SlotState.WRITTEN):
                slots.quarantine(room.slot, room.generation, now, self.fence_deadline(room, now))
        room.fenced = self.stop_writes(room)
        if room.fenced:
            self._fence_slot(room)
        engine = self.engine_of(room)
        if engine:
            self.push(room, engine)
        elif room.fenced:
            self.drop(room)  # no engine ever joined this room: nobody would release it
        return True

    def fence_deadline(self, room: Room, now: float) -> float:
        """When a failed room's slot is released if its writer never confirms."""
        return now + self.config.fence_timeout

    def _stalled(self, now: float) -> bool:
        """Whether this daemon itself stood still (SIGSTOP, swap) since the last tick
        for long enough that peers' silence meanwhile is ours (liveness.py)."""
        last, self._last_tick = self._last_tick, now
        return self.heartbeats.stood_still(last, now)

    def count_failure(self, reason: str, n: int = 1) -> None:
        self.failures[reason] += n

    def unsent(self, payloads: list[bytes]) -> None:
        """Peer messages that could not be queued (the connection was closing, or too
        much already waited for it): the live rooms they were about fail now, as
        peer_unreachable, rather than at their timeout."""
        for payload in payloads:
            msg = self.codec.peer_messages.decode(payload)
            for room in self.rooms_of_message(msg):
                if not room.finished:
                    self.never_sent(room, msg)
                    self.fail(room, ErrorCode.PEER_UNREACHABLE, "a message for this room could not be sent to the peer daemon (its connection was closing, or too much already waited for it)")

    def rooms_of_message(self, msg: Message) -> list[Room]:
        """Hook: the rooms of ours a peer message is about."""
        raise NotImplementedError

    def slot_counts(self) -> collections.Counter:
        """Slots by state, over every lane."""
        counts: collections.Counter = collections.Counter()
        for lane in self.lanes:
            if lane.aux is not None:
                counts.update(lane.aux.slots.counts())
        return counts

    def stats(self, req: int = 0) -> Stats:
        return Stats(
            req=req,
            rooms={state.value: n for state, n in self.rooms.counts().items()},
            slots={state.value: n for state, n in self.slot_counts().items()},
            failures=dict(self.failures),
            peers=self.peer_count(),
        )

    def peer_count(self) -> int:
        raise NotImplementedError

    def peer_infos(self, now: float, wall: float) -> list:
        """protocol.PeerInfo for every peer."""
        raise NotImplementedError

    def peer_states(self) -> dict[str, int]:
        states = collections.Counter(p.state for p in self.peer_infos(self.clock(), 0.0))
        return {state: states.get(state, 0) for state in ("alive", "draining", "connecting")}

    def peer_gone(self, record, reason: str) -> None:
        """The registry says a daemon of the other role is gone: its lease lapsed,
        or it registered again under a new incarnation."""
        raise NotImplementedError

    def drain(self, peer: str) -> None:
        """Operator action: no new rooms with peers whose address or name contains ``peer``."""
        raise NotImplementedError

    def fail_live(self, code: ErrorCode, reason: str) -> int:
        """Fail every live room (shutdown); returns how many."""
        live = [room for room in self.rooms if not room.finished]
        for room in live:
            self.fail(room, code, reason)
        return len(live)

    def stop_writes(self, room: Room) -> bool:
        """Hook: stop whatever may still write for ``room`` and tell the peer. Return
        True if nothing can land any more (the room is fenced at once)."""
        raise NotImplementedError

    def fenced(self, room: Room) -> None:
        """No write for this failed room can land any more."""
        if room.fenced or not room.finished:
            return
        room.fenced = True
        self._fence_slot(room)
        engine = self.engine_of(room)
        if engine:
            self.push(room, engine)
        elif self.rooms.find(room.id) is room:
            self.drop(room)

    def _fence_slot(self, room: Room) -> None:
        slots = self._slots_of(room)
        if room.slot >= 0 and slots is not None:
            slots.fence(room.slot, room.generation, self.clock())

    def succeed(self, room: Room, event: Event) -> None:
        """``event`` ends the room well: the decode side's ack (prefill), or the verified aux record (decode)."""
        if self.rooms.apply(room, event, self.clock()):
            self.outcomes["success"] += 1
            self.bytes_received += room.bytes_moved if self.role is Role.DECODE else 0
            room.fenced = True
            self.push(room, self.engine_of(room))

    def remember(self, room_id: int, state: RoomState, code: ErrorCode | None, reason: str) -> None:
        """Keep a finished room's outcome (bounded, oldest out first) for a peer or engine asking late."""
        self.finished[room_id] = (state, code, reason)
        if len(self.finished) > self.config.max_rooms:
            self.finished.popitem(last=False)

    def drop(self, room: Room) -> None:
        """Forget a finished room; its slot returns to the pool unless quarantined. Its
        outcome is remembered for a while (bounded), so a peer asking about it late
        gets an answer instead of a new, orphan room."""
        self.rooms.remove(room.id)
        self.forget(room)
        self.remember(room.id, room.state, room.code, room.reason)
        slots = self._slots_of(room)
        if room.slot >= 0 and slots is not None:
            slot = slots.slots[room.slot]
            if slot.generation == room.generation and slot.state in (SlotState.GRANTED, SlotState.ARMED, SlotState.WRITTEN):
                slots.release(room.slot, room.generation, self.clock())

    def never_sent(self, room: Room, msg: Message) -> None:
        """Hook: ``msg``, about the live ``room``, was dropped before it left this process."""

    def forget(self, room: Room) -> None:
        """Hook: drop the role's per-room state."""

    def tick(self) -> None:
        """Apply timeouts: fail rooms stuck past their state's deadline, drop
        finished rooms never released, free slots whose fence deadline passed."""
        now = self.clock()
        for room in self.rooms.expired(now):
            if room.finished:
                log.info("room %s dropped: finished %.0fs ago and never released", key_label(room.id), now - room.entered, extra={"room": room_of(room.id)})
                self.drop(room)
            else:
                limit = self.rooms.timeouts.for_state(room.state)
                self.fail(room, ErrorCode.TIMEOUT, f"no progress for {limit:g}s in {room.state.value} (peer {room.peer or 'unknown'})")
        if self.retired and self.retired[0][0] <= now:
            due = [m for t, m in self.retired if t <= now]
            self.retired = [(t, m) for t, m in self.retired if t > now]
            for mapping in due:
                self.port.release_mapping(mapping)
        for lane in self.lanes:
            if lane.aux is None:
                continue
            reclaimed = lane.aux.slots.reclaim_granted(now - self.config.retention)
            if reclaimed:
                log.warning("reclaimed %d aux slots of %s granted over %gs ago and never used: %s", len(reclaimed), lane.name, self.config.retention, reclaimed[:8])
            for slot in lane.aux.slots.expire_fences(now):
                room = self.rooms.find(slot.room)  # the room it was quarantined for, not its new state
                log.warning("aux slot %d generation %d released by fence timeout (room %s)", slot.index, slot.generation, key_label(slot.room),
                            extra={"room": room_of(slot.room)})
                if room is not None and room.generation == slot.generation:
                    self.fenced(room)
