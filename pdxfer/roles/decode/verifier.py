"""How the decode role decides a room part landed (A1, S3): each leg's LegWritten or
aux record, the aux stamp verified against the slot's generation and payload, pages
and inline KV checked, staged legs copied into the pages, and with --verify-kv the KV
digest compared; only then Success, and a room_ack to every real leg."""

from __future__ import annotations

from ...core import errors, paths
from ...core.config import Config
from ...core.errors import PdxferError
from ...core.protocol import AuxRecord, ErrorCode, LegRequest, LegWritten, RoomAck
from ...core.rooms import Event, Room
from ...core.slots import SlotState
from ...core.stamp import HEADER_BYTES, Stamp, verify
from ...core.topology import leg_layers, room_of
from ..book import RoomBook
from ..lanes import Lanes, MappedAux, MappedKV
from ..ports import DecodePort
from ..staging import Staging
from .requester import Requester
from .state import DecodeState, DecodeWork, LegState, PrefillLink


class Verifier:
    def __init__(self, config: Config, port: DecodePort, lanes: Lanes, book: RoomBook, state: DecodeState, requester: Requester,
                 staging: Staging | None) -> None:
        self.config = config
        self.port = port
        self.lanes = lanes
        self.book = book
        self.state = state
        self.requester = requester  # gives staged legs' extents back
        self.staging = staging
        self.bytes_received = 0  # KV and aux bytes of rooms that succeeded

    def _kv(self, room: Room) -> MappedKV:
        return self.lanes[room.lane].registered_kv()

    def _aux(self, room: Room) -> MappedAux:
        return self.lanes[room.lane].registered_aux()

    def leg_record(self, link: PrefillLink, room: Room, msg: AuxRecord | LegWritten) -> None:
        """A prefill rank wrote every KV block of its leg (LegWritten), and for the leg that
        carries it the aux record after them (AuxRecord): it has nothing in flight for it."""
        w = self.state.work[room.id]
        leg = w.legs[msg.leg]
        self.book.writer_done(room, msg.leg)  # the prefill sends these only after its writes completed
        if room.finished:
            self.requester.unstage(room.id, msg.leg)
            return
        if isinstance(msg, AuxRecord) != leg.request.carries_aux:
            what = "an aux record" if isinstance(msg, AuxRecord) else "no aux record"
            self.book.fail(room, ErrorCode.BAD_MESSAGE, f"prefill rank of leg {msg.leg:#x} sent {what}, but the leg that carries it is another")
            return
        if isinstance(msg, AuxRecord) and not self._aux_arrived(room, w, msg):
            return
        leg.first_check = self.port.clock()
        self.check_landed(link.endpoint, room, msg)

    def _aux_arrived(self, room: Room, w: DecodeWork, msg: AuxRecord) -> bool:
        """The aux record is aimed at the room's own slot; one that travelled here is
        checked and written. False when that failed the room."""
        aux = self._aux(room)
        slot = aux.slots.slots[msg.slot] if 0 <= msg.slot < len(aux.slots.slots) else None
        if slot is None or slot.state is not SlotState.ARMED or (slot.room, slot.generation) != (room.id, msg.generation):
            holder = f"room {room_of(slot.room)} generation {slot.generation} ({slot.state.value})" if slot else "no slot"
            reason = f"aux record for room {msg.room} generation {msg.generation} aimed at slot {msg.slot}, which holds {holder}"
            self.book.fail(room, ErrorCode.AUX_STAMP_MISMATCH, reason)
            victim = self.book.rooms.find(slot.room) if slot is not None and slot.room != room.id else None
            if msg.via_transfer_engine and victim is not None:  # the stray record landed in another room's slot
                self.book.fail(victim, ErrorCode.AUX_STAMP_MISMATCH, reason)
            return False
        try:
            if not msg.via_transfer_engine:  # the record carries the aux itself: check it, then write it
                sent = Stamp(msg.room, msg.generation, msg.length, msg.checksum)
                verify(sent, slot=msg.slot, expected_room=room_of(room.id), expected_generation=room.generation, payload=msg.payload)
                aux.write(msg.slot, sent, msg.payload)
            if msg.kv:
                self._land_inline_kv(room, w, msg)
        except PdxferError as exc:
            self.book.fail(room, exc.code, exc.message)
            return False
        return True

    def check_landed(self, endpoint: str, room: Room, msg: AuxRecord | LegWritten) -> None:
        """Check the bytes of a leg that landed: the stamp in the slot (when the transfer
        engine wrote it) and the KV digest. A write reported complete may not be
        visible yet (asynchronous paths), so a mismatch is re-checked until
        visibility_grace has passed; never Success before."""
        if room.finished or self.book.rooms.find(room.id) is not room:
            self.requester.unstage(room.id, msg.leg)
            return
        w = self.state.work[room.id]
        leg = w.legs[msg.leg]
        if (room.id, msg.leg) in self.state.staged:  # once: its record says every write completed
            try:
                self._check_written_pages(room, w, msg)
            except PdxferError as exc:
                self.requester.unstage(room.id, msg.leg)
                self.book.fail(room, exc.code, exc.message)
                return
            self._copy_staged(endpoint, room, w, leg, msg)
            return
        try:
            if isinstance(msg, AuxRecord) and msg.via_transfer_engine:  # else this daemon wrote the stamp itself, after verifying it
                aux = self._aux(room)
                sent = Stamp(msg.room, msg.generation, msg.length, msg.checksum)
                landed = aux.header(msg.slot)
                verify(landed, slot=msg.slot, expected_room=room_of(room.id), expected_generation=room.generation,
                       payload=aux.payload(msg.slot, landed.length if landed else 0))
                if landed != sent:
                    raise errors.AuxStampMismatch(f"aux slot {msg.slot} holds stamp {landed}, the prefill announced {sent}", room=room_of(room.id))
            self._check_digest(room, w, leg, msg)
        except PdxferError as exc:
            waited = self.port.clock() - leg.first_check
            if waited < self.config.visibility_grace:
                delay = min(self.config.visibility_grace - waited, max(0.001, waited))
                self.port.later(delay, lambda: self.check_landed(endpoint, room, msg))
                return
            self.book.fail(room, exc.code, exc.message)
            return
        nbytes = msg.kv_pages * self._leg_page_bytes(room, leg.request)
        if isinstance(msg, AuxRecord):
            self._aux(room).slots.mark_written(msg.slot, msg.generation, self.port.clock())
            nbytes += HEADER_BYTES + msg.length
        leg.landed = True
        room.bytes_moved += nbytes
        if all(other.landed for other in w.legs.values()):
            # It may come before room_accepted or transfer_started: it implies them.
            if self.book.succeed(room, Event.AUX_LANDED):
                self.bytes_received += room.bytes_moved
            for code, other in w.legs.items():
                if other.request.real:
                    self.port.send_link(endpoint, RoomAck(room=room_of(room.id), leg=code))

    def _copy_staged(self, endpoint: str, room: Room, w: DecodeWork, leg: LegState, msg: AuxRecord | LegWritten) -> None:
        """Copy a staged leg from its extent into the heads of the room's pages on a worker
        thread, then check the rest of what landed. The copy owns the extent until it
        ends, and the room is not fenced before (a failed room's pages are still written)."""
        kv, req, layout = self._kv(room), leg.request, leg.stage_layout
        offset = self.state.staged.pop((room.id, req.leg)).offset
        extent = self.staging.extent(offset, layout.nbytes)
        layers, pages = leg_layers(req.layers, kv.spec.num_layers_total), w.pages[: msg.kv_pages]
        self.book.rooms.copy_started(room)  # a failed room is not fenced before its copies end

        def copy() -> None:
            kv.copy_heads(extent, layout, layers, req.dst_head_start, req.head_count, pages, into_pages=True)

        def copied(error: BaseException | None) -> None:
            self.staging.arena.give(offset)
            if error is not None:
                self.book.fail(room, ErrorCode.INTERNAL, f"copying leg {req.leg:#x} out of the staging buffer failed: {error!r}")
            elif not room.finished:
                self.check_landed(endpoint, room, msg)
            self.book.copy_done(room)

        self.port.off_loop(copy, copied)

    def _leg_page_bytes(self, room: Room, leg: LegRequest) -> int:
        """Bytes a leg writes into one of the room's pages: its layers' regions, its share of the heads."""
        kv = self._kv(room)
        start, end = leg_layers(leg.layers, kv.spec.num_layers_total)
        page = sum(r.page_bytes for r in kv.regions if start <= r.layer < end)
        return page * leg.head_count // kv.spec.heads.local if leg.head_count else page

    def _land_inline_kv(self, room: Room, w: DecodeWork, msg: AuxRecord) -> None:
        """Write a small room's KV that came inside its record. The room is live and
        its slot armed for it (checked before), so its pages are still its own, and
        nothing of it can land later: this is the only write."""
        kv = self._kv(room)
        limit = paths.inline_kv_limit(kv.kind, self.config.inline_kv_bytes)
        if len(msg.kv) > limit:
            raise errors.BadMessage(f"the prefill sent {len(msg.kv)} bytes of KV inline; this daemon takes at most {limit}", room=room_of(room.id), side=errors.Side.PEER)
        self._check_written_pages(room, w, msg)
        if len(msg.kv) != msg.kv_pages * kv.page_bytes:
            raise errors.BadMessage(f"inline KV of {len(msg.kv)} bytes is not {msg.kv_pages} pages of {kv.page_bytes} bytes", room=room_of(room.id), side=errors.Side.PEER)
        kv.scatter(w.pages[: msg.kv_pages], msg.kv)

    @staticmethod
    def _check_written_pages(room: Room, w: DecodeWork, msg: AuxRecord) -> None:
        if msg.kv_pages > w.pages.size:
            raise errors.PageOutOfRange(f"the prefill wrote {msg.kv_pages} pages into {w.pages.size}", room=room_of(room.id))

    def _check_digest(self, room: Room, w: DecodeWork, leg: LegState, msg: AuxRecord | LegWritten) -> None:
        """--verify-kv: the digest of the pages written against the prefill's. Only legs of
        whole pages carry one: a head or layer slice is not what digest() covers."""
        if not self.config.verify_kv or not leg.whole:
            return
        if not msg.kv_digested:
            raise PdxferError("--verify-kv is on but the prefill sent no KV digest", room=room_of(room.id), code=ErrorCode.KV_DIGEST_MISMATCH)
        self._check_written_pages(room, w, msg)
        actual = self._kv(room).digest(w.pages[: msg.kv_pages])
        if actual != msg.kv_digest:
            raise PdxferError(
                f"KV digest {actual:#010x} over {msg.kv_pages} pages does not match the prefill's {msg.kv_digest:#010x}",
                room=room_of(room.id), code=ErrorCode.KV_DIGEST_MISMATCH,
            )
