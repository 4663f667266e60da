"""vLLM's KV cache as pdxfer regions (docs/engines.md §A2, A3, C4).

With the head-major layout the connector asks for (LBHNC), each attention layer's cache
is a view ``[blocks, kv_heads, block_size, 2 * head_dim]`` (K then V for each token) into
a storage that several layers may share. A block of a layer is one contiguous page, and
a layer's blocks follow each other: a region of ``blocks`` pages. Storages are
registered once each, as buffers, however many layers they hold.

The daemon maps the engine's memory where it is. On CPU that memory must be shared:
each storage moves into POSIX shared memory in place, the very tensors the attention
layers hold now viewing the copy (E3). On GPU each storage's caching-allocator block is
exported by CUDA IPC (adapters/cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.errors import Unsupported
from ...core.protocol import Heads, KVPacking, KVRegion, KVSpec, MemoryHandle, PageOrder, RegionKind
from ...host.memory import KV_POOL_PREFIX, SharedMemory
from ..cuda import export_tensors


@dataclass(frozen=True)
class Layer:
    index: int
    cache: torch.Tensor  # [blocks, kv_heads, block_size, 2 * head_dim]


@dataclass
class Registration:
    buffers: list[MemoryHandle]
    spec: KVSpec
    regions: list[KVRegion]
    device: str
    shared: list[SharedMemory]  # CPU: where the storages moved, kept open while the engine runs


def check_layer(layer: Layer, head_dim: int) -> None:
    """Refuse a cache the regions cannot describe, naming its shape and strides."""
    t = layer.cache
    _, h, n, c = t.shape if t.ndim == 4 else (0, 0, 0, 0)
    contiguous_blocks = t.ndim == 4 and t.stride() == (h * n * c, n * c, c, 1)
    if not contiguous_blocks or c != 2 * head_dim:
        raise Unsupported(
            f"layer {layer.index}'s KV cache has shape {tuple(t.shape)} and strides {t.stride()}: PdxferConnector moves "
            f"[blocks, kv_heads, block_size, 2 x head_dim {head_dim}] caches with contiguous blocks (the LBHNC layout)"
        )


def describe(layers: list[Layer], placements: list[tuple[int, int]], num_layers_total: int, total_kv_heads: int) -> tuple[KVSpec, list[KVRegion]]:
    """The spec and one KV region per layer (each passed check_layer); ``placements``
    gives each layer's buffer and the offset of its cache in that buffer."""
    first = layers[0].cache
    _, heads, block_size, content = first.shape
    spec = KVSpec(
        page_size=block_size, dtype=str(first.dtype).removeprefix("torch."), num_layers_total=num_layers_total,
        layers=(layers[0].index, layers[-1].index + 1),
        heads=Heads(local=heads, total=total_kv_heads, bytes_per_token_head=content * first.element_size()),
        page_order=PageOrder.HEAD_MAJOR, kv_packing=KVPacking.PACKED_PER_TOKEN, mla=False,
    )
    regions = []
    for layer, (buffer, offset) in zip(layers, placements):
        t = layer.cache
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise Unsupported(f"layer {layer.index}'s KV cache is {t.dtype} {tuple(t.shape)}, layer {layers[0].index}'s {first.dtype} {tuple(first.shape)}: "
                              "PdxferConnector moves caches whose layers are alike")
        regions.append(KVRegion(buffer=buffer, offset=offset, page_bytes=t.stride(0) * t.element_size(), num_pages=t.shape[0],
                                layer=layer.index, kind=RegionKind.KV))
    return spec, regions


def into_shared_memory(layers: list[Layer]) -> tuple[list[SharedMemory], list[tuple[int, int]]]:
    """Move each storage behind ``layers`` into shared memory: its bytes copied, then
    every layer's cache that views it re-pointed at the copy, same offset, shape and
    strides (E3). The shared memory, and each layer's (buffer, offset) in it."""
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
    return shared, placements


def register(kv_caches: dict[str, torch.Tensor], layer_index, num_layers_total: int, total_kv_heads: int, head_dim: int) -> Registration:
    """Buffers, spec and regions for ``kv_caches`` (layer name -> cache), moving CPU
    storages into shared memory first. ``layer_index`` maps a layer name to its index."""
    layers = sorted((Layer(layer_index(name), cache) for name, cache in kv_caches.items()), key=lambda layer: layer.index)
    for layer in layers:
        check_layer(layer, head_dim)
    devices = {str(layer.cache.device) for layer in layers}
    if len(devices) > 1:
        raise Unsupported(f"KV caches on several devices ({sorted(devices)}): one device per engine rank")
    device = layers[0].cache.device
    shared: list[SharedMemory] = []
    if device.type == "cpu":
        shared, placements = into_shared_memory(layers)
        buffers: list[MemoryHandle] = [shm.handle for shm in shared]
    elif device.type == "cuda":
        buffers, exported = export_tensors([layer.cache for layer in layers])
        placements = [(p.buffer, p.offset) for p in exported]
    else:
        raise Unsupported(f"KV cache on {device}: PdxferConnector registers CPU and CUDA memory")
    spec, regions = describe(layers, placements, num_layers_total, total_kv_heads)
    return Registration(buffers=buffers, spec=spec, regions=regions, device=str(device), shared=shared)
