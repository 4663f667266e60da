"""SGLang's description of a rank's KV cache (``KVArgs``) as a pdxfer registration:
buffers, regions and the spec of their pages (docs/engines.md §A2, A3, B3). Pure: the caller
says where each pointer lies (``locate``).

SGLang lists one buffer per layer and kind, token-major (NHD: a page is page_size tokens
of [heads][head_dim]): for MHA the K buffers of its layers, then their V buffers; for MLA
one latent buffer per layer. ``item_len`` is one page of one buffer, and page p of the
cache is page p of every buffer, as for pdxfer's regions. Buffers that share memory the
daemon maps as one (SGLang allocates a layer's K and V as the two halves of one tensor:
on CPU one shared-memory file, on GPU one CUDA IPC block, which may hold several layers)
become one pdxfer buffer with a region at each offset.
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Sequence

from ...core.errors import Unsupported
from ...core.protocol import Heads, KVPacking, KVRegion, KVSpec, MemoryHandle, PageOrder, RegionKind, ShmHandle

# Where a pointer lies: the buffer the daemon maps and the pointer's offset in it.
Locate = Callable[[int], "tuple[MemoryHandle, int] | None"]


class Registration(NamedTuple):
    buffers: list[MemoryHandle]
    spec: KVSpec
    regions: list[KVRegion]


def registration(
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    *,
    page_size: int,
    dtype: str,
    first_layer: int,
    num_layers_total: int,
    heads_local: int,
    heads_total: int,
    mla: bool,
    locate: Locate,
) -> Registration:
    """The registration of the KV buffers at ``ptrs`` (``lens`` bytes each, pages of
    ``item_lens`` bytes), layers ``first_layer``.. of ``num_layers_total``. Buffers
    ``locate`` names alike are registered once, as long as the longest naming says."""
    if not (len(ptrs) == len(lens) == len(item_lens)) or not ptrs:
        raise ValueError(f"KV buffers: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} page sizes")
    per_layer = 1 if mla else 2
    if len(ptrs) % per_layer:
        raise ValueError(f"{len(ptrs)} KV buffers for MHA: expected a K and a V buffer per layer")
    num_layers = len(ptrs) // per_layer
    buffers: list[MemoryHandle] = []
    index: dict[Hashable, int] = {}
    regions = []
    for i, (ptr, nbytes, page_bytes) in enumerate(zip(ptrs, lens, item_lens)):
        place = locate(ptr)
        if place is None:
            raise Unsupported(
                f"KV buffer {i} at {ptr:#x} is not in memory the daemon can map: neither in shared memory (CPU pools) nor "
                "in CUDA memory pdxfer exported (GPU pools); the plugin's pool hooks cover SGLang's MHA and MLA pools "
                "allocated by torch, not quantized, post-capture (CUDA VMM) or other pools"
            )
        handle, offset = place
        if offset + nbytes > handle.size:
            raise ValueError(f"KV buffer {i}: {nbytes} bytes at offset {offset} run past the end of {_name(handle)} ({handle.size} bytes)")
        if nbytes % page_bytes:
            raise ValueError(f"KV buffer {i}: {nbytes} bytes are not a whole number of {page_bytes}-byte pages")
        key = _key(handle)
        if key not in index:
            index[key] = len(buffers)
            buffers.append(handle)
        elif handle.size > buffers[index[key]].size:
            buffers[index[key]] = handle
        if mla:
            kind, layer = RegionKind.LATENT, i
        else:
            kind, layer = (RegionKind.K, i) if i < num_layers else (RegionKind.V, i - num_layers)
        regions.append(KVRegion(
            buffer=index[key], offset=offset, page_bytes=page_bytes, num_pages=nbytes // page_bytes,
            layer=first_layer + layer, kind=kind,
        ))
    if len({r.num_pages for r in regions}) != 1:
        raise ValueError(f"KV buffers hold different numbers of pages: {sorted({r.num_pages for r in regions})}")
    token_bytes = item_lens[0] // page_size
    spec = KVSpec(
        page_size=page_size, dtype=dtype, num_layers_total=num_layers_total, layers=(first_layer, first_layer + num_layers),
        heads=Heads(local=heads_local, total=heads_total, bytes_per_token_head=token_bytes // heads_local),
        page_order=PageOrder.TOKEN_MAJOR, kv_packing=KVPacking.SEPARATE, mla=mla,
    )
    return Registration(buffers, spec, regions)


def _key(handle: MemoryHandle) -> Hashable:
    """What makes two namings of memory one buffer: a file's name; a device block's IPC
    handle on its device (the size may differ, each export reaching as far as the
    storages it exported)."""
    if isinstance(handle, ShmHandle):
        return ("shm", handle.name)
    return (type(handle).__name__, handle.device, handle.handle)


def _name(handle: MemoryHandle) -> str:
    if isinstance(handle, ShmHandle):
        return handle.name
    return f"the device {handle.device} block of IPC handle {handle.handle[:8].hex()}..."
