"""Small rooms' KV inside the aux record (--inline-kv-bytes): which rooms take that
path (pure), that gather and scatter put every byte back in its page, that real
daemons move such rooms without a transfer-engine write while bigger rooms still
go through the engine, and that a decode daemon refuses inline KV it did not offer
or that does not fit the room."""

from __future__ import annotations

import time
import zlib

import msgspec
import numpy as np
import pytest

from pdxfer.core import paths
from pdxfer.core.plan import layout_registration, pages_to_bytes, pool_bytes, region_views
from pdxfer.core.protocol import AuxRecord, ErrorCode, Layout, LegRequest, PeerHello, PeerWelcome, RoomAccepted, RoomRequest, RoomState
from pdxfer.core.stamp import stamp_for
from pdxfer.host.memory import SharedMemory
from pdxfer.ops.inspection import daemon_counters
from pdxfer.roles.lanes import MappedKV

from .conftest import needs_mooncake, small_layout
from .roomkit import SLACK, engine, free_port, start_room
from .test_peer_death import FakePrefill
from .test_write_leave import FakeDecode

TCP, TE = paths.AuxPath.TCP, paths.AuxPath.TRANSFER_ENGINE


# --- which rooms ride the aux record (pure)


@pytest.mark.parametrize(
    "aux_path, kind, ours, theirs, nbytes, inline",
    [
        (TCP, "shm", 65536, 65536, 32768, True),
        (TCP, "shm", 65536, 65536, 65536, True),  # the limit is inclusive
        (TCP, "shm", 65536, 65536, 65537, False),  # one byte over: the transfer engine
        (TCP, "shm", 65536, 4096, 8192, False),  # the decode side offers less
        (TCP, "shm", 4096, 65536, 8192, False),  # this side allows less
        (TCP, "shm", 0, 65536, 1, False),  # off here
        (TCP, "shm", 65536, 0, 1, False),  # the decode pool is not host memory, or it is off there
        (TE, "shm", 65536, 65536, 1, False),  # aux is written by the engine: no record to ride
        (TCP, "cuda_ipc", 65536, 65536, 1, False),  # the daemon cannot read device memory with numpy
    ],
)
def test_which_rooms_send_their_kv_inline(aux_path, kind, ours, theirs, nbytes, inline):
    assert paths.send_kv_inline(aux_path, kind, ours, theirs, nbytes) is inline


@pytest.mark.parametrize("kind, offered", [("shm", 65536), ("cuda_ipc", 0), ("npu_ipc", 0)])
def test_a_decode_daemon_offers_inline_kv_only_for_host_pools(kind, offered):
    assert paths.inline_kv_limit(kind, 65536) == offered


@pytest.mark.parametrize("layout", list(Layout))
def test_gather_then_scatter_puts_every_byte_back_in_its_page(layout):
    kv_layout = small_layout(layout)
    src_mem, dst_mem = SharedMemory.create(pool_bytes(kv_layout)), SharedMemory.create(pool_bytes(kv_layout))
    try:
        spec, regions = layout_registration(kv_layout)
        src = MappedKV({src_mem.handle: src_mem}, (src_mem.handle,), spec, regions, 1, "shm")
        dst = MappedKV({dst_mem.handle: dst_mem}, (dst_mem.handle,), spec, regions, 1, "shm")
        src_mem.array[:] = np.random.default_rng(3).integers(0, 256, src_mem.size, dtype=np.uint8)
        src_pages, dst_pages = np.array([7, 2, 200]), np.array([5, 90, 6])
        data = src.gather(src_pages)
        assert len(data) == src_pages.size * src.page_bytes
        dst.scatter(dst_pages, data)
        assert dst.digest(dst_pages) == src.digest(src_pages) == zlib.crc32(data)  # the prefill digests inline KV from its bytes
        untouched = np.setdiff1d(np.arange(kv_layout.num_pages), dst_pages)
        assert not any(region[untouched].any() for region in region_views(dst_mem.array, dst.regions, kv_layout.num_pages))
    finally:
        src_mem.close()
        dst_mem.close()


# --- real daemons


@needs_mooncake
@pytest.mark.integration
def test_small_rooms_ride_the_aux_record_and_big_ones_the_transfer_engine(daemons):
    """A room of one or two pages is under the 4 KiB limit and moves with no engine
    write; one of eight pages is over it and moves as blocks. Every byte is checked."""
    limit = ["--inline-kv-bytes", "4096"]  # small_layout: 8 regions of 256-byte pages, 2 KiB per page index
    prefill, decode = daemons("prefill", *limit), daemons("decode", *limit)
    cp, cd = engine(prefill), engine(decode)
    try:
        small = [start_room(cp, cd, prefill.bootstrap, 10 + i, [3 * i, 3 * i + 1][: 1 + i % 2], [100 + 2 * i, 101 + 2 * i][: 1 + i % 2], seed=i) for i in range(4)]
        for case in small:
            assert cd.wait(case.id, timeout=10 + SLACK).state is RoomState.SUCCESS
            case.check_bytes()
        counters = daemon_counters(prefill.ready["admin"])
        assert counters["blocks_submitted"] == 0, counters
        assert counters["kv_inline_rooms"] == 4, counters
        assert counters["kv_inline_bytes"] == 6 * 2048, counters
        big = start_room(cp, cd, prefill.bootstrap, 50, list(range(40, 48)), list(range(150, 158)), seed=9)
        assert cd.wait(big.id, timeout=10 + SLACK).state is RoomState.SUCCESS
        big.check_bytes()
        counters = daemon_counters(prefill.ready["admin"])
        assert counters["blocks_submitted"] > 0 and counters["kv_inline_rooms"] == 4, counters
    finally:
        cp.close()
        cd.close()


@needs_mooncake
@pytest.mark.integration
def test_with_verify_kv_an_inline_room_is_digested_from_the_bytes_it_carries(daemons):
    """The prefill digests inline KV from the record's bytes, not by reading its pages
    again; the decode daemon digests the pages it wrote. They must agree."""
    flags = ["--inline-kv-bytes", "4096", "--verify-kv"]
    prefill, decode = daemons("prefill", *flags), daemons("decode", *flags)
    cp, cd = engine(prefill), engine(decode)
    try:
        cases = [start_room(cp, cd, prefill.bootstrap, 20 + i, [5 * i, 5 * i + 2][: 1 + i % 2], [60 + i, 90 - i][: 1 + i % 2], seed=i) for i in range(3)]
        for case in cases:
            status = cd.wait(case.id, timeout=10 + SLACK)
            assert status.state is RoomState.SUCCESS, status
            case.check_bytes()
        assert daemon_counters(prefill.ready["admin"])["kv_inline_rooms"] == 3
    finally:
        cp.close()
        cd.close()


@needs_mooncake
@pytest.mark.integration
def test_a_decode_daemon_that_offers_none_gets_transfer_engine_writes(daemons):
    prefill, decode = daemons("prefill", "--inline-kv-bytes", "65536"), daemons("decode", "--inline-kv-bytes", "0")
    cp, cd = engine(prefill), engine(decode)
    try:
        case = start_room(cp, cd, prefill.bootstrap, 7, [1], [2], seed=1)
        assert cd.wait(case.id, timeout=10 + SLACK).state is RoomState.SUCCESS
        case.check_bytes()
        counters = daemon_counters(prefill.ready["admin"])
        assert counters["kv_inline_rooms"] == 0 and counters["blocks_submitted"] > 0, counters
    finally:
        cp.close()
        cd.close()


@needs_mooncake
@pytest.mark.integration
def test_a_decode_daemon_refuses_inline_kv_it_did_not_offer_or_that_does_not_fit(daemons):
    """The prefill is played by the test, so the record can be forged. Each bad one
    fails its room with bad_message and leaves the destination pages untouched; a
    good one lands and the room succeeds."""
    port = free_port()
    decode = daemons("decode", "--inline-kv-bytes", "4096", "--heartbeat-misses", "200", name="d")
    cd = engine(decode)
    fake = FakePrefill(port, "fake000000000000")
    try:
        region_pages = cd.kv.arrays()
        page_bytes = sum(a.shape[1] for a in region_pages)  # one page index over every region
        link = {}

        def room(room_id: int, dst: list[int], kv: bytes, kv_pages: int, accepted: bool = True):
            cd.expect(room_id, f"127.0.0.1:{port}", np.array(dst), cd.alloc_slot())
            if room_id == 1:
                identity, hello = fake.recv_kind(PeerHello)
                assert hello.inline_kv_bytes == 4096, hello
                fake.welcome(identity)
                link["identity"] = identity
            _, request = fake.recv_kind(RoomRequest)
            (leg,) = request.legs  # one rank each side: one leg, the one that carries aux
            if accepted:
                fake.send(link["identity"], RoomAccepted(room=room_id, input_ready=True, legs=(leg.leg,)))
            aux = b"aux of %d" % room_id
            stamp = stamp_for(room_id, leg.generation, aux)
            fake.send(link["identity"], AuxRecord(room=room_id, slot=leg.slot, generation=leg.generation, length=stamp.length,
                                                   checksum=stamp.checksum, payload=aux, kv_pages=kv_pages, kv=kv))
            return cd.wait(room_id, timeout=SLACK)

        before = [a.copy() for a in region_pages]
        too_big = room(1, [10, 11, 12], b"\x01" * 3 * page_bytes, 3)  # 6 KiB: more than the 4 KiB offered
        assert too_big.state is RoomState.FAILED and too_big.code is ErrorCode.BAD_MESSAGE, too_big
        assert "at most 4096" in too_big.reason
        short = room(2, [20], b"\x02" * (page_bytes - 1), 1)
        assert short.state is RoomState.FAILED and short.code is ErrorCode.BAD_MESSAGE, short
        assert "is not 1 pages" in short.reason
        overflow = room(3, [30], b"\x03" * 2 * page_bytes, 2)  # two pages into a room of one
        assert overflow.state is RoomState.FAILED and overflow.code is ErrorCode.PAGE_OUT_OF_RANGE, overflow
        assert all(np.array_equal(a, b) for a, b in zip(region_pages, before)), "a refused record wrote pages"

        good = room(4, [40], bytes(range(256)) * (page_bytes // 256), 1)
        assert good.state is RoomState.SUCCESS, good
        landed = b"".join(a[40].tobytes() for a in region_pages)
        assert landed == bytes(range(256)) * (page_bytes // 256)
        # A prefill whose engine's send() came first sends no room_accepted before the record.
        unannounced = room(5, [41], bytes(range(255, -1, -1)) * (page_bytes // 256), 1, accepted=False)
        assert unannounced.state is RoomState.SUCCESS, unannounced
        assert b"".join(a[41].tobytes() for a in region_pages) == bytes(range(255, -1, -1)) * (page_bytes // 256)
    finally:
        fake.close()
        cd.close()


@needs_mooncake
@pytest.mark.integration
def test_a_small_room_whose_input_came_first_gets_its_record_and_no_other_message(daemons):
    """The aux record carrying the KV tells the decode side all that room_accepted
    would have: one message fewer for every small room. A room whose input comes
    later is still accepted first, so the decode side knows it paired."""
    prefill = daemons("prefill", "--inline-kv-bytes", "65536", "--heartbeat-interval", "5", "--heartbeat-misses", "6", name="p")
    client = engine(prefill)
    fake = FakeDecode(prefill, client)
    try:
        fake.send(msgspec.structs.replace(fake.hello, inline_kv_bytes=65536))
        fake.recv_until(PeerWelcome)
        page_tokens = client.kv.layout.page_size

        def request(room_id: int, pages: list[int]) -> RoomRequest:
            leg = LegRequest(pages=pages_to_bytes(pages), slot=room_id, generation=1, memory_version=1)
            return RoomRequest(room=room_id, legs=(leg,), lease_ms=30_000, writes_until=time.monotonic() + 30.0)

        client.send(7, [1, 2], num_tokens=2 * page_tokens, slot=client.alloc_slot())
        time.sleep(0.2)  # the engine's send() is in before the request
        fake.send(request(7, [20, 21]))
        first = fake.recv_until(AuxRecord)
        assert [type(m) for m in first] == [AuxRecord] and first[0].room == 7 and first[0].kv_pages == 2, first

        fake.send(request(8, [22]))
        accepted = fake.recv_until(RoomAccepted)
        assert [(type(m), m.input_ready) for m in accepted] == [(RoomAccepted, False)], accepted
        client.send(8, [3], num_tokens=page_tokens, slot=client.alloc_slot())
        later = fake.recv_until(AuxRecord)
        assert [type(m) for m in later] == [AuxRecord] and later[0].room == 8, later
    finally:
        fake.close()
        client.close()


def test_inline_kv_cannot_exceed_the_protocol_bound():
    from pdxfer.core import config
    from pdxfer.core.protocol import MAX_INLINE_KV_BYTES

    with pytest.raises(ValueError, match="--inline-kv-bytes is 1048577"):
        config.load({"role": "decode", "inline_kv_bytes": MAX_INLINE_KV_BYTES + 1})
    assert config.load({"role": "decode"}).inline_kv_bytes == 64 * 1024
