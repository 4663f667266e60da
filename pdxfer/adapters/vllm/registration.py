"""vLLM's KV cache as pdxfer regions (docs/engines.md §A2, A3, C4).

With the head-major layout the connector asks for (LBHNC), each attention layer's cache
is a view ``[blocks, kv_heads, block_size, 2 * head_dim]`` (K then V for each token) into
a storage that several layers may share. An MLA model's layer (DeepSeek, Kimi) holds one
latent row per token instead, ``[blocks, block_size, latent]`` (vLLM's CPU backend
puts a dimension of 1 after the blocks), the same on every TP rank: a region of kind
LATENT, registered as SGLang's MLA pools are. Either way a block of a layer is one
contiguous page, and a layer's blocks follow each other: a region of ``blocks`` pages.
Storages are registered once each, as buffers, however many layers they hold.

The daemon maps the engine's memory where it is. On CPU that memory must be shared:
each storage moves into POSIX shared memory in place, the very tensors the attention
layers hold now viewing the copy (E3). On GPU each storage's caching-allocator block is
exported by CUDA IPC (adapters/cuda.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ...core.errors import Unsupported
from ...core.protocol import Heads, KVPacking, KVRegion, KVSpec, MemoryHandle, PageOrder, RegionKind
from ...host.memory import KV_POOL_PREFIX, SharedMemory
from ..cuda import export_tensors


@dataclass(frozen=True)
class Layer:
    index: int
    cache: torch.Tensor  # [blocks, kv_heads, block_size, 2 * head_dim]; MLA: [blocks, (1,) block_size, latent]


@dataclass
class Registration:
    buffers: list[MemoryHandle]
    spec: KVSpec
    regions: list[KVRegion]
    device: str
    shared: list[SharedMemory]  # CPU: where the storages moved, kept open while the engine runs


def check_layer(layer: Layer, head_dim: int, mla: bool) -> None:
    """Refuse a cache the regions cannot describe, naming its shape and strides.
    ``head_dim``: an MLA model's is its latent's width."""
    t = layer.cache
    if mla:
        latent_rows = t.ndim in (3, 4) and (t.ndim == 3 or t.shape[1] == 1) and t.shape[-1] == head_dim
        if not latent_rows or t.stride()[0] != t[0].numel() or not t[0].is_contiguous():
            raise Unsupported(
                f"layer {layer.index}'s MLA cache has shape {tuple(t.shape)} and strides {t.stride()}: PdxferConnector moves "
                f"[blocks, block_size, latent {head_dim}] caches with contiguous blocks"
            )
        return
    _, h, n, c = t.shape if t.ndim == 4 else (0, 0, 0, 0)
    contiguous_blocks = t.ndim == 4 and t.stride() == (h * n * c, n * c, c, 1)
    if not contiguous_blocks or c != 2 * head_dim:
        raise Unsupported(
            f"layer {layer.index}'s KV cache has shape {tuple(t.shape)} and strides {t.stride()}: PdxferConnector moves "
            f"[blocks, kv_heads, block_size, 2 x head_dim {head_dim}] caches with contiguous blocks (the LBHNC layout)"
        )


def describe(layers: list[Layer], placements: list[tuple[int, int]], num_layers_total: int, total_kv_heads: int,
             mla: bool = False) -> tuple[KVSpec, list[KVRegion]]:
    """The spec and one region per layer (each passed check_layer); ``placements``
    gives each layer's buffer and the offset of its cache in that buffer."""
    first = layers[0].cache
    block_size, content = first.shape[-2:]
    dtype, layer_range = str(first.dtype).removeprefix("torch."), (layers[0].index, layers[-1].index + 1)
    if mla:  # one latent row per token, whole on every rank
        spec = KVSpec(page_size=block_size, dtype=dtype, num_layers_total=num_layers_total, layers=layer_range,
                      heads=Heads(local=1, total=1, bytes_per_token_head=content * first.element_size()),
                      page_order=PageOrder.TOKEN_MAJOR, kv_packing=KVPacking.SEPARATE, mla=True)
    else:
        spec = KVSpec(page_size=block_size, dtype=dtype, num_layers_total=num_layers_total, layers=layer_range,
                      heads=Heads(local=first.shape[1], total=total_kv_heads, bytes_per_token_head=content * first.element_size()),
                      page_order=PageOrder.HEAD_MAJOR, kv_packing=KVPacking.PACKED_PER_TOKEN, mla=False)
    regions = []
    for layer, (buffer, offset) in zip(layers, placements):
        t = layer.cache
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise Unsupported(f"layer {layer.index}'s KV cache is {t.dtype} {tuple(t.shape)}, layer {layers[0].index}'s {first.dtype} {tuple(first.shape)}: "
                              "PdxferConnector moves caches whose layers are alike")
        regions.append(KVRegion(buffer=buffer, offset=offset, page_bytes=t.stride(0) * t.element_size(), num_pages=t.shape[0],
                                layer=layer.index, kind=RegionKind.LATENT if mla else RegionKind.KV))
    return spec, regions


def into_shared_memory(layers: list[Layer], bound: Iterable[torch.Tensor] = ()) -> tuple[list[SharedMemory], list[tuple[int, int]]]:
    """Move each storage behind ``layers`` into shared memory: its bytes copied, then
    every layer's cache that views it re-pointed at the copy, same offset, shape and
    strides (E3), and so is each of ``bound`` that views a moved storage: the views the
    attention layers compute with, which vLLM makes from the caches it hands the
    connector and which are other tensor objects where a kernel wants another shape (MLA
    on CPU). The shared memory, and each layer's (buffer, offset) in it."""
    shared: list[SharedMemory] = []
    copies: list[torch.UntypedStorage] = []
    moved: dict[int, int] = {}  # old storage's address -> its buffer
    placements = []
    for layer in layers:
        t = layer.cache
        storage = t.untyped_storage()
        if storage.data_ptr() not in moved:
            shm = SharedMemory.create(storage.nbytes(), prefix=KV_POOL_PREFIX)
            copy = torch.frombuffer(shm.array, dtype=torch.uint8)
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            moved[storage.data_ptr()] = len(shared)
            shared.append(shm)
            copies.append(copy.untyped_storage())
        buffer = moved[storage.data_ptr()]
        placements.append((buffer, t.storage_offset() * t.element_size()))
        t.set_(copies[buffer], t.storage_offset(), t.size(), t.stride())
    for t in bound:
        buffer = moved.get(t.untyped_storage().data_ptr())
        if buffer is not None:
            t.set_(copies[buffer], t.storage_offset(), t.size(), t.stride())
    return shared, placements


def register(kv_caches: dict[str, torch.Tensor], layer_index, num_layers_total: int, total_kv_heads: int, head_dim: int,
             mla: bool = False, bound: Iterable[torch.Tensor] = ()) -> Registration:
    """Buffers, spec and regions for ``kv_caches`` (layer name -> cache), moving CPU
    storages into shared memory first, ``bound`` (the attention layers' own views of
    them) with them. ``layer_index`` maps a layer name to its index; ``mla``: the
    caches hold latent rows ``head_dim`` wide."""
    layers = sorted((Layer(layer_index(name), cache) for name, cache in kv_caches.items()), key=lambda layer: layer.index)
    for layer in layers:
        check_layer(layer, head_dim, mla)
    devices = {str(layer.cache.device) for layer in layers}
    if len(devices) > 1:
        raise Unsupported(f"KV caches on several devices ({sorted(devices)}): one device per engine rank")
    device = layers[0].cache.device
    shared: list[SharedMemory] = []
    if device.type == "cpu":
        shared, placements = into_shared_memory(layers, bound)
        buffers: list[MemoryHandle] = [shm.handle for shm in shared]
    elif device.type == "cuda":
        buffers, exported = export_tensors([layer.cache for layer in layers])
        placements = [(p.buffer, p.offset) for p in exported]
    else:
        raise Unsupported(f"KV cache on {device}: PdxferConnector registers CPU and CUDA memory")
    spec, regions = describe(layers, placements, num_layers_total, total_kv_heads, mla)
    return Registration(buffers=buffers, spec=spec, regions=regions, device=str(device), shared=shared)
