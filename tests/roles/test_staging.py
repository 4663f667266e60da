"""A decode role with a staging buffer (core/staging.py), with the recording port and the
fake clock: a leg from a prefill rank holding fewer heads gets an extent of the buffer
when its request leaves, if that prefill said it stages; the extent comes back only on
proof that nothing more of the leg can land (S2, as for aux slots), never when the room
merely failed."""

from __future__ import annotations

import zlib

import numpy as np

from pdxfer.core.config import Config
from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    AllocSlot,
    AuxRecord,
    EngineHello,
    ErrorCode,
    Expect,
    Heads,
    KVRegion,
    KVSpec,
    LegWritten,
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
    RoomStatus,
    ShmHandle,
    SlotGrant,
)
from pdxfer.core.errors import InsufficientCapacity
from pdxfer.core.staging import ALIGN
from pdxfer.roles.decode import DecodeService
from pdxfer.roles.staging import RESERVE_UNIT, Staging

from .rig import DECODE_INCARNATION, DST_PROBE, ENDPOINT, PREFILL_INCARNATION, PREFILL_SESSIONS, call, wire
from .port import RecordingPort

# A decode rank of TP 1 holding 2 heads, head-major: from prefill TP 2 each leg is one head of every page.
SPEC = KVSpec(page_size=4, dtype="uint8", num_layers_total=1, layers=(0, 1), page_order=PageOrder.HEAD_MAJOR,
              heads=Heads(local=2, total=2, bytes_per_token_head=8))
REGIONS = (KVRegion(buffer=0, offset=0, page_bytes=64, num_pages=16, layer=0, kind=RegionKind.KV),)
LEG_BYTES = 2 * 32  # two pages, one head of 32 bytes each


class _Memory:
    """A staging buffer's memory: ``reserve`` (backing a range with pages) records what
    it was asked, and fails while ``backable`` is false, as with /dev/shm full."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.array = np.zeros(size, np.uint8)
        self.address = self.array.ctypes.data
        self.reserved: list[tuple[int, int]] = []
        self.backable = True

    def reserve(self, offset: int, nbytes: int) -> None:
        if not self.backable:
            raise InsufficientCapacity("/dev/shm cannot back 2097152 more bytes of pdxfer-staging-1-ab (No space left on device)")
        self.reserved.append((offset, nbytes))


def made_staging(size: int, backed: bool = False) -> Staging:
    """A staging buffer of ``size`` bytes that backs its pages through _Memory.reserve (a daemon's port does it with /dev/shm)."""
    memory = _Memory(size)
    return Staging(memory, memory.reserve, backed)


def staging_decode(staging_bytes: int = 16 * ALIGN) -> DecodeService:
    service = DecodeService(Config(role=Role.DECODE, host="host", name="d"), DECODE_INCARNATION, RecordingPort(),
                            sessions=("10.0.0.2:16001",), probe_base=DST_PROBE, engine_release="", staging=made_staging(staging_bytes))
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
    service.on_link(ENDPOINT, incarnation, wire(message))


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
    assert service.hello(ENDPOINT).staging_base == base and service.hello(ENDPOINT).staging_bytes == size
    assert service.requester.staged_legs == 2


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
    assert (service.requester.staged_legs, service.staging.full) == (1, 1)


def test_a_leg_larger_than_the_whole_buffer_names_the_size_that_would_hold_it(caplog):
    staging = made_staging(2 << 20)
    assert staging.take(5 << 20) is None
    assert staging.take((5 << 20) - 1) is None  # no larger than the last one told: not said again
    assert staging.take(ALIGN) == 0  # a leg that fits still gets its extent
    assert staging.take(2 << 20) is None  # fits the buffer, not what is left of it: full, not too large
    assert staging.full == 3
    told = [r.getMessage() for r in caplog.records if r.name == "pdxfer.staging"]
    assert len(told) == 1 and "5.0 MiB" in told[0] and "2 MiB staging buffer" in told[0] and "--staging-mib 10 or more" in told[0]


def test_an_extent_is_backed_with_pages_before_it_is_handed_out_each_unit_once():
    staging = made_staging(8 * RESERVE_UNIT)
    assert staging.take(RESERVE_UNIT + 1) == 0  # reaches into a second unit: both backed
    assert staging.memory.reserved == [(0, 2 * RESERVE_UNIT)]
    second = staging.take(ALIGN)  # inside what is backed already: nothing asked
    assert second == RESERVE_UNIT + ALIGN and staging.memory.reserved == [(0, 2 * RESERVE_UNIT)]
    staging.arena.give(0)
    assert staging.take(2 * RESERVE_UNIT) == RESERVE_UNIT + 2 * ALIGN  # first fit, past the extent still held
    assert staging.memory.reserved[-1] == (2 * RESERVE_UNIT, 2 * RESERVE_UNIT)  # its units not backed before, only


def test_a_buffer_backed_at_start_hands_out_extents_without_backing_any_again():
    staging = made_staging(8 * RESERVE_UNIT, backed=True)  # --staging-at-start did it whole
    assert [staging.take(2 * RESERVE_UNIT) for _ in range(4)] == [i * 2 * RESERVE_UNIT for i in range(4)]
    assert staging.memory.reserved == [] and staging.full == 0


def test_an_extent_shared_memory_cannot_back_is_refused_and_said_without_flooding_the_log(caplog):
    staging = made_staging(8 * RESERVE_UNIT)
    staging.memory.backable = False
    assert [staging.take(ALIGN) for _ in range(5)] == [None] * 5  # the leg or chunk writes between the pages
    assert (staging.full, staging.unbacked, staging.arena.taken_bytes) == (5, 5, 0)  # nothing kept taken
    told = [r.getMessage() for r in caplog.records if r.name == "pdxfer.staging"]
    assert len(told) == 3  # the 1st, 2nd and 4th time
    assert told[0].startswith("/dev/shm cannot back") and "writes between the pages" in told[0]
    assert "(1 so far)" in told[0] and "(4 so far)" in told[2] and "free some or make it larger" in told[0]
    staging.memory.backable = True  # space came back: staging resumes
    assert staging.take(ALIGN) == 0 and staging.full == 5


def test_an_extent_is_held_after_its_room_failed_until_the_prefill_says_nothing_can_land():
    service = staging_decode()
    expect(service, 7)
    welcome(service)
    first, second = request(service).legs
    arena = service.staging.arena
    service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=False, leg=first.leg)))
    assert service.rooms.get(7).state is RoomState.FAILED
    assert len(arena) == 2  # failed, but writes of both legs may still land
    service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=True, leg=first.leg)))
    assert len(arena) == 1 and (7, second.leg) in service.state.staged  # the other leg's prefill rank has not said so
    # Its process restarts: nothing of the old one can land any more.
    service.on_connection(ENDPOINT, "disconnected")
    welcome(service, incarnation="n" * 16)
    assert len(arena) == 0 and service.state.staged == {}


def test_an_extent_of_a_room_released_before_its_prefill_confirmed_comes_back_with_the_confirmation():
    service = staging_decode()
    expect(service, 7)
    welcome(service)
    legs = request(service).legs
    service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=False, leg=legs[0].leg)))
    assert type(call(service, Release(req=6, room=7))).__name__ == "Ok"  # the engine lets the room go unfenced
    assert service.rooms.find(7).released
    assert len(service.staging.arena) == 2
    for leg in legs:
        service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(RoomFailed(room=7, code=ErrorCode.TRANSFER_FAILED, reason="x", fenced=True, leg=leg.leg)))
    assert len(service.staging.arena) == 0


def records(service, legs) -> None:
    """Each leg's record, as its prefill rank sends it once every write of the leg completed."""
    for leg in legs:
        if leg.generation:  # the leg that carries the aux record
            message = AuxRecord(room=7, slot=leg.slot, generation=leg.generation, length=0, checksum=zlib.crc32(b""), leg=leg.leg, kv_pages=2)
        else:
            message = LegWritten(room=7, leg=leg.leg, kv_pages=2)
        service.on_link(ENDPOINT, PREFILL_INCARNATION, wire(message))


def staged_room(service):
    """Room 7's two legs staged, each extent filled as its prefill rank would: its head of pages 3 and 5."""
    expect(service, 7)
    welcome(service)
    legs = request(service).legs
    for leg in legs:
        at = leg.staged_at - service.staging.base
        service.staging.memory.array[at : at + LEG_BYTES] = np.arange(LEG_BYTES, dtype=np.uint8) + 100 * (1 + leg.dst_head_start)
    return legs


def test_a_staged_leg_is_copied_into_its_pages_off_the_loop_and_the_room_succeeds_only_after():
    service = staging_decode()
    legs = staged_room(service)
    records(service, legs)
    assert len(service.port.copies) == 2 and service.rooms.get(7).state is not RoomState.SUCCESS
    assert len(service.staging.arena) == 2 and service.state.staged == {}  # the copies own their extents while they run
    assert service.port.run_copies() == 2
    assert service.rooms.get(7).state is RoomState.SUCCESS and len(service.staging.arena) == 0
    (kv,) = [b for b in service.port.mapped if b.handle.name == "kv"]
    pages = kv.array.reshape(16, 2, 32)  # [page][head][token x unit]
    for leg in legs:
        part = np.arange(LEG_BYTES, dtype=np.uint8) + 100 * (1 + leg.dst_head_start)
        assert np.array_equal(pages[[3, 5], leg.dst_head_start], part.reshape(2, 32))


def test_a_room_failing_while_a_copy_writes_its_pages_is_fenced_only_when_the_copy_ends():
    service = staging_decode()
    legs = staged_room(service)
    records(service, legs)  # both prefill ranks are done: only the daemon's own copies still write
    room = service.rooms.get(7)
    service.fail(room, ErrorCode.TIMEOUT, "the engine gave up")
    assert room.state is RoomState.FAILED and not room.fenced
    told = [m for _, _, m in service.port.take() if isinstance(m, RoomStatus) and m.room == 7]
    assert told and not told[-1].fenced  # the engine must keep the pages
    service.port.run_copies()
    assert room.fenced and len(service.staging.arena) == 0
    told = [m for _, _, m in service.port.take() if isinstance(m, RoomStatus) and m.room == 7]
    assert told and told[-1].fenced and told[-1].state is RoomState.FAILED


def test_a_copy_that_fails_fails_its_room_and_gives_its_extent_back():
    service = staging_decode()
    legs = staged_room(service)
    records(service, legs[:1])
    (work, done), = service.port.copies
    service.port.copies.clear()
    done(MemoryError("no pages"))
    room = service.rooms.get(7)
    assert room.state is RoomState.FAILED and room.code is ErrorCode.INTERNAL and "staging buffer" in room.reason
    assert len(service.staging.arena) == 1  # the other leg's prefill rank may still write into its extent
