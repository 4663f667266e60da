"""The SGLang adapter's SGLang-free parts (pdxfer.adapters.sglang.layout, .places and .link),
with SGLang's real shapes: the KVArgs a 2-layer Llama with 2 KV heads of 64 gives its
manager (tests/engines/model.py; the values a real engine dumped, tests/engines), and a
room between two live daemons driven through the links exactly as the backend's classes
drive them (docs/engines.md §B3, B5, B6). The engines themselves are tests/engines'."""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer.adapters.sglang import places
from pdxfer.adapters.sglang.layout import registration
from pdxfer.adapters.sglang.link import Link, Rows, daemon_endpoint, prefill_daemon, unsupported_ranks
from pdxfer.core.errors import Unsupported
from pdxfer.core.protocol import CudaIpcHandle, Heads, KVPacking, KVRegion, PageOrder, Rank, RegionKind, Role, RoomState, ShmHandle
from pdxfer.core.topology import local_heads
from pdxfer.ops.inspection import daemon_counters

from .conftest import needs_mooncake
from .test_cuda_export import RAW, FakeStorage, tensor

PAGE_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 2, 64, 2
PAGE_BYTES = PAGE_SIZE * HEADS * HEAD_DIM * 4  # float32: 8192, as SGLang's kv_item_lens
# SGLang allocates each layer's K and V as the halves of one tensor, padded to whole
# pages: the pool of 16,384 tokens has 1,025 pages (the first is SGLang's padding page).
PAGES = 1025
HALF = PAGES * PAGE_BYTES


def sglang_kvargs(base: int = 0x7F0000000000) -> tuple[list[int], list[int], list[int]]:
    """kv_data_ptrs, kv_data_lens, kv_item_lens as SGLang lists them: K of each layer, then V."""
    k = [base + layer * 2 * HALF for layer in range(LAYERS)]
    return k + [p + HALF for p in k], [HALF] * 4, [PAGE_BYTES] * 4


def fused_files(base: int = 0x7F0000000000):
    """locate() for sglang_kvargs: one file per layer, K at 0 and V at HALF."""

    def where(address: int) -> tuple[ShmHandle, int] | None:
        layer, offset = divmod(address - base, 2 * HALF)
        return (ShmHandle(name=f"pdxfer-kv-1-l{layer}", size=2 * HALF), offset) if 0 <= layer < LAYERS else None

    return where


def test_sglang_kv_is_one_buffer_per_layer_with_a_k_and_a_v_region():
    reg = registration(*sglang_kvargs(), page_size=PAGE_SIZE, dtype="float32", first_layer=0, num_layers_total=2,
                       heads_local=2, heads_total=2, mla=False, locate=fused_files())
    assert reg.buffers == [ShmHandle(name="pdxfer-kv-1-l0", size=2 * HALF), ShmHandle(name="pdxfer-kv-1-l1", size=2 * HALF)]
    assert reg.regions == [
        KVRegion(buffer=0, offset=0, page_bytes=PAGE_BYTES, num_pages=PAGES, layer=0, kind=RegionKind.K),
        KVRegion(buffer=1, offset=0, page_bytes=PAGE_BYTES, num_pages=PAGES, layer=1, kind=RegionKind.K),
        KVRegion(buffer=0, offset=HALF, page_bytes=PAGE_BYTES, num_pages=PAGES, layer=0, kind=RegionKind.V),
        KVRegion(buffer=1, offset=HALF, page_bytes=PAGE_BYTES, num_pages=PAGES, layer=1, kind=RegionKind.V),
    ]
    spec = reg.spec
    assert (spec.page_size, spec.dtype, spec.layers, spec.num_layers_total, spec.mla) == (16, "float32", (0, 2), 2, False)
    assert spec.heads == Heads(local=2, total=2, bytes_per_token_head=HEAD_DIM * 4)
    assert (spec.page_order, spec.kv_packing) == (PageOrder.TOKEN_MAJOR, KVPacking.SEPARATE)


def test_a_tp_rank_registers_its_share_of_the_heads():
    """Rank 1 of a TP2 server: one of the two KV heads, so its pages are half as long."""
    ptrs, lens, _ = sglang_kvargs()
    reg = registration(ptrs, [n // 2 for n in lens], [PAGE_BYTES // 2] * 4, page_size=PAGE_SIZE, dtype="float32", first_layer=0,
                       num_layers_total=2, heads_local=local_heads(HEADS, 2), heads_total=HEADS, mla=False, locate=fused_files())
    assert reg.spec.heads == Heads(local=1, total=2, bytes_per_token_head=HEAD_DIM * 4)
    assert {(r.page_bytes, r.num_pages) for r in reg.regions} == {(PAGE_BYTES // 2, PAGES)}


def test_servers_of_several_tp_ranks_are_carried_and_other_parallelism_is_named():
    assert unsupported_ranks(Rank(dp=1, pp=1, tp=8, cp=1)) == []
    refused = unsupported_ranks(Rank(dp=2, pp=4, tp=2, cp=2))
    assert [r.split(" (")[0] for r in refused] == ["attention context parallelism", "attention data parallelism", "pipeline parallelism"]


def test_a_decode_rank_reads_every_prefill_rank_from_one_daemon():
    """SGLang's /route rows of the prefill ranks a decode rank reads (TP2 -> TP1: two)."""
    assert prefill_daemon([("10.0.0.5", 18998), ("10.0.0.5", 18998)]) == "10.0.0.5:18998"
    with pytest.raises(Unsupported, match="register 2 pdxfer daemons .*10.0.0.5:18998, 10.0.0.6:18998"):
        prefill_daemon([("10.0.0.6", 18998), ("10.0.0.5", 18998)])


def test_mla_has_a_latent_region_per_layer_from_the_stage_s_first_layer():
    """A PP stage holding layers 30-31 of 32 (MLA: one buffer per layer, 576 x bf16 a token)."""
    item = PAGE_SIZE * 576 * 2
    reg = registration([0x1000, 0x9000], [item * 4, item * 4], [item, item], page_size=PAGE_SIZE, dtype="bfloat16",
                       first_layer=30, num_layers_total=32, heads_local=1, heads_total=1, mla=True,
                       locate=lambda a: (ShmHandle(name="latent", size=1 << 20), a - 0x1000))
    assert [(r.layer, r.kind, r.offset, r.num_pages) for r in reg.regions] == [(30, RegionKind.LATENT, 0, 4), (31, RegionKind.LATENT, 0x8000, 4)]
    assert (reg.spec.layers, reg.spec.heads.bytes_per_token_head, reg.spec.mla) == ((30, 32), 1152, True)


def test_memory_the_daemon_cannot_map_is_refused_naming_the_buffer():
    ptrs, lens, items = sglang_kvargs()
    with pytest.raises(Unsupported, match=f"KV buffer 2 at {ptrs[2]:#x} is not in memory the daemon can map: neither in shared memory"):
        registration(ptrs, lens, items, page_size=PAGE_SIZE, dtype="float32", first_layer=0, num_layers_total=2,
                     heads_local=2, heads_total=2, mla=False, locate=lambda a: None if a == ptrs[2] else fused_files()(a))
    with pytest.raises(ValueError, match="run past the end"):
        registration(ptrs, [HALF + PAGE_BYTES] * 4, items, page_size=PAGE_SIZE, dtype="float32", first_layer=0,
                     num_layers_total=2, heads_local=2, heads_total=2, mla=False, locate=fused_files())


@pytest.fixture
def exported(monkeypatch):
    """places' table of exported CUDA tensors, empty for this test alone."""
    monkeypatch.setattr(places, "_exported", [])


def gpu_pool(storages, itemsize: int = 4):
    """SGLang's fused K|V tensor per layer (``storages``, one per layer), as CUDA tensors
    the fake allocator carved from its blocks: K is the first half, V the second."""
    half = HALF // itemsize
    k = [tensor(s, (half,), offset=0, itemsize=itemsize) for s in storages]
    return k, [tensor(s, (half,), offset=half, itemsize=itemsize) for s in storages]


def test_a_gpu_pool_is_registered_as_its_blocks_with_each_buffer_s_offset(exported):
    """The pool hook's export, then the manager's registration from SGLang's pointers:
    the allocator packed both layers into one block (16 MiB in), so one CUDA IPC buffer
    holds four regions at their offsets in the block."""
    base = 0x7F0000000000
    at = 16 << 20
    storages = [FakeStorage(RAW, block_start=base - at, at=at + layer * 2 * HALF, nbytes=2 * HALF) for layer in range(LAYERS)]
    k, v = gpu_pool(storages)
    places.share([*k, *v])
    reg = registration(*sglang_kvargs(base), page_size=PAGE_SIZE, dtype="float32", first_layer=0, num_layers_total=2,
                       heads_local=2, heads_total=2, mla=False, locate=places.locate)
    assert reg.buffers == [CudaIpcHandle(handle=RAW, size=at + 4 * HALF, device=0)]
    assert [(r.buffer, r.offset, r.layer, r.kind) for r in reg.regions] == [
        (0, at, 0, RegionKind.K), (0, at + 2 * HALF, 1, RegionKind.K), (0, at + HALF, 0, RegionKind.V), (0, at + 3 * HALF, 1, RegionKind.V),
    ]
    assert places.locate(base - 1) is None and places.locate(base + 4 * HALF) is None


def test_a_block_exported_twice_is_one_buffer_as_long_as_the_longer_export(exported):
    """Two pools (two hook calls) whose tensors the allocator put in one block: each
    export sizes the handle to its own tensors; the registration holds the block once,
    at the longer size, and a second block apart."""
    base = 0x7F0000000000
    first = FakeStorage(RAW, block_start=base, at=0, nbytes=2 * HALF)
    second = FakeStorage(RAW, block_start=base, at=2 * HALF, nbytes=2 * HALF)
    k0, v0 = gpu_pool([first])
    k1, v1 = gpu_pool([second])
    places.share([*k0, *v0])
    places.share([*k1, *v1])
    assert places.locate(base)[0].size == 2 * HALF and places.locate(base + 2 * HALF)[0].size == 4 * HALF
    reg = registration(*sglang_kvargs(base), page_size=PAGE_SIZE, dtype="float32", first_layer=0, num_layers_total=2,
                       heads_local=2, heads_total=2, mla=False, locate=places.locate)
    assert reg.buffers == [CudaIpcHandle(handle=RAW, size=4 * HALF, device=0)]
    assert [r.offset for r in reg.regions] == [0, 2 * HALF, HALF, 3 * HALF]

    other = FakeStorage(RAW[::-1], block_start=1 << 40, at=0, nbytes=2 * HALF)
    k2, v2 = gpu_pool([other])
    places.share([*k2, *v2])
    ptrs, lens, items = sglang_kvargs(base)
    ptrs[1], ptrs[3] = 1 << 40, (1 << 40) + HALF
    reg = registration(ptrs, lens, items, page_size=PAGE_SIZE, dtype="float32", first_layer=0, num_layers_total=2,
                       heads_local=2, heads_total=2, mla=False, locate=places.locate)
    assert [b.handle for b in reg.buffers] == [RAW, RAW[::-1]]
    assert [(r.buffer, r.offset) for r in reg.regions] == [(0, 0), (1, 0), (0, HALF), (1, HALF)]


@pytest.mark.parametrize(("flags", "why"), [({"memory_saver": True}, "--enable-memory-saver"), ({"custom_pool": True}, "SGLANG_MOONCAKE_CUSTOM_MEM_POOL")])
def test_a_gpu_pool_cuda_ipc_cannot_export_is_refused_naming_the_setting(exported, flags, why):
    storage = FakeStorage(RAW, block_start=1 << 30, at=0, nbytes=2 * HALF)
    k, v = gpu_pool([storage])
    with pytest.raises(Unsupported, match=why):
        places.share([*k, *v], **flags)
    assert storage.shares == 0 and places.locate(1 << 30) is None


def test_the_daemon_is_found_by_the_endpoint_variable_or_as_pdxfer_serve_would_listen():
    assert daemon_endpoint("decode", {"PDXFER_ENDPOINT": "tcp://10.0.0.9:7000"}) == "tcp://10.0.0.9:7000"
    assert daemon_endpoint("prefill", {"PDXFER_RUNTIME_DIR": "/run/p"}) == "ipc:///run/p/prefill.engine.sock"
    assert daemon_endpoint("decode", {"PDXFER_RUNTIME_DIR": "/run/p", "PDXFER_NAME": "d1"}) == "ipc:///run/p/d1.engine.sock"
    assert daemon_endpoint("decode", {"PDXFER_ENGINE_ENDPOINT": "tcp://127.0.0.1:5555"}) == "tcp://127.0.0.1:5555"
    assert daemon_endpoint("decode", {"XDG_RUNTIME_DIR": "/run/user/5"}) == "ipc:///run/user/5/pdxfer/decode.engine.sock"


def metadata_buffers(rows: int = 8):
    """SGLang's MetadataBuffers shapes (the first four of its ten): rows of 16 int32, 16 float32, 8 uint64."""
    return [np.zeros((rows, 16), np.int32), np.zeros((rows, 16), np.float32), np.zeros((rows, 8), np.uint64)]


def as_rows(buffers) -> Rows:
    return Rows([b.ctypes.data for b in buffers], [b[0].nbytes for b in buffers])


def test_an_aux_record_is_a_room_s_row_of_every_buffer_end_to_end():
    src, dst = metadata_buffers(), metadata_buffers()
    src[0][5, 0], src[1][5, :] = 1734, 0.25
    src[2][5, 0] = 2**63 + 7  # the bootstrap_room row SGLang's gate reads
    record = np.zeros(as_rows(src).record_bytes, np.uint8)
    as_rows(src).gather(5, record.ctypes.data)
    assert record.nbytes == 64 + 64 + 64 and record[:4].view(np.int32)[0] == 1734
    as_rows(dst).scatter(2, record.tobytes())
    assert dst[0][2, 0] == 1734 and (dst[1][2] == 0.25).all() and dst[2][2, 0] == 2**63 + 7
    assert not dst[0][[0, 1, 3, 4, 5, 6, 7]].any()  # only the row named
    with pytest.raises(ValueError, match="an aux record of 10 bytes"):
        as_rows(dst).scatter(0, b"x" * 10)


class Engine:
    """One rank's SGLang-shaped memory (per layer a fused K|V tensor, in shared memory)
    and metadata rows, behind a Link; rank ``tp`` of ``tp_size`` holds its share of the
    model's heads, as the backend registers it."""

    def __init__(self, daemon, role: Role, pages: int = 32, tp: int = 0, tp_size: int = 1):
        import torch

        heads = local_heads(HEADS, tp_size)
        fused = [torch.zeros((2, pages * PAGE_SIZE, heads, HEAD_DIM)) for _ in range(LAYERS)]
        self.k = [f[0] for f in fused]
        self.v = [f[1] for f in fused]
        tensors = [*self.k, *self.v]
        places.share(tensors)  # into shared memory, as the plugin's pool hook does
        page_bytes = PAGE_SIZE * heads * HEAD_DIM * 4
        kv = registration([t.data_ptr() for t in tensors], [t.nbytes for t in tensors], [page_bytes] * 4, page_size=PAGE_SIZE,
                          dtype="float32", first_layer=0, num_layers_total=LAYERS, heads_local=heads, heads_total=HEADS,
                          mla=False, locate=places.locate)
        self.meta = metadata_buffers()
        self.link = Link(daemon.engine, engine_id=f"test-{role.value}", role=role, rank=Rank(tp=tp), sizes=Rank(dp=1, pp=1, tp=tp_size, cp=1),
                         device="cpu", kv=kv, rows=as_rows(self.meta), aux_slots=16)
        self.link.open()

    def page(self, p: int):
        return [t[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] for t in (*self.k, *self.v)]


@needs_mooncake
def test_a_room_through_the_links_as_the_backend_drives_it(daemons):
    """Announce, the decode's request with a 2-page prefix, WaitingForInput with the
    decode's positions, two chunks in SGLang's coordinates, the metadata row back in the
    decode's rows; and polls that ask the daemon nothing (B6)."""
    import torch

    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode", "--verify-kv")
    prefill, decode = Engine(prefill_daemon, Role.PREFILL), Engine(decode_daemon, Role.DECODE)
    try:
        room, src, dst = 4242, [3, 4, 5, 6, 7], [20, 21, 22]  # 5 prompt pages; the decode holds the first 2
        torch.manual_seed(0)
        for p in src:
            for t in prefill.page(p):
                t.copy_(torch.randn_like(t))
        prefill.meta[0][1, 0], prefill.meta[2][1, 0] = 1734, room

        prefill.link.announce(room)
        assert prefill.link.status(room).state is RoomState.BOOTSTRAPPING
        host, port = prefill.link.bootstrap
        decode.link.expect(room, f"{host}:{port}", dst, skip_pages=2)
        status = wait_for(prefill.link, room, RoomState.WAITING_FOR_INPUT)
        assert (status.pages, status.skip_pages) == (5, 2)
        # SGLang sends only the pages after the prefix, counting from 0 there.
        prefill.link.send(room, np.array(src[2:3], np.int32), 2 + 0, last=False)
        prefill.link.send(room, np.array(src[3:], np.int32), 2 + 1, last=True, num_tokens=5 * PAGE_SIZE - 3, row=1)
        wait_for(decode.link, room, RoomState.SUCCESS)
        decode.link.rows.scatter(6, decode.link.record(room))

        for s, d in zip(src[2:], dst):
            for a, b in zip(prefill.page(s), decode.page(d)):
                assert torch.equal(a, b)
        assert decode.meta[0][6, 0] == 1734 and decode.meta[2][6, 0] == room
        assert wait_for(prefill.link, room, RoomState.SUCCESS).state is RoomState.SUCCESS

        before = [daemon_counters(d.ready["admin"])["engine_messages"] for d in (prefill_daemon, decode_daemon)]
        for _ in range(1000):
            prefill.link.status(room), decode.link.status(room)
        after = [daemon_counters(d.ready["admin"])["engine_messages"] for d in (prefill_daemon, decode_daemon)]
        assert after == before
        assert prefill.link.quiet(room) and decode.link.quiet(room)
        prefill.link.release(room)
        decode.link.release(room)
        assert prefill.link.status(room) is None and decode.link.quiet(room)
    finally:
        prefill.link.close()
        decode.link.close()


@needs_mooncake
def test_a_tp2_prefill_room_lands_in_a_tp1_decode_s_pages_head_by_head(daemons):
    """Two prefill ranks (a head each) on one daemon, one decode rank holding both heads:
    the decode link names the prefill's sizes and the daemons write each rank's head
    into every token of the decode's pages; the metadata row comes once."""
    import torch

    prefill_daemon_, decode_daemon = daemons("prefill"), daemons("decode")
    ranks = [Engine(prefill_daemon_, Role.PREFILL, tp=tp, tp_size=2) for tp in range(2)]
    decode = Engine(decode_daemon, Role.DECODE)
    try:
        room, src, dst = 5151, [3, 4, 5], [20, 21, 22]
        torch.manual_seed(1)
        for rank in ranks:
            for p in src:
                for t in rank.page(p):
                    t.copy_(torch.randn_like(t))
            rank.meta[0][1, 0], rank.meta[2][1, 0] = 1734, room
            rank.link.announce(room)
        host, port = ranks[0].link.bootstrap
        assert ranks[1].link.bootstrap == (host, port)
        decode.link.expect(room, prefill_daemon([(host, port)] * 2), dst, skip_pages=0, prefill_sizes=Rank(tp=2, pp=1))
        for rank in ranks:
            wait_for(rank.link, room, RoomState.WAITING_FOR_INPUT)
            rank.link.send(room, np.array(src, np.int32), 0, last=True, num_tokens=3 * PAGE_SIZE, row=1)
        wait_for(decode.link, room, RoomState.SUCCESS)
        decode.link.rows.scatter(6, decode.link.record(room))

        for s, d in zip(src, dst):
            for head, rank in enumerate(ranks):
                for a, b in zip(rank.page(s), decode.page(d)):
                    assert torch.equal(a[:, 0], b[:, head])
        assert decode.meta[0][6, 0] == 1734 and decode.meta[2][6, 0] == room
        assert daemon_counters(decode_daemon.ready["admin"])["bytes_received"] == 3 * 4 * PAGE_BYTES + 32 + as_rows(decode.meta).record_bytes
        for rank in ranks:
            assert wait_for(rank.link, room, RoomState.SUCCESS).state is RoomState.SUCCESS
    finally:
        for engine in (*ranks, decode):
            engine.link.close()


@needs_mooncake
def test_a_chunk_s_cuda_event_reaches_the_daemon_which_on_cpu_fails_the_room_saying_why(daemons):
    """The backend passes SGLang's early-send event as send()'s cuda_event (A11); a CPU
    daemon cannot wait on one, so the room fails naming the chunk (on a GPU,
    tests/gpu/test_sglang_gpu.py waits on a real one)."""
    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode")
    prefill, decode = Engine(prefill_daemon, Role.PREFILL), Engine(decode_daemon, Role.DECODE)
    room = 4444
    try:
        requested(prefill, decode, room, [20, 21])
        prefill.link.send(room, np.array([3], np.int32), 0, last=False, cuda_event=bytes(64))
        status = wait_for(prefill.link, room, RoomState.FAILED)
        assert "the CUDA event of the chunk at position 0" in status.reason and "not a CUDA device" in status.reason
    finally:
        prefill.link.close()
        decode.link.close()


@needs_mooncake
def test_a_failed_room_released_before_its_fence_stays_unsafe_until_the_fence(daemons):
    """SGLang clears a failed decode receiver (failure_exception) before its deferred
    release asks is_abort_release_safe (Link.quiet): the release waits for the fence,
    and until then the room's pages are not safe. Here the prefill daemon stands still
    (SIGSTOP) as the decode aborts, so it confirms nothing is in flight only once resumed."""
    import signal

    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode")
    prefill, decode = Engine(prefill_daemon, Role.PREFILL), Engine(decode_daemon, Role.DECODE)
    room = 4343
    try:
        requested(prefill, decode, room, [20, 21])
        prefill_daemon.proc.send_signal(signal.SIGSTOP)
        try:
            decode.link.abort(room, "aborted by SGLang")
            status = wait_for(decode.link, room, RoomState.FAILED)
            assert not status.fenced
            decode.link.release(room)  # what SGLang's failure_exception -> clear() does
            assert not decode.link.quiet(room) and not decode.link.status(room).fenced
        finally:
            prefill_daemon.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: decode.link.quiet(room))
        decode.link.tidy()  # as the next poll does: the fenced room goes back to the daemon
        assert decode.link.status(room) is None and decode.link.quiet(room)
    finally:
        prefill.link.close()
        decode.link.close()


@needs_mooncake
def test_a_daemon_that_went_away_fails_its_rooms_fenced_and_is_connected_to_again(daemons, runtime_dir):
    prefill_daemon = daemons("prefill")
    prefill = Engine(prefill_daemon, Role.PREFILL)
    try:
        prefill.link.announce(77)
        prefill_daemon.proc.kill()
        prefill_daemon.proc.wait()
        status = wait_for(prefill.link, 77, RoomState.FAILED)
        assert status.fenced and "went away" in status.reason
        again = daemons("prefill")  # the same name and runtime directory: the same endpoint
        assert again.engine == prefill_daemon.engine
        wait_until(lambda: reconnected(prefill.link, 78))
        assert prefill.link.status(78).state is RoomState.BOOTSTRAPPING
    finally:
        prefill.link.close()


def reconnected(link: Link, room: int) -> bool:
    try:
        link.announce(room)
        return True
    except Exception:
        return False


def wait_until(condition, seconds: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def requested(prefill: Engine, decode: Engine, room: int, dst: list[int]) -> None:
    """The prefill announces ``room``, the decode asks for it into ``dst`` (no prefix),
    and the prefill's room waits for its input."""
    prefill.link.announce(room)
    host, port = prefill.link.bootstrap
    decode.link.expect(room, f"{host}:{port}", dst, skip_pages=0)
    wait_for(prefill.link, room, RoomState.WAITING_FOR_INPUT)


def wait_for(link: Link, room: int, state: RoomState):
    wait_until(lambda: (s := link.status(room)) is not None and s.state is state)
    return link.status(room)


@pytest.mark.parametrize("fence_bound, refused", [(15.0, False), (30.0, True)])
def test_a_decode_server_refuses_an_engine_that_would_release_pages_before_its_daemon_can_fence(daemons, fence_bound, refused):
    """SGLang gives up holding a failed request's decode pages after its deferred-release
    timeout (30 s by default); the daemon fences within its --fence-bound: the backend
    learns the bound on connecting and refuses a timeout that is not above it."""
    from pdxfer.adapters.sglang.link import release_timeout_refusal

    decode = Engine(daemons("decode", "--fence-bound", str(fence_bound)), Role.DECODE)
    try:
        assert decode.link.fence_bound == fence_bound
        why = release_timeout_refusal(30.0, decode.link.fence_bound)
        assert bool(why) is refused
        if refused:
            assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT is 30s" in why and f"within {fence_bound:g}s (its --fence-bound)" in why
    finally:
        decode.link.close()
