"""How the decode role asks for a room (A4, A5): a rank's legs from core/topology.py,
gathered with its sibling ranks' into one request per room per prefill daemon, which
leaves once every registered rank of the engine expected the room, or after
expect_batch_ms; a request waits for the link's clock (its leave to write)."""

from __future__ import annotations

import msgspec

from ..core import errors
from ..core.errors import PdxferError
from ..core.plan import staged_layout
from ..core.protocol import Expect, KVSpec, LegRequest, RoomRequest
from ..core.staging import StagedLayout
from ..core.topology import decode_rank_of, leg_code, leg_layers, legs_for_decode_rank, local_heads, room_key
from .decode_state import PendingRequest, PrefillLink, StagedExtent
from .pools import Lane


def _prefill_heads(spec: KVSpec, msg: Expect) -> int:
    """KV heads each rank of the prefill engine holds."""
    return spec.heads.total if spec.mla else local_heads(spec.heads.total, msg.prefill_sizes.tp or 1)


class RoomRequests:
    """DecodeService's requests (a mixin: it reads the service's lanes, links, pending
    requests, config and port)."""

    def _leg_requests(self, lane: Lane, msg: Expect) -> list[LegRequest]:
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

    def _stage_layout(self, lane: Lane, msg: Expect, leg: LegRequest, positions: int) -> StagedLayout | None:
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
            state = self.work[key].legs[leg.leg] if key in self.work else None
            if state is not None and state.stage_layout is not None:
                offset = self.staging.take(state.stage_layout.nbytes)
                if offset is not None:
                    self.staged[(key, leg.leg)] = StagedExtent(offset, link.endpoint, link.epoch)
                    self.staged_legs += 1
                    leg = state.request = msgspec.structs.replace(leg, staged_at=self.staging.base + offset)
            legs.append(leg)
        return msgspec.structs.replace(request, legs=tuple(legs))

    def _unstage(self, room_id: int, leg: int) -> None:
        """Nothing of the leg can land any more: its staging extent, if it has one, is free."""
        extent = self.staged.pop((room_id, leg), None)
        if extent is not None:
            self.staging.arena.give(extent.offset)

    def _gather(self, link: PrefillLink, room_id: int, lane: Lane, legs: list[LegRequest]) -> None:
        """A5: one request per room per prefill daemon, with the legs of every local rank
        of the engine; it leaves once they all expected the room, or after expect_batch_ms."""
        key = (link.endpoint, room_id)
        pending = self.pending.get(key)
        if pending is None:
            self.pending[key] = pending = PendingRequest(link, [])
        pending.legs.extend(legs)
        if all(self.rooms.find(room_key(room_id, self.lanes[i].code)) is not None for i in self._siblings(lane)):
            self._flush(key, pending)
        elif len(pending.legs) == len(legs):  # the first rank's: the others have expect_batch_ms to follow
            self.port.later(self.config.expect_batch_ms / 1000, lambda: self._flush(key, pending))

    def _siblings(self, lane: Lane) -> set[int]:
        """The registered lanes of ``lane``'s engine and DP rank: every one expects each of its rooms."""
        return {other.index for other in self.lanes
                if other.ready and other.engine_id == lane.engine_id and other.rank.dp == lane.rank.dp} | {lane.index}

    def _flush(self, key: tuple[str, int], pending: PendingRequest) -> None:
        if self.pending.get(key) is not pending:
            return  # sent already
        del self.pending[key]
        if not pending.legs:
            return
        link, room_id = pending.link, key[1]
        request = RoomRequest(
            room=room_id, legs=tuple(pending.legs), lease_ms=int(self.config.transfer_timeout * 1000),
            writes_until=link.writes_until(self.clock(), self._leave_span),
        )
        if link.offsets:
            self.port.send_link(link.endpoint, self._staged(link, request))
        elif room_id in link.held:  # a later rank's legs join those already waiting for the welcome
            held = link.held[room_id]
            link.held[room_id] = msgspec.structs.replace(held, legs=held.legs + request.legs)
        else:  # its leave to write needs the prefill's clock: the welcome brings it
            link.held[room_id] = request

    def _send_request(self, link: PrefillLink, request: RoomRequest) -> None:
        """A request held until the link knew the prefill's clock, with its leave to write from now."""
        leave = link.writes_until(self.clock(), self._leave_span)
        self.port.send_link(link.endpoint, self._staged(link, msgspec.structs.replace(request, writes_until=leave)))
