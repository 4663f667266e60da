"""Roles built with a recording port (port.py), registered the way an engine registers,
and the messages a test hands them or expects of them.

The pools are a page-first layout, one region, so every page is one block: page p of
a pool at B is the bytes [B + p * PAGE_BYTES, B + (p + 1) * PAGE_BYTES).
"""

from __future__ import annotations

from pdxfer.core.config import Config
from pdxfer.core.plan import compat_of, layout_regions, layout_registration, pages_to_bytes, pool_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    AllocSlot,
    Codec,
    ErrorCode,
    Expect,
    KVLayout,
    Layout,
    Message,
    LaneInfo,
    PeerHello,
    Rank,
    RegisterAux,
    RegisterKV,
    Role,
    RoomState,
    RoomStatus,
    Send,
    ShmHandle,
    SlotGrant,
)
from pdxfer.roles.decode import DecodeService
from pdxfer.roles.prefill import PrefillService

from .port import RecordingPort

LAYOUT = KVLayout(layout=Layout.PAGE_FIRST, num_layers=2, num_pages=16, page_size=4, token_bytes=8, dtype="bfloat16")
(REGION,) = layout_regions(LAYOUT)
SPEC, REGIONS = layout_registration(LAYOUT)
PAGE_BYTES = REGION.page_bytes  # 2 layers x K,V x 4 tokens x 8 bytes = 128
SLOTS, SLOT_BYTES = 8, 256
ENGINE = b"engine-1"

PREFILL_INCARNATION = "p" * 16
PREFILL_SESSIONS = ("10.0.0.1:15001", "10.0.0.1:15002")
BOOTSTRAP = "10.0.0.1:8998"
ENDPOINT = "tcp://10.0.0.1:8998"  # the decode side's name for the prefill's link

DECODE = b"decode-a"  # the identity a decode daemon's connection has at the prefill
DECODE_INCARNATION = "d" * 16
DECODE_SESSIONS = ("10.0.0.2:16001",)
# Where a decode daemon described by decode_hello() has its pools, as literal addresses.
DST_KV = 0x7F00_0000_0000
DST_AUX = 0x7F10_0000_0000
DST_PROBE = 0x7F20_0000_0040

TICK = 125  # ms between ticks (the daemon ticks every 50; 125 keeps every time exact in binary)

codec = Codec()


def done(awaitable):
    """The result of a coroutine that never waits (the recording port's mapping)."""
    try:
        awaitable.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine waited on something")


def wired(message: Message) -> tuple[Message, int]:
    """A peer message as it comes off the wire to a role: decoded, and its bytes there."""
    raw = codec.encode(message)
    return codec.peer_messages.decode(raw), len(raw)


def wire(message: Message) -> Message:
    return wired(message)[0]


def call(service, message: Message, engine: bytes = ENGINE) -> Message | None:
    """The engine ``engine`` sends ``message``; the reply."""
    reply = service.on_engine(engine, codec.engine_requests.decode(codec.encode(message)))
    return done(reply) if hasattr(reply, "send") else reply


def register(service, engine: bytes = ENGINE) -> None:
    """What an engine does first: register its KV pool and its aux buffer."""
    name = engine.decode()
    kv = RegisterKV(req=1, buffers=(ShmHandle(name=f"kv-{name}", size=pool_bytes(LAYOUT)),), spec=SPEC, regions=REGIONS, memory_version=1)
    aux = RegisterAux(req=2, memory=ShmHandle(name=f"aux-{name}", size=SLOTS * SLOT_BYTES), num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    for message in (kv, aux):
        reply = call(service, message, engine)
        assert type(reply).__name__ == "Ok", reply


def grant(service, engine: bytes = ENGINE) -> SlotGrant:
    reply = call(service, AllocSlot(req=3), engine)
    assert isinstance(reply, SlotGrant), reply
    return reply


def prefill(port: RecordingPort | None = None, registered: bool = True, **options) -> PrefillService:
    """A prefill role, registered by its engine unless ``registered`` is false; ``options`` are Config fields."""
    service = PrefillService(Config(role=Role.PREFILL, **options), PREFILL_INCARNATION, port or RecordingPort(),
                             sessions=PREFILL_SESSIONS, bootstrap_address=BOOTSTRAP)
    if registered:
        register(service)
    return service


def decode(port: RecordingPort | None = None, registered: bool = True, **options) -> DecodeService:
    """A decode role named host/d, registered by its engine unless ``registered`` is false; ``options`` are Config fields."""
    service = DecodeService(Config(role=Role.DECODE, host="host", name="d", **options), DECODE_INCARNATION, port or RecordingPort(),
                            sessions=DECODE_SESSIONS, probe_base=DST_PROBE, engine_release="")
    if registered:
        register(service)
    return service


def decode_hello(incarnation: str = DECODE_INCARNATION, name: str = "host/d", inline_kv_bytes: int = 0, lanes: tuple = (), **fields) -> PeerHello:
    """What a decode daemon with the pools above says first. No inline KV unless asked:
    the rooms here are about writes. ``lanes`` describe other ranks' pools instead."""
    lane = LaneInfo(index=0, rank=Rank(), compat=compat_of(SPEC, REGIONS, SLOT_BYTES), heads_local=SPEC.heads.local, layers=SPEC.layers,
                    region_bases=(DST_KV,), num_pages=LAYOUT.num_pages, aux_base=DST_AUX, aux_slots=SLOTS, memory_version=1)
    fields = {"session": DECODE_SESSIONS[0], "sessions": DECODE_SESSIONS, **fields}
    return PeerHello(
        version=PROTOCOL_VERSION, incarnation=incarnation, lanes=lanes or (lane,), name=name, probe_base=DST_PROBE,
        inline_kv_bytes=inline_kv_bytes, **fields,
    )


def send(room: int, pages: list[int], slot: SlotGrant, aux_bytes: int = 0, tokens: int | None = None) -> Send:
    return Send(req=10, room=room, pages=pages_to_bytes(pages), num_tokens=tokens or len(pages) * LAYOUT.page_size,
                slot=slot.slot, generation=slot.generation, aux_bytes=aux_bytes, memory_version=1)


def expect(room: int, pages: list[int], slot: SlotGrant, bootstrap: str = BOOTSTRAP) -> Expect:
    return Expect(req=11, room=room, bootstrap=bootstrap, pages=pages_to_bytes(pages), slot=slot.slot,
                  generation=slot.generation, memory_version=1)


def status(room: int, state: RoomState, fenced: bool, code: ErrorCode | None = None, reason: str = "", pages: int = 0, skip_pages: int = 0) -> RoomStatus:
    """What the engine hears of ``room``: on the prefill, once the decode's request is in,
    the positions it wants (``pages``) and those it skips."""
    return RoomStatus(req=0, room=room, state=state, code=code, reason=reason, fenced=fenced, pages=pages, skip_pages=skip_pages)


def run(service: PrefillService | DecodeService, ms: int) -> None:
    """Let ``ms`` pass, ticking as the daemon does."""
    for _ in range(ms // TICK):
        service.port.advance(TICK)
        service.tick()
