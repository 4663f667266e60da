"""The decode role: take the engine's expect(), ask the prefill daemon for the room,
and declare Success only when the aux record's stamp verifies against the slot the
room armed (A1, S3).

One link (a ZMQ DEALER, opened by the daemon) per prefill bootstrap address. The
first message on a link, and the first after every re-registration, is a
PeerHello describing this side's pools.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np

from . import errors
from .errors import IllegalTransition, PdxferError
from .plan import check_pages, pages_from_bytes
from .pools import compat
from .protocol import (
    PROTOCOL_VERSION,
    AuxRecord,
    ErrorCode,
    Expect,
    Message,
    Ok,
    PeerError,
    PeerHello,
    PeerRefused,
    PeerWelcome,
    Role,
    RoomAccepted,
    RoomAck,
    RoomFailed,
    RoomRequest,
    TransferStarted,
    compat_hash,
)
from .rooms import Event, Room
from .service import RoomService
from .slots import SlotState
from .stamp import Stamp, verify

log = logging.getLogger("pdxfer.decode")


def bootstrap_endpoint(address: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port'."""
    address = address.strip()
    if address.startswith("tcp://"):
        address = address[len("tcp://") :]
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.BadMessage(f"bootstrap address {address!r} is not host:port")
    return f"tcp://{host}:{port}"


@dataclass(eq=False)
class PrefillLink:
    endpoint: str
    incarnation: str = ""
    session: str = ""
    ready: bool = False
    rooms: set[int] = field(default_factory=set)


@dataclass(eq=False)
class DecodeWork:
    engine: bytes
    link: str
    memory_version: int
    peer_fenced: bool = False  # the prefill said it has no write in flight for this room


class DecodeService(RoomService):
    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.links: dict[str, PrefillLink] = {}
        self.work: dict[int, DecodeWork] = {}
        self.open_link: Callable[[str], None] = lambda endpoint: None
        self.close_link: Callable[[str], None] = lambda endpoint: None
        self.send_link: Callable[[str, Message], None] = lambda endpoint, message: None

    # --- engine side

    def on_expect(self, identity: bytes, msg: Expect) -> Message:
        kv, _ = self._kv(), self._aux()
        endpoint = bootstrap_endpoint(msg.bootstrap)
        try:
            dst = pages_from_bytes(msg.pages)
        except ValueError as exc:
            raise errors.BadMessage(str(exc), room=msg.room) from None
        check_pages(dst, kv.layout.num_pages, "destination", msg.room)
        self.check_local_version(msg.memory_version, msg.room)
        room = self.rooms.create(msg.room, Role.DECODE, self.clock())
        try:
            self.bind_slot(room, msg.slot, msg.generation)
        except PdxferError:
            self.rooms.remove(room.id)
            raise
        self.work[room.id] = DecodeWork(identity, endpoint, msg.memory_version)
        room.peer = endpoint
        link = self._link(endpoint)
        link.rooms.add(room.id)
        self.send_link(
            endpoint,
            RoomRequest(room=room.id, pages=msg.pages, slot=msg.slot, generation=msg.generation, memory_version=msg.memory_version, num_draft_tokens=msg.num_draft_tokens),
        )
        return Ok(req=msg.req)

    def _link(self, endpoint: str) -> PrefillLink:
        link = self.links.get(endpoint)
        if link is None:
            self.links[endpoint] = link = PrefillLink(endpoint)
            self.open_link(endpoint)
            self.send_link(endpoint, self.hello())
        return link

    def hello(self) -> PeerHello:
        kv, aux = self._kv(), self._aux()
        ours = compat(kv, aux)
        return PeerHello(
            version=PROTOCOL_VERSION,
            incarnation=self.incarnation,
            session=self.session,
            compat=ours,
            compat_hash=compat_hash(ours),
            region_bases=kv.bases,
            num_pages=kv.layout.num_pages,
            aux_base=aux.memory.address,
            aux_slots=aux.num_slots,
            memory_version=kv.version,
        )

    def on_kv_registered(self) -> None:
        if self.kv is not None and self.aux is not None:
            for endpoint in self.links:
                self.send_link(endpoint, self.hello())

    # --- bootstrap channel

    def on_link(self, endpoint: str, raw: bytes) -> None:
        link = self.links.get(endpoint)
        if link is None:
            return
        try:
            msg = self.codec.peer_messages.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable message from prefill %s: %s", endpoint, exc)
            return
        try:
            self._dispatch_link(link, msg)
        except IllegalTransition as exc:  # the peer sent a signal that does not fit the room's state (H3)
            log.warning("prefill %s sent %s out of order: %s", endpoint, type(msg).__name__, exc)
            self.send_link(endpoint, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"{type(msg).__name__} out of order: {exc.message}", room=getattr(msg, "room", 0)))
        except PdxferError as exc:
            log.warning("prefill %s sent %s that cannot be accepted: %s", endpoint, type(msg).__name__, exc)
            self.send_link(endpoint, PeerError(code=exc.code, message=exc.message, room=exc.room))
        except Exception:  # H1
            self.failures["internal"] += 1
            log.exception("internal error handling %s from prefill %s", type(msg).__name__, endpoint)

    def _dispatch_link(self, link: PrefillLink, msg: Message) -> None:
        if isinstance(msg, PeerWelcome):
            link.ready, link.incarnation, link.session = True, msg.incarnation, msg.session
            log.info("prefill daemon %s (incarnation %s) accepted this daemon", link.endpoint, msg.incarnation)
            return
        if isinstance(msg, PeerRefused):
            self._refused(link, msg)
            return
        if isinstance(msg, PeerError):
            log.warning("prefill %s reported %s: %s", link.endpoint, msg.code.value, msg.message)
            room = self._room_of(link, msg.room) if msg.room else None
            if room is not None:
                self.fail(room, msg.code, f"prefill side: {msg.message}")
            return
        room = self._room_of(link, msg.room)
        if room is None:
            return  # dropped or never ours; nothing to change
        if isinstance(msg, RoomAccepted):
            self.rooms.apply(room, Event.BOOTSTRAPPED, self.clock())
            if msg.input_ready:
                self.rooms.apply(room, Event.INPUT_READY, self.clock())
        elif isinstance(msg, TransferStarted):
            self.rooms.apply(room, Event.INPUT_READY, self.clock())
        elif isinstance(msg, AuxRecord):
            self._aux_record(link, room, msg)
        elif isinstance(msg, RoomFailed):
            self.work[room.id].peer_fenced = msg.fenced
            if not self.fail(room, msg.code, f"prefill side: {msg.reason}") and msg.fenced:
                self.fenced(room)
        else:
            raise errors.BadMessage(f"a decode daemon does not accept {type(msg).__name__}", side=errors.Side.PEER)

    def _room_of(self, link: PrefillLink, room_id: int) -> Room | None:
        room = self.rooms.find(room_id)
        if room is None or room.peer != link.endpoint:
            return None
        return room

    def _refused(self, link: PrefillLink, msg: PeerRefused) -> None:
        log.error("prefill daemon %s refused this daemon [%s]: %s", link.endpoint, msg.code.value, msg.reason)
        for room_id in list(link.rooms):
            room = self.rooms.find(room_id)
            if room is not None:
                self.work[room_id].peer_fenced = True  # it refused us: it never wrote
                self.fail(room, msg.code, f"prefill {link.endpoint} refused: {msg.reason}")
        self.links.pop(link.endpoint, None)
        self.close_link(link.endpoint)

    def _aux_record(self, link: PrefillLink, room: Room, msg: AuxRecord) -> None:
        aux = self._aux()
        w = self.work[room.id]
        w.peer_fenced = True  # the prefill sends aux only after its KV writes completed
        if room.finished:
            return
        slot = aux.slots.slots[msg.slot] if 0 <= msg.slot < len(aux.slots) else None
        try:
            if slot is None or slot.state is not SlotState.ARMED or (slot.room, slot.generation) != (msg.room, msg.generation):
                holder = f"room {slot.room} generation {slot.generation} ({slot.state.value})" if slot else "no slot"
                raise errors.AuxStampMismatch(
                    f"aux record for room {msg.room} generation {msg.generation} aimed at slot {msg.slot}, which holds {holder}",
                    room=room.id,
                )
            sent = Stamp(msg.room, msg.generation, msg.length, msg.checksum)
            if msg.via_transfer_engine:
                landed = aux.header(msg.slot)
                payload = aux.payload(msg.slot, landed.length if landed else 0)
                verify(landed, slot=msg.slot, expected_room=room.id, expected_generation=room.generation, payload=payload)
                if landed != sent:
                    raise errors.AuxStampMismatch(f"aux slot {msg.slot} holds stamp {landed}, the prefill announced {sent}", room=room.id)
            else:
                verify(sent, slot=msg.slot, expected_room=room.id, expected_generation=room.generation, payload=msg.payload)
                aux.write(msg.slot, sent, msg.payload)
        except PdxferError as exc:
            self.fail(room, exc.code, exc.message)
            victim = self.rooms.find(slot.room) if slot is not None and slot.room != room.id else None
            if msg.via_transfer_engine and victim is not None:
                # the stray record was written into another room's slot
                self.fail(victim, exc.code, exc.message)
            return
        aux.slots.mark_written(msg.slot, msg.generation, self.clock())
        if room.state.value == "waiting_for_input":
            self.rooms.apply(room, Event.INPUT_READY, self.clock())
        self.succeed(room)
        self.send_link(link.endpoint, RoomAck(room=room.id))

    # --- hooks

    def stop_writes(self, room: Room) -> bool:
        w = self.work.get(room.id)
        if w is None or w.peer_fenced:
            return True
        # Tell the prefill; its RoomFailed(fenced) reply, or the fence timeout, fences us.
        self.send_link(w.link, RoomFailed(room=room.id, code=room.code, reason=room.reason, fenced=True))
        return False

    def engine_of(self, room: Room) -> bytes:
        w = self.work.get(room.id)
        return w.engine if w else b""

    def room_memory_version(self, room: Room) -> int:
        w = self.work.get(room.id)
        return w.memory_version if w else 0

    def forget(self, room: Room) -> None:
        w = self.work.pop(room.id, None)
        if w is not None and w.link in self.links:
            self.links[w.link].rooms.discard(room.id)
