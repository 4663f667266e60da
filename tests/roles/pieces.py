"""The pieces a role builds its parts from, built here without the role: lanes
registered through roles.lanes with the recording port (port.py: plain process memory,
no shared memory mapped), a room book, and a recording stand-in for what a role tells
the book of its rooms (book.RoomParts). Tests of one part (test_book.py,
test_requester.py, ...) construct that part with these, as the role's __init__ does.

The pools are rig.py's: one page-first region of 16 pages, PAGE_BYTES each, 8 aux
slots of SLOT_BYTES.
"""

from __future__ import annotations

from pdxfer.core.config import Config
from pdxfer.core.plan import pool_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    EngineHello,
    Rank,
    RegisterAux,
    RegisterKV,
    Role,
    RoomStatus,
    ShmHandle,
)
from pdxfer.core.rooms import Room
from pdxfer.core.topology import room_of
from pdxfer.roles.book import RoomBook
from pdxfer.roles.lanes import Lane, Lanes, Replaced

from .port import RecordingPort
from .rig import LAYOUT, REGIONS, SLOT_BYTES, SLOTS, SPEC, done


def config(role: Role, **options) -> Config:
    """A role's config; ``options`` are Config fields."""
    return Config(role=role, host="host", name="d", **options) if role is Role.DECODE else Config(role=role, **options)


def kv_registration(name: str = "kv", version: int = 1, spec=SPEC, regions=REGIONS) -> RegisterKV:
    return RegisterKV(req=1, buffers=(ShmHandle(name=name, size=pool_bytes(LAYOUT)),), spec=spec, regions=regions, memory_version=version)


def aux_registration(name: str = "aux", slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> RegisterAux:
    return RegisterAux(req=2, memory=ShmHandle(name=name, size=slots * slot_bytes), num_slots=slots, slot_bytes=slot_bytes)


def never_replaced(lane: Lane, replaced: Replaced) -> None:
    raise AssertionError(f"a first registration replaced something: {replaced}")


def register(lanes: Lanes, lane: Lane, spec=SPEC) -> Lane:
    """What an engine rank does first: its KV pool and aux buffer, named after the lane."""
    done(lanes.register_kv(lane, kv_registration(f"kv-{lane.index}", spec=spec), never_replaced))
    done(lanes.register_aux(lane, aux_registration(f"aux-{lane.index}"), never_replaced))
    return lane


def engine(tp: int) -> bytes:
    """The engine connection of TP rank ``tp`` (several_ranks)."""
    return b"engine-%d" % tp


def registered_lanes(config: Config, port: RecordingPort, ranks: int = 1, spec=SPEC) -> Lanes:
    """Lanes with ``ranks`` TP ranks of one engine registered (one: an unnamed engine
    that never said hello, as rig.py's; more: engine "e", each rank connected as engine(tp))."""
    lanes = Lanes(config, config.role, port)
    if ranks == 1:
        register(lanes, lanes.of(engine(0)), spec)
        return lanes
    for tp in range(ranks):
        hello = EngineHello(req=1, version=PROTOCOL_VERSION, engine_id="e", role=config.role, rank=Rank(tp=tp), sizes=Rank(tp=ranks))
        register(lanes, lanes.hello(engine(tp), hello), spec)
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


def made_book(role: Role = Role.DECODE, slot_fence: float = float("inf"), ranks: int = 1, parts: BookParts | None = None,
              **options) -> RoomBook:
    """A room book over registered lanes, with a recording port and BookParts (book.parts);
    ``options`` are Config fields."""
    port = RecordingPort()
    cfg = config(role, **options)
    parts = parts or BookParts()
    book = RoomBook(cfg, port, registered_lanes(cfg, port, ranks), parts, slot_fence=slot_fence)
    parts.book = book
    return book
