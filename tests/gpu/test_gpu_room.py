"""A room between two daemons started with --device cuda:0 whose KV pools are GPU
memory: torch tensors of this process (the engine of both), exported by CUDA IPC
(adapters/cuda.py), moved by the CUDA build of the Mooncake transfer engine over TCP
on loopback, every byte of the destination pool checked."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdxfer.adapters.cuda import export_tensors
from pdxfer.client import Client
import msgspec

from pdxfer.core.plan import layout_regions, layout_registration, pool_bytes, region_views
from pdxfer.core.protocol import Layout, RoomState

from ..conftest import needs_mooncake, small_layout
from . import cuda_missing
from .sides import pattern

MISSING = cuda_missing()
pytestmark = [pytest.mark.skipif(bool(MISSING), reason=MISSING or "-"), needs_mooncake, pytest.mark.integration]

# 8 layers of K and V, pages of 16 tokens of 8 heads x 64 x bf16: 16 KiB per page and
# region, 128 MiB a pool.
LAYOUT = small_layout(Layout.MHA, num_layers=8, num_pages=512, page_size=16, token_bytes=1024)


def gpu_engine(daemon):
    """A client of ``daemon`` whose KV pool is a CUDA tensor of this process, registered
    as one buffer (its cudaMalloc block) and the layout's regions at the tensor's offset
    inside it."""
    import torch

    pool = torch.zeros(pool_bytes(LAYOUT), dtype=torch.uint8, device="cuda")
    (handle,), (place,) = export_tensors([pool])
    assert handle.size >= place.offset + place.length and place.length == pool_bytes(LAYOUT)
    spec, regions = layout_registration(LAYOUT)
    client = Client(daemon.engine, timeout=20.0, device="cuda:0")
    client.connect()
    client.register_kv([handle], spec, [msgspec.structs.replace(r, offset=r.offset + place.offset) for r in regions])
    client.create_aux_buffer(16, 64)
    return client, pool


def test_a_room_moves_gpu_pool_bytes_between_two_daemons(daemons):
    import torch

    prefill_daemon = daemons("prefill", "--device", "cuda:0")
    decode_daemon = daemons("decode", "--device", "cuda:0")
    prefill, src_pool = gpu_engine(prefill_daemon)
    decode, dst_pool = gpu_engine(decode_daemon)
    sent = pattern(7, pool_bytes(LAYOUT))
    src_pool.copy_(torch.from_numpy(sent))
    torch.cuda.synchronize()  # the KV is complete before send() (A11's adapter guarantee)

    rng = np.random.default_rng(5)
    src, dst = rng.permutation(LAYOUT.num_pages)[:256], rng.permutation(LAYOUT.num_pages)[:256]
    slot_d = decode.alloc_slot()
    decode.expect(1, prefill_daemon.bootstrap, dst, slot_d, memory_version=1)
    slot_p = prefill.alloc_slot()
    prefill.aux.payload(slot_p)[:5] = np.frombuffer(b"hello", np.uint8)
    started = time.perf_counter()
    prefill.send(1, src, 256 * LAYOUT.page_size, slot_p, aux_bytes=5, memory_version=1)
    assert decode.wait(1, timeout=60).state is RoomState.SUCCESS
    seconds = time.perf_counter() - started
    assert prefill.wait(1, timeout=60).state is RoomState.SUCCESS
    assert bytes(decode.aux.payload(slot_d)[:5]) == b"hello"

    regions = layout_regions(LAYOUT)
    got = region_views(dst_pool.cpu().numpy(), regions, LAYOUT.num_pages)
    want = region_views(sent, regions, LAYOUT.num_pages)
    untouched = np.setdiff1d(np.arange(LAYOUT.num_pages), dst)
    for region, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g[dst], w[src]), f"region {region}: the room's pages differ"
        assert not g[untouched].any(), f"region {region}: pages outside the room were written"
    moved = len(regions) * 256 * regions[0].page_bytes
    print(f"\nGPU pool -> GPU pool over tcp: {moved} bytes in {len(regions) * 256} pages, {seconds * 1000:.1f} ms "
          f"from send to the decode's success ({moved / seconds / 1e9:.2f} GB/s)")
    decode.release(1)
    prefill.release(1)
    for client in (prefill, decode):
        client.close()


def test_a_chunk_sent_with_a_cuda_event_is_written_once_the_work_before_it_completed(daemons):
    """A11: the engine writes its pages on a stream, records an interprocess event after
    that work, and sends at once with the event's IPC handle (no synchronize). A slow
    kernel queued before the copy keeps the event pending for a while: the daemon waits
    for it, so the decode receives the pages' final bytes, never the zeros before."""
    import torch

    prefill_daemon = daemons("prefill", "--device", "cuda:0")
    decode_daemon = daemons("decode", "--device", "cuda:0")
    prefill, src_pool = gpu_engine(prefill_daemon)
    decode, dst_pool = gpu_engine(decode_daemon)
    sent = torch.from_numpy(pattern(8, pool_bytes(LAYOUT))).cuda()
    pages = np.arange(64)
    slot_d = decode.alloc_slot()
    decode.expect(2, prefill_daemon.bootstrap, pages, slot_d, memory_version=1)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the pages are written
        src_pool.copy_(sent)
        event = torch.cuda.Event(interprocess=True)
        event.record(stream)
    assert not event.query()  # the send below goes while the work is still queued
    prefill.send(2, pages, 64 * LAYOUT.page_size, prefill.alloc_slot(), aux_bytes=0, memory_version=1, cuda_event=bytes(event.ipc_handle()))
    assert decode.wait(2, timeout=60).state is RoomState.SUCCESS
    regions = layout_regions(LAYOUT)
    got = region_views(dst_pool.cpu().numpy(), regions, LAYOUT.num_pages)
    want = region_views(sent.cpu().numpy(), regions, LAYOUT.num_pages)
    for region, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g[pages], w[pages]), f"region {region}: the pages were written before the event completed"
    for client in (prefill, decode):
        client.close()
