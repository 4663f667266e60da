"""A decode role with a staging buffer (core/staging.py), with the recording port and the
fake clock: a leg from a prefill rank holding fewer heads gets an extent of the buffer
when its request leaves, if that prefill said it stages; the extent comes back only on
proof that nothing more of the leg can land (S2, as for aux slots), never when the room
merely failed."""

from __future__ import annotations

import numpy as np

from pdxfer.core.config import Config
from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    AllocSlot,
    EngineHello,
    ErrorCode,
    Expect,
    Heads,
    KVRegion,
    KVSpec,
    PageOrder,
    PeerWelcome,
    Rank,
    RegionKind,
    RegisterAux,
    RegisterKV,
    Release,
    Role,
    RoomFailed,
    RoomRequest,
    RoomState,
    ShmHandle,
    SlotGrant,
)
from pdxfer.core.staging import ALIGN
from pdxfer.roles.decode import DecodeService
from pdxfer.roles.pools import Staging

from .rig import DECODE_INCARNATION, DST_PROBE, ENDPOINT, PREFILL_INCARNATION, PREFILL_SESSIONS, call, codec
from .port import RecordingPort

# A decode rank of TP 1 holding 2 heads, head-major: from prefill TP 2 each leg is one head of every page.
SPEC = KVSpec(page_size=4, dtype="uint8", num_layers_total=1, layers=(0, 1), page_order=PageOrder.HEAD_MAJOR,
              heads=Heads(local=2, total=2, bytes_per_token_head=8))
REGIONS = (KVRegion(buffer=0, offset=0, page_bytes=64, num_pages=16, layer=0, kind=RegionKind.KV),)
LEG_BYTES = 2 * 32  # two pages, one head of 32 bytes each


class _Memory:
    def __init__(self, size: int) -> None:
        self.size = size
        self.array = np.zeros(size, np.uint8)
        self.address = self.array.ctypes.data


def staging_decode(staging_bytes: int = 16 * ALIGN) -> DecodeService:
    service = DecodeService(Config(role=Role.DECODE, host="host", name="d"), DECODE_INCARNATION, RecordingPort(),
                            sessions=("10.0.0.2:16001",), probe_base=DST_PROBE, engine_release="", staging=Staging(_Memory(staging_bytes)))
    hello = EngineHello(req=1, version=PROTOCOL_VERSION, engine_id="e", role=Role.DECODE, rank=Rank(tp=0), sizes=Rank(tp=1))
    kv = RegisterKV(req=2, buffers=(ShmHandle(name="kv", size=64 * 16),), spec=SPEC, regions=REGIONS, memory_version=1)
    aux = RegisterAux(req=3, memory=ShmHandle(name="aux", size=8 * 256), num_slots=8, slot_bytes=256)
    for message in (hello, kv, aux):
        assert type(call(service, message)).__name__ in ("Welcome", "Ok")
    return service


def expect(service, room: int) -> None:
    slot = call(service, AllocSlot(req=4))
    assert isinstance(slot, SlotGrant)
    reply = call(service, Expect(req=5, room=room, bootstrap="10.0.0.1:8998", pages=pages_to_bytes([3, 5]), slot=slot.slot,
                                 generation=slot.generation, memory_version=1, prefill_sizes=Rank(tp=2)))
    assert type(reply).__name__ == "Ok", reply


def welcome(service, stages: bool = True, incarnation: str = PREFILL_INCARNATION) -> None:
    service.on_connection(ENDPOINT, "connected")
    message = PeerWelcome(version=PROTOCOL_VERSION, incarnation=incarnation, session=PREFILL_SESSIONS[0], clock=5_000.0, stages=stages)
    service.on_link(ENDPOINT, incarnation, codec.encode(message))


def request(service) -> RoomRequest:
    (sent,) = [m for _, _, m in service.port.take() if isinstance(m, RoomRequest)]
    return sent


def test_legs_from_ranks_with_fewer_heads_leave_with_extents_of_the_staging_buffer():
    service = staging_decode()
    expect(service, 7)  # before the prefill's welcome: held, and staged as it leaves
    assert service.staging.arena.taken_bytes == 0
    welcome(service)
    legs = request(service).legs
    base, size = service.staging.base, service.staging.arena.size
    assert [leg.head_count for leg in legs] == [1, 1]
    assert all(base <= leg.staged_at and leg.staged_at + LEG_BYTES <= base + size for leg in legs)
    assert len({leg.staged_at for leg in legs}) == 2
    assert service.hello().staging_base == base and service.hello().staging_bytes == size
    assert service.staged_legs == 2


def test_a_prefill_that_did_not_say_it_stages_is_asked_for_the_pages():
    service = staging_decode()
    expect(service, 7)
    welcome(service, stages=False)
    assert [leg.staged_at for leg in request(service).legs] == [0, 0]
    assert service.staging.arena.taken_bytes == 0


def test_a_leg_finding_the_buffer_full_writes_into_the_pages():
    service = staging_decode(staging_bytes=ALIGN)  # one extent
    expect(service, 7)
    welcome(service)
    assert sorted(bool(leg.staged_at) for leg in request(service).legs) == [False, True]
    assert (service.staged_legs, service.staging_full) == (1, 1)


def test_a_leg_larger_than_the_whole_buffer_names_the_size_that_would_hold_it(caplog):
    staging = Staging(_Memory(2 << 20))
    assert staging.take(5 << 20) is None
    assert staging.take((5 << 20) - 1) is None  # no larger than the last one told: not said again
    assert staging.take(ALIGN) == 0  # a leg that fits still gets its extent
    assert staging.take(2 << 20) is None  # fits the buffer, not what is left of it: full, not too large
    assert staging.full == 3
    told = [r.getMessage() for r in caplog.records if r.name == "pdxfer.staging"]
    assert len(told) == 1 and "5.0 MiB" in told[0] and "2 MiB staging buffer" in told[0] and "--staging-mib 10 or more" in told[0]


def test_an_extent_is_held_after_its_room_failed_until_the_prefill_says_nothing_can_land():
    service = staging_decode()
    expect(service, 7)
    welcome(service)
    first, second = request(service).legs
    arena = service.staging.arena
    service.on_link(ENDPOINT, PREFILL_INCARNATION, codec.encode(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=False, leg=first.leg)))
    assert service.rooms.get(7).state is RoomState.FAILED
    assert len(arena) == 2  # failed, but writes of both legs may still land
    service.on_link(ENDPOINT, PREFILL_INCARNATION, codec.encode(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=True, leg=first.leg)))
    assert len(arena) == 1 and (7, second.leg) in service.staged  # the other leg's prefill rank has not said so
    # Its process restarts: nothing of the old one can land any more.
    service.on_connection(ENDPOINT, "disconnected")
    welcome(service, incarnation="n" * 16)
    assert len(arena) == 0 and service.staged == {}


def test_an_extent_of_a_room_released_before_its_prefill_confirmed_comes_back_with_the_confirmation():
    service = staging_decode()
    expect(service, 7)
    welcome(service)
    legs = request(service).legs
    service.on_link(ENDPOINT, PREFILL_INCARNATION, codec.encode(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=False, leg=legs[0].leg)))
    assert type(call(service, Release(req=6, room=7))).__name__ == "Ok"  # the engine lets the room go unfenced
    assert service.rooms.find(7) is None
    assert len(service.staging.arena) == 2
    for leg in legs:
        service.on_link(ENDPOINT, PREFILL_INCARNATION, codec.encode(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=True, leg=leg.leg)))
    assert len(service.staging.arena) == 0
