"""The decode role: take the engine's expect(), ask the prefill daemon for the room,
and declare Success only when the aux record's stamp (and, with --verify-kv, the KV
digest) verifies against what this side expects (A1, S3).

One link (a wire.bootstrap.MessageLink, opened by the daemon) per prefill bootstrap
address. The first message on a link, and the first after every re-registration and
every change of our transfer sessions, is a PeerHello describing this side's pools and
the legs of the prefill's rooms we hold live; with a cluster secret it leaves only once
the prefill proved it holds the secret too (wire.bootstrap), since it says where to
write. Every link heartbeats; a prefill that stops answering, drops its connection, or
answers under a new incarnation is declared dead and exactly the rooms on that link fail.

Fencing (S2). A failed room's slot and pages go back to the engine only on proof that
no write aimed at them can land: the prefill confirms it has nothing in flight for the
room (room_failed with fenced, or its aux record, which it sends only after its writes
completed); a new incarnation of it answers at its address (the old process is gone);
or every generation of this daemon's transfer sessions the room could be written into
ended (rotation.py). No clock is proof: a prefill frozen with writes queued inside its
transfer engine sends them when it resumes, whatever leases ran out meanwhile. Until one
of those, the room is *fence-pending*: failed, not fenced, its slot quarantined with no
deadline, visible in ``pdxfer rooms``, ``slots``, ``peers`` and the metrics; the room
table keeps the facts (core/rooms.py: its writers are its legs).

Leave to write. That lease starts on the prefill's clock, when it starts writing, and
a prefill that stood still (SIGSTOP, swap) or sat behind a partition may read a room's
request long after this side gave up on the room. So every room request and heartbeat
also carries ``writes_until``: send time + transfer timeout + fence timeout, on the
prefill's clock (this side bounds the offset from the prefill's answers). Messages on a
link arrive in order, so a room not failed when the prefill reads one was live when it
was sent, and is held at least that long; the prefill writes to this side only before
the newest leave it read. Requests wait for the link's first offset (the welcome).

The parts: asking for rooms (requester.py), deciding they landed (verifier.py), ending
sessions (rotation.py); what they share (state.py); the rooms themselves (book.py) and
the engine conversation both roles have (engine.py).
"""

from __future__ import annotations

import collections
import functools
import logging
import math

from ...core import errors, paths
from ...core.config import Config
from ...core.errors import IllegalTransition, PdxferError
from ...core.generations import Span
from ...core.liveness import TickGaps, resumed
from ...core.plan import check_memory_version, check_pages, pages_from_bytes
from ...core.protocol import (
    PROTOCOL_VERSION,
    AuxRecord,
    ErrorCode,
    Expect,
    Heartbeat,
    HeartbeatAck,
    LaneInfo,
    LegWritten,
    Message,
    Ok,
    PeerError,
    PeerHello,
    PeerInfo,
    PeerRefused,
    PeerWelcome,
    Role,
    RoomAccepted,
    RoomFailed,
    RoomRequest,
    RoomState,
    RoomStatus,
    SessionsDrained,
    TransferStarted,
    pack_legs,
)
from ...core.rooms import Event, Room
from ...core.topology import decode_rank_of, key_label, room_key, room_of
from ...transport import Peer, primary
from ..book import RoomBook
from ..engine import EngineDesk
from ..lanes import Lane, Lanes
from ..ports import DecodePort
from ..staging import Staging
from .requester import Requester
from .rotation import SessionRotation
from .state import DecodeState, DecodeWork, LegState, PrefillLink
from .verifier import Verifier

log = logging.getLogger("pdxfer.decode")


@functools.lru_cache(maxsize=1024)  # parsed for every expect(); prefill addresses are few
def bootstrap_endpoint(address: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port'."""
    address = address.strip()
    if address.startswith("tcp://"):
        address = address[len("tcp://") :]
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.BadMessage(f"bootstrap address {address!r} is not host:port")
    return f"tcp://{host}:{port}"


class DecodeService:
    role = Role.DECODE

    def __init__(self, config: Config, incarnation: str, port: DecodePort, *, sessions: Peer, probe_base: int, engine_release: str,
                 staging: Staging | None = None) -> None:
        self.config = config
        self.incarnation = incarnation
        self.port = port
        self.name = f"{config.host}/{config.instance}"  # stable name peers know this daemon by
        self.probe_base = probe_base  # 64 scratch bytes of ours a prefill may write to test its session
        self.engine_release = engine_release  # this host's transfer engine version, told to prefills (A3 over tcp needs both to acknowledge writes)
        self.staging = staging
        self.heartbeats = config.heartbeats
        self.heartbeat_misses = 0
        self.peer_messages: collections.Counter[type] = collections.Counter()  # peer messages received, by type (A5 counts requests)
        self.state = DecodeState()
        self.lanes = Lanes(config, Role.DECODE, port)
        self.book = RoomBook(config, port, self.lanes, self, slot_fence=math.inf)  # never by a clock (S2)
        self.rooms = self.book.rooms
        self.room_messages = {Expect: self._expect}
        self.desk = EngineDesk(Role.DECODE, incarnation, "", config.fence_seconds, port, self.lanes, self.book, self)
        self.on_engine = self.desk.on_engine  # the daemon's engine messages go straight to the desk
        self.requester = Requester(config, port, self.lanes, self.book, self.state, staging)
        self.verifier = Verifier(config, port, self.lanes, self.book, self.state, self.requester, staging)
        self.sessions = SessionRotation(config, port, self.book, self.state, sessions, self._hello_all)
        self._gaps = TickGaps(config.heartbeats)

    # --- the engine conversation (roles/engine.py asks these)

    def _expect(self, identity: bytes, msg: Expect) -> Message:
        lane = self.lanes.of(identity)
        kv, aux = lane.registered_kv(), lane.registered_aux()
        endpoint = self._resolve(msg.bootstrap, msg.room)
        link = self.state.links.get(endpoint)
        if link is not None and link.draining:
            raise errors.Busy(f"an operator is draining prefill {endpoint}: no new rooms with it", room=msg.room, retry_after_ms=1000)
        try:
            dst = pages_from_bytes(msg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room) from None
        check_pages(dst, kv.num_pages, "destination", msg.room)
        check_memory_version(msg.memory_version, kv.version, "local", msg.room)
        legs = self.requester.legs(lane, msg)
        room = self.book.create(room_key(msg.room, lane.code), Role.DECODE, lane.index, peer=endpoint)
        # What it can receive at most: its pages in every region and a full aux record.
        room.bytes_planned = dst.size * kv.page_bytes + aux.slot_bytes
        try:
            self.book.bind_slot(room, msg.slot, msg.generation)
        except PdxferError:
            self.rooms.remove(room.id)
            raise
        link = self._link(endpoint)
        # A dummy leg writes nothing here: landed from the start, and no writer.
        states = {leg.leg: LegState(leg, landed=not leg.real, stage_layout=self.requester.stage_layout(lane, msg, leg, dst.size))
                  for leg in legs}
        room.writers.update(leg.leg for leg in legs if leg.real)
        now = self.sessions.generations.current
        self.state.work[room.id] = DecodeWork(identity, endpoint, msg.memory_version, dst.copy(), states, epoch=link.epoch, span=Span(now, now))
        link.rooms.add(room.id)
        if link.unreachable:
            room.reason = f"waiting for prefill {endpoint}: {link.unreachable}"
        self.requester.gather(link, msg.room, lane, legs)
        return Ok(req=msg.req)

    def _resolve(self, bootstrap: str, room: int) -> str:
        """A prefill daemon's bootstrap endpoint from host:port, or from its name in the registry."""
        try:
            address = None if ":" in bootstrap else self.port.resolve(bootstrap)
        except PdxferError as exc:
            raise PdxferError(exc.message, code=exc.code, room=room) from None
        if address is None:  # an address, or a name with no registry to look it up in
            return bootstrap_endpoint(bootstrap)
        try:
            return bootstrap_endpoint(address)
        except PdxferError as exc:
            raise PdxferError(exc.message, code=exc.code, room=room) from None

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        return self.book.fail(room, code, reason)

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        return RoomStatus(req=req, room=room_of(room.id), state=room.state, code=room.code, reason=room.reason, fenced=room.fenced)

    def memory_version(self, room: Room) -> int:
        w = self.state.work.get(room.id)
        return w.memory_version if w else 0

    def registered(self) -> None:
        """An engine rank registered: every prefill hears where our pools are now."""
        if any(lane.ready for lane in self.lanes):
            self._hello_all()

    def disown(self, room: Room) -> None:
        w = self.state.work.get(room.id)
        if w is not None:
            w.engine = b""

    def engine_of(self, room: Room) -> bytes:
        w = self.state.work.get(room.id)
        return w.engine if w else b""

    def release(self, room: Room) -> None:
        self.book.release(room)

    def peer_count(self) -> int:
        return len(self.state.links)

    # --- what the book asks of its rooms (roles/book.py)

    def stop_writes(self, room: Room) -> None:
        """Tell each leg's prefill rank the room failed (it waits for an ack, or its
        engine's send() would); legs still waiting to leave never do."""
        w = self.state.work.get(room.id)
        if w is None:
            room.writers.clear()
            return
        room_id = room_of(room.id)
        for code, leg in w.legs.items():
            if not leg.peer_failed:
                self.port.send_link(w.link, RoomFailed(room=room_id, code=room.code, reason=room.reason, fenced=True, leg=code))
        link = self.state.links.get(w.link)
        if link is not None:
            self.requester.withdraw(link, room)
        if room.writers:
            log.warning("room %s: pages and slot %d held until prefill %s confirms nothing is in flight or restarts, or until "
                        "the transfer sessions it may write into end (within %gs of its last word)",
                        key_label(room.id), room.slot, w.link, self.config.fence_seconds, extra={"room": room_id, "peer": w.link})

    def fenced(self, room: Room, proven: bool) -> None:
        self.requester.unstage_room(room.id)

    def forget(self, room: Room) -> None:
        w = self.state.work.pop(room.id, None)
        if w is not None and w.link in self.state.links:
            self.state.links[w.link].rooms.discard(room.id)

    # --- the bootstrap channel

    def _link(self, endpoint: str) -> PrefillLink:
        link = self.state.links.get(endpoint)
        if link is None:
            now = self.port.clock()
            self.state.links[endpoint] = link = PrefillLink(endpoint, last_heard=now, last_word=now)
            self.port.open_link(endpoint)
            self.port.send_link(endpoint, self.hello(endpoint))
        return link

    def hello(self, endpoint: str) -> PeerHello:
        """What the prefill at ``endpoint`` hears first on every connection, and again on
        every registration and rotation: our pools and sessions, and the legs of its rooms
        we hold live, which from now on may be written through these sessions only."""
        ready = [lane for lane in self.lanes if lane.ready]
        sessions = self.sessions.sessions
        return PeerHello(
            version=PROTOCOL_VERSION,
            incarnation=self.incarnation,
            session=primary(sessions),
            sessions=sessions,
            lanes=tuple(self._lane_info(lane) for lane in ready),
            name=self.name,
            probe_base=self.probe_base,
            verify_kv=self.config.verify_kv,
            inline_kv_bytes=min((paths.inline_kv_limit(lane.kv.kind, self.config.inline_kv_bytes) for lane in ready), default=0),
            engine_release=self.engine_release,
            staging_base=self.staging.base if self.staging else 0,
            staging_bytes=self.staging.arena.size if self.staging else 0,
            live_legs=pack_legs(self._live_legs(endpoint)),
        )

    def _live_legs(self, endpoint: str) -> list[tuple[int, int]]:
        """The (room, leg) pairs of the link's rooms not failed; each of those rooms may be
        written into the current generation from now on."""
        link, current = self.state.links.get(endpoint), self.sessions.generations.current
        pairs = []
        for room in self._link_rooms(link) if link is not None else ():
            if room.state is not RoomState.FAILED:
                w = self.state.work[room.id]
                w.span = w.span.moved(current)
                pairs += [(room_of(room.id), code) for code in w.legs]
        return pairs

    @staticmethod
    def _lane_info(lane: Lane) -> LaneInfo:
        kv, aux = lane.kv, lane.aux
        return LaneInfo(
            index=lane.index, rank=lane.rank, compat=lane.compat(), heads_local=kv.spec.heads.local,
            layers=kv.spec.layers, region_bases=kv.bases, num_pages=kv.num_pages, aux_base=aux.memory.address,
            aux_slots=aux.num_slots, memory_version=kv.version,
        )

    def _hello_all(self) -> None:
        """A hello on every link; one whose connection is down hears it first thing on
        the next (its greeting), so none waits there behind what is queued."""
        for endpoint, link in self.state.links.items():
            if link.connected or not link.epoch:
                self.port.send_link(endpoint, self.hello(endpoint))

    def on_link(self, endpoint: str, incarnation: str, msg: Message) -> None:
        """A message from the prefill at ``endpoint``, decoded; ``incarnation`` its envelope's."""
        link = self.state.links.get(endpoint)
        if link is None:
            return
        link.last_heard = link.last_word = self.port.clock()
        if link.incarnation and incarnation != link.incarnation:
            self._restarted(link, incarnation)
        self.peer_messages[type(msg)] += 1  # by type: named by tag when counted
        try:
            self._dispatch_link(link, msg)
        except IllegalTransition as exc:  # the peer sent a signal that does not fit the room's state (H3)
            log.warning("prefill %s sent %s out of order: %s", endpoint, type(msg).__name__, exc, extra={"peer": endpoint})
            self.port.send_link(endpoint, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"{type(msg).__name__} out of order: {exc.message}", room=getattr(msg, "room", 0)))
        except PdxferError as exc:
            log.warning("prefill %s sent %s that cannot be accepted: %s", endpoint, type(msg).__name__, exc, extra={"peer": endpoint})
            self.port.send_link(endpoint, PeerError(code=exc.code, message=exc.message, room=exc.room))
        except Exception:  # H1
            self.book.count_failure("internal")
            log.exception("internal error handling %s from prefill %s", type(msg).__name__, endpoint, extra={"peer": endpoint})

    def _dispatch_link(self, link: PrefillLink, msg: Message) -> None:
        if isinstance(msg, (AuxRecord, LegWritten)):  # every room's, so asked first
            room = self._room_of(link, msg.room, msg.leg)
            if room is not None:
                self.verifier.leg_record(link, room, msg)
            return
        if isinstance(msg, HeartbeatAck):
            now = self.port.clock()
            link.clock_sample(msg.clock, now)
            if msg.seq == link.beats:
                link.rtt = now - link.last_beat
                if msg.wall:
                    link.skew = msg.wall - (link.beat_wall + link.rtt / 2)
            return
        if isinstance(msg, PeerWelcome):
            link.ready, link.incarnation, link.session, link.stages = True, msg.incarnation, msg.session, msg.stages
            link.clock_sample(msg.clock, self.port.clock())
            log.info("prefill daemon %s (incarnation %s) accepted this daemon", link.endpoint, msg.incarnation, extra={"peer": link.endpoint})
            self.requester.send_held(link)
            return
        if isinstance(msg, PeerRefused):
            self._refused(link, msg)
            return
        if isinstance(msg, PeerError):
            self._peer_error(link, msg)
            return
        if isinstance(msg, SessionsDrained):
            self.sessions.drained(link, tuple(msg.sessions))
            return
        if isinstance(msg, RoomAccepted):  # one per request: the rooms of the legs it took
            for room in {r.id: r for leg in msg.legs if (r := self._room_of(link, msg.room, leg)) is not None}.values():
                if room.state is RoomState.BOOTSTRAPPING:  # another leg's request may have been accepted first
                    self.book.advance(room, Event.BOOTSTRAPPED)
                if msg.input_ready:
                    self._started(room)
            return
        room = self._room_of(link, msg.room, getattr(msg, "leg", 0))
        if room is None:  # never ours, or gone
            return
        if isinstance(msg, TransferStarted):
            self._started(room)
        elif isinstance(msg, RoomFailed):
            self.state.work[room.id].legs[msg.leg].peer_failed = True
            if msg.fenced:  # that prefill rank has nothing in flight for it
                self.requester.unstage(room.id, msg.leg)
                self.book.writer_done(room, msg.leg)
            self.book.fail(room, msg.code, f"prefill side: {msg.reason}")
        else:
            raise errors.BadMessage(f"a decode daemon does not accept {type(msg).__name__}", side=errors.Side.PEER)

    def _started(self, room: Room) -> None:
        """A prefill rank began writing the room (the first of its legs to)."""
        if room.state is not RoomState.TRANSFERRING:
            self.book.advance(room, Event.INPUT_READY)
        w = self.state.work[room.id]
        w.started = w.started or self.port.clock()

    def _room_of(self, link: PrefillLink, room_id: int, leg: int) -> Room | None:
        """The rank's room a leg of ``room_id`` from this link writes into, if it is ours."""
        room = self.rooms.find(room_key(room_id, decode_rank_of(leg)))
        if room is None or room.peer != link.endpoint or leg not in self.state.work[room.id].legs:
            return None
        return room

    def _peer_error(self, link: PrefillLink, msg: PeerError) -> None:
        log.warning("prefill %s reported %s: %s", link.endpoint, msg.code.value, msg.message, extra={"room": msg.room or None, "peer": link.endpoint})
        if msg.code is ErrorCode.UNKNOWN_PEER:
            if not link.ready:
                # Our rooms here already failed; this may answer something sent before
                # our new hello, or the hello itself was lost in a reconnect: say it again.
                self.port.send_link(link.endpoint, self.hello(link.endpoint))
                return
            # It declared us dead (we stalled) or lost us: our rooms there are gone.
            link.ready = False
            self._fail_link(link, ErrorCode.PEER_DEAD, f"prefill {link.endpoint} no longer knows this daemon: {msg.message}")
            self.port.send_link(link.endpoint, self.hello(link.endpoint))
            return
        room = self._room_of(link, msg.room, msg.leg) if msg.room else None
        if room is not None:
            self.book.fail(room, msg.code, f"prefill side: {msg.message}")

    def _refused(self, link: PrefillLink, msg: PeerRefused) -> None:
        log.error("prefill daemon %s refused this daemon [%s]: %s", link.endpoint, msg.code.value, msg.reason, extra={"peer": link.endpoint})
        for room in self._link_rooms(link):
            self.requester.unstage_room(room.id)
            self.book.writers_gone(room)  # it refused us: it never wrote
        self._fail_link(link, msg.code, f"prefill {link.endpoint} refused: {msg.reason}")
        self.state.links.pop(link.endpoint, None)
        self.port.close_link(link.endpoint)

    def link_unauthenticated(self, endpoint: str, why: str) -> None:
        """A message from the prefill whose signature does not check (wire.seal.Seal says
        which side lacks the secret): nothing in it is believed, but the link's live
        rooms fail now, naming the cluster secret, instead of at the bootstrap timeout.
        That gives no one a power they lacked: whoever can put bytes on this
        connection can close it, which fails the same rooms. Fencing still takes proof
        (stop_writes): only a request still held, never sent, is fenced at once."""
        self.book.count_failure("unauthenticated")
        log.warning("dropped a message from prefill %s: %s", endpoint, why, extra={"peer": endpoint})
        link = self.state.links.get(endpoint)
        if link is not None:
            self._fail_link(link, ErrorCode.UNAUTHENTICATED, f"prefill {endpoint} sent a message this daemon cannot trust: {why}")

    def link_unproven(self, endpoint: str, why: str) -> None:
        """The link's connection was refused because the prefill did not prove the
        cluster secret (wire.bootstrap: nothing was sent on it): the link's live rooms
        fail now, naming the secret, rather than at the bootstrap timeout. As in
        link_unauthenticated, that is no power a stranger at the address lacked."""
        link = self.state.links.get(endpoint)
        if link is not None:
            self._fail_link(link, ErrorCode.UNAUTHENTICATED, f"prefill {endpoint}: {why}")

    def _fail_link(self, link: PrefillLink, code: ErrorCode, reason: str, before: int | None = None) -> None:
        """Fail the link's rooms (those asked for before epoch ``before``, when given)."""
        for room in self._link_rooms(link, before):
            self.book.fail(room, code, reason)

    def still_wanted(self, msg: Message) -> bool:
        return self.requester.still_wanted(msg)

    def unsent(self, messages: list[Message]) -> None:
        """Peer messages that could not be queued (the connection was closing, or too
        much already waited for it): the live rooms they were about fail now, as
        peer_unreachable, rather than at their timeout."""
        for msg in messages:
            if isinstance(msg, RoomRequest):
                rooms = self.requester.rooms_of(msg)
            elif isinstance(msg, RoomFailed):
                rooms = [r for r in [self.rooms.find(room_key(msg.room, decode_rank_of(msg.leg)))] if r is not None]
            else:
                continue
            for room in rooms:
                if not room.finished:
                    if isinstance(msg, RoomRequest):
                        self.requester.never_sent(room, msg)
                    self.book.fail(room, ErrorCode.PEER_UNREACHABLE, "a message for this room could not be sent to the peer daemon "
                                                                     "(its connection was closing, or too much already waited for it)")

    # --- peer health

    def tick(self) -> None:
        for room in self.book.tick():
            self.book.fail(room, ErrorCode.TIMEOUT, self.book.timeout_reason(room))
        now = self.port.clock()
        rule = self.heartbeats
        stalled = self._gaps.stood_still(now)
        for link in list(self.state.links.values()):
            if stalled:  # we were frozen, not they silent: start their clocks again
                link.last_heard, link.last_word = resumed(link.last_heard, now), resumed(link.last_word, now)
            if not link.rooms and rule.idle(link.last_heard, now):
                self._forget_link(link)
                continue
            if link.connected and rule.due(link.last_beat, now):
                if rule.missed(link.beats, link.last_beat, link.last_heard):
                    self.heartbeat_misses += 1  # not a word since the last one
                link.beats += 1
                link.last_beat, link.beat_wall = now, self.port.wall()
                self.port.send_link(link.endpoint, Heartbeat(seq=link.beats, wall=link.beat_wall,
                                                             writes_until=link.writes_until(now, self.requester.leave_span)))
            # Silence counts only once the prefill has answered at all; before that the
            # bootstrap timeout covers a prefill that never shows up.
            if link.incarnation and rule.dead(link.last_heard, now) and self._live_rooms(link):
                self.declare_dead(link, f"prefill {link.endpoint} answered nothing for {now - link.last_heard:.1f}s ({self.config.heartbeat_misses} heartbeats missed)")
        self.sessions.tick(now)

    def _live_rooms(self, link: PrefillLink) -> bool:
        return any((room := self.rooms.find(r)) is not None and not room.finished for r in link.rooms)

    def _forget_link(self, link: PrefillLink) -> None:
        """An idle link to a prefill not heard from in a long while: close it, so
        churn in prefill addresses cannot grow links and heartbeats without end."""
        log.info("closing idle link to prefill %s", link.endpoint, extra={"peer": link.endpoint})
        self.state.links.pop(link.endpoint, None)
        self.port.close_link(link.endpoint)

    def on_connection(self, endpoint: str, event: str) -> None:
        """The link's TCP connection came or went (the link reconnects by itself)."""
        link = self.state.links.get(endpoint)
        if link is None:
            return
        link.connected = event == "connected"
        if link.connected and link.unreachable:
            log.info("prefill %s reached after: %s", endpoint, link.unreachable, extra={"peer": endpoint})
            link.unreachable = ""
            for room in self._link_rooms(link):
                if not room.finished:
                    room.reason = ""
        if not link.connected:
            link.epoch += 1
            if self._live_rooms(link):
                self.declare_dead(link, f"prefill {endpoint} closed its connection")
            else:
                # A peer that answered and went is news (a killed or restarting prefill), whether or not it held rooms.
                log.log(logging.WARNING if link.incarnation else logging.INFO, "connection to prefill %s lost; connecting again",
                        endpoint, extra={"peer": endpoint})

    def unreachable(self, endpoint: str, why: str) -> None:
        """A connect to the prefill failed (the link tries again by itself): said once per
        streak in the log, and in the status of each room waiting for it, so its engine
        and `pdxfer room` see why at once rather than a timeout's worth later."""
        link = self.state.links.get(endpoint)
        if link is None or link.unreachable == why:
            return
        waiting = [room for room in self._link_rooms(link) if room.state is RoomState.BOOTSTRAPPING]
        if not link.unreachable:
            log.warning("cannot reach prefill %s: %s; trying again (%d rooms waiting for it)", endpoint, why, len(waiting), extra={"peer": endpoint})
        link.unreachable = why
        for room in waiting:
            room.reason = f"waiting for prefill {endpoint}: {why}"
            self.book.push(room)

    def declare_dead(self, link: PrefillLink, reason: str, before: int | None = None) -> None:
        """Fail exactly the rooms on this link (those asked for before epoch ``before``,
        when given). The link stays: it reconnects, and a recovered or restarted prefill
        gets new rooms as usual."""
        self.book.count_failure("peers_declared_dead")
        live = sum(1 for room in self._link_rooms(link, before) if not room.finished)
        log.error("declared prefill %s dead, failing its %d live rooms: %s", link.endpoint, live, reason, extra={"peer": link.endpoint})
        link.last_heard = self.port.clock()
        self._fail_link(link, ErrorCode.PEER_DEAD, reason, before)

    def _link_rooms(self, link: PrefillLink, before: int | None = None) -> list[Room]:
        """The link's rooms; with ``before``, those asked for in an earlier epoch."""
        rooms = [room for r in list(link.rooms) if (room := self.rooms.find(r)) is not None]
        return rooms if before is None else [room for room in rooms if self.state.work[room.id].epoch < before]

    def _restarted(self, link: PrefillLink, incarnation: str, on_link: bool = True) -> None:
        """A new process answers at the link's address: the old one is gone, so
        nothing of it can land any more. When it answered on the link, rooms asked for
        since the connection to the old one was lost went to it (the link says hello
        first on every new connection): they stay."""
        old = link.incarnation
        link.incarnation, link.ready = incarnation, False
        link.offsets.clear()  # perhaps another host's clock
        before = link.epoch if on_link else None
        self.declare_dead(link, f"prefill {link.endpoint} restarted (incarnation {old} -> {incarnation})", before)
        for room in self._link_rooms(link, before):
            self.book.writers_gone(room)
        for key, extent in list(self.state.staged.items()):
            if extent.link == link.endpoint and (before is None or extent.epoch < before):
                self.requester.unstage(*key)
        self.port.send_link(link.endpoint, self.hello(link.endpoint))

    # --- what the daemon and operators ask

    def peer_infos(self, now: float, wall: float) -> list[PeerInfo]:
        fence_in = self.sessions.fence_in(now)
        return [
            PeerInfo(
                address=link.endpoint, name=link.endpoint, incarnation=link.incarnation, state=self._peer_state(link, now),
                last_heard=now - link.last_word, rtt_ms=link.rtt * 1000 if link.rtt >= 0 else -1.0,
                clock_skew_ms=link.skew * 1000, rooms=len(link.rooms), fence_pending=len(self.book.fence_pending(link.endpoint)),
                fence_in=fence_in.get(link.endpoint, -1.0),
            )
            for link in self.state.links.values()
        ]

    def _peer_state(self, link: PrefillLink, now: float) -> str:
        if link.draining:
            return "draining"
        if link.incarnation and self.heartbeats.dead(link.last_word, now):
            return "silent"
        return "alive" if link.ready and link.connected else "connecting"

    def peer_gone(self, record, reason: str) -> None:
        """The registry says a prefill daemon is gone: its lease lapsed, or it registered
        again under a new incarnation."""
        link = self.state.links.get(bootstrap_endpoint(record.bootstrap)) if record.bootstrap else None
        if link is None or (link.incarnation and link.incarnation != record.incarnation):
            return  # not ours, or already talking to its successor
        successor = self.port.incarnation_of(record.name)
        if successor and successor != record.incarnation:
            self._restarted(link, successor, on_link=False)  # the old process is gone: fence at once
        elif link.rooms:
            self.declare_dead(link, f"prefill {record.name}: {reason}")

    def drain(self, peer: str) -> None:
        """Operator action: no new rooms with prefills whose address contains ``peer``."""
        matched = [link for link in self.state.links.values() if peer in link.endpoint]
        if not matched:
            raise errors.PdxferError(f"no prefill link matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        for link in matched:
            link.draining = True
            log.warning("operator drains prefill %s: no new rooms, %d finishing", link.endpoint, len(link.rooms), extra={"peer": link.endpoint})

    def check_cut(self, peer: str) -> list[PrefillLink]:
        """The links an operator's cut names (pdxfer peer P --cut); raises if none."""
        matched = [link for link in self.state.links.values() if peer in link.endpoint]
        if not matched:
            raise errors.PdxferError(f"no prefill link matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        return matched

    def cut(self, peer: str, answer) -> None:
        """Operator cut: end the sessions every room waiting for proof may be written
        into, without failing any live prefill's writes (a rotation); ``answer(fenced)``
        once it ended, with how many rooms it fenced."""
        matched = self.check_cut(peer)
        self.sessions.cut(f"operator cut (peer {peer!r}: {', '.join(link.endpoint for link in matched)})", answer)

    # --- what the daemon asks of either role (roles/inbound.py)

    def sessions_rotated(self, sessions: Peer) -> None:
        self.sessions.rotated(sessions)

    def sessions_ended(self, sessions: Peer) -> None:
        self.sessions.ended(sessions)

    def rotation_failed(self, reason: str) -> None:
        self.sessions.failed(reason)

    def counters(self) -> dict[str, float]:
        """Everything this role counts, for the admin API and the metrics."""
        return {
            **self.desk.counters(),
            **{f"peer_messages_in:{kind.__struct_config__.tag}": float(n) for kind, n in self.peer_messages.items()},
            "heartbeat_misses": float(self.heartbeat_misses),
            "staging_taken_bytes": float(self.staging.arena.taken_bytes if self.staging else 0),
            "bytes_received": float(self.verifier.bytes_received),
            "legs_staged": float(self.requester.staged_legs),
            "staging_full": float(self.staging.full if self.staging else 0),
            "session_rotations": float(self.sessions.rotations),
            "rooms_fenced_by_session_end": float(self.sessions.fenced),
        }
