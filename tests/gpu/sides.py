"""The processes of tests/gpu/test_cuda_ipc.py, each spawned and answering over a pipe
(an exception travels back as its traceback): an engine that allocates tensors shaped
like SGLang's or vLLM's, fills and exports them (adapters/cuda.py); a daemon that maps
them (host/memory.py), checks every byte and writes its own pattern, which the engine
then reads back through its tensors. The daemon side uses no torch, as a daemon."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
import traceback

import numpy as np

from pdxfer.adapters.cuda import export_tensors
from pdxfer.core.errors import Unsupported
from pdxfer.host import memory

H2D, D2H = 1, 2  # cudaMemcpyKind
DAEMON_SEED = 500  # the daemon writes pattern(DAEMON_SEED + i) into tensor i
PAD_SEED = 1000  # the tensors allocated around the KV ones, which nobody may touch


def pattern(seed: int, n: int) -> np.ndarray:
    """n bytes that differ with the seed and shift with the position: a tensor read at
    the wrong offset, or another tensor's bytes, do not match."""
    start = np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
    mixed = np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + start  # wraps modulo 2**64
    return (mixed >> np.uint64(29)).astype(np.uint8)


def engine(conn, shape: str) -> None:
    try:
        _engine(conn, shape)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def daemon(conn, handles, places) -> None:
    try:
        _daemon(conn, handles, places)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def expandable_engine(conn) -> None:
    try:
        import torch

        tensor = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        expandable = any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())
        try:
            export_tensors([tensor])
            conn.send(("exported", expandable, ""))
        except Unsupported as exc:
            conn.send(("refused", expandable, str(exc)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def freeing_engine(conn) -> None:
    """Frees a tensor it exported and one it did not, and allocates the same size
    after each: is the freed block handed out again?"""
    try:
        import torch

        reused = {}
        for exported in (False, True):
            tensor = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
            at = tensor.data_ptr()
            if exported:
                export_tensors([tensor])
            del tensor
            reused[exported] = torch.empty(4 << 20, dtype=torch.uint8, device="cuda").data_ptr() == at
        conn.send(("freed", reused))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def sglang_shaped(torch):
    """(pads, per-layer K and V [tokens, heads, head_dim]): layers 0-1 carved from a
    small-pool block after three small tensors, layers 2-3 from a cached 64 MiB block
    after a 3 MiB tensor, so each layer lies inside a block shared with others."""
    cuda = torch.device("cuda", 0)
    pads = [torch.empty(n, dtype=torch.uint8, device=cuda) for n in (1000, 3000, 5000)]
    kv = [torch.empty(64, 4, 64, dtype=torch.float16, device=cuda) for _ in range(4)]  # 32 KiB each
    cached = torch.empty(64 << 20, dtype=torch.uint8, device=cuda)
    del cached  # its block stays with the allocator, which carves the next ones from it
    pads.append(torch.empty(3 << 20, dtype=torch.uint8, device=cuda))
    kv += [torch.empty(2048, 8, 64, dtype=torch.float16, device=cuda) for _ in range(4)]  # 2 MiB each
    return pads, kv


def vllm_shaped(torch):
    """(pads, per-layer views [blocks, heads, block_size, 2*head_dim] of one storage),
    the storage carved from a cached 32 MiB block after a 1 MiB + 4 KiB tensor."""
    cuda = torch.device("cuda", 0)
    cached = torch.empty(32 << 20, dtype=torch.uint8, device=cuda)
    del cached
    pads = [torch.empty((1 << 20) + 4096, dtype=torch.uint8, device=cuda)]
    layers, blocks, heads, block_size, head_dim = 4, 32, 4, 16, 64
    per_layer = blocks * heads * block_size * 2 * head_dim
    storage = torch.empty(layers * per_layer, dtype=torch.bfloat16, device=cuda)
    kv = [storage[i * per_layer : (i + 1) * per_layer].view(blocks, heads, block_size, 2 * head_dim) for i in range(layers)]
    return pads, kv


def byte_span(torch, tensor):
    """The bytes a dense tensor spans, as a uint8 tensor over the same memory."""
    start, length = tensor.storage_offset() * tensor.element_size(), tensor.numel() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage(), start, (length,))


def block_facts(torch, kv, handles, places) -> tuple[list[str], int]:
    """Each placement against the allocator's own record of its blocks (the memory
    snapshot), which export_tensors does not read: the problems found, and how many
    blocks the tensors lie in."""
    segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == 0]
    problems, buffer_of = [], {}
    for i, (tensor, place) in enumerate(zip(kv, places)):
        at = tensor.data_ptr()
        block = next(s for s in segments if s["address"] <= at < s["address"] + s["total_size"])
        if place.offset != at - block["address"]:
            problems.append(f"tensor {i}: offset {place.offset}, but it lies {at - block['address']} bytes into its block")
        if buffer_of.setdefault(block["address"], place.buffer) != place.buffer:
            problems.append(f"tensor {i}: buffer {place.buffer}, but its block is buffer {buffer_of[block['address']]}")
        size = handles[place.buffer].size
        if not place.offset + place.length <= size <= block["total_size"]:
            problems.append(f"tensor {i}: ends at {place.offset + place.length}, handle size {size}, block size {block['total_size']}")
    if len(set(buffer_of.values())) != len(buffer_of):
        problems.append(f"two blocks share a handle: {buffer_of}")
    return problems, len(buffer_of)


def _engine(conn, shape: str) -> None:
    import torch

    pads, kv = {"sglang": sglang_shaped, "vllm": vllm_shaped}[shape](torch)
    for seed, tensors in ((0, kv), (PAD_SEED, pads)):
        for i, tensor in enumerate(tensors):
            span = byte_span(torch, tensor)
            span.copy_(torch.from_numpy(pattern(seed + i, span.numel())))
    torch.cuda.synchronize()  # the daemon reads at once
    started = time.perf_counter()
    handles, places = export_tensors(kv)
    export_ms = (time.perf_counter() - started) * 1000
    problems, blocks = block_facts(torch, kv, handles, places)
    conn.send(("exported", handles, places, {"problems": problems, "blocks": blocks, "export_ms": export_ms}))
    assert conn.recv() == "check"
    torch.cuda.synchronize()
    back = {
        "kv": [_differing(byte_span(torch, t), pattern(DAEMON_SEED + i, t.numel() * t.element_size())) for i, t in enumerate(kv)],
        "pads": [_differing(byte_span(torch, t), pattern(PAD_SEED + i, t.numel())) for i, t in enumerate(pads)],
    }
    conn.send(("checked", back))


def vllm_registered_engine(conn) -> None:
    """vLLM-shaped layer views, filled with pattern(i) per layer, registered as
    PdxferConnector's worker registers them: the buffers and, per layer region, where
    its pages lie (as Placements, for the daemon side)."""
    try:
        import torch

        from pdxfer.adapters.cuda import Placement
        from pdxfer.adapters.vllm.registration import register

        _, kv = vllm_shaped(torch)
        for i, tensor in enumerate(kv):
            span = byte_span(torch, tensor)
            span.copy_(torch.from_numpy(pattern(i, span.numel())))
        torch.cuda.synchronize()
        heads, head_dim = kv[0].shape[1], kv[0].shape[3] // 2
        reg = register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)}, lambda name: int(name.split(".")[2]),
                       len(kv), heads, head_dim)
        _, exported = export_tensors(kv)
        places = [Placement(r.buffer, r.offset, r.num_pages * r.page_bytes) for r in reg.regions]
        conn.send(("registered", reg.buffers, places, {"device": reg.device, "exported": exported, "spec": reg.spec,
                                                       "layers": [r.layer for r in reg.regions]}))
        assert conn.recv() == "check"
        torch.cuda.synchronize()
        conn.send(("checked", [_differing(byte_span(torch, t), pattern(DAEMON_SEED + i, t.numel() * t.element_size())) for i, t in enumerate(kv)]))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _differing(span, expected: np.ndarray) -> int:
    return int(np.count_nonzero(span.cpu().numpy() != expected))


def _daemon(conn, handles, places) -> None:
    memory.bind_device("cuda:0")
    cudart = ctypes.CDLL(ctypes.util.find_library("cudart"))
    cudart.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def copy(dst: int, src: int, n: int, kind: int) -> None:
        rc = cudart.cudaMemcpy(dst, src, n, kind)
        assert rc == 0, f"cudaMemcpy failed with CUDA error {rc}"

    def read(address: int, n: int) -> np.ndarray:
        host = np.empty(n, np.uint8)
        copy(host.ctypes.data, address, n, D2H)
        return host

    started = time.perf_counter()
    mapped = [memory.open_handle(h) for h in handles]
    open_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    differing = [int(np.count_nonzero(read(mapped[p.buffer].address + p.offset, p.length) != pattern(i, p.length))) for i, p in enumerate(places)]
    read_ms = (time.perf_counter() - started) * 1000
    # A daemon re-registering memory opens a handle it already holds (a new pool
    # version, a second engine rank naming the same block).
    first = places[0]
    again = memory.open_handle(handles[first.buffer])
    reopened = {
        "same_address": again.address == mapped[first.buffer].address,
        "differing": int(np.count_nonzero(read(again.address + first.offset, first.length) != pattern(0, first.length))),
    }
    again.close()
    for i, p in enumerate(places):
        data = pattern(DAEMON_SEED + i, p.length)
        copy(mapped[p.buffer].address + p.offset, data.ctypes.data, p.length, H2D)
    assert cudart.cudaDeviceSynchronize() == 0
    for m in mapped:
        m.close()
    conn.send(("checked", {"differing": differing, "reopened": reopened, "open_ms": open_ms, "read_ms": read_ms,
                           "bytes": sum(p.length for p in places)}))
