"""Transfer arithmetic: registrations, bounds, versions, capacity, positions, and page
indices -> coalesced (src, dst, len) blocks. Pure functions over numpy arrays; no
per-page Python loops, so a million pages plan in milliseconds.

An engine's KV cache is a list of *regions* in the buffers it registered, each an
array of ``num_pages`` pages of ``page_bytes`` holding one (layer, kind). Both sides
order their regions by (layer, kind) (``canonical``), so with equal compat region i
of the prefill pairs with region i of the decode whatever order each engine listed
them in. A run of pages that is contiguous on both sides becomes one block per region.
Between ranks of different TP a leg moves a slice of each page's heads (``plan_leg_blocks``).
A pool pdxfer creates (``KVLayout``) is one buffer whose regions ``layout_registration`` names.

Page *positions* count a room's pages from 0; the decode may hold a prefix and skip
it: source position j goes to destination page ``pages[j - skip]`` (``chunk_pages``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import BadMessage, InsufficientCapacity, PageOutOfRange, StaleMemoryVersion, Unsupported
from .protocol import PROTOCOL_VERSION, Compat, Heads, KVLayout, KVRegion, KVSpec, Layout, PageOrder, RegionKind
from .staging import StagedLayout, slice_bytes

PAGE_DTYPE = np.dtype("<i4")
SMALL = 16  # page lists up to this long take plain-Python paths: numpy's per-call cost dominates there


@dataclass(frozen=True)
class Region:
    offset: int  # bytes from the start of the pool
    page_bytes: int


def layout_regions(layout: KVLayout) -> tuple[Region, ...]:
    """The buffers of a pool, in the order blocks are planned."""
    n, per_layer = layout.num_pages, layout.page_size * layout.token_bytes
    if layout.layout is Layout.MHA:  # K0 V0 K1 V1 ...
        return tuple(Region(i * n * per_layer, per_layer) for i in range(2 * layout.num_layers))
    if layout.layout is Layout.MLA:  # one latent buffer per layer
        return tuple(Region(i * n * per_layer, per_layer) for i in range(layout.num_layers))
    if layout.layout is Layout.PAGE_FIRST:  # [page][layer][K|V][token]
        return (Region(0, 2 * layout.num_layers * per_layer),)
    if layout.layout is Layout.PAGE_FIRST_KV:  # K: [page][layer][token], then V alike
        page = layout.num_layers * per_layer
        return (Region(0, page), Region(n * page, page))
    raise ValueError(f"unknown layout {layout.layout!r}")


def pool_bytes(layout: KVLayout) -> int:
    regions = layout_regions(layout)
    return len(regions) * layout.num_pages * regions[0].page_bytes


_LAYOUT_KINDS = {
    Layout.MHA: (RegionKind.K, RegionKind.V),  # per layer
    Layout.MLA: (RegionKind.LATENT,),  # per layer
    Layout.PAGE_FIRST: (RegionKind.KV,),  # one region for every layer, named by layer 0
    Layout.PAGE_FIRST_KV: (RegionKind.K, RegionKind.V),  # likewise
}


def layout_registration(layout: KVLayout) -> tuple[KVSpec, tuple[KVRegion, ...]]:
    """A pool pdxfer created (one buffer, index 0) as the spec and regions it is registered with."""
    per_layer = layout.layout in (Layout.MHA, Layout.MLA)
    kinds = _LAYOUT_KINDS[layout.layout]
    regions = tuple(
        KVRegion(buffer=0, offset=r.offset, page_bytes=r.page_bytes, num_pages=layout.num_pages,
                 layer=i // len(kinds) if per_layer else 0, kind=kinds[i % len(kinds)])
        for i, r in enumerate(layout_regions(layout))
    )
    spec = KVSpec(
        page_size=layout.page_size, dtype=layout.dtype, num_layers_total=layout.num_layers, layers=(0, layout.num_layers),
        heads=Heads(local=1, total=1, bytes_per_token_head=layout.token_bytes), mla=layout.layout is Layout.MLA,
    )
    return spec, regions


_KIND_ORDER = {kind: i for i, kind in enumerate(RegionKind)}


def canonical(regions: Sequence[KVRegion]) -> tuple[KVRegion, ...]:
    """Regions in the order both sides plan in: by layer, then kind (K, V, KV, latent, draft, state)."""
    return tuple(sorted(regions, key=lambda r: (r.layer, _KIND_ORDER[r.kind])))


def check_registration(buffer_sizes: Sequence[int], spec: KVSpec, regions: Sequence[KVRegion]) -> None:
    """What a daemon needs of a registration before it maps anything: each region
    inside its buffer, no two overlapping, one page count for all, each (layer, kind)
    once and inside the rank's layers."""
    start, end = spec.layers
    if not start < end <= spec.num_layers_total:
        raise BadMessage(f"layers [{start}, {end}) are not a range within the model's {spec.num_layers_total} layers")
    if len({r.num_pages for r in regions}) > 1:
        raise BadMessage(f"every region must have the same number of pages (a page index names a page of each): got {sorted({r.num_pages for r in regions})}")
    seen: set[tuple[int, RegionKind]] = set()
    for i, r in enumerate(regions):
        if r.buffer >= len(buffer_sizes):
            raise BadMessage(f"region {i} names buffer {r.buffer}, but {len(buffer_sizes)} buffers were registered")
        if r.offset + r.num_pages * r.page_bytes > buffer_sizes[r.buffer]:
            raise InsufficientCapacity(
                f"region {i} (layer {r.layer} {r.kind.value}) ends at byte {r.offset + r.num_pages * r.page_bytes} "
                f"of buffer {r.buffer}, which has {buffer_sizes[r.buffer]}"
            )
        if not start <= r.layer < end:
            raise BadMessage(f"region {i} holds layer {r.layer}, outside this rank's layers [{start}, {end})")
        if (r.layer, r.kind) in seen:
            raise BadMessage(f"region {i}: layer {r.layer} {r.kind.value} is registered twice")
        seen.add((r.layer, r.kind))
    spans = sorted((r.buffer, r.offset, r.offset + r.num_pages * r.page_bytes) for r in regions)
    for (buffer, _, ends), (other, begins, _) in zip(spans, spans[1:]):
        if buffer == other and begins < ends:
            raise BadMessage(f"two regions of buffer {buffer} overlap (one ends at byte {ends}, the next begins at {begins})")


def region_addresses(buffer_bases: Sequence[int], regions: Sequence[KVRegion]) -> tuple[int, ...]:
    """Where each region starts in this process: its buffer's mapped address plus its offset."""
    return tuple(buffer_bases[r.buffer] + r.offset for r in regions)


def compat_of(spec: KVSpec, regions: Sequence[KVRegion], aux_slot_bytes: int) -> Compat:
    return Compat(
        version=PROTOCOL_VERSION,
        dtype=spec.dtype,
        page_size=spec.page_size,
        heads_total=spec.heads.total,
        bytes_per_token_head=spec.heads.bytes_per_token_head,
        page_order=spec.page_order,
        kv_packing=spec.kv_packing,
        mla=spec.mla,
        num_layers_total=spec.num_layers_total,
        regions=tuple((r.layer, r.kind, r.page_bytes) for r in canonical(regions)),
        aux_slot_bytes=aux_slot_bytes,
    )


def pages_from_bytes(raw: bytes) -> np.ndarray:
    if len(raw) % PAGE_DTYPE.itemsize:
        raise ValueError(f"page list of {len(raw)} bytes is not a whole number of int32 values")
    return np.frombuffer(raw, dtype=PAGE_DTYPE)


def pages_to_bytes(pages) -> bytes:
    return np.ascontiguousarray(pages, dtype=PAGE_DTYPE).tobytes()


def check_pages(pages: np.ndarray, num_pages: int, what: str, room: int = 0) -> None:
    """C2: every index must name a page of the registered pool. Never clamps."""
    if pages.size == 0:
        raise PageOutOfRange(f"{what} page list is empty", room=room)
    if pages.size <= SMALL:
        values = pages.tolist()
        if 0 <= min(values) and max(values) < num_pages:
            return  # the common small room, without numpy's per-call overhead
    bad = np.flatnonzero((pages < 0) | (pages >= num_pages))
    if bad.size:
        at = int(bad[0])
        raise PageOutOfRange(
            f"{what} page index {int(pages[at])} at position {at} is out of range: "
            f"the pool has pages 0..{num_pages - 1} ({bad.size} bad indices in all)",
            room=room,
        )


def check_memory_version(used: int, current: int, what: str, room: int = 0) -> None:
    """C3: an operation computed against an older registration must not run."""
    if used != current:
        raise StaleMemoryVersion(
            f"{what} page indices were computed against memory version {used}, "
            f"but the registered version is {current}",
            room=room,
        )


def pages_for_tokens(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def check_source(num_tokens: int, src_pages: int, page_size: int, room: int = 0) -> None:
    """The prefill's page positions (its last chunk's end) must hold exactly its tokens."""
    need = pages_for_tokens(num_tokens, page_size)
    if src_pages != need:
        raise InsufficientCapacity(
            f"{num_tokens} tokens need {need} pages of {page_size} tokens, but send() named {src_pages} page positions",
            room=room,
        )


def chunk_pages(first_page: int, src: np.ndarray, skip: int, dst: np.ndarray, room: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A chunk of source pages for positions [first_page, first_page + len(src)) against
    the decode's ``dst`` pages for positions [skip, skip + len(dst)): the source pages
    kept (positions below ``skip`` are dropped) and the destination page of each."""
    drop = min(max(skip - first_page, 0), src.size)
    at = first_page + drop - skip
    kept = src[drop:]
    if at + kept.size > dst.size:
        raise InsufficientCapacity(
            f"the prefill sent positions up to {first_page + src.size} but the decode expects {skip + dst.size} "
            f"({skip} skipped + {dst.size} pages)",
            room=room,
        )
    return kept, dst[at : at + kept.size]


def check_positions(first: int, end: int, skip: int, dst_pages: int, num_draft_tokens: int, last: bool, room: int = 0) -> None:
    """The prefill's chunks cover positions [first, end), the last of them in when
    ``last``; the decode wants [skip, skip + dst_pages). Every wanted position must
    come, and, once the last chunk is in, no more, unless the decode made room for
    draft tokens (its pages may then outnumber the positions)."""
    want = skip + dst_pages
    if first > skip:
        raise BadMessage(f"the prefill's first chunk starts at position {first}, but the decode skips only {skip}: positions {skip}..{first - 1} would never be written", room=room)
    if not last:
        return
    if end > want or (end < want and not num_draft_tokens):
        raise (InsufficientCapacity if end > want else BadMessage)(
            f"the prefill's room has {end} page positions but the decode expects {want} ({skip} skipped + {dst_pages} pages)",
            room=room,
        )


def check_capacity(num_tokens: int, num_draft_tokens: int, dst_pages: int, page_size: int, room: int = 0) -> None:
    """C1: the destination holds the prompt plus the speculative draft tokens."""
    need_tokens = num_tokens + num_draft_tokens
    have = dst_pages * page_size
    if have < need_tokens:
        raise InsufficientCapacity(
            f"destination too small: {dst_pages} pages x {page_size} tokens = {have} tokens, "
            f"but the room needs {num_tokens} prompt + {num_draft_tokens} draft = {need_tokens}",
            room=room,
        )


@dataclass(frozen=True)
class Runs:
    """Runs of pages contiguous on both sides: src_start[i].. and dst_start[i].. for length[i] pages."""

    src_start: np.ndarray
    dst_start: np.ndarray
    length: np.ndarray


def coalesce(src_pages: np.ndarray, dst_pages: np.ndarray) -> Runs:
    if src_pages.shape != dst_pages.shape:
        raise ValueError(f"{src_pages.size} source pages but {dst_pages.size} destination pages")
    if 0 < src_pages.size <= SMALL:
        return Runs(*(np.array(column, np.int64) for column in _runs_small(src_pages.tolist(), dst_pages.tolist())))
    src = src_pages.astype(np.int64, copy=False)
    dst = dst_pages.astype(np.int64, copy=False)
    if src.size == 0:
        empty = np.zeros(0, np.int64)
        return Runs(empty, empty, empty)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return Runs(src[starts], dst[starts], ends - starts)


def _runs_small(src: list[int], dst: list[int]) -> tuple[list[int], list[int], list[int]]:
    """coalesce() for a handful of pages, as (src starts, dst starts, lengths) lists:
    plain Python is several times faster than numpy at this size (the
    control-plane-bound case)."""
    starts = [0] + [i for i in range(1, len(src)) if src[i] - src[i - 1] != 1 or dst[i] - dst[i - 1] != 1]
    ends = starts[1:] + [len(src)]
    return [src[i] for i in starts], [dst[i] for i in starts], [e - s for s, e in zip(starts, ends)]


@dataclass(frozen=True)
class Blocks:
    """Byte ranges to write: src[i] -> dst[i], length[i] bytes (uint64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    nbytes: int
    uniform: int = 0  # the length of every block when they are all equal (scattered pages), else 0

    @classmethod
    def of(cls, src, dst, length) -> "Blocks":
        length = np.asarray(length, np.uint64)
        return cls(np.asarray(src, np.uint64), np.asarray(dst, np.uint64), length, int(length.sum()), _uniform(length))

    def __len__(self) -> int:
        return int(self.src.size)

    def lists(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """Blocks start..end as the Python lists the transfer engine is called with;
        equal lengths are repeated, not converted (a third of the cost)."""
        length = [self.uniform] * (end - start) if self.uniform else self.length[start:end].tolist()
        return self.src[start:end].tolist(), self.dst[start:end].tolist(), length


def _uniform(length: np.ndarray) -> int:
    return int(length[0]) if length.size and bool((length == length[0]).all()) else 0


def plan_blocks(
    regions: Sequence[Region],
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
) -> Blocks:
    """Blocks that copy src_pages[i] to dst_pages[i] in every region.

    ``src_bases``/``dst_bases`` are the addresses of each region on either side;
    only the first ``len(src_pages)`` destination pages are written."""
    if dst_pages.size < src_pages.size:
        raise InsufficientCapacity(f"{src_pages.size} source pages but only {dst_pages.size} destination pages")
    if 0 < src_pages.size <= SMALL:
        starts, dst_starts, lengths = _runs_small(src_pages.tolist(), dst_pages[: src_pages.size].tolist())
        per_region = [(sb, db, r.page_bytes) for sb, db, r in zip(src_bases, dst_bases, regions)]
        length = np.array([n * pb for _, _, pb in per_region for n in lengths], np.uint64)
        return Blocks(
            np.array([sb + s * pb for sb, _, pb in per_region for s in starts], np.uint64),
            np.array([db + d * pb for _, db, pb in per_region for d in dst_starts], np.uint64),
            length,
            sum(lengths) * sum(pb for _, _, pb in per_region),
            _uniform(length),
        )
    runs = coalesce(src_pages, dst_pages[: src_pages.size])
    page_bytes = np.array([r.page_bytes for r in regions], dtype=np.uint64)[:, None]
    src_base = np.asarray(src_bases, dtype=np.uint64)[:, None]
    dst_base = np.asarray(dst_bases, dtype=np.uint64)[:, None]
    length = np.broadcast_to(runs.length.astype(np.uint64) * page_bytes, (len(regions), runs.length.size)).ravel()
    return Blocks(
        src=(src_base + runs.src_start.astype(np.uint64) * page_bytes).ravel(),
        dst=(dst_base + runs.dst_start.astype(np.uint64) * page_bytes).ravel(),
        length=length,
        nbytes=int(length.sum()),
        uniform=_uniform(length),
    )


def region_bases(base: int, regions: Sequence[Region]) -> tuple[int, ...]:
    return tuple(base + r.offset for r in regions)


def region_views(pool: np.ndarray, regions: Sequence[Region], num_pages: int) -> list[np.ndarray]:
    """A pool's bytes as one [num_pages, page_bytes] array per region, in layout order."""
    return [pool[r.offset : r.offset + num_pages * r.page_bytes].reshape(num_pages, r.page_bytes) for r in regions]


# --- one leg of a room between ranks whose TP sizes may differ (docs/engines.md §A6)


def _region_name(r: KVRegion) -> str:
    return f"layer {r.layer} {r.kind.value}"


def leg_region_pairs(
    src_regions: Sequence[KVRegion], dst_regions: Sequence[KVRegion], layers: tuple[int, int]
) -> tuple[tuple[int, int], ...]:
    """(source index, destination index) of every region of layers [start, end) held
    on both sides, in canonical order. Regions outside the layers are left alone (a
    PP-1 decode holds every stage's layers); a (layer, kind) only one side holds in
    them is Unsupported, since its bytes would either be lost or never written."""
    return _region_pairs(tuple(src_regions), tuple(dst_regions), tuple(layers))


# A staged leg is paired three times on its way (its layout, its blocks, its copy), each
# ~14 us for 8 layers of K and V against ~1 us to hash the regions: 14% of a 4:2 prefill
# loop's samples. Registrations are few, so the pairings seen are too.
@functools.lru_cache(maxsize=256)
def _region_pairs(src_regions: tuple[KVRegion, ...], dst_regions: tuple[KVRegion, ...], layers: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    start, end = layers
    src = {(r.layer, r.kind): i for i, r in enumerate(src_regions) if start <= r.layer < end}
    dst = {(r.layer, r.kind): i for i, r in enumerate(dst_regions) if start <= r.layer < end}
    keys = sorted(src.keys() | dst.keys(), key=lambda key: (key[0], _KIND_ORDER[key[1]]))
    lacking = [
        f"{side} lacks layer {layer} {kind.value}"
        for layer, kind in keys
        for side, held in (("prefill", src), ("decode", dst))
        if (layer, kind) not in held
    ]
    if lacking:
        raise Unsupported(f"layers [{start}, {end}) of the leg: " + ", ".join(lacking))
    return tuple((src[key], dst[key]) for key in keys)


def _head_unit(r: KVRegion, page_size: int, heads: int, side: str) -> int:
    """Bytes of one head for one token in a page of ``r`` (K and V together in a packed region)."""
    unit, rest = divmod(r.page_bytes, page_size * heads)
    if rest or not unit:
        raise Unsupported(
            f"{_region_name(r)} on the {side}: a page of {r.page_bytes} bytes is not {page_size} tokens x {heads} heads "
            "of a whole number of bytes"
        )
    return unit


def plan_leg_blocks(
    src_regions: Sequence[KVRegion],
    src_bases: Sequence[int],
    src_heads: int,
    dst_regions: Sequence[KVRegion],
    dst_bases: Sequence[int],
    dst_heads: int,
    page_size: int,
    page_order: PageOrder,
    src_head_start: int,
    head_count: int,
    dst_head_start: int,
    layers: tuple[int, int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
) -> Blocks:
    """Blocks of one leg (topology.Leg): heads [src_head_start, +head_count) of the
    source's pages src_pages[i] into heads [dst_head_start, +head_count) of the
    destination's pages dst_pages[i], in every region pair of ``layers``.

    ``src_regions``/``dst_regions`` are canonical() registrations with their region
    addresses ``*_bases``; ``*_heads`` the KV heads each rank holds. A head_major page
    ([head][token][unit]) gives one block per (region, page); a token_major one
    ([token][head][unit]) one per (region, page, token). A leg that moves whole pages
    (every head of both ranks) is plan_blocks': runs of pages coalesced. A dummy leg
    (head_count 0) has no blocks."""
    if dst_pages.size < src_pages.size:
        raise InsufficientCapacity(f"{src_pages.size} source pages but only {dst_pages.size} destination pages")
    for side, start, heads in (("prefill", src_head_start, src_heads), ("decode", dst_head_start, dst_heads)):
        if start < 0 or head_count < 0 or start + head_count > heads:
            raise BadMessage(f"heads [{start}, {start + head_count}) are outside the {side} rank's {heads} heads")
    pairs = leg_region_pairs(src_regions, dst_regions, layers)
    if head_count == 0 or not pairs:
        return Blocks.of([], [], [])
    src = [src_regions[i] for i, _ in pairs]
    dst = [dst_regions[j] for _, j in pairs]
    src_base = [src_bases[i] for i, _ in pairs]
    dst_base = [dst_bases[j] for _, j in pairs]
    if head_count == src_heads == dst_heads:
        for s, d in zip(src, dst):
            if s.page_bytes != d.page_bytes:
                raise Unsupported(f"{_region_name(s)}: pages of {s.page_bytes} bytes on the prefill but {d.page_bytes} on the decode")
        return plan_blocks(src, src_base, dst_base, src_pages, dst_pages)
    unit = []
    for s, d in zip(src, dst):
        su, du = _head_unit(s, page_size, src_heads, "prefill"), _head_unit(d, page_size, dst_heads, "decode")
        if su != du:
            raise Unsupported(f"{_region_name(s)}: one token of one head is {su} bytes on the prefill but {du} on the decode")
        unit.append(su)

    # Axes: region pair, page, token. A head_major slice is one span per page (a token
    # axis of one); a token_major one is a span per token, rows of heads x unit bytes.
    u = np.array(unit, np.uint64)[:, None, None]
    head_major = page_order is PageOrder.HEAD_MAJOR
    head_stride = u * np.uint64(page_size) if head_major else u
    t = np.arange(1 if head_major else page_size, dtype=np.uint64)[None, None, :]

    def starts(regions, bases, pages, heads, head_start):
        page_bytes = np.array([r.page_bytes for r in regions], np.uint64)[:, None, None]
        base = np.asarray(bases, np.uint64)[:, None, None]
        return (base + pages.astype(np.uint64)[None, :, None] * page_bytes + t * u * np.uint64(heads)
                + np.uint64(head_start) * head_stride).ravel()

    src_at = starts(src, src_base, src_pages, src_heads, src_head_start)
    dst_at = starts(dst, dst_base, dst_pages[: src_pages.size], dst_heads, dst_head_start)
    length = np.broadcast_to(np.uint64(head_count) * head_stride, (len(pairs), src_pages.size, t.size)).ravel()
    return Blocks.of(src_at, dst_at, length)


def staged_layout(src_regions: Sequence[KVRegion], dst_regions: Sequence[KVRegion], dst_heads: int, head_count: int,
                  layers: tuple[int, int], positions: int) -> StagedLayout:
    """Where a staged leg (core/staging.py) of ``positions`` page positions lies in its
    extent: a slice of ``head_count`` of the decode rank's ``dst_heads`` heads per page
    of each region pair of ``layers``."""
    pairs = leg_region_pairs(src_regions, dst_regions, layers)
    return StagedLayout(slice_bytes([dst_regions[j].page_bytes for _, j in pairs], dst_heads, head_count), positions)


def plan_staged_blocks(
    src_regions: Sequence[KVRegion],
    src_bases: Sequence[int],
    src_heads: int,
    dst_regions: Sequence[KVRegion],
    dst_heads: int,
    page_size: int,
    page_order: PageOrder,
    src_head_start: int,
    head_count: int,
    layers: tuple[int, int],
    src_pages: np.ndarray,
    positions: np.ndarray,
    staged_at: int,
    layout: StagedLayout,
) -> Blocks:
    """plan_leg_blocks into a staging extent at ``staged_at`` instead of the decode's
    pages: position p of region pair k goes to ``staged_at + layout.offsets[k] + p *
    slice``, a page of ``head_count`` heads, so source runs of whole pages stay runs."""
    if positions.size and int(positions.max()) >= layout.positions:
        raise BadMessage(f"position {int(positions.max())} is outside the staged leg's {layout.positions}")
    staged, bases = staged_regions(src_regions, dst_regions, layers, layout, staged_at)
    return plan_leg_blocks(src_regions, src_bases, src_heads, staged, bases, head_count, page_size, page_order,
                           src_head_start, head_count, 0, layers, src_pages, positions)


def plan_from_staging(
    src_regions: Sequence[KVRegion],
    dst_regions: Sequence[KVRegion],
    dst_bases: Sequence[int],
    dst_heads: int,
    page_size: int,
    page_order: PageOrder,
    head_count: int,
    dst_head_start: int,
    layers: tuple[int, int],
    dst_pages: np.ndarray,
    staged_at: int,
    layout: StagedLayout,
) -> Blocks:
    """plan_leg_blocks from a chunk gathered into a staging extent at ``staged_at`` (the
    prefill side of core/staging.py): its position p of region pair k, a page of
    ``head_count`` heads, goes to ``dst_pages[p]``, so runs of destination pages are
    one block each."""
    staged, bases = staged_regions(src_regions, dst_regions, layers, layout, staged_at)
    return plan_leg_blocks(staged, bases, head_count, dst_regions, dst_bases, dst_heads, page_size, page_order,
                           0, head_count, dst_head_start, layers, np.arange(layout.positions), dst_pages)


def staged_regions(src_regions: Sequence[KVRegion], dst_regions: Sequence[KVRegion], layers: tuple[int, int],
                   layout: StagedLayout, at: int) -> tuple[tuple[KVRegion, ...], tuple[int, ...]]:
    """A staging extent at ``at`` as a pool the planner reads: a region of
    ``layout.positions`` pages of one slice per region pair of ``layers``, and their addresses."""
    pairs = leg_region_pairs(src_regions, dst_regions, layers)
    staged = tuple(KVRegion(buffer=0, offset=0, page_bytes=size, num_pages=layout.positions, layer=dst_regions[j].layer, kind=dst_regions[j].kind)
                   for (_, j), size in zip(pairs, layout.slice_bytes))
    return staged, tuple(at + offset for offset in layout.offsets)
