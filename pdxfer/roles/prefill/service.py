"""The prefill role: meet decode daemons' room requests with the engine's send(),
write the KV, then the aux record, and finish when the decode side verified it.

Per room: the engine's Send and the decode daemon's RoomRequest arrive in either
order; when both are in, every check that needs both halves runs (capacity C1,
destination bounds C2, destination memory version C3) before a single byte moves.
The aux record goes only after every KV block completed (A3), and the room succeeds
only when the decode daemon acknowledged its stamp (A1).

Decode daemons heartbeat every link; one that stays silent for heartbeat_misses
intervals, or says hello again under the same name with a new incarnation, is
declared dead and exactly its rooms fail. So is one to which a write fails while its
bootstrap connection is closed: a killed daemon's connection resets and the writes to
it fail within a moment, which ends its rooms then, not at the heartbeat bound. Either
alone proves nothing: a daemon that lives reconnects, and a write that fails to a
daemon still connected is written again (pump.py).

A decode daemon's later hello names the legs it holds live: this side fails its parts
the hello leaves out, then writes the others through the hello's sessions (each part
writes only through the sessions it was given), and says sessions_drained for the
replaced ones once nothing of ours is in flight there (proto/PROTOCOL.md, "Fencing").

No block of a room is submitted after its lease (the transfer timeout, counted from
when its writes start), nor after the newest leave to write its decode daemon gave
(protocol.Heartbeat): that is what lets the decode side release a dead or cut-off
writer's destination after a bound of its own.

The parts: writing a room part (writer.py), a rank's parts for several decode ranks
(parts.py), what they share (state.py); the rooms themselves (book.py) and the engine
conversation both roles have (engine.py).
"""

from __future__ import annotations

import collections
import logging

from ...core import errors
from ...core.config import Config
from ...core.errors import PdxferError
from ...core.liveness import TickGaps, resumed
from ...core.plan import check_memory_version, check_pages, check_source, pages_from_bytes
from ...core.protocol import (
    PROTOCOL_VERSION,
    Announce,
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    LegRequest,
    Message,
    Ok,
    PeerError,
    PeerHello,
    PeerInfo,
    PeerRefused,
    PeerWelcome,
    Role,
    RoomAccepted,
    RoomAck,
    RoomFailed,
    RoomRequest,
    RoomState,
    RoomStatus,
    Send,
    TransferStarted,
    unpack_legs,
)
from ...core import paths
from ...core.rooms import Event, Room
from ...core.topology import decode_rank_of, fan_key, prefill_rank_of, room_key, room_of
from ...transport import Peer, label, primary
from ..book import RoomBook
from ..engine import EngineDesk
from ..lanes import Lanes
from ..ports import PrefillPort
from ..staging import Staging
from .parts import RoomParts
from .state import Chunk, DecodePeer, PrefillState, PrefillWork
from .writer import Writer

log = logging.getLogger("pdxfer.prefill")

EARLY_BYTES = 64 * 1024 * 1024  # peer messages held for an engine that has not registered yet


class PrefillService:
    role = Role.PREFILL

    def __init__(self, config: Config, incarnation: str, port: PrefillPort, *, sessions: Peer, bootstrap_address: str,
                 staging: Staging | None = None) -> None:
        self.config = config
        self.incarnation = incarnation
        self.port = port
        self.sessions = sessions  # our transfer engines' sessions, which a transport reset replaces (new_sessions)
        self.staging = staging
        self.heartbeats = config.heartbeats
        self.peer_messages: collections.Counter[type] = collections.Counter()  # peer messages received, by type
        self.connected: set[bytes] = set()  # identities with a bootstrap connection now (wire.bootstrap)
        self.state = PrefillState()
        self.lanes = Lanes(config, Role.PREFILL, port)
        self.book = RoomBook(config, port, self.lanes, self, slot_fence=config.fence_timeout)
        self.rooms = self.book.rooms
        self.room_messages = {Send: self._send, Announce: self._announce}
        self.desk = EngineDesk(Role.PREFILL, incarnation, bootstrap_address, 0.0, port, self.lanes, self.book, self)
        self.on_engine = self.desk.on_engine  # the daemon's engine messages go straight to the desk
        self.parts = RoomParts(self.book, self.state)
        self.writer = Writer(config, port, self.lanes, self.book, self.state, self.parts, staging)
        # Peer messages that arrived before the engine registered, replayed after: (identity, incarnation, message, bytes).
        self._early: collections.deque[tuple[bytes, str, Message, int]] = collections.deque()
        self._early_bytes = 0
        self._gaps = TickGaps(config.heartbeats)

    # --- the engine conversation (roles/engine.py asks these)

    def _send(self, identity: bytes, msg: Send) -> Message:
        lane = self.lanes.of(identity)
        kv, aux = lane.registered_kv(), lane.registered_aux()
        try:
            src = pages_from_bytes(msg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room) from None
        check_pages(src, kv.num_pages, "source", msg.room)
        check_memory_version(msg.memory_version, kv.version, "local", msg.room)
        key = room_key(msg.room, lane.code)
        if msg.last:
            check_source(msg.num_tokens, msg.first_page + src.size, kv.spec.page_size, msg.room)
            if msg.generation < 1:
                raise errors.BadMessage(f"the last chunk of room {msg.room} carries its aux slot: send() it with slot=", room=msg.room)
            if msg.aux_bytes > aux.payload_bytes:
                raise errors.InsufficientCapacity(f"aux record of {msg.aux_bytes} bytes exceeds the slot payload of {aux.payload_bytes}", room=msg.room)
        room, w = self.rooms.find(key), self.state.work.get(key)
        if room is not None and w is not None and w.last:
            raise errors.DuplicateRoom(f"send() for room {msg.room} came after its last chunk", room=msg.room)
        if room is not None and room.finished:
            raise PdxferError(f"room {msg.room} already failed before send(): {room.reason}", room=msg.room, code=room.code)
        if room is None and key in self.book.finished:
            state, code, reason = self.book.finished[key]
            raise PdxferError(f"room {msg.room} already {state.value} before send(): {reason}", room=msg.room, code=code or ErrorCode.DUPLICATE_ROOM)
        if w is not None and w.first >= 0 and msg.first_page != w.end:
            raise errors.BadMessage(f"a chunk of room {msg.room} starts at position {msg.first_page}, but the chunks before it end at {w.end}: chunks come in order, without gaps", room=msg.room)
        created = room is None
        if created:
            room = self.book.create(key, Role.PREFILL, lane.index)
            self.state.work[room.id] = w = PrefillWork()
        parts = self.parts.group(room) if w.fans else (room,)  # fan-out is consulted only where the room fans out
        for part in parts:
            part.lane = lane.index  # the rank that sends the room owns it (a request made first only guessed)
        if msg.last:
            try:
                self.book.bind_slot(room, msg.slot, msg.generation)
            except PdxferError:
                if created:
                    self.rooms.remove(room.id)
                    self.state.work.pop(room.id, None)
                raise
            for part in parts:
                self.state.work[part.id].aux_slot = msg.slot
        chunk = Chunk(msg.first_page, src.copy(), msg.last, msg.num_tokens, msg.aux_bytes, msg.release_when_settled, waiting=bool(msg.cuda_event))
        w.engine, w.memory_version = identity, msg.memory_version
        for part in parts:
            self._hand_over(part, self.state.work[part.id], chunk)
        if msg.cuda_event:  # once the chunk is in its parts: a port may answer at once (a daemon that cannot wait)
            self.port.after_event(msg.cuda_event, lambda error: self._event_done(room.id, chunk, error))
        return Ok(req=msg.req)

    def _event_done(self, key: int, chunk: Chunk, error: str) -> None:
        """A chunk's CUDA event completed (its pages hold their KV now), or cannot be waited on."""
        chunk.waiting = False
        room = self.rooms.find(key)
        if room is None:
            return
        for part in self.parts.group(room):
            w = self.state.work[part.id]
            if part.finished or chunk not in w.chunks:
                continue
            if error:
                self.parts.fail(part, ErrorCode.TRANSFER_FAILED, f"the CUDA event of the chunk at position {chunk.first_page}: {error}")
            elif w.started:
                self.writer.write_chunks(part, w)

    def _hand_over(self, room: Room, w: PrefillWork, chunk: Chunk) -> None:
        """A chunk of the room's input: written at once if the room has started, else it
        may start the room now."""
        if room.finished:
            return
        w.take(room, chunk)
        if w.started:
            self.writer.write_chunks(room, w)
        else:
            self.book.advance(room, Event.INPUT_READY)
            if room.state is RoomState.TRANSFERRING:
                self.writer.start(room, w, announce=TransferStarted(room=room_of(room.id), leg=w.leg))

    def _announce(self, identity: bytes, msg: Announce) -> Message:
        """The engine will send this room: it hears the room's status when the decode's
        request comes (waiting_for_input, with its pages), now if it came already."""
        lane = self.lanes.of(identity)
        key = room_key(msg.room, lane.code)
        room = self.rooms.find(key)
        if room is None and key in self.book.finished:
            state, code, reason = self.book.finished[key]
            raise PdxferError(f"room {msg.room} already {state.value} before announce(): {reason}", room=msg.room, code=code or ErrorCode.DUPLICATE_ROOM)
        if room is None:
            room = self.book.create(key, Role.PREFILL, lane.index)
            self.state.work[room.id] = PrefillWork()
        for part in self.parts.group(room):  # the rank that announces the room owns it (a request made first only guessed)
            part.lane = lane.index
        self.state.work[room.id].engine = identity
        if room.finished or self.state.work[room.id].request is not None:
            self.book.push(room)
        return Ok(req=msg.req)

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        return self.parts.fail(room, code, reason)

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        w = self.state.work.get(room.id)
        return self.parts.status(room, req) if w is None or w.fans_out() else w.status(room, req)

    def memory_version(self, room: Room) -> int:
        w = self.state.work.get(room.id)
        return w.memory_version if w and w.memory_version else self.lanes[room.lane].registered_kv().version

    def registered(self) -> None:
        """An engine rank registered: what decode daemons sent before any had is replayed."""
        if any(lane.ready for lane in self.lanes):
            self._early_bytes = 0
            while self._early:
                self.on_peer(*self._early.popleft())

    def disown(self, room: Room) -> None:
        w = self.parts.head(room)
        if w is not None:
            w.engine = b""

    def engine_of(self, room: Room) -> bytes:
        w = self.state.work.get(room.id)
        if w is not None and w.first_room:  # a fan-out part: its first part's engine speaks for it
            w = self.parts.head(room)
        return w.engine if w else b""

    def release(self, room: Room) -> None:
        self.parts.release(room)

    def peer_count(self) -> int:
        return len(self.state.peers)

    # --- what the book asks of its rooms (roles/book.py)

    def stop_writes(self, room: Room) -> None:
        """Submit no more of the failed room; its jobs in flight still settle (and a job
        the pump gave up on may still land: no proof). Its decode side hears now if
        writes are in flight, and once they all settled, fenced."""
        w = self.state.work.get(room.id)
        if w is None:
            return
        w.chunks.clear()
        for job in room.writers:
            if not job.settled:
                self.port.cancel(job)
        if w.peer and room.writers:
            self.port.send_peer(w.peer, RoomFailed(room=room_of(room.id), code=room.code, reason=room.reason, fenced=False, leg=w.leg))

    def fenced(self, room: Room, proven: bool) -> None:
        """Nothing of ours can land for the failed room: its decode side may reuse what it
        gave us (not on our own fence deadline alone: that proves nothing there)."""
        w = self.state.work.get(room.id)
        if proven and w is not None and w.peer:
            self.port.send_peer(w.peer, RoomFailed(room=room_of(room.id), code=room.code or ErrorCode.INTERNAL, reason=room.reason, fenced=True, leg=w.leg))

    def forget(self, room: Room) -> None:
        w = self.state.work.pop(room.id, None)
        if w is not None and w.peer in self.state.peers:
            self.state.peers[w.peer].rooms.discard(room.id)

    # --- the bootstrap channel

    def on_peer(self, identity: bytes, incarnation: str, msg: Message, nbytes: int) -> None:
        """A message from the decode daemon connected as ``identity``, decoded (``nbytes`` on the wire)."""
        self.peer_messages[type(msg)] += 1  # by type: named by tag when counted
        if not any(lane.ready for lane in self.lanes):
            self._hold(identity, incarnation, msg, nbytes)
            return
        try:
            if isinstance(msg, PeerHello):
                self._hello(identity, msg)
                return
            peer = self.state.peers.get(identity)
            if peer is None:
                raise PdxferError("this prefill daemon does not know you (it restarted, or declared you dead): say peer_hello", code=ErrorCode.UNKNOWN_PEER, side=errors.Side.PEER)
            peer.last_heard = self.port.clock()
            if isinstance(msg, RoomRequest):
                peer.writes_until = max(peer.writes_until, msg.writes_until)
                self._request(peer, msg)
            elif isinstance(msg, RoomAck):
                self._ack(peer, msg)
            elif isinstance(msg, Heartbeat):
                wall = self.port.wall()
                if msg.wall:
                    peer.skew = msg.wall - wall
                peer.writes_until = max(peer.writes_until, msg.writes_until)
                self.port.send_peer(identity, HeartbeatAck(seq=msg.seq, wall=wall, clock=self.port.clock()))
            elif isinstance(msg, RoomFailed):
                self._peer_failed(peer, msg)
            else:
                raise errors.BadMessage(f"a prefill daemon does not accept {type(msg).__name__}", side=errors.Side.PEER)
        except PdxferError as exc:
            self.port.send_peer(identity, PeerError(code=exc.code, message=exc.message, room=exc.room))
        except Exception as exc:  # H1
            self.book.count_failure("internal")
            log.exception("internal error handling %s from peer", type(msg).__name__)
            self.port.send_peer(identity, PeerError(code=ErrorCode.INTERNAL, message=f"internal error: {exc!r}", room=getattr(msg, "room", 0)))

    def refuse_unauthenticated(self, identity: bytes, messages: list[Message], why: str) -> None:
        """A batch whose signature does not check (wire.seal.Seal): refused with the reason,
        which names the cluster secret, and logged naming the decode daemon as its
        peer_hello (a connection's first message) names it: unverified, and so quoted,
        but what an operator looks for."""
        who, session = f"incarnation {identity.decode(errors='replace')!r}", None
        for msg in messages:
            if isinstance(msg, PeerHello):
                who, session = f"{msg.name!r} session {msg.session!r}, {who}", msg.session
        self.book.count_failure("unauthenticated")
        log.warning("refused decode daemon %s (unverified: as it names itself): %s", who, why, extra={"peer": session})
        self.port.send_peer(identity, PeerRefused(code=ErrorCode.UNAUTHENTICATED, reason=why))

    def _hold(self, identity: bytes, incarnation: str, msg: Message, nbytes: int) -> None:
        """Keep what decode daemons send before our engine registered (bounded by
        max_rooms); their rooms' bootstrap timeout covers an engine that never does."""
        if len(self._early) >= self.config.max_rooms or self._early_bytes + nbytes > EARLY_BYTES:
            self.port.send_peer(identity, PeerError(code=ErrorCode.BUSY, message="the prefill engine has not registered yet and the early-message queue is full"))
            return
        self._early.append((identity, incarnation, msg, nbytes))
        self._early_bytes += nbytes

    def _hello(self, identity: bytes, hello: PeerHello) -> None:
        refusal = self._hello_refusal(hello)
        if refusal:
            self.port.send_peer(identity, PeerRefused(code=refusal[0], reason=refusal[1]))
            log.warning("refused decode daemon %s: %s", hello.session, refusal[1], extra={"peer": hello.session})
            return
        live = unpack_legs(hello.live_legs)
        peer = self.state.peers.get(identity)
        if peer is None:
            for old in [p for p in self.state.peers.values() if hello.name and p.hello.name == hello.name]:
                self.declare_dead(old, f"decode daemon {hello.name} restarted (incarnation {old.hello.incarnation} -> {hello.incarnation})")
            self.state.peers[identity] = peer = DecodePeer(identity, hello, self.port.clock())
            log.info("decode daemon %s %s (incarnation %s) connected", hello.name, hello.session, hello.incarnation, extra={"peer": hello.session})
        else:
            old, old_sessions = peer.hello, peer.sessions
            peer.said(hello)
            if {lane.index: lane.memory_version for lane in old.lanes} != {lane.index: lane.memory_version for lane in hello.lanes}:
                self._peer_relocated(peer, old)
            self._move_parts(peer, live)
            if peer.sessions != old_sessions:
                peer.retiring.add(old_sessions)
                self.writer.say_drained(peer)
        self.port.send_peer(identity, PeerWelcome(version=PROTOCOL_VERSION, incarnation=self.incarnation, session=primary(self.sessions),
                                                  clock=self.port.clock(), stages=True))

    def _hello_refusal(self, hello: PeerHello) -> tuple[ErrorCode, str] | None:
        """Why a decode daemon's hello is refused ((code, reason)), or None."""
        if hello.version != PROTOCOL_VERSION:
            return ErrorCode.VERSION_MISMATCH, f"peer speaks protocol {hello.version}, this prefill daemon speaks {PROTOCOL_VERSION}"
        try:
            paths.check_engine_release(self.config.protocol, hello.engine_release, f"decode daemon {hello.name or hello.session}'s")
        except errors.Unsupported as exc:
            return ErrorCode.COMPAT_MISMATCH, exc.message
        if hello.sessions and hello.sessions[0] != hello.session:
            return ErrorCode.BAD_MESSAGE, f"peer_hello sessions {list(hello.sessions)} do not start with its session {hello.session!r}"
        try:
            unpack_legs(hello.live_legs)
        except ValueError as exc:
            return ErrorCode.BAD_MESSAGE, str(exc)
        refusal = self._page_size_refusal(hello)
        return (ErrorCode.COMPAT_MISMATCH, refusal) if refusal else None

    def _move_parts(self, peer: DecodePeer, live: set[tuple[int, int]]) -> None:
        """A peer_hello names the legs of ours its daemon holds live: those write through
        its sessions from now on; every other part of ours for it failed there (its
        room_failed may have been lost with a connection, or be behind this hello), so it
        fails here before a byte of it could go to the new sessions."""
        for key in list(peer.rooms):
            room, w = self.rooms.find(key), self.state.work.get(key)
            if room is None or w is None or room.finished:
                continue
            if (room_of(key), w.leg) in live:
                w.sessions = peer.sessions
            else:
                self.parts.fail(room, ErrorCode.PEER_DEAD, f"decode daemon {peer.hello.name or peer.label} no longer holds this room live (its peer_hello left it out)")

    def _page_size_refusal(self, hello: PeerHello) -> str:
        """A9: pages are moved whole, so a decode rank whose page size no rank here has
        is refused at the handshake, naming both (the other fields are checked per leg)."""
        ours = sorted({lane.kv.spec.page_size for lane in self.lanes if lane.ready})
        theirs = sorted({lane.compat.page_size for lane in hello.lanes if lane.compat.page_size not in ours})
        if not ours or not theirs:
            return ""
        return (f"incompatible KV layout: page_size: prefill={ours[0] if len(ours) == 1 else ours!r} decode={theirs[0] if len(theirs) == 1 else theirs!r}: "
                "pdxfer moves whole pages; run both sides with the same page size")

    def _peer_relocated(self, peer: DecodePeer, old: PeerHello) -> None:
        """C3: rooms whose blocks were planned against a destination lane's old memory fail."""
        before = {lane.index: lane.memory_version for lane in old.lanes}
        for room_id in list(peer.rooms):
            room, w = self.rooms.find(room_id), self.state.work.get(room_id)
            if room is None or w is None or room.finished:
                continue
            lane = peer.lanes.get(w.request.lane)
            now = lane.memory_version if lane is not None else 0
            if w.request.memory_version != now:
                self.parts.fail(room, ErrorCode.STALE_MEMORY_VERSION, f"the decode engine re-registered its KV pool (memory version {before.get(w.request.lane, 0)} -> {now})")

    def _request(self, peer: DecodePeer, msg: RoomRequest) -> None:
        """A decode daemon's request for a room: one leg per (local prefill rank, its
        decode rank). It is answered once (A5): room_accepted, input_ready when every
        leg's rank has handed over its input; a leg refused is answered on its own."""
        taken: list[tuple[Room, PrefillWork]] = []
        for leg in msg.legs:
            try:
                taken += self._leg(peer, msg, leg)
            except PdxferError as exc:
                self.port.send_peer(peer.identity, PeerError(code=exc.code, message=exc.message, room=msg.room, leg=leg.leg))
        if not taken:
            return
        ready = [(room, w) for room, w in taken if room.state is RoomState.TRANSFERRING]
        accept = RoomAccepted(room=msg.room, input_ready=len(ready) == len(taken), legs=tuple(w.leg for _, w in taken))
        if len(taken) == 1 and ready:  # start sends it, or an aux record that implies it
            self.writer.start(*ready[0], announce=accept)
            return
        self.port.send_peer(peer.identity, accept)
        for room, w in ready:
            self.writer.start(room, w, announce=None)

    def _leg(self, peer: DecodePeer, msg: RoomRequest, leg: LegRequest) -> list[tuple[Room, PrefillWork]]:
        """Take one leg of a request: the room of its prefill rank, bootstrapped. Returns
        it, or nothing when the room had already finished (the decode side is told)."""
        key = room_key(msg.room, prefill_rank_of(leg.leg))
        room, w = self.rooms.find(key), self.state.work.get(key)
        if room is None and key in self.book.finished:
            state, code, reason = self.book.finished[key]
            why = f"the prefill engine already finished this room ({state.value}{': ' + reason if reason else ''})"
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=code or ErrorCode.UNKNOWN_ROOM, reason=why, fenced=True, leg=leg.leg))
            return []
        if room is not None and room.finished and not (w and w.peer):
            # Failed before the decode side showed up: tell it, with nothing in flight.
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=room.code or ErrorCode.INTERNAL, reason=room.reason, fenced=True, leg=leg.leg))
            return []
        # A part that succeeded already may have siblings still to come (its request's fan_out).
        fan_out = room is not None and room.state is not RoomState.FAILED and w is not None and w.request is not None \
            and decode_rank_of(w.request.leg) != decode_rank_of(leg.leg)
        if fan_out:  # this prefill rank writes to another decode rank too: a room of its own for it
            first, key = room, fan_key(msg.room, leg.leg)
            room, w = self.rooms.find(key), self.state.work.get(key)
        if room is not None and (room.finished or (w and w.peer)) or key in self.book.finished:
            raise errors.DuplicateRoom(f"room {msg.room} was already requested", room=msg.room, side=errors.Side.PEER)
        try:
            dst = pages_from_bytes(leg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room, side=errors.Side.PEER) from None
        if peer.draining or self.desk.draining:
            who = "this prefill daemon is draining for shutdown" if self.desk.draining else "an operator is draining this decode daemon here"
            raise errors.Busy(f"{who}: no new rooms", room=msg.room, retry_after_ms=1000)
        if len(peer.rooms) >= self.config.max_rooms_per_peer:
            raise errors.Busy(f"this decode daemon already holds {len(peer.rooms)} rooms here (limit {self.config.max_rooms_per_peer})", room=msg.room)
        self._check_early(peer, msg.room, key, leg, dst, room if room is not None else (first if fan_out else None))
        if room is None:
            # Its rank's lane if registered (its announce or send names the right one: _owned_by).
            lane = next((lane.index for lane in self.lanes if lane.code == prefill_rank_of(leg.leg)), 0)
            room = self.book.create(key, Role.PREFILL, lane, peer=peer.label)
            self.state.work[room.id] = PrefillWork()
        w = self.state.work[room.id]
        w.peer, w.request, w.dst_pages, w.lease_ms, w.sessions = peer.identity, leg, dst.copy(), msg.lease_ms, peer.sessions
        room.peer = peer.label
        peer.rooms.add(room.id)
        self.book.advance(room, Event.BOOTSTRAPPED)
        if fan_out:
            self.parts.fan(first, room, w)
        return [(room, w)]

    def _check_early(self, peer: DecodePeer, room_id: int, key: int, leg: LegRequest, dst, room: Room | None) -> None:
        """A leg's destination and layouts, checked when its request comes if the prefill
        rank's memory is known (its engine announced the room, or it is the only engine
        of that rank here), not once its engine has computed and sent: an
        incompatible pair fails before the prefill spends the compute (SGLang computes
        only once the decode asked). The engine hears it from its room, or at its
        announce or send; the decode daemon from the PeerError this raises."""
        head = self.parts.head(room) if room is not None else None
        if head is not None and head.engine:  # its engine announced or sent: the room's lane is that rank's
            local = self.lanes[room.lane]
        else:
            # A request names the rank, not the engine: with several engines of that rank
            # here, which one's memory it reads is known only once one sends it.
            ranks = [lane for lane in self.lanes if lane.code == prefill_rank_of(leg.leg) and lane.ready]
            if len(ranks) != 1:
                return
            local = ranks[0]
        if not local.ready:
            return
        try:
            self.writer.destination(local, leg, dst, peer, room_id)
        except PdxferError as exc:
            if room is not None:
                self.parts.fail(room, exc.code, exc.message)
            else:
                self.book.remember(key, RoomState.FAILED, exc.code, exc.message)
            raise

    def _ack(self, peer: DecodePeer, msg: RoomAck) -> None:
        room = self.rooms.get(self.parts.leg_key(msg.room, msg.leg))
        if self.state.work[room.id].peer != peer.identity:
            raise errors.BadMessage(f"room {msg.room} belongs to another decode daemon", room=msg.room, side=errors.Side.PEER)
        if room.state is not RoomState.TRANSFERRING:
            return  # failed meanwhile: the failure stands
        room.bytes_moved = room.bytes_planned  # the decode side verified every byte of it, aux included
        self.book.succeed(room, Event.DONE)

    def _peer_failed(self, peer: DecodePeer, msg: RoomFailed) -> None:
        key = self.parts.leg_key(msg.room, msg.leg)
        room = self.rooms.find(key)
        w = self.state.work.get(key)
        if w is not None and w.peer and w.peer != peer.identity:
            # Another decode daemon's room under the same id (a second request for it
            # was refused as duplicate_room): its failure is not this peer's to make.
            # Nothing of ours is aimed at this peer for it, so its pages may go.
            self.book.count_failure("ignored:room-of-another-peer")
            log.warning("room %d: ignored room_failed from decode daemon %s: the room belongs to another decode daemon (%s)",
                        msg.room, peer.hello.name or peer.label, msg.reason)
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=msg.code, reason="this prefill wrote nothing for your room under this id", fenced=True, leg=msg.leg))
            return
        if room is not None and not room.finished:
            self.parts.fail(room, msg.code, f"decode side: {msg.reason}")
            return
        if room is None and key not in self.book.finished:  # its request never reached us: a later send() hears why
            self.book.remember(key, RoomState.FAILED, msg.code, f"decode side: {msg.reason}")
        if room is None or not room.writers:  # nothing of ours in flight: acknowledge the fence now
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=msg.code, reason="no write in flight", fenced=True, leg=msg.leg))

    def unsent(self, messages: list[Message]) -> None:
        """Messages to a decode daemon that could not be queued (its connection was
        closing, or too much already waited for it): the live rooms they were about fail
        now, as peer_unreachable, rather than at their timeout."""
        for msg in messages:
            room_id = getattr(msg, "room", 0)
            legs = msg.legs if isinstance(msg, RoomAccepted) else (getattr(msg, "leg", 0),)
            for room in {room.id: room for leg in legs if room_id and (room := self.rooms.find(self.parts.leg_key(room_id, leg))) is not None}.values():
                if not room.finished:
                    self.parts.fail(room, ErrorCode.PEER_UNREACHABLE, "a message for this room could not be sent to the peer daemon "
                                                                      "(its connection was closing, or too much already waited for it)")

    # --- peer health

    def on_connection(self, identity: bytes, event: str) -> None:
        """A decode daemon's bootstrap connection came (it proved its identity) or went."""
        if event == "connected":
            self.connected.add(identity)
            return
        self.connected.discard(identity)
        peer = self.state.peers.get(identity)
        if peer is not None:
            log.info("decode daemon %s's bootstrap connection closed: its %d rooms here fail if a write to it fails before it is back",
                     peer.hello.name or peer.label, len(peer.rooms), extra={"peer": peer.label})

    def write_failed(self, sessions: Peer) -> None:
        """A write to the transfer sessions ``sessions`` failed (the pump writes it
        again). To a decode daemon whose bootstrap connection is closed too, that is
        proof enough that it is gone: its rooms fail now, and their jobs are cancelled
        (their writes in flight still settle before a room counts as fenced)."""
        for peer in [p for p in self.state.peers.values() if p.sessions == sessions and p.identity not in self.connected]:
            self.declare_dead(peer, f"decode daemon {peer.hello.name or peer.label}: its bootstrap connection closed and a "
                                    f"write to its transfer engine ({label(sessions)}) failed")

    def new_sessions(self, sessions: Peer) -> None:
        """The transport was re-created: decode daemons reach our engines at ``sessions`` now."""
        self.sessions = sessions

    def tick(self) -> None:
        for room in self.book.tick():
            self.parts.fail(room, ErrorCode.TIMEOUT, self.book.timeout_reason(room))
        now = self.port.clock()
        if self._gaps.stood_still(now):  # we were frozen, not they silent: start their clocks again
            for peer in self.state.peers.values():
                peer.last_heard = resumed(peer.last_heard, now)
        for peer in [p for p in self.state.peers.values() if self.heartbeats.dead(p.last_heard, now)]:
            self.declare_dead(peer, f"decode daemon {peer.hello.name or peer.label} sent nothing for {now - peer.last_heard:.1f}s ({self.config.heartbeat_misses} heartbeats missed)")

    def declare_dead(self, peer: DecodePeer, reason: str) -> None:
        """Fail exactly this peer's rooms and forget it; a live peer says hello again."""
        self.state.peers.pop(peer.identity, None)
        self.book.count_failure("peers_declared_dead")
        live = sum(1 for r in peer.rooms if (room := self.rooms.find(r)) is not None and not room.finished)
        log.error("declared decode daemon %s dead, failing its %d live rooms: %s", peer.hello.name or peer.label, live, reason, extra={"peer": peer.label})
        for room_id in list(peer.rooms):
            room = self.rooms.find(room_id)
            if room is not None:
                self.parts.fail(room, ErrorCode.PEER_DEAD, reason)

    # --- what the daemon and operators ask

    def peer_infos(self, now: float, wall: float) -> list[PeerInfo]:
        return [
            PeerInfo(
                address=p.hello.session, name=p.hello.name, incarnation=p.hello.incarnation,
                state="draining" if p.draining else ("alive" if p.identity in self.connected else "connecting"),
                last_heard=now - p.last_heard, rtt_ms=-1.0, clock_skew_ms=p.skew * 1000, rooms=len(p.rooms),
            )
            for p in self.state.peers.values()
        ]

    def peer_gone(self, record, reason: str) -> None:
        """The registry says a decode daemon is gone: its lease lapsed, or it registered
        again under a new incarnation."""
        name = f"{record.host}/{record.name}"
        for peer in [p for p in self.state.peers.values() if p.hello.name == name and p.hello.incarnation == record.incarnation]:
            self.declare_dead(peer, f"decode daemon {name}: {reason}")

    def drain(self, peer: str) -> None:
        """Operator action: no new rooms from decode daemons whose session or name contains ``peer``."""
        matched = [p for p in self.state.peers.values() if peer in p.hello.session or peer in p.hello.name]
        if not matched:
            raise errors.PdxferError(f"no decode peer matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        for p in matched:
            p.draining = True
            log.warning("operator drains decode daemon %s: no new rooms, %d finishing", p.hello.name or p.label, len(p.rooms), extra={"peer": p.label})

    def transport_closed(self) -> int:
        return self.writer.transport_closed()

    # --- what the daemon asks of either role (roles/inbound.py)

    def counters(self) -> dict[str, float]:
        """Everything this role counts, for the admin API and the metrics."""
        return {
            **self.desk.counters(),
            **{f"peer_messages_in:{kind.__struct_config__.tag}": float(n) for kind, n in self.peer_messages.items()},
            "staging_taken_bytes": float(self.staging.arena.taken_bytes if self.staging else 0),
            "kv_inline_rooms": float(self.writer.kv_inline_rooms),
            "kv_inline_bytes": float(self.writer.kv_inline_bytes),
            "chunks_gathered": float(self.writer.staged_chunks),
            "staging_full": float(self.staging.full if self.staging else 0),
        }
