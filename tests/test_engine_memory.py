"""Protocol 4, step 1 of issue 27 (docs/engines.md §A2-A4, B6): engines register memory they
own as buffers and regions, a prefill announces a room and sends it in chunks, a decode
skips the prefix it holds, and poll() answers from pushed statuses.

Real daemons, the real transfer engine over TCP on loopback. The engines' KV is laid out
as SGLang and vLLM lay theirs out, in shared memory made here; every destination byte is
compared with a reference computed here with numpy from the source tensors."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from pdxfer import AsyncClient, Client, Heads, KVPacking, KVRegion, KVSpec, PageOrder, Rank, RegionKind, Role, RoomState
from pdxfer.core import errors
from pdxfer.core.protocol import AdminSlots, ErrorCode
from pdxfer.host.memory import KV_POOL_PREFIX, SHM_DIR, SharedMemory
from pdxfer.ops.inspection import AdminClient, daemon_counters

from .conftest import needs_mooncake
from .roomkit import wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

K, V, KV = RegionKind.K, RegionKind.V, RegionKind.KV
SLOTS, PAYLOAD = 8, 64


class SGLangKV:
    """KV as SGLang's MHATokenToKVPool holds it: per layer a K and a V tensor [tokens,
    heads, head_dim] (token-major), each in a buffer of its own. KVArgs list every K
    layer first, then every V ("k_first"); "interleaved" lists K0 V0 K1 V1 instead:
    regions pair up by (layer, kind) whatever the order."""

    def __init__(self, order: str = "k_first", layers: int = 3, heads: int = 2, head_dim: int = 16, page_size: int = 4,
                 num_pages: int = 64, dtype: str = "float16") -> None:
        item = np.dtype(dtype).itemsize
        keys = [(l, K) for l in range(layers)] + [(l, V) for l in range(layers)]
        if order == "interleaved":
            keys = [(l, kind) for l in range(layers) for kind in (K, V)]
        tokens = num_pages * page_size
        self.memory = [SharedMemory.create(tokens * heads * head_dim * item, prefix=KV_POOL_PREFIX) for _ in keys]
        tensors = [np.frombuffer(m.array, dtype).reshape(tokens, heads, head_dim) for m in self.memory]
        # Page p of a tensor is tokens [p * page_size, (p + 1) * page_size).
        self.pages = {key: t.reshape(num_pages, page_size, heads, head_dim) for key, t in zip(keys, tensors)}
        self.buffers = [m.handle for m in self.memory]
        page_bytes = page_size * heads * head_dim * item
        self.regions = [KVRegion(buffer=i, offset=0, page_bytes=page_bytes, num_pages=num_pages, layer=l, kind=kind)
                        for i, (l, kind) in enumerate(keys)]
        self.spec = KVSpec(page_size=page_size, dtype=dtype, num_layers_total=layers, layers=(0, layers),
                           heads=Heads(local=heads, total=heads, bytes_per_token_head=head_dim * item))
        self.page_bytes = page_bytes * len(keys)  # one page index, over every region

    def close(self) -> None:
        for m in self.memory:
            m.close()


class VLLMKV:
    """KV as vLLM's CPU backend holds it (LBHNC): one storage [layers, blocks, kv_heads,
    block_size, 2 * head_dim], K and V packed per token, head-major inside a block; each
    layer's tensor is a view of it at its offset. Registered as vLLM's connector sees it:
    one buffer per layer, all the same handle, which the daemon maps once."""

    def __init__(self, layers: int = 3, heads: int = 2, head_dim: int = 8, block_size: int = 4, num_blocks: int = 48,
                 dtype: str = "float32") -> None:
        item = np.dtype(dtype).itemsize
        page_bytes = heads * block_size * 2 * head_dim * item
        self.memory = [SharedMemory.create(layers * num_blocks * page_bytes, prefix=KV_POOL_PREFIX)]
        storage = np.frombuffer(self.memory[0].array, dtype).reshape(layers, num_blocks, heads, block_size, 2 * head_dim)
        self.pages = {(l, KV): storage[l] for l in range(layers)}
        self.buffers = [self.memory[0].handle] * layers
        self.regions = [KVRegion(buffer=l, offset=l * num_blocks * page_bytes, page_bytes=page_bytes, num_pages=num_blocks,
                                 layer=l, kind=KV) for l in range(layers)]
        self.spec = KVSpec(page_size=block_size, dtype=dtype, num_layers_total=layers, layers=(0, layers),
                           heads=Heads(local=heads, total=heads, bytes_per_token_head=head_dim * item),
                           page_order=PageOrder.HEAD_MAJOR, kv_packing=KVPacking.PACKED_PER_TOKEN)
        self.page_bytes = page_bytes * layers

    def close(self) -> None:
        self.memory[0].close()


def fill(kv, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for pages in kv.pages.values():
        pages[...] = rng.standard_normal(pages.shape).astype(pages.dtype)


def reference(src, dst, src_pages, dst_pages) -> dict:
    """What every tensor of ``dst`` must hold once ``src``'s pages moved into ``dst_pages``,
    computed from the tensors themselves: the rest of each stays as it is."""
    want = {key: pages.copy() for key, pages in dst.pages.items()}
    for key, pages in want.items():
        pages[np.asarray(dst_pages)] = src.pages[key][np.asarray(src_pages)]
    return want


def assert_holds(kv, want: dict) -> None:
    for key, pages in kv.pages.items():
        assert np.array_equal(pages.view(np.uint8), want[key].view(np.uint8)), f"layer {key[0]} {key[1].value} differs"


def connect(daemon, kv, role: Role, payload: int = PAYLOAD, engine_id: str = "") -> Client:
    client = Client(daemon.engine, timeout=20.0, engine_id=engine_id or f"test-{role.value}", role=role, device="cpu")
    client.connect()
    assert client.register_kv(kv.buffers, kv.spec, kv.regions) == 1
    client.create_aux_buffer(SLOTS, payload)
    return client


@pytest.fixture
def engines(pair):
    """factory(prefill_kv, decode_kv, **connect options) -> (prefill client, decode client, bootstrap)."""
    prefill_daemon, decode_daemon = pair
    made = []

    def make(prefill_kv, decode_kv, payload: int = PAYLOAD):
        made.extend((prefill_kv, decode_kv))
        p = connect(prefill_daemon, prefill_kv, Role.PREFILL, payload)
        d = connect(decode_daemon, decode_kv, Role.DECODE, payload)
        made.extend((p, d))
        return p, d, prefill_daemon.bootstrap

    make.prefill_daemon, make.decode_daemon = prefill_daemon, decode_daemon
    yield make
    for thing in reversed(made):
        thing.close()


def waiting_for_input(client: Client, room: int):
    return wait_until(lambda: (s := client.poll(room)).state is RoomState.WAITING_FOR_INPUT and s, 10,
                      f"room {room} waiting for input on the prefill")


def aux_of(client: Client, slot, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8)
    client.aux.payload(slot)[:] = data
    return data.tobytes()


def counter(daemon, name: str) -> float:
    return daemon_counters(daemon.ready["admin"])[name]


def test_a_room_moves_between_sglang_shaped_registrations(engines):
    """Two layers' K and V in six buffers of their own on each side, listed K-first by the
    prefill and interleaved by the decode."""
    src, dst = SGLangKV("k_first"), SGLangKV("interleaved")
    prefill, decode, boot = engines(src, dst)
    fill(src, 1)
    fill(dst, 2)
    src_pages, dst_pages = [9, 3, 4, 5, 40, 63, 0], [7, 8, 9, 30, 2, 1, 50]
    want = reference(src, dst, src_pages, dst_pages)
    dslot = decode.alloc_slot()
    decode.expect(101, boot, dst_pages, dslot)
    prefill.announce(101)
    assert waiting_for_input(prefill, 101).pages == len(dst_pages)
    pslot = prefill.alloc_slot()
    aux = aux_of(prefill, pslot, 3)
    prefill.send(101, src_pages, num_tokens=len(src_pages) * 4 - 1, slot=pslot, aux_bytes=PAYLOAD)
    assert decode.wait(101).state is RoomState.SUCCESS
    assert prefill.wait(101).state is RoomState.SUCCESS
    assert_holds(dst, want)
    assert decode.aux.read(dslot, 101) == aux


def test_a_room_moves_between_vllm_shaped_registrations(engines):
    """One shared-memory file holds every layer at its offset, head-major with K and V
    packed per token; the connector names it once per layer and the daemon maps it once.
    vLLM needs no aux record: stamp-only slots tell the decode the room landed."""
    src, dst = VLLMKV(), VLLMKV()
    prefill, decode, boot = engines(src, dst, payload=0)
    fill(src, 4)
    fill(dst, 5)
    for daemon, kv in ((engines.prefill_daemon, src), (engines.decode_daemon, dst)):
        with open(f"/proc/{daemon.ready['pid']}/maps") as fh:
            mapped = [line for line in fh if line.rstrip().endswith(os.path.join(SHM_DIR, kv.memory[0].name))]
        assert len(mapped) == 1, mapped
    src_pages, dst_pages = list(range(10, 22)), [47, 0, 1, 2, 3, 20, 21, 22, 5, 6, 7, 8]
    want = reference(src, dst, src_pages, dst_pages)
    dslot = decode.alloc_slot()
    decode.expect(102, boot, dst_pages, dslot)
    prefill.send(102, src_pages, num_tokens=12 * 4, slot=prefill.alloc_slot(), aux_bytes=0)
    assert decode.wait(102).state is RoomState.SUCCESS
    assert prefill.wait(102).state is RoomState.SUCCESS
    assert_holds(dst, want)
    assert decode.aux.read(dslot, 102) == b""


def test_a_room_sent_in_four_chunks_writes_each_chunk_as_it_comes(engines):
    """The first chunk lands (its bytes at the destination, the prefill's byte counter
    past them) before the second is handed over; the aux record follows the last."""
    src, dst = SGLangKV(), SGLangKV()
    prefill, decode, boot = engines(src, dst)
    fill(src, 6)
    fill(dst, 7)
    src_pages, dst_pages = np.arange(20, 36), np.arange(40, 56)[::-1]
    want = reference(src, dst, src_pages, dst_pages)
    dslot = decode.alloc_slot()
    decode.expect(103, boot, dst_pages, dslot)
    prefill.announce(103)
    assert waiting_for_input(prefill, 103).pages == 16
    moved = counter(engines.prefill_daemon, "bytes_moved")
    prefill.send(103, src_pages[:4], first_page=0, last=False)

    def first_chunk_landed() -> bool:
        return all(np.array_equal(pages[dst_pages[:4]], want[key][dst_pages[:4]]) for key, pages in dst.pages.items())

    wait_until(first_chunk_landed, 10, "the first chunk's bytes at the destination")
    assert counter(engines.prefill_daemon, "bytes_moved") - moved == 4 * src.page_bytes
    assert prefill.poll(103).state is RoomState.TRANSFERRING
    # transfer_started travels the bootstrap channel and then to the engine, the bytes the
    # transfer engine: either may come first. The aux record waits for the last chunk.
    wait_until(lambda: decode.poll(103).state is RoomState.TRANSFERRING, 10, "the decode side to hear writes began")
    assert not any(np.array_equal(pages[dst_pages[4:]], want[key][dst_pages[4:]]) for key, pages in dst.pages.items())
    for at in (4, 8):
        prefill.send(103, src_pages[at : at + 4], first_page=at, last=False)
    pslot = prefill.alloc_slot()
    aux = aux_of(prefill, pslot, 8)
    prefill.send(103, src_pages[12:], first_page=12, last=True, num_tokens=16 * 4, slot=pslot, aux_bytes=PAYLOAD)
    assert decode.wait(103).state is RoomState.SUCCESS
    assert prefill.wait(103).state is RoomState.SUCCESS
    assert_holds(dst, want)
    assert decode.aux.read(dslot, 103) == aux
    assert counter(engines.prefill_daemon, "bytes_moved") - moved == 16 * src.page_bytes


@pytest.mark.parametrize("sends", ["every_page", "after_the_prefix"])
def test_a_prefix_skip_moves_only_the_pages_after_it(engines, sends):
    """The decode holds the first 5 of a room's 12 pages (its cache hit, in pages of its
    own) and expects the other 7. The prefill sends every page from position 0, in two
    chunks, the first across the prefix's end, or only those after the prefix: either
    way exactly 7 pages move, and nothing else at the destination changes."""
    src, dst = SGLangKV(layers=2), SGLangKV(layers=2)
    prefill, decode, boot = engines(src, dst)
    fill(src, 9)
    fill(dst, 10)
    room, skip = 104 if sends == "every_page" else 105, 5
    src_pages, dst_pages = np.arange(30, 42), np.array([3, 60, 61, 62, 10, 11, 12])
    want = reference(src, dst, src_pages[skip:], dst_pages)
    dslot = decode.alloc_slot()
    decode.expect(room, boot, dst_pages, dslot, skip_pages=skip)
    prefill.announce(room)
    status = waiting_for_input(prefill, room)
    assert (status.pages, status.skip_pages) == (12, 5)
    moved = counter(engines.prefill_daemon, "bytes_moved")
    pslot = prefill.alloc_slot()
    aux = aux_of(prefill, pslot, 11)
    tokens = 12 * 4 - 2
    if sends == "every_page":
        prefill.send(room, src_pages[:7], first_page=0, last=False)
        prefill.send(room, src_pages[7:], first_page=7, num_tokens=tokens, slot=pslot, aux_bytes=PAYLOAD)
    else:
        prefill.send(room, src_pages[skip:], first_page=skip, num_tokens=tokens, slot=pslot, aux_bytes=PAYLOAD)
    assert decode.wait(room).state is RoomState.SUCCESS
    assert prefill.wait(room).state is RoomState.SUCCESS
    assert_holds(dst, want)  # every page but the 7 destination pages as it was, the prefix pages 0..2 included
    assert decode.aux.read(dslot, room) == aux
    assert counter(engines.prefill_daemon, "bytes_moved") - moved == 7 * src.page_bytes


def test_a_room_whose_chunks_end_short_of_the_decodes_pages_fails_naming_both(engines):
    src, dst = SGLangKV(layers=1), SGLangKV(layers=1)
    prefill, decode, boot = engines(src, dst)
    decode.expect(106, boot, [1, 2, 3, 4], decode.alloc_slot(), skip_pages=1)
    prefill.send(106, [5, 6], first_page=1, num_tokens=12, slot=prefill.alloc_slot(), aux_bytes=0)
    for client in (prefill, decode):
        status = client.wait(106)
        assert (status.state, status.code) == (RoomState.FAILED, ErrorCode.BAD_MESSAGE), status
        assert "has 3 page positions but the decode expects 5 (1 skipped + 4 pages)" in status.reason, status


def test_announce_pushes_waiting_for_input_when_the_decodes_request_comes_or_at_once(engines):
    src, dst = SGLangKV(layers=1), SGLangKV(layers=1)
    prefill, decode, boot = engines(src, dst)
    # Announced first: bootstrapping until the decode asks.
    prefill.announce(107)
    assert prefill.poll(107).state is RoomState.BOOTSTRAPPING
    decode.expect(107, boot, [1, 2, 3], decode.alloc_slot(), skip_pages=2)
    status = waiting_for_input(prefill, 107)
    assert (status.pages, status.skip_pages) == (5, 2)
    # Asked first: the announce is answered with the status at once.
    decode.expect(108, boot, [4, 5], decode.alloc_slot())
    wait_until(lambda: decode.poll(108).state is RoomState.WAITING_FOR_INPUT, 10, "the prefill's room_accepted")
    prefill.announce(108, wait=True)
    status = prefill.poll(108)  # the pushed status came before the ok
    assert (status.state, status.pages, status.skip_pages) == (RoomState.WAITING_FOR_INPUT, 2, 0)
    for room in (107, 108):
        prefill.abort(room)
        assert decode.wait(room).state is RoomState.FAILED


def test_a_thousand_polls_send_no_message_to_the_daemon(engines):
    """B6: the SGLang scheduler polls every queued room on every loop. A room settled,
    and one waiting for its input: 1,000 polls of each on each side, and the daemons
    received nothing from either engine meanwhile."""
    src, dst = SGLangKV(layers=1), SGLangKV(layers=1)
    prefill, decode, boot = engines(src, dst)
    decode.expect(109, boot, [1], decode.alloc_slot())
    prefill.send(109, [2], num_tokens=4, slot=prefill.alloc_slot(), aux_bytes=0)
    assert decode.wait(109).state is RoomState.SUCCESS and prefill.wait(109).state is RoomState.SUCCESS
    decode.expect(110, boot, [3], decode.alloc_slot())
    prefill.announce(110)
    waiting_for_input(prefill, 110)
    wait_until(lambda: decode.poll(110).state is RoomState.WAITING_FOR_INPUT, 10, "the decode's room waiting")
    daemons = (engines.prefill_daemon, engines.decode_daemon)
    before = [counter(d, "engine_messages") for d in daemons]
    for _ in range(1000):
        for client, room, state in ((prefill, 109, RoomState.SUCCESS), (decode, 109, RoomState.SUCCESS),
                                    (prefill, 110, RoomState.WAITING_FOR_INPUT), (decode, 110, RoomState.WAITING_FOR_INPUT)):
            assert client.poll(room).state is state
    assert [counter(d, "engine_messages") for d in daemons] == before
    prefill.abort(110)


async def test_a_thousand_polls_of_an_async_client_send_no_message_to_the_daemon(pair):
    prefill_daemon, decode_daemon = pair
    src, dst = SGLangKV(layers=1), SGLangKV(layers=1)
    clients = []
    try:
        for daemon, kv, role in ((prefill_daemon, src, Role.PREFILL), (decode_daemon, dst, Role.DECODE)):
            client = AsyncClient(daemon.engine, timeout=20.0, engine_id=f"async-{role.value}", role=role)
            await client.connect()
            await client.register_kv(kv.buffers, kv.spec, kv.regions)
            await client.create_aux_buffer(SLOTS, 0)
            clients.append(client)
        prefill, decode = clients
        await decode.expect(111, prefill_daemon.bootstrap, [1, 2], await decode.alloc_slot())
        await prefill.send(111, [3, 4], num_tokens=8, slot=await prefill.alloc_slot(), aux_bytes=0)
        assert (await decode.wait(111)).state is RoomState.SUCCESS and (await prefill.wait(111)).state is RoomState.SUCCESS
        before = [counter(d, "engine_messages") for d in pair]
        for _ in range(1000):
            assert (await prefill.poll(111)).state is RoomState.SUCCESS
            assert (await decode.poll(111)).state is RoomState.SUCCESS
        assert [counter(d, "engine_messages") for d in pair] == before
    finally:
        for client in clients:
            await client.close()
        src.close()
        dst.close()


def test_incompatible_registrations_fail_their_rooms_naming_every_differing_field(engines):
    """Layouts are compared once both halves of a room are in: a decode daemon serves
    many ranks, so another layout fails the rooms between the two ranks, not the hello
    (but for the page size, refused at the handshake: test_integration)."""
    src = SGLangKV(layers=2, page_size=4, dtype="float16")
    dst = SGLangKV(layers=3, page_size=4, dtype="float32")
    prefill, decode, boot = engines(src, dst)
    decode.expect(112, boot, [1], decode.alloc_slot())
    prefill.send(112, [2], num_tokens=4, slot=prefill.alloc_slot(), aux_bytes=0)
    for side in (decode, prefill):
        status = side.wait(112)
        assert (status.state, status.code) == (RoomState.FAILED, ErrorCode.COMPAT_MISMATCH), status
        assert "incompatible KV layout: " in status.reason, status.reason
        for named in ("dtype: prefill='float16' decode='float32'",
                      "bytes_per_token_head: prefill=32 decode=64", "num_layers_total: prefill=2 decode=3",
                      "regions: prefill=[0:k:256, 0:v:256, 1:k:256, 1:v:256] decode=[0:k:512, 0:v:512, 1:k:512, 1:v:512, 2:k:512, 2:v:512]"):
            assert named in status.reason, status.reason


def lane_slots(daemon) -> dict[int, int]:
    """Slots by lane, as the daemon's admin API lists them."""
    with AdminClient(daemon.ready["admin"]) as admin:
        return dict(collections.Counter(slot.lane for slot in admin.call(AdminSlots).slots))


def test_a_daemon_serves_every_rank_of_an_engine_each_in_a_lane_of_its_own(engines):
    """Two ranks of one engine on one daemon are both welcome, each with its own KV
    and aux buffer (a lane); the rank that connects again (a restarted engine) finds
    its lane. What a daemon cannot serve is refused naming the fix."""
    prefill_daemon = engines.prefill_daemon
    before = lane_slots(prefill_daemon)
    kvs = [SGLangKV(layers=1), SGLangKV(layers=1, heads=1)]
    ranks = [Client(prefill_daemon.engine, timeout=10, engine_id="eng", rank=Rank(tp=tp), sizes=Rank(tp=2)) for tp in (0, 1)]
    try:
        for client, kv, slots in zip(ranks, kvs, (3, 5)):
            client.connect()
            assert client.register_kv(kv.buffers, kv.spec, kv.regions) == 1  # each rank its own pool: its first registration
            client.create_aux_buffer(slots, PAYLOAD)
        after = lane_slots(prefill_daemon)
        new = {lane: count for lane, count in after.items() if lane not in before}
        assert sorted(new.values()) == [3, 5] and after == before | new, (before, after)
        assert [client.alloc_slot().index for client in ranks] == [0, 0]  # slots are per lane
        for options, named in [
            (dict(role=Role.DECODE), "is a decode engine but this daemon is a prefill daemon: connect it to a decode daemon"),
            (dict(sizes=Rank(cp=2)), "context parallelism (CP size 2), which pdxfer does not support yet: run it with CP 1"),
        ]:
            client = Client(prefill_daemon.engine, timeout=10, engine_id="eng", **options)
            with pytest.raises(errors.Unsupported) as caught:
                client.connect()
            assert named in str(caught.value)
            client.close()
        again = Client(prefill_daemon.engine, timeout=10, engine_id="eng", rank=Rank(tp=1), sizes=Rank(tp=2))
        again.connect()  # a rank it serves, from another connection (a restarted engine): welcome, in its lane
        # Which holds the first registration of these buffers: a new Client starts at
        # version 1 and must pass one above it, as the refusal and the README say.
        with pytest.raises(errors.StaleMemoryVersion, match=r"needs a memory version above 1, got 1 \(a new Client .* pass memory_version=2 or above\)"):
            again.register_kv(kvs[1].buffers, kvs[1].spec, kvs[1].regions)
        assert again.register_kv(kvs[1].buffers, kvs[1].spec, kvs[1].regions, memory_version=2) == 2
        again.close()
        assert lane_slots(prefill_daemon) == after
    finally:
        for thing in (*ranks, *kvs):
            thing.close()


def test_registering_again_bumps_the_memory_version_and_a_recreated_buffer_is_mapped_anew(engines):
    """The same buffers registered again: memory version 2, and a room computed against
    1 is refused. An engine that restarts creates its shared memory again under the same
    name: the daemon maps the new file, not the one it mapped before."""
    src, dst = SGLangKV(layers=1), SGLangKV(layers=1)
    prefill, decode, boot = engines(src, dst)
    assert decode.register_kv(dst.buffers, dst.spec, dst.regions) == 2
    with pytest.raises(errors.StaleMemoryVersion, match="memory version 1, but the registered version is 2"):
        decode.expect(113, boot, [1], decode.alloc_slot(), memory_version=1)
    # The prefill engine "restarts": same names, new files, new bytes.
    for m in src.memory:
        recreate(m.name, m.size)
    reborn = [SharedMemory.open(m.name, m.size) for m in src.memory]
    try:
        new = {key: np.frombuffer(m.array, pages.dtype).reshape(pages.shape) for (key, pages), m in zip(src.pages.items(), reborn)}
        rng = np.random.default_rng(12)
        for pages in new.values():
            pages[...] = rng.standard_normal(pages.shape).astype(pages.dtype)
        assert prefill.register_kv(src.buffers, src.spec, src.regions) == 2
        want = {key: pages.copy() for key, pages in dst.pages.items()}
        for key, pages in want.items():
            pages[[5, 6]] = new[key][[7, 8]]
        decode.expect(114, boot, [5, 6], decode.alloc_slot())
        prefill.send(114, [7, 8], num_tokens=8, slot=prefill.alloc_slot(), aux_bytes=0)
        assert decode.wait(114).state is RoomState.SUCCESS
        assert_holds(dst, want)
    finally:
        for m in reborn:
            m.close()


def recreate(name: str, size: int) -> None:
    """Shared memory made again under ``name``, as a restarted engine makes it: a new file."""
    path = os.path.join(SHM_DIR, name)
    os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
