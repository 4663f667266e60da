"""How the prefill role writes a room part once both halves are in (the engine's input
and the decode's request): every check that needs both (C1-C3, compat, the lease and
the decode's leave to write) before a byte moves, the chunks planned and submitted as
they come, then the aux record once every KV block completed (A3), or a LegWritten for
a leg without it; a failed part is fenced once its writes drained (its jobs are its
writers in the room table: core/rooms.py)."""

from __future__ import annotations

import math
import zlib

import msgspec
import numpy as np

from ...core import errors, paths
from ...core.config import Config
from ...core.errors import PdxferError
from ...core.plan import (Blocks, check_capacity, check_memory_version, check_pages, check_positions, chunk_pages, plan_blocks,
                          plan_from_staging, plan_leg_blocks, plan_staged_blocks, staged_layout)
from ...core.protocol import AuxRecord, Compat, ErrorCode, KVRegion, LaneInfo, LegRequest, LegWritten, Message, PeerHello, SessionsDrained, compat_diff
from ...core.rooms import Event, Room
from ...core.staging import StagedLayout
from ...core.stamp import HEADER_BYTES, stamp_for
from ...core.topology import leg_layers, room_of
from ...transport import Job
from ..book import RoomBook
from ..lanes import Lane, Lanes, MappedAux, MappedKV
from ..ports import PrefillPort
from ..staging import Staging
from .parts import RoomParts
from .state import DecodePeer, PrefillState, PrefillWork


def _without_regions(compat: Compat) -> Compat:
    return msgspec.structs.replace(compat, regions=())


def _regions_of(lane: LaneInfo) -> tuple[KVRegion, ...]:
    """A decode rank's regions as its hello describes them (the planner needs no buffer or offset of theirs)."""
    return tuple(KVRegion(buffer=0, offset=0, page_bytes=page_bytes, num_pages=lane.num_pages, layer=layer, kind=kind)
                 for layer, kind, page_bytes in lane.compat.regions)


def _whole(leg: LegRequest) -> bool:
    """Whole pages of every layer: equal TP and PP on both sides."""
    return leg.head_count == 0 and leg.layers == (0, 0)


class Writer:
    def __init__(self, config: Config, port: PrefillPort, lanes: Lanes, book: RoomBook, state: PrefillState, parts: RoomParts,
                 staging: Staging | None) -> None:
        self.config = config
        self.port = port
        self.lanes = lanes
        self.book = book
        self.state = state
        self.parts = parts  # fails a room's parts together
        self.staging = staging  # where a leg's slices are gathered before they are written (core/staging.py); None: nowhere
        self.aux_path = paths.choose_aux_path(config.protocol, config.aux_path)
        self.staged_chunks = 0  # chunks written from an extent
        self.kv_inline_rooms = self.kv_inline_bytes = 0  # rooms whose KV rode their aux record, and its bytes

    def _kv(self, room: Room) -> MappedKV:
        return self.lanes[room.lane].registered_kv()

    def _aux(self, room: Room) -> MappedAux:
        return self.lanes[room.lane].registered_aux()

    def start(self, room: Room, w: PrefillWork, announce: Message | None) -> None:
        """Both halves are in: check everything, then write the chunks handed over so far
        (and later ones as they come). ``announce`` tells the decode side writes begin
        (room_accepted, or transfer_started when our input came later; None when the
        request's answer went already). An inline room's aux record, sent at once,
        tells it instead, and a failed room's room_failed: one message fewer for every
        small room."""
        kv = self._kv(room)
        peer = self.state.peers.get(w.peer)
        req = w.request
        try:
            if peer is None:
                raise errors.PeerUnreachable("the decode daemon that requested this room is gone", room=room_of(room.id))
            _, w.staged_layout = self.destination(self.lanes[room.lane], w.request, w.dst_pages, peer, room_of(room.id))
            check_positions(w.first, w.end, req.skip_pages, w.dst_pages.size, req.num_draft_tokens, False, room_of(room.id))
            inline = self._inline(room, w, kv, peer.hello) if req.real and _whole(req) else None
        except PdxferError as exc:
            self.parts.fail(room, exc.code, exc.message)
            return
        w.started = True
        if inline is not None:  # a few pages: they ride the aux record
            kept, nbytes = inline
            w.chunks.clear()
            w.kept, w.written = [kept], kept.size
            room.bytes_planned = nbytes + HEADER_BYTES + w.aux_bytes
            self.kv_inline_rooms += 1
            self.kv_inline_bytes += nbytes
            self._send_aux(room, w, kv.gather(kept))
            return
        now, leave = self.port.clock(), peer.writes_until or math.inf
        if now >= leave and req.real:
            self.parts.fail(room, ErrorCode.LEASE_EXPIRED, (
                f"the decode daemon's leave to write ran out {now - leave:.1f}s ago and nothing from it "
                "renewed it (a partition, or this daemon stood still): its pages may be another room's by now"))
            return
        if announce is not None:
            self.port.send_peer(w.peer, announce)
        w.lease_end = min(now + self._lease(w), leave)
        self.write_chunks(room, w)

    def destination(self, local: Lane, req: LegRequest, dst_pages: np.ndarray, peer: DecodePeer,
                     room_id: int) -> tuple[LaneInfo, StagedLayout | None]:
        """The decode rank's memory a leg of ours (``local``'s) writes into, checked against
        the leg (C2, C3) and against our own layout; and where a staged leg lies in its
        extent of the decode's staging buffer (None: not staged)."""
        lane = peer.lanes.get(req.lane)
        if lane is None:
            raise errors.BadMessage(f"the decode daemon's request names its lane {req.lane}, which its hello does not list", room=room_id, side=errors.Side.PEER)
        check_memory_version(req.memory_version, lane.memory_version, "destination", room_id)
        check_pages(dst_pages, lane.num_pages, "destination", room_id)
        if req.carries_aux and req.slot >= lane.aux_slots:
            raise errors.PageOutOfRange(f"destination aux slot {req.slot} is out of range: the peer has slots 0..{lane.aux_slots - 1}", room=room_id)
        staged = self._check_staged(local, req, lane, dst_pages.size, peer, room_id) if req.staged_at else None
        kv = local.registered_kv()
        ours, theirs = local.compat(), lane.compat
        if not _whole(req):  # a slice of heads or layers: regions are paired and sized by the planner
            ours, theirs = _without_regions(ours), _without_regions(theirs)
        diff = compat_diff(ours, theirs) if ours != theirs else []  # equal structs compare in C; the diff says how they differ
        if diff and (kv.spec.heads.local, kv.spec.layers) != (lane.heads_local, lane.layers) \
                and not compat_diff(_without_regions(ours), _without_regions(theirs)):
            # One model split otherwise: whole pages are what the decode plans between engines of equal TP and PP.
            raise PdxferError(
                f"the decode daemon asked for whole pages, as between engines of equal TP and PP, but this prefill rank "
                f"holds {kv.spec.heads.local} of {kv.spec.heads.total} KV heads, layers {kv.spec.layers[0]}-{kv.spec.layers[1] - 1}, "
                f"and the decode rank {lane.heads_local}, layers {lane.layers[0]}-{lane.layers[1] - 1}: the decode engine must name "
                "the prefill engine's TP and PP sizes (expect(prefill_sizes=...); vLLM: the prefill's answer carries them)",
                room=room_id, code=ErrorCode.COMPAT_MISMATCH)
        if diff:
            raise PdxferError(f"incompatible KV layout: {'; '.join(diff)}", room=room_id, code=ErrorCode.COMPAT_MISMATCH)
        return lane, staged

    @staticmethod
    def _check_staged(local: Lane, req: LegRequest, lane: LaneInfo, positions: int, peer: DecodePeer, room_id: int) -> StagedLayout:
        """Where a staged leg lies in its extent, which must lie inside the decode daemon's
        staging buffer (C2)."""
        hello = peer.hello
        if not req.head_count:
            raise errors.BadMessage("the decode daemon asked for whole pages to be staged", room=room_id, side=errors.Side.PEER)
        kv = local.registered_kv()
        layout = staged_layout(kv.regions, _regions_of(lane), lane.heads_local, req.head_count,
                               leg_layers(req.layers, kv.spec.num_layers_total), positions)
        nbytes = layout.nbytes
        if req.staged_at < hello.staging_base or req.staged_at + nbytes > hello.staging_base + hello.staging_bytes:
            raise errors.PageOutOfRange(
                f"staged leg [{req.staged_at:#x}, +{nbytes}) is outside the decode daemon's staging buffer "
                f"[{hello.staging_base:#x}, +{hello.staging_bytes})", room=room_id)
        return layout

    def _inline(self, room: Room, w: PrefillWork, kv, dst_hello: PeerHello) -> tuple[np.ndarray, int] | None:
        """A room handed over in one chunk whose KV is small enough to ride its aux record:
        its source pages (checked, as the last chunk's are) and their bytes; else None. A
        chunked room is written as it comes."""
        if not (w.last and len(w.chunks) == 1) or w.chunks[0].waiting:
            return None
        kept, _ = chunk_pages(w.chunks[0].first_page, w.chunks[0].pages, w.request.skip_pages, w.dst_pages, room_of(room.id))
        nbytes = kept.size * kv.page_bytes
        if not paths.send_kv_inline(self.aux_path, kv.kind, self.config.inline_kv_bytes, dst_hello.inline_kv_bytes, nbytes):
            return None
        self._check_end(room, w)
        return kept, nbytes

    def _check_end(self, room: Room, w: PrefillWork) -> None:
        """The last chunk is in: the positions match the decode's, and C1."""
        req = w.request
        check_positions(w.first, w.end, req.skip_pages, w.dst_pages.size, req.num_draft_tokens, True, room_of(room.id))
        self._check_capacity(room, w)

    def _check_capacity(self, room: Room, w: PrefillWork) -> None:
        """C1, once the token count is known (the last chunk): the decode's pages hold the
        tokens after its prefix, and its draft tokens."""
        req, page_size = w.request, self._kv(room).spec.page_size
        check_capacity(w.num_tokens - req.skip_pages * page_size, req.num_draft_tokens, w.dst_pages.size, page_size, room_of(room.id))

    def write_chunks(self, room: Room, w: PrefillWork) -> None:
        """Plan and submit the chunks handed over and not written yet; once the last
        chunk's writes all completed, the aux record follows (_kv_written)."""
        req, peer = w.request, self.state.peers.get(w.peer)
        try:
            if peer is None:
                raise errors.PeerUnreachable("the decode daemon that requested this room is gone", room=room_of(room.id))
            if w.last:  # before the last chunk's bytes move (in a room of one chunk: before any)
                self._check_end(room, w)
            ready = []  # in order: none after one that waits for its CUDA event
            for chunk in w.chunks:
                if chunk.waiting:
                    break
                ready.append(chunk)
            targets = np.arange(w.dst_pages.size) if req.staged_at else w.dst_pages  # a staged leg's are positions
            planned = [chunk_pages(chunk.first_page, chunk.pages, req.skip_pages, targets, room_of(room.id)) for chunk in ready]
            blocks = []
            try:
                for kept, dst in planned:
                    blocks.append(self._plan(room, w, peer, kept, dst) if req.real and kept.size else (None, None))
            except PdxferError:
                for _, extent in blocks:
                    self._give_extent(extent)
                raise
        except PdxferError as exc:
            self.parts.fail(room, exc.code, exc.message)
            return
        del w.chunks[: len(ready)]
        if not req.real:  # a dummy leg: this rank's part is over once its input is
            if w.last:
                self.book.succeed(room, Event.DONE)
            return
        if w.last and req.carries_aux:  # the room is whole: its aux record is planned too
            room.bytes_planned += HEADER_BYTES + w.aux_bytes
        for (kept, _), (planned_blocks, extent) in zip(planned, blocks):
            w.kept.append(kept)
            w.written += kept.size
            if planned_blocks is not None:
                room.bytes_planned += planned_blocks.nbytes
                job = Job(room.id, w.sessions, planned_blocks, self._kv_written, deadline=w.lease_end, probe=peer.hello.probe_base)
                if extent is not None:
                    self.state.gathered[job] = extent
                self._submit(room, job)
        self._aux_when_written(room, w)

    def _plan(self, room: Room, w: PrefillWork, peer: DecodePeer, src: np.ndarray, dst: np.ndarray) -> tuple[Blocks, int | None]:
        """The blocks of one chunk of the leg: whole pages, or its heads and layers (A6-A8),
        into the decode's pages or, staged, into its staging buffer (``dst`` are then
        positions); and the extent of our own staging buffer the chunk was gathered
        into (core/staging.py), if it was."""
        kv, req = self._kv(room), w.request
        lane = peer.lanes[req.lane]
        if _whole(req):
            return plan_blocks(kv.regions, kv.bases, lane.region_bases, src, dst), None
        theirs, layers = _regions_of(lane), leg_layers(req.layers, kv.spec.num_layers_total)
        if w.staged_layout is not None:
            return plan_staged_blocks(kv.regions, kv.bases, kv.spec.heads.local, theirs, lane.heads_local, kv.spec.page_size,
                                      kv.spec.page_order, req.src_head_start, req.head_count, layers, src, dst, req.staged_at,
                                      w.staged_layout), None
        if self.staging is not None and req.head_count and kv.worth_staging(req.head_count, lane.heads_local, self.config.stage_spans_below):
            gathered = self._gather(kv, req, lane, theirs, layers, src, dst)
            if gathered is not None:
                return gathered
        heads = (req.src_head_start, req.head_count, req.dst_head_start) if req.head_count else (0, kv.spec.heads.local, 0)
        return plan_leg_blocks(kv.regions, kv.bases, kv.spec.heads.local, theirs, lane.region_bases, lane.heads_local,
                               kv.spec.page_size, kv.spec.page_order, *heads, layers, src, dst), None

    def _gather(self, kv, req: LegRequest, lane: LaneInfo, theirs: tuple[KVRegion, ...], layers: tuple[int, int],
                src: np.ndarray, dst: np.ndarray) -> tuple[Blocks, int] | None:
        """A chunk's slices gathered into an extent of our staging buffer, and its blocks
        from there: runs of destination pages, one block each. None when no extent is free."""
        layout = staged_layout(kv.regions, theirs, lane.heads_local, req.head_count, layers, src.size)
        offset = self.staging.take(layout.nbytes)
        if offset is None:
            return None
        try:
            blocks = plan_from_staging(kv.regions, theirs, lane.region_bases, lane.heads_local, kv.spec.page_size, kv.spec.page_order,
                                       req.head_count, req.dst_head_start, layers, dst, self.staging.base + offset, layout)
        except PdxferError:
            self._give_extent(offset)
            raise
        kv.copy_heads(self.staging.extent(offset, layout.nbytes), layout, layers, req.src_head_start, req.head_count, src, into_pages=False)
        self.staged_chunks += 1
        return blocks, offset

    def _give_extent(self, extent: int | None) -> None:
        if extent is not None:
            self.staging.arena.give(extent)

    def _aux_when_written(self, room: Room, w: PrefillWork) -> None:
        if w.last and not room.writers and not w.chunks and not w.aux_sent and not room.finished:
            self._send_aux(room, w)

    def _lease(self, w: PrefillWork) -> float:
        """Seconds this room may keep submitting writes: our transfer timeout, or the
        decode side's if shorter (it releases the destination on that basis)."""
        own = self.config.transfer_timeout
        return min(own, w.lease_ms / 1000) if w.lease_ms else own

    def _submit(self, room: Room, job: Job) -> None:
        self.book.rooms.writer_started(room, job)
        self.state.in_flight_to[job.peer] += 1
        self.port.submit(job)

    def _settled(self, job: Job) -> Room | None:
        """A job's writes settled: the room's writer is done unless the pump gave up on it
        (its writes may still land); once none of ours is in flight through a decode
        daemon's replaced sessions, it hears so. The job's room, if it is still here."""
        room = self.book.rooms.find(job.id)
        if job.abandoned:
            return room
        self.state.in_flight_to[job.peer] -= 1
        if not self.state.in_flight_to[job.peer]:
            del self.state.in_flight_to[job.peer]
            for peer in self.state.peers.values():
                if job.peer in peer.retiring:
                    self.say_drained(peer)
        if room is not None:
            self.book.writer_done(room, job)
        return room

    def say_drained(self, peer: DecodePeer) -> None:
        """Tell the decode daemon which of its replaced sessions nothing of ours is in flight through any more."""
        for sessions in [s for s in peer.retiring if not self.state.in_flight_to[s]]:
            peer.retiring.discard(sessions)
            self.port.send_peer(peer.identity, SessionsDrained(sessions=sessions))

    def _kv_written(self, job: Job) -> None:
        if self.state.gathered:  # its writes settled: nothing reads its extent any more
            self._give_extent(self.state.gathered.pop(job, None))
        room = self._settled(job)
        w = self.state.work.get(job.id)
        if room is None or w is None or room.finished:
            return
        room.bytes_moved += job.blocks.nbytes if job.ok else 0
        if not job.ok:
            self.parts.fail(room, ErrorCode.TRANSFER_FAILED, job.error or "cancelled")
            return
        self._aux_when_written(room, w)

    def _send_aux(self, room: Room, w: PrefillWork, kv: bytes = b"") -> None:
        """Every KV block is written, or ``kv`` carries the room's KV: the aux goes (A3)."""
        w.aux_sent = True
        aux, peer, req = self._aux(room), self.state.peers.get(w.peer), w.request
        if peer is None:
            self.parts.fail(room, ErrorCode.PEER_DEAD, "the decode daemon went away while its KV was written")
            return
        if (peer.hello.verify_kv or self.config.verify_kv) and _whole(req):  # of inline KV, without gathering it again
            w.digest = zlib.crc32(kv) if kv else self._kv(room).digest(w.source_pages())
        if not req.carries_aux:  # another leg carries the room's aux record to this decode rank
            self.port.send_peer(w.peer, LegWritten(room=room_of(room.id), leg=req.leg, kv_pages=w.written,
                                                   kv_digested=w.digest is not None, kv_digest=w.digest or 0))
            return
        payload = aux.payload(w.aux_slot, w.aux_bytes)
        stamp = stamp_for(room_of(room.id), req.generation, payload)
        # A fan-out room's record travels here: the slot's header is its first room's to write.
        if self.aux_path is paths.AuxPath.TCP or w.first_room:
            self.port.send_peer(w.peer, self._record(room, w, stamp, payload, kv))
            return
        aux.write_header(w.aux_slot, stamp)
        lane = peer.lanes[req.lane]
        dst = lane.aux_base + req.slot * lane.compat.aux_slot_bytes
        blocks = Blocks.of([aux.slot_address(w.aux_slot)], [dst], [HEADER_BYTES + len(payload)])
        self._submit(room, Job(room.id, w.sessions, blocks, self._aux_written, deadline=w.lease_end, probe=peer.hello.probe_base))

    def _record(self, room: Room, w: PrefillWork, stamp, payload: bytes = b"", kv: bytes = b"") -> AuxRecord:
        req = w.request
        return AuxRecord(
            room=room_of(room.id), leg=req.leg, slot=req.slot, generation=req.generation, length=stamp.length, checksum=stamp.checksum,
            payload=payload, via_transfer_engine=self.aux_path is paths.AuxPath.TRANSFER_ENGINE and not w.first_room,
            kv_pages=w.written, kv_digested=w.digest is not None, kv_digest=w.digest or 0, kv=kv,
        )

    def _aux_written(self, job: Job) -> None:
        room = self._settled(job)
        w = self.state.work.get(job.id)
        if room is None or w is None or room.finished:
            return
        if not job.ok:
            self.parts.fail(room, ErrorCode.TRANSFER_FAILED, f"aux write: {job.error or 'cancelled'}")
            return
        room.bytes_moved += job.blocks.nbytes
        self.port.send_peer(w.peer, self._record(room, w, self._aux(room).header(w.aux_slot)))

    def transport_closed(self) -> int:
        """This daemon's transfer engines are gone (it is stopping): nothing of ours can
        land any more, so every failed room still waiting for its writes, or given up
        on by the pump, is fenced and its decode side told so. Returns how many."""
        waiting = [room for room in self.book.rooms if room.finished and room.writers]
        for room in waiting:
            self.book.writers_gone(room)
        for job in list(self.state.gathered):
            self._give_extent(self.state.gathered.pop(job))
        return len(waiting)
