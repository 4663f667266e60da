"""B7 on a GPU: an SGLang GPU server's KV as the backend registers it, without SGLang.
Per-layer fused K|V CUDA tensors shaped as SGLang's MHATokenToKVPool allocates them are
exported by the pool hook's ``places.share``, registered from their pointers
(``layout.registration`` with ``places.locate``, as the KV manager does) through the
backend's Link with two ``--device cuda:0`` daemons. A room moves in two chunks; the
first is sent while a "forward" on another stream is still writing its pages, with an
event chained behind that forward's (``event_after``, as the backend passes SGLang's
early-send event, A11). Every byte of the room's pages is checked, the pages around them
stay zero, and the metadata row arrives."""

from __future__ import annotations

import numpy as np
import pytest

from pdxfer.adapters.cuda import event_after
from pdxfer.adapters.sglang import places
from pdxfer.adapters.sglang.layout import registration
from pdxfer.adapters.sglang.link import Link
from pdxfer.core.protocol import CudaIpcHandle, Rank, RegionKind, Role, RoomState

from ..conftest import needs_mooncake
from ..test_sglang_adapter import as_rows, metadata_buffers, wait_for
from . import cuda_missing

MISSING = cuda_missing()
pytestmark = [pytest.mark.skipif(bool(MISSING), reason=MISSING or "-"), needs_mooncake, pytest.mark.integration]

# 4 layers, pages of 16 tokens of 8 KV heads x 128 x bf16: 32 KiB per page of a K or V
# tensor; 256 pages, so 8 MiB per tensor and 16 MiB per layer's fused K|V.
LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 128, 16, 256
PAGE_BYTES = PAGE_SIZE * HEADS * HEAD_DIM * 2


class GpuRank:
    """One SGLang rank's GPU KV pool and metadata rows behind a Link, registered as the
    backend registers them."""

    def __init__(self, daemon, role: Role):
        import torch

        fused = [torch.zeros((2, PAGES * PAGE_SIZE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        self.k, self.v = [f[0] for f in fused], [f[1] for f in fused]
        self.tensors = [*self.k, *self.v]
        places.share(self.tensors)  # what the plugin's pool hook does with a CUDA pool
        self.kv = registration([t.data_ptr() for t in self.tensors], [t.nbytes for t in self.tensors], [PAGE_BYTES] * len(self.tensors),
                               page_size=PAGE_SIZE, dtype="bfloat16", first_layer=0, num_layers_total=LAYERS, heads_local=HEADS,
                               heads_total=HEADS, mla=False, locate=places.locate)
        self.meta = metadata_buffers()
        self.link = Link(daemon.engine, engine_id=f"gpu-{role.value}", role=role, rank=Rank(), sizes=Rank(dp=1, pp=1, tp=1, cp=1),
                         device="cuda:0", kv=self.kv, rows=as_rows(self.meta), aux_slots=16)
        self.link.open()

    def pages(self, pages) -> list:
        """Each tensor's ``pages``, as [len(pages), page bytes] uint8 on the host."""
        import torch

        return [t.view(PAGES, -1)[list(pages)].view(torch.uint8).cpu().numpy() for t in self.tensors]


@pytest.fixture
def exported(monkeypatch):
    monkeypatch.setattr(places, "_exported", [])


def test_an_sglang_shaped_gpu_pool_is_exported_registered_and_moved_room_by_room(daemons, exported):
    import torch

    prefill_daemon, decode_daemon = daemons("prefill", "--device", "cuda:0"), daemons("decode", "--device", "cuda:0")
    prefill, decode = GpuRank(prefill_daemon, Role.PREFILL), GpuRank(decode_daemon, Role.DECODE)
    try:
        for rank in (prefill, decode):
            buffers, regions = rank.kv.buffers, rank.kv.regions
            assert all(isinstance(b, CudaIpcHandle) and b.device == 0 for b in buffers)
            assert len(buffers) <= LAYERS  # a layer's K and V halves lie in one block
            k_of = {r.layer: r for r in regions if r.kind is RegionKind.K}
            for r in regions:
                if r.kind is RegionKind.V:  # V is the second half of its layer's tensor
                    assert (r.buffer, r.offset) == (k_of[r.layer].buffer, k_of[r.layer].offset + PAGES * PAGE_SIZE * HEADS * HEAD_DIM * 2)

        room, src, dst = 9001, list(range(5, 13)), list(range(100, 108))
        head, tail = src[:4], src[4:]  # the first chunk is the "cached prefix", sent early; consecutive pages
        gen = torch.Generator(device="cuda").manual_seed(3)
        for t in prefill.tensors:
            t.view(PAGES, -1)[tail] = torch.randn((len(tail), t[0].numel() * PAGE_SIZE), generator=gen, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        prefill.meta[0][1, 0], prefill.meta[2][1, 0] = 1734, room

        prefill.link.announce(room)
        host, port = prefill.link.bootstrap
        decode.link.expect(room, f"{host}:{port}", dst, skip_pages=0)
        wait_for(prefill.link, room, RoomState.WAITING_FOR_INPUT)

        # The forward writes its pages through a slice: indexing with a Python list copies
        # the index from pageable host memory, which waits for the stream (the sleep) first.
        head_pages = slice(head[0], head[-1] + 1)
        forward = torch.cuda.Stream()
        with torch.cuda.stream(forward):
            torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the pages are written
            for t in prefill.tensors:
                t.view(PAGES, -1)[head_pages] = torch.randn((len(head), t[0].numel() * PAGE_SIZE), generator=gen, device="cuda", dtype=torch.bfloat16)
            forward_done = torch.cuda.Event()  # SGLang's early-send event: not interprocess
            forward_done.record(forward)
        event, handle = event_after(forward_done, torch.cuda.Stream())
        assert not event.query()  # the chunk goes while the forward still writes it
        prefill.link.send(room, np.array(head, np.int32), 0, last=False, cuda_event=handle)
        prefill.link.send(room, np.array(tail, np.int32), len(head), last=True, num_tokens=len(src) * PAGE_SIZE - 5, row=1)
        wait_for(decode.link, room, RoomState.SUCCESS)
        decode.link.rows.scatter(6, decode.link.record(room))
        torch.cuda.synchronize()

        untouched = sorted(set(range(PAGES)) - set(dst))
        for i, (sent, got, rest) in enumerate(zip(prefill.pages(src), decode.pages(dst), decode.pages(untouched))):
            assert np.array_equal(sent, got), f"tensor {i}: the room's pages differ"
            assert sent[: len(head)].any(), f"tensor {i}: the early chunk's pages are zeros, so a read before the forward would pass"
            assert not rest.any(), f"tensor {i}: pages outside the room were written"
        assert decode.meta[0][6, 0] == 1734 and decode.meta[2][6, 0] == room
        assert wait_for(prefill.link, room, RoomState.SUCCESS).state is RoomState.SUCCESS
        for rank in (prefill, decode):
            rank.link.release(room)
    finally:
        prefill.link.close()
        decode.link.close()
