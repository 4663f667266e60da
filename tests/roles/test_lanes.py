"""Lanes on their own (roles/lanes.py): the engine ranks a daemon serves, what each
registered, the registrations that replace others (and who hears of it), the memory
version rule, replaced mappings kept until writes aimed at them are over, and slots
reclaimed. Memory is mapped through the recording port (plain process memory)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pdxfer.core import errors
from pdxfer.core.plan import pool_bytes
from pdxfer.core.protocol import PROTOCOL_VERSION, CudaIpcHandle, EngineHello, Rank, RegisterAux, RegisterKV, Role, ShmHandle
from pdxfer.core.slots import Fenced, SlotState
from pdxfer.core.stamp import HEADER_BYTES, Stamp
from pdxfer.roles.lanes import Lane, Lanes, MappedAux, MappedKV, Replaced

from .pieces import aux_registration, config, kv_registration, never_replaced, register
from .port import Buffer, RecordingPort
from .rig import LAYOUT, PAGE_BYTES, REGIONS, SLOT_BYTES, SLOTS, SPEC, done

GRACE = 30.0 + 10.0  # s: transfer timeout + fence timeout, how long a replaced mapping is kept


def made(role: Role = Role.DECODE, **options) -> Lanes:
    return Lanes(config(role, **options), role, RecordingPort())


def hello(tp: int = 0, tp_size: int = 1, engine_id: str = "e", role: Role | None = Role.DECODE, **fields) -> EngineHello:
    return EngineHello(req=1, version=PROTOCOL_VERSION, engine_id=engine_id, role=role, rank=Rank(tp=tp), sizes=Rank(tp=tp_size), **fields)


class Heard:
    """A ``replaced`` callback: what it heard, and the lane's aux buffer when it did."""

    def __init__(self) -> None:
        self.heard: list[tuple[int, Replaced, object]] = []

    def __call__(self, lane: Lane, replaced: Replaced) -> None:
        self.heard.append((lane.index, replaced, lane.aux))


# --- engine ranks


def test_a_hello_makes_a_lane_per_engine_rank_and_a_restarted_rank_finds_its_own():
    lanes = made()
    first = lanes.hello(b"c1", hello(tp=0, tp_size=2))
    second = lanes.hello(b"c2", hello(tp=1, tp_size=2))
    assert (first.index, second.index) == (0, 1) and (first.code, second.code) == (0, 1)
    assert first.sizes == Rank(dp=1, pp=1, tp=2, cp=1)  # a size left 0 is 1
    assert second.name == "e rank pp=0 tp=1" and first.name == "e"  # rank (0, 0) is named by its engine alone
    again = lanes.hello(b"c3", hello(tp=1, tp_size=2))  # the same rank under a new connection: a restart
    assert again is second and len(lanes) == 2
    assert lanes.of(b"c3") is second and lanes.engines == {b"c1", b"c2", b"c3"}
    other = lanes.hello(b"c4", hello(tp=0, tp_size=2, engine_id="f"))
    assert other.index == 2  # another engine's rank 0 is another lane


def test_a_connection_that_never_said_hello_is_rank_0_of_an_unnamed_engine():
    lanes = made()
    lane = lanes.of(b"anyone")
    assert (lane.index, lane.engine_id, lane.rank, lane.name) == (0, "", Rank(), "engine")
    assert lanes.of(b"someone else") is lane and b"anyone" not in lanes.engines


def test_an_engine_gone_leaves_its_lane_for_a_successor():
    lanes = made()
    lane = lanes.hello(b"c1", hello())
    assert lanes.gone(b"c1") is lane and lanes.gone(b"c1") is None
    assert lanes.engines == set() and list(lanes) == [lane]
    assert lanes.hello(b"c2", hello()) is lane


@pytest.mark.parametrize("message, error, says", [
    (hello(role=Role.PREFILL), errors.Unsupported, "engine 'e' is a prefill engine but this daemon is a decode daemon: connect it to a prefill daemon"),
    (EngineHello(req=1, version=PROTOCOL_VERSION, rank=Rank(), sizes=Rank(cp=2)), errors.Unsupported, "the engine runs context parallelism (CP size 2)"),
    (hello(tp=2, tp_size=2), errors.BadMessage, "engine 'e': rank tp=2 is not below its size tp=2"),
])
def test_a_hello_the_daemon_cannot_serve_is_refused_saying_why(message, error, says):
    lanes = made()
    with pytest.raises(error) as refused:
        lanes.hello(b"c1", message)
    assert says in refused.value.message and len(lanes) == 0 and lanes.engines == set()


def test_a_hello_without_a_role_is_taken_as_this_daemons():
    lanes = made(Role.PREFILL)
    assert lanes.hello(b"c1", hello(role=None)).index == 0


# --- registrations


def test_a_first_registration_maps_each_buffer_and_replaces_nothing():
    lanes = made()
    lane = lanes.of(b"e")
    assert not lane.ready and lanes.slots_of(0) is None
    with pytest.raises(errors.NotRegistered):
        lane.registered_kv()
    register(lanes, lane)
    (kv_buffer, aux_buffer) = lanes.port.mapped
    assert lane.ready and lane.kv.version == 1 and lane.kv.kind == "shm"
    assert lane.kv.buffers == [kv_buffer] and lane.kv.bases == (kv_buffer.address,)
    assert (lane.kv.page_bytes, lane.kv.num_pages) == (PAGE_BYTES, LAYOUT.num_pages)
    assert lane.aux.memory is aux_buffer and len(lane.aux.slots) == SLOTS and lanes.slots_of(0) is lane.aux.slots
    assert lanes.mappings() == [kv_buffer, aux_buffer] and lanes.retired == []


def test_the_same_buffers_registered_again_need_a_higher_memory_version_and_the_refusal_names_it():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    kv, heard = lane.kv, Heard()
    for version in (1, 0):
        with pytest.raises(errors.StaleMemoryVersion) as refused:
            done(lanes.register_kv(lane, kv_registration("kv-0", version=version), heard))
        assert "needs a memory version above 1" in refused.value.message and "pass memory_version=2 or above" in refused.value.message
    assert lane.kv is kv and heard.heard == [] and len(lanes.port.mapped) == 2  # nothing mapped, nothing replaced

    done(lanes.register_kv(lane, kv_registration("kv-0", version=3), heard))
    assert lane.kv is not kv and lane.kv.version == 3
    assert lane.kv.buffers[0] is kv.buffers[0] and len(lanes.port.mapped) == 2  # the same memory: kept mapped
    assert heard.heard == [(0, Replaced("the engine re-registered its KV cache (memory version 1 -> 3)", 1), lane.aux)]
    assert lanes.retired == [] and lanes.port.released == []
    with pytest.raises(errors.StaleMemoryVersion) as refused:  # the rule follows the version in force now
        done(lanes.register_kv(lane, kv_registration("kv-0", version=3), heard))
    assert "pass memory_version=4 or above" in refused.value.message


def test_new_kv_memory_replaces_every_room_planned_against_the_old_and_retires_its_mapping():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    old, heard = lane.kv.buffers[0], Heard()
    now = lanes.port.clock()
    done(lanes.register_kv(lane, kv_registration("kv-new", version=1), heard))  # new memory: any version will do
    assert lane.kv.buffers[0] is lanes.port.mapped[-1] and lane.kv.buffers[0] is not old
    assert heard.heard == [(0, Replaced("the engine registered new KV memory (a restarted engine?)"), lane.aux)]
    assert lanes.retired == [(now + GRACE, old)] and not old.closed


def test_memory_made_anew_under_the_same_name_is_new_memory():
    """A restarted engine may make its shared memory again under the same name: not the
    memory the daemon mapped, so the version rule does not hold it back."""
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    old, heard = lane.kv.buffers[0], Heard()
    lanes.port.remade.add(old.handle)
    done(lanes.register_kv(lane, kv_registration("kv-0", version=1), heard))
    assert lane.kv.buffers[0] is not old and lane.kv.buffers[0].handle == old.handle
    assert [replaced.version for _, replaced, _ in heard.heard] == [None]  # every room of the lane, whatever its version
    assert [mapping for _, mapping in lanes.retired] == [old]


def test_a_replaced_mapping_is_released_once_its_grace_is_over():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    old = lane.kv.buffers[0]
    done(lanes.register_kv(lane, kv_registration("kv-new"), Heard()))
    lanes.port.advance(round(GRACE * 1000) - 1)
    lanes.release_retired(lanes.port.clock())
    assert lanes.port.released == [] and len(lanes.retired) == 1
    lanes.port.advance(1)
    lanes.release_retired(lanes.port.clock())
    assert lanes.port.released == [old] and lanes.retired == []


def test_a_registration_whose_mapping_fails_leaves_nothing_mapped():
    class Failing(RecordingPort):
        async def map_memory(self, handle):
            if handle.name == "bad":
                raise errors.PdxferError("cannot map bad")
            return await super().map_memory(handle)

    lanes = Lanes(config(Role.DECODE), Role.DECODE, Failing())
    lane = lanes.of(b"e")
    size = pool_bytes(LAYOUT)
    message = RegisterKV(req=1, buffers=(ShmHandle(name="good", size=size), ShmHandle(name="bad", size=size)), spec=SPEC,
                         regions=REGIONS, memory_version=1)
    with pytest.raises(errors.PdxferError, match="cannot map bad"):
        done(lanes.register_kv(lane, message, never_replaced))
    assert [m.handle.name for m in lanes.port.mapped] == ["good"] and lanes.port.released == lanes.port.mapped
    assert lane.kv is None


@pytest.mark.parametrize("buffers, says", [
    ((ShmHandle(name="kv", size=pool_bytes(LAYOUT)), CudaIpcHandle(handle=b"h", size=pool_bytes(LAYOUT), device=0)),
     "the buffers of one KV registration must be of one kind, not cuda_ipc, shm"),
    ((CudaIpcHandle(handle=b"h", size=pool_bytes(LAYOUT), device=0),), "cuda_ipc pools need the daemon started with --device cuda:N"),
    ((ShmHandle(name="kv", size=pool_bytes(LAYOUT) - 1),), "region 0 (layer 0 kv) ends at byte"),
])
def test_a_kv_registration_the_daemon_cannot_take_maps_nothing(buffers, says):
    lanes = made()
    lane = lanes.of(b"e")
    with pytest.raises(errors.PdxferError) as refused:
        done(lanes.register_kv(lane, RegisterKV(req=1, buffers=buffers, spec=SPEC, regions=REGIONS, memory_version=1), never_replaced))
    assert says in refused.value.message and lanes.port.mapped == [] and lane.kv is None


def test_an_aux_buffer_must_be_shared_memory_large_enough_for_its_slots():
    lanes = made()
    lane = lanes.of(b"e")
    with pytest.raises(errors.Unsupported, match="shm handles only"):
        done(lanes.register_aux(lane, RegisterAux(req=2, memory=CudaIpcHandle(handle=b"h", size=4096, device=0), num_slots=2, slot_bytes=256), never_replaced))
    with pytest.raises(errors.InsufficientCapacity, match="8 slots of 256 bytes need 2048 bytes, the buffer has 2047"):
        done(lanes.register_aux(lane, RegisterAux(req=2, memory=ShmHandle(name="aux", size=2047), num_slots=8, slot_bytes=256), never_replaced))
    assert lanes.port.mapped == [] and lane.aux is None


def test_a_new_aux_buffer_is_announced_while_the_old_slots_are_still_the_lanes_then_the_old_one_retires():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    old = lane.aux
    old.slots.allocate(lanes.port.clock())
    heard, now = Heard(), lanes.port.clock()
    done(lanes.register_aux(lane, aux_registration("aux-new", slots=4), heard))
    assert heard.heard == [(0, Replaced("the engine registered a new aux buffer (a restarted engine?)"), old)]
    assert lane.aux is not old and len(lane.aux.slots) == 4 and lane.aux.slots.free_count == 4
    assert lanes.retired == [(now + GRACE, old.memory)]


def test_compat_is_made_once_per_registration():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    compat = lane.compat()
    assert lane.compat() is compat and compat.aux_slot_bytes == SLOT_BYTES
    done(lanes.register_kv(lane, kv_registration("kv-0", version=2), Heard()))
    assert lane.compat() is not compat and lane.compat() == compat  # made again, for the same layout


# --- slots


def test_slots_granted_and_never_bound_go_back_after_retention():
    lanes = made(retention=5.0)
    lane = register(lanes, lanes.of(b"e"))
    slot = lane.aux.slots.allocate(lanes.port.clock())
    lanes.port.advance(5_000)
    assert lanes.reclaim_slots(lanes.port.clock()) == [] and slot.state is SlotState.GRANTED
    lanes.port.advance(1)
    assert lanes.reclaim_slots(lanes.port.clock()) == [] and slot.state is SlotState.FREE  # nobody to tell


def test_slots_whose_fence_deadline_passed_are_freed_and_said_with_their_room():
    lanes = made()
    lane = register(lanes, lanes.of(b"e"))
    other = register(lanes, lanes.hello(b"c1", hello(tp=0, tp_size=1, engine_id="f")))
    now = lanes.port.clock()
    for aux, room in ((lane.aux, 7), (other.aux, 8)):
        slot = aux.slots.allocate(now)
        aux.slots.bind(slot.index, slot.generation, room, now)
        aux.slots.quarantine(slot.index, slot.generation, now, now + 2.0)
    assert lanes.slot_counts()[SlotState.QUARANTINED] == 2
    lanes.port.advance(1_999)
    assert lanes.reclaim_slots(lanes.port.clock()) == []
    lanes.port.advance(1)
    assert lanes.reclaim_slots(lanes.port.clock()) == [Fenced(0, 1, 7), Fenced(0, 1, 8)]
    assert lanes.slot_counts() == {SlotState.FREE: 2 * SLOTS, **{s: 0 for s in SlotState if s is not SlotState.FREE}}


# --- what a lane maps


def test_an_aux_slot_holds_a_stamp_then_its_payload():
    lanes = made()
    aux: MappedAux = register(lanes, lanes.of(b"e")).aux
    stamp = Stamp(7, 3, 5, zlib.crc32(b"hello"))
    assert aux.header(2) is None and aux.payload_bytes == SLOT_BYTES - HEADER_BYTES
    aux.write(2, stamp, b"hello")
    assert aux.header(2) == stamp and aux.payload(2, 5) == b"hello"
    assert aux.header(1) is None and aux.header(3) is None  # its neighbours untouched
    assert aux.slot_address(2) == aux.memory.address + 2 * SLOT_BYTES
    assert bytes(aux.memory.array[2 * SLOT_BYTES + HEADER_BYTES:][:5]) == b"hello"
    aux.clear_header(2)
    assert aux.header(2) is None and aux.payload(2, 5) == b"hello"


def test_pages_gathered_scatter_back_and_their_digest_is_that_of_the_bytes_gathered():
    lanes = made()
    kv: MappedKV = register(lanes, lanes.of(b"e")).kv
    array = kv.buffers[0].array
    array[:] = np.arange(array.size) % 251
    pages = np.array([5, 2], np.int32)
    gathered = kv.gather(pages)
    assert gathered == bytes(array[5 * PAGE_BYTES:6 * PAGE_BYTES]) + bytes(array[2 * PAGE_BYTES:3 * PAGE_BYTES])
    assert kv.digest(pages) == zlib.crc32(gathered)
    kv.scatter(np.array([9, 10], np.int32), gathered)
    assert bytes(array[9 * PAGE_BYTES:11 * PAGE_BYTES]) == gathered
    assert kv.digest(np.array([9, 10], np.int32)) == kv.digest(pages)


def test_a_device_pool_is_never_read_by_the_daemon():
    handle = CudaIpcHandle(handle=b"h", size=pool_bytes(LAYOUT), device=0)
    kv = MappedKV({handle: Buffer(ShmHandle(name="x", size=pool_bytes(LAYOUT)))}, (handle,), SPEC, REGIONS, 1, "cuda_ipc")
    with pytest.raises(errors.Unsupported, match=r"inline KV needs a host-memory pool \(this one is cuda_ipc\)"):
        kv.gather(np.array([0], np.int32))
    with pytest.raises(errors.Unsupported, match=r"a KV digest \(--verify-kv\) needs a host-memory pool"):
        kv.digest(np.array([0], np.int32))
