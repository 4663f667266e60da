"""SGLang's description of a rank's KV cache (``KVArgs``) as a pdxfer registration:
buffers, regions and the spec of their pages (ENGINES.md A2, A3, B3). Pure: the caller
says where each pointer lies (``locate``).

SGLang lists one buffer per layer and kind, token-major (NHD: a page is page_size tokens
of [heads][head_dim]): for MHA the K buffers of its layers, then their V buffers; for MLA
one latent buffer per layer. ``item_len`` is one page of one buffer, and page p of the
cache is page p of every buffer, as for pdxfer's regions. Buffers that share a file
(SGLang allocates a layer's K and V as the two halves of one tensor) become one pdxfer
buffer with a region at each offset.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from ...core.errors import Unsupported
from ...core.protocol import Heads, KVPacking, KVRegion, KVSpec, PageOrder, RegionKind, ShmHandle
from ..shm import Place


class Registration(NamedTuple):
    buffers: list[ShmHandle]
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
    locate: Callable[[int], Place | None],
) -> Registration:
    """The registration of the KV buffers at ``ptrs`` (``lens`` bytes each, pages of
    ``item_lens`` bytes), layers ``first_layer``.. of ``num_layers_total``."""
    if not (len(ptrs) == len(lens) == len(item_lens)) or not ptrs:
        raise ValueError(f"KV buffers: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} page sizes")
    per_layer = 1 if mla else 2
    if len(ptrs) % per_layer:
        raise ValueError(f"{len(ptrs)} KV buffers for MHA: expected a K and a V buffer per layer")
    num_layers = len(ptrs) // per_layer
    buffers: list[ShmHandle] = []
    index: dict[str, int] = {}
    regions = []
    for i, (ptr, nbytes, page_bytes) in enumerate(zip(ptrs, lens, item_lens)):
        place = locate(ptr)
        if place is None:
            raise Unsupported(
                f"KV buffer {i} at {ptr:#x} is not in shared memory: the daemon cannot map it (GPU memory needs CUDA IPC "
                "registration, not there yet; CPU KV moves into shared memory by the plugin's pool hook)"
            )
        if place.offset + nbytes > place.size:
            raise ValueError(f"KV buffer {i}: {nbytes} bytes at offset {place.offset} run past the end of {place.name} ({place.size} bytes)")
        if nbytes % page_bytes:
            raise ValueError(f"KV buffer {i}: {nbytes} bytes are not a whole number of {page_bytes}-byte pages")
        if place.name not in index:
            index[place.name] = len(buffers)
            buffers.append(ShmHandle(name=place.name, size=place.size))
        if mla:
            kind, layer = RegionKind.LATENT, i
        else:
            kind, layer = (RegionKind.K, i) if i < num_layers else (RegionKind.V, i - num_layers)
        regions.append(KVRegion(
            buffer=index[place.name], offset=place.offset, page_bytes=page_bytes, num_pages=nbytes // page_bytes,
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
