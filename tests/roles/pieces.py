"""The pieces a role builds its parts from, built here without the role: lanes
registered through roles.lanes with the recording port (port.py: plain process memory,
no shared memory mapped), a room book, and a recording stand-in for what a role tells
the book of its rooms (book.RoomParts). Tests of one part (test_book.py,
test_requester.py, ...) construct that part with these, as the role's __init__ does.

The pools are rig.py's: one page-first region of 16 pages, PAGE_BYTES each, 8 aux
slots of SLOT_BYTES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from pdxfer.core.config import Config
from pdxfer.core.generations import Span
from pdxfer.core.plan import pages_from_bytes, pages_to_bytes, pool_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    EngineHello,
    LegRequest,
    Rank,
    RegisterAux,
    RegisterKV,
    Role,
    RoomState,
    RoomStatus,
    ShmHandle,
)
from pdxfer.core.rooms import Event, Room
from pdxfer.core.topology import room_key, room_of
from pdxfer.roles.book import RoomBook
from pdxfer.roles.decode.requester import Requester
from pdxfer.roles.decode.rotation import SessionRotation
from pdxfer.roles.decode.state import DecodeState, DecodeWork, LegState, PrefillLink
from pdxfer.roles.decode.verifier import Verifier
from pdxfer.roles.lanes import Lane, Lanes, Replaced
from pdxfer.roles.prefill.parts import RoomParts
from pdxfer.roles.prefill.state import Chunk, DecodePeer, PrefillState, PrefillWork
from pdxfer.roles.prefill.writer import Writer

from .port import RecordingPort
from .rig import DECODE, DECODE_SESSIONS, ENDPOINT, ENGINE, LAYOUT, REGIONS, SLOT_BYTES, SLOTS, SPEC, decode_hello, done


def config(role: Role, **options) -> Config:
    """A role's config; ``options`` are Config fields."""
    return Config(role=role, host="host", name="d", **options) if role is Role.DECODE else Config(role=role, **options)


def kv_registration(name: str = "kv", version: int = 1, spec=SPEC, regions=REGIONS) -> RegisterKV:
    return RegisterKV(req=1, buffers=(ShmHandle(name=name, size=pool_bytes(LAYOUT)),), spec=spec, regions=regions, memory_version=version)


def aux_registration(name: str = "aux", slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> RegisterAux:
    return RegisterAux(req=2, memory=ShmHandle(name=name, size=slots * slot_bytes), num_slots=slots, slot_bytes=slot_bytes)


def never_replaced(lane: Lane, replaced: Replaced) -> None:
    raise AssertionError(f"a first registration replaced something: {replaced}")


def register(lanes: Lanes, lane: Lane, spec=SPEC, regions=REGIONS) -> Lane:
    """What an engine rank does first: its KV pool and aux buffer, named after the lane."""
    done(lanes.register_kv(lane, kv_registration(f"kv-{lane.index}", spec=spec, regions=regions), never_replaced))
    done(lanes.register_aux(lane, aux_registration(f"aux-{lane.index}"), never_replaced))
    return lane


def engine(tp: int) -> bytes:
    """The engine connection of TP rank ``tp`` (registered_lanes)."""
    return b"engine-%d" % tp


def registered_lanes(config: Config, port: RecordingPort, ranks: int = 1, spec=SPEC, regions=REGIONS) -> Lanes:
    """Lanes with ``ranks`` TP ranks of one engine registered (one: an unnamed engine
    that never said hello, as rig.py's; more: engine "e", each rank connected as engine(tp))."""
    lanes = Lanes(config, config.role, port)
    if ranks == 1:
        register(lanes, lanes.of(engine(0)), spec, regions)
        return lanes
    for tp in range(ranks):
        hello = EngineHello(req=1, version=PROTOCOL_VERSION, engine_id="e", role=config.role, rank=Rank(tp=tp), sizes=Rank(tp=ranks))
        register(lanes, lanes.hello(engine(tp), hello), spec, regions)
    return lanes


class BookParts:
    """A role as its book sees it (book.RoomParts): every call recorded, in order, as
    (what, room key, detail); a room's engine is whatever ``engines`` says (none unless
    set); release goes back to the book, as both roles do."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engines: dict[int, bytes] = {}  # room key -> its engine connection
        self.book: RoomBook | None = None  # set once the book is made

    def engine_of(self, room: Room) -> bytes:
        return self.engines.get(room.id, b"")

    def status(self, room: Room, req: int = 0) -> RoomStatus:
        return RoomStatus(req=req, room=room_of(room.id), state=room.state, code=room.code, reason=room.reason, fenced=room.fenced)

    def stop_writes(self, room: Room) -> None:
        self.calls.append(("stop_writes", room.id, frozenset(room.writers)))

    def fenced(self, room: Room, proven: bool) -> None:
        self.calls.append(("fenced", room.id, proven))

    def forget(self, room: Room) -> None:
        self.calls.append(("forget", room.id, None))

    def release(self, room: Room) -> None:
        self.calls.append(("release", room.id, None))
        self.book.release(room)

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def made_book(role: Role = Role.DECODE, slot_fence: float = math.inf, ranks: int = 1, parts: BookParts | None = None,
              spec=SPEC, regions=REGIONS, **options) -> RoomBook:
    """A room book over registered lanes, with a recording port and BookParts (book.parts);
    ``options`` are Config fields."""
    port = RecordingPort()
    cfg = config(role, **options)
    parts = parts or BookParts()
    book = RoomBook(cfg, port, registered_lanes(cfg, port, ranks, spec, regions), parts, slot_fence=slot_fence)
    parts.book = book
    return book


# --- the decode role's parts


@dataclass(eq=False)
class DecodeParts:
    """The decode role's parts, made as DecodeService.__init__ makes them (no staging
    buffer), over a book whose role is BookParts; ``hellos`` counts the hellos the
    rotation asked the role to send every prefill."""

    book: RoomBook
    state: DecodeState
    requester: Requester
    verifier: Verifier
    sessions: SessionRotation
    hellos: list[float]

    @property
    def port(self) -> RecordingPort:
        return self.book.port

    @property
    def lanes(self) -> Lanes:
        return self.book.lanes


def decode_parts(ranks: int = 1, spec=SPEC, regions=REGIONS, sessions=DECODE_SESSIONS, **options) -> DecodeParts:
    book = made_book(Role.DECODE, ranks=ranks, spec=spec, regions=regions, **options)
    cfg, port, state, hellos = book.config, book.port, DecodeState(), []
    requester = Requester(cfg, port, book.lanes, book, state, None)
    verifier = Verifier(cfg, port, book.lanes, book, state, requester, None)
    rotation = SessionRotation(cfg, port, book, state, sessions, lambda: hellos.append(port.clock()))
    return DecodeParts(book, state, requester, verifier, rotation, hellos)


def leg(code: int = 0, lane: int = 0, pages=(5, 6), aux: bool = True, **fields) -> LegRequest:
    """A leg of a decode rank's room; ``aux``: it carries the room's aux record (decode_room
    fills in the room's slot)."""
    return LegRequest(leg=code, lane=lane, pages=pages_to_bytes(list(pages)), generation=1 if aux else 0, memory_version=1, **fields)


def decode_room(parts: DecodeParts, room_id: int, legs: list[LegRequest] | None = None, lane: int = 0, endpoint: str = ENDPOINT,
                pages=(5, 6), to: RoomState = RoomState.TRANSFERRING, span: Span = Span(1, 1)) -> Room:
    """A decode rank's room as the service makes it on expect(): in the book with an aux
    slot bound (the leg that carries the aux record names it), its work and legs in the
    shared state, its real legs its writers, on the link to ``endpoint`` (made if new);
    moved on to ``to``. Its engine is ENGINE."""
    book, now = parts.book, parts.port.clock()
    grant = parts.lanes[lane].aux.slots.allocate(now)
    legs = [msgspec.structs.replace(one, slot=grant.index, generation=grant.generation) if one.carries_aux else one
            for one in (legs or [leg(lane=lane, pages=pages)])]
    room = book.create(room_key(room_id, parts.lanes[lane].code), Role.DECODE, lane, peer=endpoint)
    book.bind_slot(room, grant.index, grant.generation)
    book.parts.engines[room.id] = ENGINE
    parts.state.work[room.id] = DecodeWork(ENGINE, endpoint, 1, np.array(pages, np.int32),
                                           {one.leg: LegState(one, landed=not one.real) for one in legs}, span=span)
    room.writers.update(one.leg for one in legs if one.real)
    link = parts.state.links.get(endpoint)
    if link is None:
        link = parts.state.links[endpoint] = PrefillLink(endpoint, last_heard=now, last_word=now, ready=True, connected=True)
    link.rooms.add(room.id)
    if to is not RoomState.BOOTSTRAPPING:
        book.advance(room, Event.BOOTSTRAPPED)
    if to is RoomState.TRANSFERRING:
        book.advance(room, Event.INPUT_READY)
    parts.port.take()
    return room


# --- the prefill role's parts


@dataclass(eq=False)
class PrefillParts:
    """The prefill role's parts, made as PrefillService.__init__ makes them (no staging
    buffer), over a book whose role is BookParts; the decode daemon DECODE said
    rig.decode_hello() (its pools at rig.DST_KV and rig.DST_AUX)."""

    book: RoomBook
    state: PrefillState
    parts: RoomParts
    writer: Writer

    @property
    def port(self) -> RecordingPort:
        return self.book.port

    @property
    def lanes(self) -> Lanes:
        return self.book.lanes

    @property
    def peer(self) -> DecodePeer:
        return self.state.peers[DECODE]


def prefill_parts(hello_fields: dict | None = None, **options) -> PrefillParts:
    cfg = config(Role.PREFILL, **options)
    book = made_book(Role.PREFILL, slot_fence=cfg.fence_timeout, **options)
    state = PrefillState()
    state.peers[DECODE] = DecodePeer(DECODE, decode_hello(**(hello_fields or {})), last_heard=book.port.clock())
    parts = RoomParts(book, state)
    return PrefillParts(book, state, parts, Writer(book.config, book.port, book.lanes, book, state, parts, None))


def chunk(first_page: int, pages, last: bool = True, aux_bytes: int = 0, tokens_per_page: int = LAYOUT.page_size) -> Chunk:
    """A chunk of a room's input as the engine hands it over (its last: ``tokens_per_page`` for every position so far)."""
    pages = np.array(list(pages), np.int32)
    return Chunk(first_page, pages, last, (first_page + pages.size) * tokens_per_page if last else 0, aux_bytes, False)


def prefill_room(parts: PrefillParts, room_id: int, dst=(5, 6), request: LegRequest | None = None, lease_ms: int = 30_000,
                 key: int | None = None, bind: bool = True) -> tuple[Room, PrefillWork]:
    """A prefill rank's room part whose decode request came (``request``: by default one
    leg of whole pages into ``dst``, carrying the aux record into the decode's slot 3;
    its pages are the destination) and whose engine bound an aux slot: bootstrapped, no
    input yet. Its engine is ENGINE. ``key``: its key in the room table (default: the room
    id); ``bind``: false for a fan-out part, which reads its first part's slot."""
    book, now = parts.book, parts.port.clock()
    request = request or LegRequest(pages=pages_to_bytes(list(dst)), slot=3, generation=1, memory_version=1)
    room = book.create(key if key is not None else room_id, Role.PREFILL, 0, peer=DECODE_SESSIONS[0])
    slot = -1
    if bind:
        grant = parts.lanes[0].aux.slots.allocate(now)
        book.bind_slot(room, grant.index, grant.generation)
        slot = grant.index
    book.parts.engines[room.id] = ENGINE
    w = parts.state.work[room.id] = PrefillWork(engine=ENGINE if bind else b"", memory_version=1, peer=DECODE, sessions=DECODE_SESSIONS,
                                                request=request, lease_ms=lease_ms, dst_pages=pages_from_bytes(request.pages).copy(),
                                                aux_slot=slot)
    parts.peer.rooms.add(room.id)
    book.advance(room, Event.BOOTSTRAPPED)
    parts.port.take()
    return room, w


def hand_over(parts: PrefillParts, room: Room, w: PrefillWork, piece: Chunk) -> None:
    """The engine hands ``piece`` over, as the service does: written at once once the room
    started, else it moves the room on (to transferring: the request is in)."""
    w.take(room, piece)
    if w.started:
        parts.writer.write_chunks(room, w)
    else:
        parts.book.advance(room, Event.INPUT_READY)
