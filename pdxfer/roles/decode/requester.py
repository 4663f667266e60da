"""How the decode role asks for a room (A4, A5): a rank's legs from core/topology.py,
gathered with its sibling ranks' into one request per room per prefill daemon, which
leaves once every registered rank of the engine expected the room, or after
expect_batch_ms; a request waits for the link's clock (its leave to write). Legs that
gain from staging take an extent of the staging buffer as their request leaves, and
give it back once nothing of them can land; legs of a failed room still waiting to
leave never do."""

from __future__ import annotations

import msgspec

from ...core import errors
from ...core.config import Config
from ...core.errors import PdxferError
from ...core.plan import staged_layout
from ...core.protocol import Expect, KVSpec, LegRequest, RoomRequest
from ...core.rooms import Room
from ...core.staging import StagedLayout
from ...core.topology import decode_rank_of, leg_code, leg_layers, legs_for_decode_rank, local_heads, room_key, room_of
from ..book import RoomBook
from ..lanes import Lane, Lanes
from ..ports import DecodePort
from ..staging import Staging
from .state import DecodeState, PendingRequest, PrefillLink, StagedExtent


def _prefill_heads(spec: KVSpec, msg: Expect) -> int:
    """KV heads each rank of the prefill engine holds."""
    return spec.heads.total if spec.mla else local_heads(spec.heads.total, msg.prefill_sizes.tp or 1)


class Requester:
    def __init__(self, config: Config, port: DecodePort, lanes: Lanes, book: RoomBook, state: DecodeState, staging: Staging | None) -> None:
        self.config = config
        self.port = port
        self.lanes = lanes
        self.book = book
        self.state = state
        self.staging = staging  # where legs between ranks of different TP land first (core/staging.py); None: nowhere
        self.staged_legs = 0  # legs given an extent

    @property
    def leave_span(self) -> float:
        """How long a room sent now keeps its pages at least, should it fail at once: its
        lease, then the fence timeout."""
        return self.config.transfer_timeout + self.config.fence_timeout

    def legs(self, lane: Lane, msg: Expect) -> list[LegRequest]:
        """This rank's legs of the room (core/topology.py): which prefill ranks write
        which heads and layers into its pages, and which one carries the aux record."""
        spec = lane.registered_kv().spec
        prefill_tp, prefill_pp = msg.prefill_sizes.tp or 1, msg.prefill_sizes.pp or 1
        try:
            expected = spec.heads.total if spec.mla else local_heads(spec.heads.total, lane.sizes.tp)
            if spec.heads.local != expected:
                raise errors.BadMessage(
                    f"{lane.name} registered {spec.heads.local} local KV heads, but {spec.heads.total} heads over TP "
                    f"{lane.sizes.tp} give each rank {expected}")
            legs = legs_for_decode_rank(prefill_tp, lane.sizes.tp, spec.heads.total, lane.rank.tp, spec.mla, prefill_pp,
                                        lane.sizes.pp, num_layers=spec.num_layers_total, decode_stage=lane.rank.pp)
        except PdxferError as exc:
            raise PdxferError(exc.message, code=exc.code, room=msg.room) from None
        prefill_heads = _prefill_heads(spec, msg)
        fan_out = max(1, lane.sizes.tp // prefill_tp)  # how many decode ranks each prefill rank writes to
        out = []
        for leg in legs:
            whole_heads = leg.head_count == spec.heads.local == prefill_heads
            whole_layers = (leg.layer_start, leg.layer_end) == (0, spec.num_layers_total)
            out.append(LegRequest(
                leg=leg_code(leg), lane=lane.index, pages=msg.pages,
                slot=msg.slot if leg.carries_aux else 0, generation=msg.generation if leg.carries_aux else 0,
                memory_version=msg.memory_version, num_draft_tokens=msg.num_draft_tokens, skip_pages=msg.skip_pages,
                real=leg.real, src_head_start=0 if whole_heads else leg.src_head_start,
                head_count=0 if whole_heads else leg.head_count, dst_head_start=0 if whole_heads else leg.dst_head_start,
                layers=(0, 0) if whole_layers else (leg.layer_start, leg.layer_end), fan_out=fan_out,
            ))
        return out

    def stage_layout(self, lane: Lane, msg: Expect, leg: LegRequest, positions: int) -> StagedLayout | None:
        """Where a leg would lie in an extent of the staging buffer, if it gains from one (core/staging.py)."""
        kv = lane.registered_kv()
        spec = kv.spec
        if self.staging is None or not leg.real or not kv.worth_staging(leg.head_count, _prefill_heads(spec, msg), self.config.stage_spans_below):
            return None
        return staged_layout(kv.regions, kv.regions, spec.heads.local, leg.head_count, leg_layers(leg.layers, spec.num_layers_total), positions)

    def _staged(self, link: PrefillLink, request: RoomRequest) -> RoomRequest:
        """A request as it leaves: its legs that gain from staging get an extent of the
        staging buffer where one is free and the prefill writes staged legs (its welcome
        said so); the others write into the pages."""
        if not link.stages:
            return request
        legs = []
        for leg in request.legs:
            key = room_key(request.room, decode_rank_of(leg.leg))
            w = self.state.work.get(key)
            state = w.legs[leg.leg] if w is not None else None
            if state is not None and state.stage_layout is not None:
                offset = self.staging.take(state.stage_layout.nbytes)
                if offset is not None:
                    self.state.staged[(key, leg.leg)] = StagedExtent(offset, link.endpoint, link.epoch)
                    self.staged_legs += 1
                    leg = state.request = msgspec.structs.replace(leg, staged_at=self.staging.base + offset)
            legs.append(leg)
        return msgspec.structs.replace(request, legs=tuple(legs))

    def unstage(self, key: int, leg: int) -> None:
        """Nothing of the leg can land any more: its staging extent, if it has one, is free."""
        extent = self.state.staged.pop((key, leg), None)
        if extent is not None:
            self.staging.arena.give(extent.offset)

    def unstage_room(self, key: int) -> None:
        for code in [leg for (k, leg) in self.state.staged if k == key]:
            self.unstage(key, code)

    def gather(self, link: PrefillLink, room_id: int, lane: Lane, legs: list[LegRequest]) -> None:
        """A5: one request per room per prefill daemon, with the legs of every local rank
        of the engine; it leaves once they all expected the room, or after expect_batch_ms."""
        key = (link.endpoint, room_id)
        pending = self.state.pending.get(key)
        if pending is None:
            self.state.pending[key] = pending = PendingRequest(link, [])
        pending.legs.extend(legs)
        if all(self.book.rooms.find(room_key(room_id, self.lanes[i].code)) is not None for i in self._siblings(lane)):
            self._flush(key, pending)
        elif len(pending.legs) == len(legs):  # the first rank's: the others have expect_batch_ms to follow
            self.port.later(self.config.expect_batch_ms / 1000, lambda: self._flush(key, pending))

    def _siblings(self, lane: Lane) -> set[int]:
        """The registered lanes of ``lane``'s engine and DP rank: every one expects each of its rooms."""
        return {other.index for other in self.lanes
                if other.ready and other.engine_id == lane.engine_id and other.rank.dp == lane.rank.dp} | {lane.index}

    def _flush(self, key: tuple[str, int], pending: PendingRequest) -> None:
        if self.state.pending.get(key) is not pending:
            return  # sent already
        del self.state.pending[key]
        if not pending.legs:
            return
        link, room_id = pending.link, key[1]
        request = RoomRequest(
            room=room_id, legs=tuple(pending.legs), lease_ms=int(self.config.transfer_timeout * 1000),
            writes_until=link.writes_until(self.port.clock(), self.leave_span),
        )
        if link.offsets:
            self.port.send_link(link.endpoint, self._staged(link, request))
        elif room_id in link.held:  # a later rank's legs join those already waiting for the welcome
            held = link.held[room_id]
            link.held[room_id] = msgspec.structs.replace(held, legs=held.legs + request.legs)
        else:  # its leave to write needs the prefill's clock: the welcome brings it
            link.held[room_id] = request

    def send_held(self, link: PrefillLink) -> None:
        """The link knows the prefill's clock now: the requests held for it leave, each with its leave to write from now."""
        leave = link.writes_until(self.port.clock(), self.leave_span)
        for request in link.held.values():
            self.port.send_link(link.endpoint, self._staged(link, msgspec.structs.replace(request, writes_until=leave)))
        link.held.clear()

    def withdraw(self, link: PrefillLink, room: Room) -> None:
        """The room's legs leave the request not sent yet (gathering, or held for the
        link's clock): the prefill never hears of them, so nothing of them can land."""
        room_id = room_of(room.id)
        pending = self.state.pending.get((link.endpoint, room_id))
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

    def never_sent(self, room: Room, msg: RoomRequest) -> None:
        """The prefill never heard of these legs of the room: nothing to tell, nothing can land."""
        w = self.state.work.get(room.id)
        if w is None:
            return
        for request in msg.legs:
            leg = w.legs.get(request.leg) if request.lane == room.lane else None
            if leg is not None:
                leg.peer_failed = True
                self.unstage(room.id, request.leg)
                self.book.writer_done(room, request.leg)

    def rooms_of(self, msg: RoomRequest) -> list[Room]:
        keys = {room_key(msg.room, decode_rank_of(leg.leg)) for leg in msg.legs}
        return [room for key in keys if (room := self.book.rooms.find(key)) is not None]

    def still_wanted(self, msg) -> bool:
        """For a link that connects: whether a message posted while it was down still
        goes. A room_request whose room ended meanwhile does not: once the room is
        released its pages may be another room's. The prefill never heard of that
        room, so a failed one is fenced now."""
        if not isinstance(msg, RoomRequest):
            return True
        rooms = self.rooms_of(msg)
        if any(not room.finished for room in rooms):
            return True
        for room in rooms:
            self.never_sent(room, msg)
            self.book.writers_gone(room)
        return False
