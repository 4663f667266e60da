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

No block of a room is submitted after its lease (the transfer timeout, counted from
when its writes start), nor after the newest leave to write its decode daemon gave
(protocol.Heartbeat): that is what lets the decode side release a dead or cut-off
writer's destination after a bound of its own.

Here: the engine side, the bootstrap channel (hello, requests, acks, failures) and peer
health. Writing a room part is prefill_writes.py; a rank's parts for several decode
ranks, fan_out.py; the records kept, prefill_state.py.
"""

from __future__ import annotations

import collections
import logging

from ..core import errors, paths
from ..core.config import Config
from ..core.errors import PdxferError
from ..core.liveness import resumed
from ..core.plan import check_pages, check_source, pages_from_bytes
from ..core.protocol import (
    UNDECODABLE,
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
    Send,
    SessionsDrained,
    TransferStarted,
    tag_of,
    unpack_legs,
)
from ..core.rooms import Event, Room
from ..core.topology import decode_rank_of, fan_key, prefill_rank_of, room_key, room_of
from ..transport import Job, Peer, label, primary
from .base import RoomService
from .fan_out import FanOutParts
from .pools import Staging
from .ports import PrefillPort
from .prefill_state import Chunk, DecodePeer, PrefillWork
from .prefill_writes import RoomWrites

log = logging.getLogger("pdxfer.prefill")

EARLY_BYTES = 64 * 1024 * 1024  # peer messages held for an engine that has not registered yet



class PrefillService(RoomWrites, FanOutParts, RoomService):
    role = Role.PREFILL

    def __init__(self, config: Config, incarnation: str, port: PrefillPort, *, sessions: Peer, bootstrap_address: str,
                 staging: Staging | None = None) -> None:
        super().__init__(config, incarnation, port, sessions=sessions, bootstrap_address=bootstrap_address)
        self.port: PrefillPort = port
        self.peers: dict[bytes, DecodePeer] = {}
        self.connected: set[bytes] = set()  # identities with a bootstrap connection now (wire.bootstrap)
        self.work: dict[int, PrefillWork] = {}
        self.aux_path = paths.choose_aux_path(self.config.protocol, self.config.aux_path)
        self.staging = staging  # where a leg's slices are gathered before they are written (core/staging.py); None: nowhere
        self.gathered: dict[Job, int] = {}  # a chunk's job: the extent it is written from, until its writes settled
        self.in_flight_to: collections.Counter[Peer] = collections.Counter()  # jobs not settled (or given up on by the pump), by the sessions they write to
        self.staged_chunks = 0  # chunks written from an extent
        # Peer messages that arrived before the engine registered, replayed after.
        self._early: collections.deque[tuple[bytes, str, bytes]] = collections.deque()
        self._early_bytes = 0

    # --- engine side

    def on_send(self, identity: bytes, msg: Send) -> Message:
        lane = self.lane_for(identity)
        kv, aux = lane.registered_kv(), lane.registered_aux()
        try:
            src = pages_from_bytes(msg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room) from None
        check_pages(src, kv.num_pages, "source", msg.room)
        self.check_local_version(lane, msg.memory_version, msg.room)
        key = room_key(msg.room, lane.code)
        if msg.last:
            check_source(msg.num_tokens, msg.first_page + src.size, kv.spec.page_size, msg.room)
            if msg.generation < 1:
                raise errors.BadMessage(f"the last chunk of room {msg.room} carries its aux slot: send() it with slot=", room=msg.room)
            if msg.aux_bytes > aux.payload_bytes:
                raise errors.InsufficientCapacity(f"aux record of {msg.aux_bytes} bytes exceeds the slot payload of {aux.payload_bytes}", room=msg.room)
        room, w = self.rooms.find(key), self.work.get(key)
        if room is not None and w is not None and w.last:
            raise errors.DuplicateRoom(f"send() for room {msg.room} came after its last chunk", room=msg.room)
        if room is not None and room.finished:
            raise PdxferError(f"room {msg.room} already failed before send(): {room.reason}", room=msg.room, code=room.code)
        if room is None and key in self.finished:
            state, code, reason = self.finished[key]
            raise PdxferError(f"room {msg.room} already {state.value} before send(): {reason}", room=msg.room, code=code or ErrorCode.DUPLICATE_ROOM)
        if w is not None and w.first >= 0 and msg.first_page != w.end:
            raise errors.BadMessage(f"a chunk of room {msg.room} starts at position {msg.first_page}, but the chunks before it end at {w.end}: chunks come in order, without gaps", room=msg.room)
        created = room is None
        if created:
            room = self.rooms.create(key, Role.PREFILL, self.clock())
            self.work[room.id] = w = PrefillWork()
        self._owned_by(room, lane)
        if msg.last:
            try:
                self.bind_slot(room, msg.slot, msg.generation)
            except PdxferError:
                if created:
                    self.rooms.remove(room.id)
                    self.work.pop(room.id, None)
                raise
            for part in self._group(room):
                self.work[part.id].aux_slot = msg.slot
        chunk = Chunk(msg.first_page, src.copy(), msg.last, msg.num_tokens, msg.aux_bytes, msg.release_when_settled, waiting=bool(msg.cuda_event))
        w.engine, w.memory_version = identity, msg.memory_version
        self._hand_over(room, w, chunk)
        for fan in self._fans(room):
            self._hand_over(fan, self.work[fan.id], chunk)
        if msg.cuda_event:  # once the chunk is in its parts: a port may answer at once (a daemon that cannot wait)
            self.port.after_event(msg.cuda_event, lambda error: self._event_done(room.id, chunk, error))
        return Ok(req=msg.req)

    def _owned_by(self, room: Room, lane) -> None:
        """The engine rank that announces or sends the room owns it, and its parts: a room
        a request made first only guessed its lane (the rank may not have registered)."""
        for part in self._group(room):
            part.lane = lane.index

    @staticmethod
    def _take(room: Room, w: PrefillWork, chunk: Chunk) -> None:
        if chunk.last:
            w.last, w.num_tokens, w.aux_bytes = True, chunk.num_tokens, chunk.aux_bytes
            room.release_when_settled = chunk.release_when_settled
        if w.first < 0:
            w.first = chunk.first_page
        w.end = chunk.first_page + chunk.pages.size
        w.chunks.append(chunk)
        w.handed.append(chunk)

    def _event_done(self, key: int, chunk: Chunk, error: str) -> None:
        """A chunk's CUDA event completed (its pages hold their KV now), or cannot be waited on."""
        chunk.waiting = False
        room = self.rooms.find(key)
        if room is None:
            return
        for part in self._group(room):
            w = self.work[part.id]
            if part.finished or chunk not in w.chunks:
                continue
            if error:
                self.fail(part, ErrorCode.TRANSFER_FAILED, f"the CUDA event of the chunk at position {chunk.first_page}: {error}")
            elif w.started:
                self._write_chunks(part, w)

    def _hand_over(self, room: Room, w: PrefillWork, chunk: Chunk) -> None:
        """A chunk of the room's input: written at once if the room has started, else it
        may start the room now."""
        if room.finished:
            return
        self._take(room, w, chunk)
        if w.started:
            self._write_chunks(room, w)
        else:
            self.advance(room, Event.INPUT_READY)
            if room.state is RoomState.TRANSFERRING:
                self._start(room, w, announce=TransferStarted(room=room_of(room.id), leg=w.leg))

    def on_announce(self, identity: bytes, msg: Announce) -> Message:
        """The engine will send this room: it hears the room's status when the decode's
        request comes (waiting_for_input, with its pages), now if it came already."""
        lane = self.lane_for(identity)
        key = room_key(msg.room, lane.code)
        room = self.rooms.find(key)
        if room is None and key in self.finished:
            state, code, reason = self.finished[key]
            raise PdxferError(f"room {msg.room} already {state.value} before announce(): {reason}", room=msg.room, code=code or ErrorCode.DUPLICATE_ROOM)
        if room is None:
            room = self.rooms.create(key, Role.PREFILL, self.clock())
            self.work[room.id] = PrefillWork()
        self._owned_by(room, lane)
        self.work[room.id].engine = identity
        if room.finished or self.work[room.id].request is not None:
            self.push(room, identity)
        return Ok(req=msg.req)

    # --- bootstrap channel

    def on_peer(self, identity: bytes, incarnation: str, raw: bytes) -> None:
        if len(raw) > self.config.max_message_bytes:
            self.port.send_peer(identity, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"message of {len(raw)} bytes exceeds the {self.config.max_message_bytes}-byte limit"))
            return
        try:
            msg = self.codec.peer_messages.decode(raw)
        except UNDECODABLE as exc:
            self.port.send_peer(identity, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"cannot decode peer message: {exc}"))
            return
        self.peer_messages[tag_of(msg)] += 1
        if not any(lane.ready for lane in self.lanes):
            self._hold(identity, incarnation, raw)
            return
        try:
            if isinstance(msg, PeerHello):
                self._hello(identity, msg)
                return
            peer = self.peers.get(identity)
            if peer is None:
                raise PdxferError("this prefill daemon does not know you (it restarted, or declared you dead): say peer_hello", code=ErrorCode.UNKNOWN_PEER, side=errors.Side.PEER)
            peer.last_heard = self.clock()
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
                self.port.send_peer(identity, HeartbeatAck(seq=msg.seq, wall=wall, clock=self.clock()))
            elif isinstance(msg, RoomFailed):
                self._peer_failed(peer, msg)
            else:
                raise errors.BadMessage(f"a prefill daemon does not accept {type(msg).__name__}", side=errors.Side.PEER)
        except PdxferError as exc:
            self.port.send_peer(identity, PeerError(code=exc.code, message=exc.message, room=exc.room))
        except Exception as exc:  # H1
            self.count_failure("internal")
            log.exception("internal error handling %s from peer", type(msg).__name__)
            self.port.send_peer(identity, PeerError(code=ErrorCode.INTERNAL, message=f"internal error: {exc!r}", room=getattr(msg, "room", 0)))

    def refuse_unauthenticated(self, identity: bytes, payloads: list[bytes], why: str) -> None:
        """A message whose signature does not check (wire.seal.Seal): refused with the reason,
        which names the cluster secret, and logged naming the decode daemon as its
        peer_hello (a connection's first message) names it: unverified, and so quoted,
        but what an operator looks for."""
        who, session = f"incarnation {identity.decode(errors='replace')!r}", None
        for raw in payloads:
            try:
                msg = self.codec.peer_messages.decode(raw)
            except UNDECODABLE:
                continue
            if isinstance(msg, PeerHello):
                who, session = f"{msg.name!r} session {msg.session!r}, {who}", msg.session
        self.count_failure("unauthenticated")
        log.warning("refused decode daemon %s (unverified: as it names itself): %s", who, why, extra={"peer": session})
        self.port.send_peer(identity, PeerRefused(code=ErrorCode.UNAUTHENTICATED, reason=why))

    def _hold(self, identity: bytes, incarnation: str, raw: bytes) -> None:
        """Keep what decode daemons send before our engine registered (bounded by
        max_rooms); their rooms' bootstrap timeout covers an engine that never does."""
        if len(self._early) >= self.config.max_rooms or self._early_bytes + len(raw) > EARLY_BYTES:
            self.port.send_peer(identity, PeerError(code=ErrorCode.BUSY, message="the prefill engine has not registered yet and the early-message queue is full"))
            return
        self._early.append((identity, incarnation, raw))
        self._early_bytes += len(raw)

    def on_kv_registered(self) -> None:
        if any(lane.ready for lane in self.lanes):
            self._early_bytes = 0
            while self._early:
                self.on_peer(*self._early.popleft())

    def _hello(self, identity: bytes, hello: PeerHello) -> None:
        if hello.version != PROTOCOL_VERSION:
            self.port.send_peer(identity, PeerRefused(code=ErrorCode.VERSION_MISMATCH, reason=f"peer speaks protocol {hello.version}, this prefill daemon speaks {PROTOCOL_VERSION}"))
            return
        try:
            paths.check_engine_release(self.config.protocol, hello.engine_release, f"decode daemon {hello.name or hello.session}'s")
        except errors.Unsupported as exc:
            self.port.send_peer(identity, PeerRefused(code=ErrorCode.COMPAT_MISMATCH, reason=exc.message))
            log.warning("refused decode daemon %s: %s", hello.session, exc.message, extra={"peer": hello.session})
            return
        if hello.sessions and hello.sessions[0] != hello.session:
            reason = f"peer_hello sessions {list(hello.sessions)} do not start with its session {hello.session!r}"
            self.port.send_peer(identity, PeerRefused(code=ErrorCode.BAD_MESSAGE, reason=reason))
            log.warning("refused decode daemon %s: %s", hello.session, reason, extra={"peer": hello.session})
            return
        try:
            live = unpack_legs(hello.live_legs)
        except ValueError as exc:
            self.port.send_peer(identity, PeerRefused(code=ErrorCode.BAD_MESSAGE, reason=str(exc)))
            log.warning("refused decode daemon %s: %s", hello.session, exc, extra={"peer": hello.session})
            return
        refusal = self._page_size_refusal(hello)
        if refusal:
            self.port.send_peer(identity, PeerRefused(code=ErrorCode.COMPAT_MISMATCH, reason=refusal))
            log.warning("refused decode daemon %s: %s", hello.session, refusal, extra={"peer": hello.session})
            return
        peer = self.peers.get(identity)
        if peer is None:
            for old in [p for p in self.peers.values() if hello.name and p.hello.name == hello.name]:
                self.declare_dead(old, f"decode daemon {hello.name} restarted (incarnation {old.hello.incarnation} -> {hello.incarnation})")
            self.peers[identity] = peer = DecodePeer(identity, hello, self.clock())
            log.info("decode daemon %s %s (incarnation %s) connected", hello.name, hello.session, hello.incarnation, extra={"peer": hello.session})
        else:
            old = peer.hello
            old_sessions = peer.sessions
            peer.said(hello)
            moved = {lane.index: lane.memory_version for lane in old.lanes} != {lane.index: lane.memory_version for lane in hello.lanes}
            if moved:
                self._peer_relocated(peer, old)
            self._move_parts(peer, live)
            if peer.sessions != old_sessions:
                peer.retiring.add(old_sessions)
                self._say_drained(peer)
        self.port.send_peer(identity, PeerWelcome(version=PROTOCOL_VERSION, incarnation=self.incarnation, session=primary(self.sessions), clock=self.clock(), stages=True))

    def _move_parts(self, peer: DecodePeer, live: set[tuple[int, int]]) -> None:
        """A peer_hello names the legs of ours its daemon holds live: those write through
        its sessions from now on; every other part of ours for it failed there (its
        room_failed may have been lost with a connection, or be behind this hello), so it
        fails here before a byte of it could go to the new sessions."""
        for key in list(peer.rooms):
            room, w = self.rooms.find(key), self.work.get(key)
            if room is None or w is None or room.finished:
                continue
            if (room_of(key), w.leg) in live:
                w.sessions = peer.sessions
            else:
                self.fail(room, ErrorCode.PEER_DEAD, f"decode daemon {peer.hello.name or peer.label} no longer holds this room live (its peer_hello left it out)")

    def _say_drained(self, peer: DecodePeer) -> None:
        """Tell the decode daemon which of its replaced sessions nothing of ours is in flight through any more."""
        for sessions in [s for s in peer.retiring if not self.in_flight_to[s]]:
            peer.retiring.discard(sessions)
            self.port.send_peer(peer.identity, SessionsDrained(sessions=sessions))

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
            room, w = self.rooms.find(room_id), self.work.get(room_id)
            if room is None or w is None or room.finished:
                continue
            lane = peer.lanes.get(w.request.lane)
            now = lane.memory_version if lane is not None else 0
            if w.request.memory_version != now:
                self.fail(room, ErrorCode.STALE_MEMORY_VERSION, f"the decode engine re-registered its KV pool (memory version {before.get(w.request.lane, 0)} -> {now})")

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
        if len(taken) == 1 and ready:  # _start sends it, or an aux record that implies it
            self._start(*ready[0], announce=accept)
            return
        self.port.send_peer(peer.identity, accept)
        for room, w in ready:
            self._start(room, w, announce=None)

    def _leg(self, peer: DecodePeer, msg: RoomRequest, leg: LegRequest) -> list[tuple[Room, PrefillWork]]:
        """Take one leg of a request: the room of its prefill rank, bootstrapped. Returns
        it, or nothing when the room had already finished (the decode side is told)."""
        key = room_key(msg.room, prefill_rank_of(leg.leg))
        room, w = self.rooms.find(key), self.work.get(key)
        if room is None and key in self.finished:
            state, code, reason = self.finished[key]
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
            room, w = self.rooms.find(key), self.work.get(key)
        if room is not None and (room.finished or (w and w.peer)) or key in self.finished:
            raise errors.DuplicateRoom(f"room {msg.room} was already requested", room=msg.room, side=errors.Side.PEER)
        try:
            dst = pages_from_bytes(leg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room, side=errors.Side.PEER) from None
        if peer.draining or self.draining:
            who = "this prefill daemon is draining for shutdown" if self.draining else "an operator is draining this decode daemon here"
            raise errors.Busy(f"{who}: no new rooms", room=msg.room, retry_after_ms=1000)
        if len(peer.rooms) >= self.config.max_rooms_per_peer:
            raise errors.Busy(f"this decode daemon already holds {len(peer.rooms)} rooms here (limit {self.config.max_rooms_per_peer})", room=msg.room)
        self._check_early(peer, msg.room, key, leg, dst, room if room is not None else (first if fan_out else None))
        if room is None:
            room = self.rooms.create(key, Role.PREFILL, self.clock(), peer=peer.label)
            # Its rank's lane if registered (its announce or send names the right one: _owned_by).
            room.lane = next((lane.index for lane in self.lanes if lane.code == prefill_rank_of(leg.leg)), 0)
            self.work[room.id] = PrefillWork()
        w = self.work[room.id]
        w.peer, w.request, w.dst_pages, w.lease_ms, w.sessions = peer.identity, leg, dst.copy(), msg.lease_ms, peer.sessions
        room.peer = peer.label
        peer.rooms.add(room.id)
        self.advance(room, Event.BOOTSTRAPPED)
        if fan_out:
            self._fan(first, room, w)
        return [(room, w)]


    def _check_early(self, peer: DecodePeer, room_id: int, key: int, leg: LegRequest, dst, room: Room | None) -> None:
        """A leg's destination and layouts, checked when its request comes if the prefill
        rank's memory is known (its engine announced the room, or it is the only engine
        of that rank here), not once its engine has computed and sent: an
        incompatible pair fails before the prefill spends the compute (SGLang computes
        only once the decode asked). The engine hears it from its room, or at its
        announce or send; the decode daemon from the PeerError this raises."""
        head = self._head(room) if room is not None else None
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
            self._destination(local, leg, dst, peer, room_id)
        except PdxferError as exc:
            if room is not None:
                self.fail(room, exc.code, exc.message)
            else:
                self.remember(key, RoomState.FAILED, exc.code, exc.message)
            raise
    def _ack(self, peer: DecodePeer, msg: RoomAck) -> None:
        room = self.rooms.get(self._leg_key(msg.room, msg.leg))
        if self.work[room.id].peer != peer.identity:
            raise errors.BadMessage(f"room {msg.room} belongs to another decode daemon", room=msg.room, side=errors.Side.PEER)
        if room.state.value != "transferring":
            return  # failed meanwhile: the failure stands
        room.bytes_moved = room.bytes_planned  # the decode side verified every byte of it, aux included
        self.succeed(room, Event.DONE)

    def _peer_failed(self, peer: DecodePeer, msg: RoomFailed) -> None:
        key = self._leg_key(msg.room, msg.leg)
        room = self.rooms.find(key)
        w = self.work.get(key)
        if w is not None and w.peer and w.peer != peer.identity:
            # Another decode daemon's room under the same id (a second request for it
            # was refused as duplicate_room): its failure is not this peer's to make.
            # Nothing of ours is aimed at this peer for it, so its pages may go.
            self.count_failure("ignored:room-of-another-peer")
            log.warning("room %d: ignored room_failed from decode daemon %s: the room belongs to another decode daemon (%s)",
                        msg.room, peer.hello.name or peer.label, msg.reason)
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=msg.code, reason="this prefill wrote nothing for your room under this id", fenced=True, leg=msg.leg))
            return
        if room is not None and not room.finished:
            self.fail(room, msg.code, f"decode side: {msg.reason}")
            return
        if room is None and key not in self.finished:  # its request never reached us: a later send() hears why
            self.remember(key, RoomState.FAILED, msg.code, f"decode side: {msg.reason}")
        if w is None or (w.job is None and not w.jobs):  # nothing of ours in flight: acknowledge the fence now
            self.port.send_peer(peer.identity, RoomFailed(room=msg.room, code=msg.code, reason="no write in flight", fenced=True, leg=msg.leg))

    # --- peer health

    def on_connection(self, identity: bytes, event: str) -> None:
        """A decode daemon's bootstrap connection came (it proved its identity) or went."""
        if event == "connected":
            self.connected.add(identity)
            return
        self.connected.discard(identity)
        peer = self.peers.get(identity)
        if peer is not None:
            log.info("decode daemon %s's bootstrap connection closed: its %d rooms here fail if a write to it fails before it is back",
                     peer.hello.name or peer.label, len(peer.rooms), extra={"peer": peer.label})

    def write_failed(self, sessions: Peer) -> None:
        """A write to the transfer sessions ``sessions`` failed (the pump writes it
        again). To a decode daemon whose bootstrap connection is closed too, that is
        proof enough that it is gone: its rooms fail now, and their jobs are cancelled
        (their writes in flight still settle before a room counts as fenced)."""
        for peer in [p for p in self.peers.values() if p.sessions == sessions and p.identity not in self.connected]:
            self.declare_dead(peer, f"decode daemon {peer.hello.name or peer.label}: its bootstrap connection closed and a "
                                    f"write to its transfer engine ({label(sessions)}) failed")

    def tick(self) -> None:
        super().tick()
        now = self.clock()
        if self._stalled(now):  # we were frozen, not they silent: start their clocks again
            for peer in self.peers.values():
                peer.last_heard = resumed(peer.last_heard, now)
        for peer in [p for p in self.peers.values() if self.heartbeats.dead(p.last_heard, now)]:
            self.declare_dead(peer, f"decode daemon {peer.hello.name or peer.label} sent nothing for {now - peer.last_heard:.1f}s ({self.config.heartbeat_misses} heartbeats missed)")

    def declare_dead(self, peer: DecodePeer, reason: str) -> None:
        """Fail exactly this peer's rooms and forget it; a live peer says hello again."""
        self.peers.pop(peer.identity, None)
        self.count_failure("peers_declared_dead")
        live = sum(1 for r in peer.rooms if (room := self.rooms.find(r)) is not None and not room.finished)
        log.error("declared decode daemon %s dead, failing its %d live rooms: %s", peer.hello.name or peer.label, live, reason, extra={"peer": peer.label})
        for room_id in list(peer.rooms):
            room = self.rooms.find(room_id)
            if room is not None:
                self.fail(room, ErrorCode.PEER_DEAD, reason)

    # --- hooks

    def stop_writes(self, room: Room) -> bool:
        w = self.work.get(room.id)
        if w is None:
            return True
        w.chunks.clear()
        jobs = [job for job in (*w.jobs, w.job) if job is not None]
        for job in jobs:
            if not job.settled:
                self.port.cancel(job)
        # A job the pump abandoned has settled, but its writes may still land (a wedged
        # session): that is no proof, so the decode side is not told fenced.
        in_flight = any(not job.settled or job.abandoned for job in jobs)
        if w.peer:
            self.port.send_peer(w.peer, RoomFailed(room=room_of(room.id), code=room.code, reason=room.reason, fenced=not in_flight, leg=w.leg))
        return not in_flight

    def engine_of(self, room: Room) -> bytes:
        w = self._head(room)
        return w.engine if w else b""

    def disown(self, room: Room) -> None:
        w = self._head(room)
        if w is not None:
            w.engine = b""

    def room_pages(self, room: Room) -> tuple[int, int]:
        w = self.work.get(room.id)
        if w is None or w.request is None:
            return 0, 0
        return w.request.skip_pages + w.dst_pages.size, w.request.skip_pages

    def room_memory_version(self, room: Room) -> int:
        w = self.work.get(room.id)
        return w.memory_version if w and w.memory_version else self._kv(room).version

    def rooms_of_message(self, msg: Message) -> list[Room]:
        room_id = getattr(msg, "room", 0)
        if not room_id:
            return []
        legs = msg.legs if isinstance(msg, RoomAccepted) else (getattr(msg, "leg", 0),)
        return list({room.id: room for leg in legs if (room := self.rooms.find(self._leg_key(room_id, leg))) is not None}.values())

    def forget(self, room: Room) -> None:
        w = self.work.pop(room.id, None)
        if w is not None and w.peer in self.peers:
            self.peers[w.peer].rooms.discard(room.id)

    def peer_count(self) -> int:
        return len(self.peers)

    def peer_infos(self, now: float, wall: float) -> list[PeerInfo]:
        return [
            PeerInfo(
                address=p.hello.session, name=p.hello.name, incarnation=p.hello.incarnation,
                state="draining" if p.draining else "alive", last_heard=now - p.last_heard, rtt_ms=-1.0,
                clock_skew_ms=p.skew * 1000, rooms=len(p.rooms),
            )
            for p in self.peers.values()
        ]

    def peer_gone(self, record, reason: str) -> None:
        name = f"{record.host}/{record.name}"
        for peer in [p for p in self.peers.values() if p.hello.name == name and p.hello.incarnation == record.incarnation]:
            self.declare_dead(peer, f"decode daemon {name}: {reason}")

    def drain(self, peer: str) -> None:
        matched = [p for p in self.peers.values() if peer in p.hello.session or peer in p.hello.name]
        if not matched:
            raise errors.PdxferError(f"no decode peer matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        for p in matched:
            p.draining = True
            log.warning("operator drains decode daemon %s: no new rooms, %d finishing", p.hello.name or p.label, len(p.rooms), extra={"peer": p.label})
