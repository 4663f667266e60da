"""The decode role: take the engine's expect(), ask the prefill daemon for the room,
and declare Success only when the aux record's stamp (and, with --verify-kv, the KV
digest) verifies against what this side expects (A1, S3).

One link (a wire.bootstrap.PeerLink, opened by the daemon) per prefill bootstrap address. The
first message on a link, and the first after every re-registration, is a
PeerHello describing this side's pools; with a cluster secret it leaves only once the
prefill proved it holds the secret too (wire.bootstrap), since it says where to write. Every link heartbeats; a prefill that stops
answering, drops its connection, or answers under a new incarnation is declared dead
and exactly the rooms on that link fail.

Fencing (S2). A failed room's slot and pages go back to the engine only on proof that
no write aimed at them can land: the prefill confirms it has nothing in flight for the
room (room_failed with fenced, or its aux record, which it sends only after its writes
completed); a new incarnation of it answers at its address (the old process is gone);
or every generation of this daemon's transfer sessions the room could be written into
ended (core/generations.py: ending an engine closes its sockets with whatever they
held). No clock is proof: a prefill frozen with writes queued inside its transfer engine
sends them when it resumes, whatever leases ran out meanwhile. Until one of those, the
room is *fence-pending*: failed, not fenced, its slot quarantined with no deadline,
visible in ``pdxfer rooms``, ``slots``, ``peers`` and the metrics.

Sessions end by rotation: new engines beside the current ones, a hello on every link
with the legs each prefill may move to them (it fails the others first), and the old
engines ended once every prefill still heard from said it drained them, or at the
rotation's deadline. A room waiting for proof starts one when its prefill went silent
past the heartbeat bound, or after half the fence bound, so that it is fenced within
``--fence-bound`` of its prefill's last word; ``pdxfer peer P --cut`` starts one too.

Leave to write. That lease starts on the prefill's clock, when it starts writing, and
a prefill that stood still (SIGSTOP, swap) or sat behind a partition may read a room's
request long after this side gave up on the room. So every room request and heartbeat
also carries ``writes_until``: send time + transfer timeout + fence timeout, on the
prefill's clock (this side bounds the offset from the prefill's answers). Messages on a
link arrive in order, so a room not failed when the prefill reads one was live when it
was sent, and is held at least that long; the prefill writes to this side only before
the newest leave it read. Requests wait for the link's first offset (the welcome).

Here: the engine side, the bootstrap channel, peer health and fencing. Asking for a
room (legs, gathering) is decode_requests.py; deciding it landed, decode_verify.py;
the records kept, decode_state.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import msgspec

from ..core import errors, paths
from ..core.config import Config
from ..core.errors import IllegalTransition, PdxferError
from ..core.generations import Generations, Rotation, Span, fence_due
from ..core.liveness import resumed
from ..core.plan import check_pages, pages_from_bytes
from ..core.protocol import (
    UNDECODABLE,
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
    RoomState,
    RoomFailed,
    RoomRequest,
    SessionsDrained,
    TransferStarted,
    pack_legs,
    tag_of,
)
from ..core.rooms import Event, Room
from ..core.slots import SlotState
from ..core.topology import decode_rank_of, key_label, room_key, room_of
from ..transport import Peer, label, primary
from .base import RoomService
from .decode_requests import RoomRequests
from .decode_state import DecodeWork, LegState, PendingRequest, PrefillLink, StagedExtent, Unfenced
from .decode_verify import RoomVerification
from .pools import Lane, Staging
from .ports import DecodePort

log = logging.getLogger("pdxfer.decode")

# A rotation gives live prefills at least this long to move off the old sessions, and
# ends them this long before the first waiting room's fence is due.
ROTATION_MIN_DRAIN = 0.2
ROTATION_END_MARGIN = 0.5
ROTATION_RETRY = 1.0  # seconds between tries when new transfer engines fail to start


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


class DecodeService(RoomRequests, RoomVerification, RoomService):
    role = Role.DECODE

    def __init__(self, config: Config, incarnation: str, port: DecodePort, *, sessions: Peer, probe_base: int, engine_release: str,
                 staging: Staging | None = None) -> None:
        super().__init__(config, incarnation, port, sessions=sessions, bootstrap_address="")
        self.port: DecodePort = port
        self.links: dict[str, PrefillLink] = {}
        self.work: dict[int, DecodeWork] = {}
        self.pending: dict[tuple[str, int], PendingRequest] = {}  # (prefill endpoint, room id): legs gathering (A5)
        self.name = f"{config.host}/{config.instance}"  # stable name peers know this daemon by
        self.probe_base = probe_base  # 64 scratch bytes of ours a prefill may write to test its session
        self.engine_release = engine_release  # this host's transfer engine version, told to prefills (A3 over tcp needs both to acknowledge writes)
        self.fence_bound = config.fence_seconds
        self.generations = Generations.starting(sessions)  # our transfer sessions over time (core/generations.py)
        self.rotation: Rotation | None = None  # the retirement of the generation before the current one, while it runs
        self.rotation_asked = ""  # why a rotation was asked for and has not begun ("": none asked)
        self.rotation_retry_at = 0.0  # after a rotation failed to start: not asked again before this
        self.cut_waiters: list = []  # operator cuts answered once the rotation after them ended: fenced count -> None
        self.rotations = 0  # generations retired by a rotation
        self.cuts = 0  # of them, asked for by an operator (pdxfer peer P --cut)
        self.sessions_fenced = 0  # failed rooms fenced because every generation they could be written into ended
        self.staging = staging  # where legs between ranks of different TP land first (core/staging.py); None: nowhere
        self.staged: dict[tuple[int, int], StagedExtent] = {}  # (room key, leg code): its extent, until fenced
        self.staged_legs = 0  # legs given an extent

    # --- engine side

    def on_expect(self, identity: bytes, msg: Expect) -> Message:
        lane = self.lane_for(identity)
        kv, aux = lane.registered_kv(), lane.registered_aux()
        endpoint = self._resolve(msg.bootstrap, msg.room)
        link = self.links.get(endpoint)
        if link is not None and link.draining:
            raise errors.Busy(f"an operator is draining prefill {endpoint}: no new rooms with it", room=msg.room, retry_after_ms=1000)
        try:
            dst = pages_from_bytes(msg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room) from None
        check_pages(dst, kv.num_pages, "destination", msg.room)
        self.check_local_version(lane, msg.memory_version, msg.room)
        legs = self._leg_requests(lane, msg)
        room = self.rooms.create(room_key(msg.room, lane.code), Role.DECODE, self.clock(), peer=endpoint)
        room.lane = lane.index
        # What it can receive at most: its pages in every region and a full aux record.
        room.bytes_planned = dst.size * kv.page_bytes + aux.slot_bytes
        try:
            self.bind_slot(room, msg.slot, msg.generation)
        except PdxferError:
            self.rooms.remove(room.id)
            raise
        link = self._link(endpoint)
        # A dummy leg writes nothing here: landed and fenced from the start.
        states = {leg.leg: LegState(leg, landed=not leg.real, peer_fenced=not leg.real, stage_layout=self._stage_layout(lane, msg, leg, dst.size))
                  for leg in legs}
        now_gen = self.generations.current
        self.work[room.id] = DecodeWork(identity, endpoint, msg.memory_version, dst.copy(), states, epoch=link.epoch, span=Span(now_gen, now_gen))
        link.rooms.add(room.id)
        self._gather(link, msg.room, lane, legs)
        return Ok(req=msg.req)

    @property
    def _leave_span(self) -> float:
        """How long a room sent now keeps its pages at least, should it fail at once:
        its lease, then the fence timeout (see fence_deadline)."""
        return self.config.transfer_timeout + self.config.fence_timeout

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

    def _link(self, endpoint: str) -> PrefillLink:
        link = self.links.get(endpoint)
        if link is None:
            self.links[endpoint] = link = PrefillLink(endpoint, last_heard=self.clock(), last_word=self.clock())
            self.port.open_link(endpoint)
            self.port.send_link(endpoint, self.hello(endpoint))
        return link

    def hello(self, endpoint: str) -> PeerHello:
        """What the prefill at ``endpoint`` hears first on every connection, and again on
        every registration and rotation: our pools and sessions, and the legs of its rooms
        we hold live, which from now on may be written through these sessions only."""
        return PeerHello(
            version=PROTOCOL_VERSION,
            incarnation=self.incarnation,
            session=primary(self.sessions),
            sessions=self.sessions,
            lanes=tuple(self._lane_info(lane) for lane in self.lanes if lane.ready),
            name=self.name,
            probe_base=self.probe_base,
            verify_kv=self.config.verify_kv,
            inline_kv_bytes=min((paths.inline_kv_limit(lane.kv.kind, self.config.inline_kv_bytes) for lane in self.lanes if lane.ready), default=0),
            engine_release=self.engine_release,
            staging_base=self.staging.base if self.staging else 0,
            staging_bytes=self.staging.arena.size if self.staging else 0,
            live_legs=pack_legs(self._live_legs(endpoint)),
        )

    def _live_legs(self, endpoint: str) -> list[tuple[int, int]]:
        """The (room, leg) pairs of the link's rooms not failed; each of those rooms may be
        written into the current generation from now on."""
        link, current = self.links.get(endpoint), self.generations.current
        pairs = []
        for room in self._link_rooms(link) if link is not None else ():
            if room.state is not RoomState.FAILED:
                w = self.work[room.id]
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

    def on_kv_registered(self) -> None:
        if any(lane.ready for lane in self.lanes):
            self._hello_all()

    def _hello_all(self) -> None:
        """A hello on every link; one whose connection is down hears it first thing on
        the next (its greeting), so none waits there behind what is queued."""
        for endpoint, link in self.links.items():
            if link.connected or not link.epoch:
                self.port.send_link(endpoint, self.hello(endpoint))

    # --- bootstrap channel

    def on_link(self, endpoint: str, incarnation: str, raw: bytes) -> None:
        link = self.links.get(endpoint)
        if link is None:
            return
        link.last_heard = link.last_word = self.clock()
        if link.incarnation and incarnation != link.incarnation:
            self._restarted(link, incarnation)
        try:
            msg = self.codec.peer_messages.decode(raw)
        except UNDECODABLE as exc:
            log.warning("undecodable message from prefill %s: %s", endpoint, exc, extra={"peer": endpoint})
            return
        self.peer_messages[tag_of(msg)] += 1
        try:
            self._dispatch_link(link, msg)
        except IllegalTransition as exc:  # the peer sent a signal that does not fit the room's state (H3)
            log.warning("prefill %s sent %s out of order: %s", endpoint, type(msg).__name__, exc, extra={"peer": endpoint})
            self.port.send_link(endpoint, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"{type(msg).__name__} out of order: {exc.message}", room=getattr(msg, "room", 0)))
        except PdxferError as exc:
            log.warning("prefill %s sent %s that cannot be accepted: %s", endpoint, type(msg).__name__, exc, extra={"peer": endpoint})
            self.port.send_link(endpoint, PeerError(code=exc.code, message=exc.message, room=exc.room))
        except Exception:  # H1
            self.count_failure("internal")
            log.exception("internal error handling %s from prefill %s", type(msg).__name__, endpoint, extra={"peer": endpoint})

    def _dispatch_link(self, link: PrefillLink, msg: Message) -> None:
        if isinstance(msg, (AuxRecord, LegWritten)):  # every room's, so asked first
            room = self._room_of(link, msg.room, msg.leg)
            if room is not None:
                self._leg_record(link, room, msg)
            else:  # the prefill sends these only after its writes completed
                self._confirmed_released(link, msg.room, msg.leg)
            return
        if isinstance(msg, HeartbeatAck):
            now = self.clock()
            link.clock_sample(msg.clock, now)
            if msg.seq == link.beats:
                link.rtt = now - link.last_beat
                if msg.wall:
                    link.skew = msg.wall - (link.beat_wall + link.rtt / 2)
            return
        if isinstance(msg, PeerWelcome):
            link.ready, link.incarnation, link.session, link.stages = True, msg.incarnation, msg.session, msg.stages
            link.clock_sample(msg.clock, self.clock())
            log.info("prefill daemon %s (incarnation %s) accepted this daemon", link.endpoint, msg.incarnation, extra={"peer": link.endpoint})
            for request in link.held.values():
                self._send_request(link, request)
            link.held.clear()
            return
        if isinstance(msg, PeerRefused):
            self._refused(link, msg)
            return
        if isinstance(msg, PeerError):
            self._peer_error(link, msg)
            return
        if isinstance(msg, SessionsDrained):
            self._drained(link, tuple(msg.sessions))
            return
        if isinstance(msg, RoomAccepted):  # one per request: the rooms of the legs it took
            for room in {r.id: r for leg in msg.legs if (r := self._room_of(link, msg.room, leg)) is not None}.values():
                if room.state is RoomState.BOOTSTRAPPING:  # another leg's request may have been accepted first
                    self.advance(room, Event.BOOTSTRAPPED)
                if msg.input_ready:
                    self._started(room)
            return
        room = self._room_of(link, msg.room, getattr(msg, "leg", 0))
        if room is None:  # released by its engine, or never ours
            if isinstance(msg, RoomFailed) and msg.fenced:
                self._confirmed_released(link, msg.room, msg.leg)
            return
        if isinstance(msg, TransferStarted):
            self._started(room)
        elif isinstance(msg, RoomFailed):
            w = self.work[room.id]
            leg = w.legs[msg.leg]
            leg.peer_fenced, leg.peer_failed = msg.fenced, True
            if msg.fenced:
                self._unstage(room.id, msg.leg)
            if not self.fail(room, msg.code, f"prefill side: {msg.reason}") and w.writers_done:
                self.fenced(room)
        else:
            raise errors.BadMessage(f"a decode daemon does not accept {type(msg).__name__}", side=errors.Side.PEER)

    def _confirmed_released(self, link: PrefillLink, room_id: int, leg: int) -> None:
        """A prefill rank has nothing in flight for a failed room no longer in the table
        (its engine released it): once every rank of it said so, its quarantined slot may go."""
        key = room_key(room_id, decode_rank_of(leg))
        self._unstage(key, leg)
        held = link.unfenced.get(key)
        if held is None:
            return
        waiting = held.waiting - {leg}
        if waiting:
            link.unfenced[key] = dataclasses.replace(held, waiting=waiting)
            return
        del link.unfenced[key]
        self._fence_released(held)

    def _fence_released(self, entry: Unfenced) -> None:
        aux = self.lanes[entry.lane].aux
        if aux is not None:
            aux.slots.fence(entry.slot, entry.generation, self.clock())

    def _unfenced_waiting(self, entry: Unfenced) -> bool:
        """Whether a failed room's slot (link.unfenced) is still quarantined for it."""
        aux = self.lanes[entry.lane].aux
        slot = aux.slots.slots[entry.slot] if aux is not None else None
        return slot is not None and slot.generation == entry.generation and slot.state is SlotState.QUARANTINED

    def _started(self, room: Room) -> None:
        """A prefill rank began writing the room (the first of its legs to)."""
        if room.state is not RoomState.TRANSFERRING:
            self.advance(room, Event.INPUT_READY)
        w = self.work[room.id]
        w.started = w.started or self.clock()

    def _room_of(self, link: PrefillLink, room_id: int, leg: int) -> Room | None:
        """The rank's room a leg of ``room_id`` from this link writes into, if it is ours."""
        room = self.rooms.find(room_key(room_id, decode_rank_of(leg)))
        if room is None or room.peer != link.endpoint or leg not in self.work[room.id].legs:
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
            self.fail(room, msg.code, f"prefill side: {msg.message}")

    def _refused(self, link: PrefillLink, msg: PeerRefused) -> None:
        log.error("prefill daemon %s refused this daemon [%s]: %s", link.endpoint, msg.code.value, msg.reason, extra={"peer": link.endpoint})
        for room_id in list(link.rooms):
            if room_id in self.work:
                for code, leg in self.work[room_id].legs.items():
                    leg.peer_fenced = True  # it refused us: it never wrote
                    self._unstage(room_id, code)
        self._fail_link(link, msg.code, f"prefill {link.endpoint} refused: {msg.reason}")
        self.links.pop(link.endpoint, None)
        self.port.close_link(link.endpoint)

    def link_unauthenticated(self, endpoint: str, why: str) -> None:
        """A message from the prefill whose signature does not check (wire.seal.Seal says
        which side lacks the secret): nothing in it is believed, but the link's live
        rooms fail now, naming the cluster secret, instead of at the bootstrap timeout.
        That gives no one a power they lacked: whoever can put bytes on this
        connection can close it, which fails the same rooms. Fencing still takes proof
        (stop_writes): only a request still held, never sent, is fenced at once."""
        self.count_failure("unauthenticated")
        log.warning("dropped a message from prefill %s: %s", endpoint, why, extra={"peer": endpoint})
        link = self.links.get(endpoint)
        if link is not None:
            self._fail_link(link, ErrorCode.UNAUTHENTICATED, f"prefill {endpoint} sent a message this daemon cannot trust: {why}")

    def link_unproven(self, endpoint: str, why: str) -> None:
        """The link's connection was refused because the prefill did not prove the
        cluster secret (wire.bootstrap: nothing was sent on it): the link's live rooms
        fail now, naming the secret, rather than at the bootstrap timeout. As in
        link_unauthenticated, that is no power a stranger at the address lacked."""
        link = self.links.get(endpoint)
        if link is not None:
            self._fail_link(link, ErrorCode.UNAUTHENTICATED, f"prefill {endpoint}: {why}")

    def _fail_link(self, link: PrefillLink, code: ErrorCode, reason: str, before: int | None = None) -> None:
        """Fail the link's rooms (those asked for before epoch ``before``, when given)."""
        for room in self._link_rooms(link, before):
            self.fail(room, code, reason)

    # --- peer health

    def tick(self) -> None:
        super().tick()
        now = self.clock()
        rule = self.heartbeats
        stalled = self._stalled(now)
        for link in list(self.links.values()):
            if stalled:  # we were frozen, not they silent: start their clocks again
                link.last_heard, link.last_word = resumed(link.last_heard, now), resumed(link.last_word, now)
            if not link.rooms and rule.idle(link.last_heard, now):
                self._forget_link(link)
                continue
            link.unfenced = {r: entry for r, entry in link.unfenced.items() if self._unfenced_waiting(entry)}
            if link.connected and rule.due(link.last_beat, now):
                if rule.missed(link.beats, link.last_beat, link.last_heard):
                    self.heartbeat_misses += 1  # not a word since the last one
                link.beats += 1
                link.last_beat, link.beat_wall = now, self.port.wall()
                self.port.send_link(link.endpoint, Heartbeat(seq=link.beats, wall=link.beat_wall, writes_until=link.writes_until(now, self._leave_span)))
            # Silence counts only once the prefill has answered at all; before that the
            # bootstrap timeout covers a prefill that never shows up.
            if link.incarnation and rule.dead(link.last_heard, now) and self._live_rooms(link):
                self.declare_dead(link, f"prefill {link.endpoint} answered nothing for {now - link.last_heard:.1f}s ({self.config.heartbeat_misses} heartbeats missed)")
        self._fence_by_bound(now)

    def _live_rooms(self, link: PrefillLink) -> bool:
        return any((room := self.rooms.find(r)) is not None and not room.finished for r in link.rooms)

    def _forget_link(self, link: PrefillLink) -> None:
        """An idle link to a prefill not heard from in a long while: close it, so
        churn in prefill addresses cannot grow links and heartbeats without end."""
        log.info("closing idle link to prefill %s", link.endpoint, extra={"peer": link.endpoint})
        self.links.pop(link.endpoint, None)
        self.port.close_link(link.endpoint)

    def on_connection(self, endpoint: str, event: str) -> None:
        """The link's TCP connection came or went (the link reconnects by itself)."""
        link = self.links.get(endpoint)
        if link is None:
            return
        link.connected = event == "connected"
        if not link.connected:
            link.epoch += 1
            if self._live_rooms(link):
                self.declare_dead(link, f"prefill {endpoint} closed its connection")

    def declare_dead(self, link: PrefillLink, reason: str, before: int | None = None) -> None:
        """Fail exactly the rooms on this link (those asked for before epoch ``before``,
        when given). The link stays: it reconnects, and a recovered or restarted prefill
        gets new rooms as usual."""
        self.count_failure("peers_declared_dead")
        live = sum(1 for room in self._link_rooms(link, before) if not room.finished)
        log.error("declared prefill %s dead, failing its %d live rooms: %s", link.endpoint, live, reason, extra={"peer": link.endpoint})
        link.last_heard = self.clock()
        self._fail_link(link, ErrorCode.PEER_DEAD, reason, before)

    def _link_rooms(self, link: PrefillLink, before: int | None = None) -> list[Room]:
        """The link's rooms; with ``before``, those asked for in an earlier epoch."""
        rooms = [room for r in list(link.rooms) if (room := self.rooms.find(r)) is not None]
        return rooms if before is None else [room for room in rooms if self.work[room.id].epoch < before]

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
        self._fence_link(link, before)
        self.port.send_link(link.endpoint, self.hello(link.endpoint))

    def _fence_link(self, link: PrefillLink, before: int | None = None) -> None:
        """Nothing the link's prefill sent can land any more: its failed rooms (those of
        epochs before ``before``, when given), and the slots of those the engine already
        released, are fenced."""
        for room in self._link_rooms(link, before):
            self.fenced(room)
        for key, extent in list(self.staged.items()):
            if extent.link == link.endpoint and (before is None or extent.epoch < before):
                self._unstage(*key)
        for key, entry in list(link.unfenced.items()):
            if before is None or entry.epoch < before:
                self._fence_released(entry)
                del link.unfenced[key]

    def fence_pending(self, link: PrefillLink) -> int:
        """Failed rooms of this link (released by their engine or not) still waiting
        for proof that nothing of them can land."""
        return sum(1 for entry in link.unfenced.values() if self._unfenced_waiting(entry))

    # --- ending old sessions (core/generations.py)

    def check_cut(self, peer: str) -> list[PrefillLink]:
        """The links an operator's cut names (pdxfer peer P --cut); raises if none."""
        matched = [link for link in self.links.values() if peer in link.endpoint]
        if not matched:
            raise errors.PdxferError(f"no prefill link matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        return matched

    def cut(self, peer: str, answer) -> None:
        """Operator cut (pdxfer peer P --cut): end the sessions every room waiting for
        proof may be written into, without failing any live prefill's writes: a
        rotation; ``answer(fenced)`` once it ended, with how many rooms it fenced."""
        matched = self.check_cut(peer)
        self.cut_waiters.append(answer)
        self._ask_rotation(f"operator cut (peer {peer!r}: {', '.join(link.endpoint for link in matched)})")

    def _ask_rotation(self, reason: str) -> None:
        """Start a rotation, or one more after the one running: it covers only rooms
        whose generations it ends."""
        if self.rotation_asked:
            return
        self.rotation_asked = reason
        if self.rotation is None:
            log.warning("replacing this daemon's transfer sessions: %s", reason)
            self.port.rotate_sessions()

    def rotation_failed(self, reason: str) -> None:
        """New transfer engines could not start: the tick asks again a while later."""
        log.error("could not start new transfer sessions (%s): %s; trying again in %gs", self.rotation_asked, reason, ROTATION_RETRY)
        self.count_failure("rotation_failed")
        self.rotation_asked = ""
        self.rotation_retry_at = self.clock() + ROTATION_RETRY

    def sessions_rotated(self, sessions: Peer) -> None:
        """New transfer engines took over at ``sessions`` (a rotation, or a new engine
        process after the last one died): every prefill hears of them with the legs it may
        move there, and the generation before them ends once every prefill live now said
        it drained, or at the deadline."""
        old = self.generations.current
        old_sessions = self.generations.sessions
        self.generations.rotated(sessions)
        self.new_sessions(sessions)
        reason, self.rotation_asked = self.rotation_asked or "the transfer engine process ended", ""
        self._hello_all()
        if old not in self.generations.live:  # ended already (its process died): nothing to wait for
            self._after_rotation(0)
            return
        now, rule = self.clock(), self.heartbeats
        waiting = {link.endpoint for link in self.links.values()
                   if link.ready and link.connected and not rule.dead(link.last_word, now)}
        dues = [due for _, _, due in self._waiting_for_proof(now)]
        deadline = max(now + ROTATION_MIN_DRAIN, min(dues, default=now + self.fence_bound) - ROTATION_END_MARGIN)
        self.rotation = Rotation(old, old_sessions, reason, now, deadline, waiting)
        log.warning("transfer sessions %s replace %s (%s); %d prefill(s) to move off them within %.1fs",
                    label(sessions), label(old_sessions), reason, len(waiting), deadline - now)
        self._end_if_due(now)

    def _drained(self, link: PrefillLink, sessions: Peer) -> None:
        rotation = self.rotation
        if rotation is not None and rotation.sessions == sessions and rotation.drained(link.endpoint):
            self._end_if_due(self.clock())

    def _end_if_due(self, now: float) -> None:
        rotation = self.rotation
        if rotation is None or not rotation.due(now):
            return
        rotation.ending = True
        if rotation.waiting:
            log.warning("ending transfer sessions %s although %s did not say they drained within %.1fs: their writes still in "
                        "flight there fail", label(rotation.sessions), ", ".join(sorted(rotation.waiting)), now - rotation.started)
        self.port.end_sessions(rotation.sessions)

    def sessions_ended(self, sessions: Peer) -> None:
        """The engines at ``sessions`` ended (we ended them, or their process died): every
        failed room that could be written into no live generation is fenced."""
        if self.generations.ended(sessions) is None:
            return
        fenced = self._fence_where_sessions_ended()
        self.sessions_fenced += fenced
        rotation = self.rotation
        if rotation is not None and rotation.sessions == sessions:
            self.rotation = None
            self.rotations += 1
            log.warning("transfer sessions %s ended after %.1fs (%s): %d room(s) waiting for proof fenced",
                        label(sessions), self.clock() - rotation.started, rotation.reason, fenced)
            self._after_rotation(fenced)
        elif fenced:
            log.warning("transfer sessions %s ended: %d room(s) waiting for proof fenced", label(sessions), fenced)

    def _after_rotation(self, fenced: int) -> None:
        waiters, self.cut_waiters = self.cut_waiters, []
        self.cuts += len(waiters)
        for answer in waiters:
            answer(fenced)
        if self.rotation_asked:  # asked for while this one ran
            self.port.rotate_sessions()

    def _fence_where_sessions_ended(self) -> int:
        """Fence every failed room, and every released one's slot, that no live generation
        can receive a write for; how many."""
        fenced = 0
        for link in self.links.values():
            for room in self._link_rooms(link):
                w = self.work[room.id]
                if room.finished and not room.fenced and self.generations.all_ended(w.span):
                    w.sessions_ended = True
                    for code in w.legs:
                        self._unstage(room.id, code)
                    self.fenced(room)
                    fenced += 1
            for key, entry in list(link.unfenced.items()):
                if self.generations.all_ended(entry.span):
                    for code in entry.waiting:
                        self._unstage(key, code)
                    if self.rooms.find(key) is None:  # a room still in the table was fenced above
                        self._fence_released(entry)
                        fenced += 1
                    del link.unfenced[key]
        return fenced

    def _waiting_for_proof(self, now: float) -> list[tuple[PrefillLink, Unfenced, float]]:
        """Every failed room still waiting for proof: (its link, its entry, when it must be fenced)."""
        bound = self.fence_bound
        return [(link, entry, fence_due(entry.failed_at, link.last_word, bound))
                for link in self.links.values() for entry in link.unfenced.values() if self._unfenced_waiting(entry)]

    def _fence_by_bound(self, now: float) -> None:
        """The tick's: end a rotation's old sessions once no live prefill is left to
        drain them, or at its deadline; and start a rotation for a room waiting for proof
        whose prefill went silent, or that waited half the fence bound, unless the one
        running ends its sessions already."""
        rotation = self.rotation
        if rotation is not None:
            for endpoint in list(rotation.waiting):  # a prefill that went away drains nothing: its writes end with the sessions
                link = self.links.get(endpoint)
                if link is None or not link.connected or self.heartbeats.dead(link.last_word, now):
                    rotation.drained(endpoint)
        self._end_if_due(now)
        if now < self.rotation_retry_at:
            return
        rule, half = self.heartbeats, self.fence_bound / 2
        for link, entry, _ in self._waiting_for_proof(now):
            silent = rule.dead(link.last_word, now)
            if not (silent or now - entry.failed_at >= half):
                continue
            if self.rotation is not None and entry.span.last <= self.rotation.old:
                continue  # the running rotation ends its sessions
            why = f"prefill {link.endpoint} silent for {now - link.last_word:.1f}s" if silent else \
                f"a room of prefill {link.endpoint} waited {now - entry.failed_at:.1f}s for its writes to drain"
            self._ask_rotation(f"{why}, with rooms waiting for proof that nothing of theirs can land")
            return

    # --- hooks

    def fence_deadline(self, room: Room, now: float) -> float:
        """Never by a clock (S2): a frozen prefill's queued writes land whenever it
        resumes. Only a proof fences (see the module docstring)."""
        return math.inf

    def fenced(self, room: Room) -> None:
        w = self.work.get(room.id)
        if w is not None and w.copies:  # its last copy out of the staging buffer calls this again
            return
        super().fenced(room)

    def stop_writes(self, room: Room) -> bool:
        w = self.work.get(room.id)
        if w is None:
            return True
        room_id = room_of(room.id)
        for code, leg in w.legs.items():
            if not leg.peer_failed:  # the prefill must learn it: it waits for an ack, or its engine's send() would
                self.port.send_link(w.link, RoomFailed(room=room_id, code=room.code, reason=room.reason, fenced=True, leg=code))
        link = self.links.get(w.link)
        if link is not None:
            self._withdraw(link, room)
        if w.peer_fenced:
            return not w.copies  # a copy still writing its pages fences it when it ends
        # Its RoomFailed(fenced) replies, its restart, or the end of its sessions fences it; nothing else.
        if link is not None and room.slot >= 0:
            waiting = frozenset(code for code, leg in w.legs.items() if not leg.peer_fenced)
            link.unfenced[room.id] = Unfenced(room.lane, room.slot, room.generation, waiting, w.span, self.clock(), w.epoch)
        log.warning("room %s: pages and slot %d held until prefill %s confirms nothing is in flight or restarts, or until "
                    "the transfer sessions it may write into end (within %gs of its last word)",
                    key_label(room.id), room.slot, w.link, self.fence_bound, extra={"room": room_id, "peer": w.link})
        return False

    def _withdraw(self, link: PrefillLink, room: Room) -> None:
        """The room's legs leave the request not sent yet (gathering, or held for the
        link's clock): the prefill never hears of them, so nothing of them can land."""
        room_id = room_of(room.id)
        pending = self.pending.get((link.endpoint, room_id))
        if pending is not None:
            mine = [leg for leg in pending.legs if leg.lane == room.lane]
            pending.legs = [leg for leg in pending.legs if leg.lane != room.lane]
            if mine:
                self.never_sent(room, RoomRequest(room=room_id, legs=tuple(mine)))
        held = link.held.get(room_id)
        if held is not None:
            mine = tuple(leg for leg in held.legs if leg.lane == room.lane)
            rest = tuple(leg for leg in held.legs if leg.lane != room.lane)
            if rest:
                link.held[room_id] = msgspec.structs.replace(held, legs=rest)
            else:
                del link.held[room_id]
            if mine:
                self.never_sent(room, msgspec.structs.replace(held, legs=mine))

    def still_wanted(self, payload: bytes) -> bool:
        """For a link that connects: whether a message posted while it was down still
        goes. A room_request whose room ended meanwhile does not: once the room is
        released its pages may be another room's. The prefill never heard of that
        room, so a failed one is fenced now."""
        msg = self.codec.peer_messages.decode(payload)
        if not isinstance(msg, RoomRequest):
            return True
        rooms = self.rooms_of_message(msg)
        if any(not room.finished for room in rooms):
            return True
        for room in rooms:
            self.never_sent(room, msg)
            self.fenced(room)
        return False

    def never_sent(self, room: Room, msg: Message) -> None:
        w = self.work.get(room.id)
        if w is not None and isinstance(msg, RoomRequest):  # the prefill never heard of these legs: nothing to tell, nothing can land
            for request in msg.legs:
                leg = w.legs.get(request.leg) if request.lane == room.lane else None
                if leg is not None:
                    leg.peer_failed = leg.peer_fenced = True
                    self._unstage(room.id, request.leg)

    def rooms_of_message(self, msg: Message) -> list[Room]:
        if isinstance(msg, RoomRequest):
            keys = {room_key(msg.room, decode_rank_of(leg.leg)) for leg in msg.legs}
        elif isinstance(msg, RoomFailed):
            keys = {room_key(msg.room, decode_rank_of(msg.leg))}
        else:
            return []
        return [room for key in keys if (room := self.rooms.find(key)) is not None]

    def engine_of(self, room: Room) -> bytes:
        w = self.work.get(room.id)
        return w.engine if w else b""

    def disown(self, room: Room) -> None:
        w = self.work.get(room.id)
        if w is not None:
            w.engine = b""

    def room_memory_version(self, room: Room) -> int:
        w = self.work.get(room.id)
        return w.memory_version if w else 0

    def forget(self, room: Room) -> None:
        w = self.work.pop(room.id, None)
        if w is not None and w.link in self.links:
            self.links[w.link].rooms.discard(room.id)

    def peer_count(self) -> int:
        return len(self.links)

    def peer_infos(self, now: float, wall: float) -> list[PeerInfo]:
        dues: dict[str, float] = {}
        for link, _, due in self._waiting_for_proof(now):
            dues[link.endpoint] = min(due, dues.get(link.endpoint, due))
        return [
            PeerInfo(
                address=link.endpoint, name=link.endpoint, incarnation=link.incarnation, state=self._peer_state(link, now),
                last_heard=now - link.last_word, rtt_ms=link.rtt * 1000 if link.rtt >= 0 else -1.0,
                clock_skew_ms=link.skew * 1000, rooms=len(link.rooms), fence_pending=self.fence_pending(link),
                fence_in=max(0.0, dues[link.endpoint] - now) if link.endpoint in dues else -1.0,
            )
            for link in self.links.values()
        ]

    def _peer_state(self, link: PrefillLink, now: float) -> str:
        if link.draining:
            return "draining"
        if link.incarnation and self.heartbeats.dead(link.last_word, now):
            return "silent"
        return "alive" if link.ready and link.connected else "connecting"

    def peer_gone(self, record, reason: str) -> None:
        link = self.links.get(bootstrap_endpoint(record.bootstrap)) if record.bootstrap else None
        if link is None or (link.incarnation and link.incarnation != record.incarnation):
            return  # not ours, or already talking to its successor
        successor = self.port.incarnation_of(record.name)
        if successor and successor != record.incarnation:
            self._restarted(link, successor, on_link=False)  # the old process is gone: fence at once
        elif link.rooms:
            self.declare_dead(link, f"prefill {record.name}: {reason}")

    def drain(self, peer: str) -> None:
        matched = [link for link in self.links.values() if peer in link.endpoint]
        if not matched:
            raise errors.PdxferError(f"no prefill link matches {peer!r}", code=ErrorCode.UNKNOWN_PEER)
        for link in matched:
            link.draining = True
            log.warning("operator drains prefill %s: no new rooms, %d finishing", link.endpoint, len(link.rooms), extra={"peer": link.endpoint})
