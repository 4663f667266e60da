"""Transfer arithmetic with literal addresses (in the style of vLLM's
test_mooncake_connector): every expected region, offset and block below is written out
by hand, so a change in the arithmetic shows up as a concrete wrong number."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.core import errors
from pdxfer.core.plan import (
    Region,
    canonical,
    check_capacity,
    check_memory_version,
    check_pages,
    check_positions,
    check_registration,
    check_source,
    chunk_pages,
    coalesce,
    compat_of,
    layout_regions,
    layout_registration,
    pages_for_tokens,
    pages_from_bytes,
    pages_to_bytes,
    plan_blocks,
    pool_bytes,
    region_addresses,
    region_bases,
)
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Heads,
    KVLayout,
    KVPacking,
    KVRegion,
    KVSpec,
    Layout,
    PageOrder,
    RegionKind,
)


def kv(layout: Layout, num_layers: int, num_pages: int, page_size: int, token_bytes: int) -> KVLayout:
    return KVLayout(
        layout=layout, num_layers=num_layers, num_pages=num_pages, page_size=page_size, token_bytes=token_bytes, dtype="bf16"
    )


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype="<i4")


def triples(blocks) -> list[tuple[int, int, int]]:
    return list(zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist()))


# --- layouts

# 2 layers, 4 pages of 16 tokens x 8 bytes: one layer's page is 128 bytes.
MHA = kv(Layout.MHA, num_layers=2, num_pages=4, page_size=16, token_bytes=8)
# 3 layers, 10 pages of 4 tokens x 576 bytes: 2304 bytes per layer page.
MLA = kv(Layout.MLA, num_layers=3, num_pages=10, page_size=4, token_bytes=576)
# 2 layers, 8 pages of 16 tokens x 8 bytes.
PAGE_FIRST = kv(Layout.PAGE_FIRST, num_layers=2, num_pages=8, page_size=16, token_bytes=8)
PAGE_FIRST_KV = kv(Layout.PAGE_FIRST_KV, num_layers=2, num_pages=8, page_size=16, token_bytes=8)


@pytest.mark.parametrize(
    ("layout", "regions", "total"),
    [
        # K0, V0, K1, V1, each 4 pages x 128 bytes.
        (MHA, [(0, 128), (512, 128), (1024, 128), (1536, 128)], 2048),
        # One latent buffer per layer, each 10 pages x 2304 bytes.
        (MLA, [(0, 2304), (23040, 2304), (46080, 2304)], 69120),
        # One buffer; a page holds 2 layers x (K, V) x 128 bytes.
        (PAGE_FIRST, [(0, 512)], 4096),
        # A K buffer then a V buffer; a page holds 2 layers x 128 bytes.
        (PAGE_FIRST_KV, [(0, 256), (2048, 256)], 4096),
    ],
    ids=lambda v: v.layout.value if isinstance(v, KVLayout) else None,
)
def test_layout_regions_and_pool_bytes(layout, regions, total):
    assert layout_regions(layout) == tuple(Region(o, p) for o, p in regions)
    assert pool_bytes(layout) == total


def test_region_bases():
    assert region_bases(0x1000, layout_regions(MHA)) == (0x1000, 0x1200, 0x1400, 0x1600)


K, V, KV, LATENT = RegionKind.K, RegionKind.V, RegionKind.KV, RegionKind.LATENT


@pytest.mark.parametrize(
    ("layout", "regions"),
    [
        # (offset, page_bytes, layer, kind): per-layer K and V, as layout_regions lays them.
        (MHA, [(0, 128, 0, K), (512, 128, 0, V), (1024, 128, 1, K), (1536, 128, 1, V)]),
        (MLA, [(0, 2304, 0, LATENT), (23040, 2304, 1, LATENT), (46080, 2304, 2, LATENT)]),
        # A region over every layer is named by layer 0.
        (PAGE_FIRST, [(0, 512, 0, KV)]),
        (PAGE_FIRST_KV, [(0, 256, 0, K), (2048, 256, 0, V)]),
    ],
    ids=lambda v: v.layout.value if isinstance(v, KVLayout) else None,
)
def test_a_pool_pdxfer_makes_is_one_buffer_and_its_regions(layout, regions):
    spec, got = layout_registration(layout)
    assert got == tuple(KVRegion(buffer=0, offset=o, page_bytes=b, num_pages=layout.num_pages, layer=l, kind=k) for o, b, l, k in regions)
    assert spec == KVSpec(
        page_size=layout.page_size, dtype="bf16", num_layers_total=layout.num_layers, layers=(0, layout.num_layers),
        heads=Heads(local=1, total=1, bytes_per_token_head=layout.token_bytes), mla=layout.layout is Layout.MLA,
    )
    check_registration([pool_bytes(layout)], spec, got)


def test_compat_of_names_the_spec_and_every_region_in_canonical_order():
    spec, regions = layout_registration(PAGE_FIRST_KV)
    compat = compat_of(spec, regions, aux_slot_bytes=4096)
    assert compat.version == PROTOCOL_VERSION
    assert compat.regions == ((0, K, 256), (0, V, 256))
    assert (compat.page_size, compat.num_layers_total, compat.dtype, compat.aux_slot_bytes) == (16, 2, "bf16", 4096)
    assert (compat.heads_total, compat.bytes_per_token_head, compat.mla) == (1, 8, False)
    assert (compat.page_order, compat.kv_packing) == (PageOrder.TOKEN_MAJOR, KVPacking.SEPARATE)


# --- engine-owned memory: real engines' shapes

# SGLang (MHATokenToKVPool, NHD): per layer a K tensor [tokens, heads, head_dim] and a V
# tensor, each its own buffer; KVArgs lists every K first, then every V. Here: 2 layers,
# 2 local heads of 8 total, head_dim 64 fp16 (128 bytes), page of 16 tokens: 4096 bytes.
SGL_SPEC = KVSpec(page_size=16, dtype="float16", num_layers_total=2, layers=(0, 2), heads=Heads(local=2, total=8, bytes_per_token_head=128))
SGL_PAGE = 16 * 2 * 128


def sglang_regions(order: str, num_pages: int = 10) -> tuple[KVRegion, ...]:
    """Buffers 0,1 are K0,K1 and 2,3 are V0,V1 ("k_first"), or K0,V0,K1,V1 ("interleaved")."""
    keys = [(0, K), (1, K), (0, V), (1, V)] if order == "k_first" else [(0, K), (0, V), (1, K), (1, V)]
    return tuple(KVRegion(buffer=i, offset=0, page_bytes=SGL_PAGE, num_pages=num_pages, layer=l, kind=k) for i, (l, k) in enumerate(keys))


# vLLM CPU (LBHNC): one storage [layers, blocks, kv_heads, block_size, 2 * head_dim]: K
# and V packed per token, head-major inside a block. 3 layers, 4 heads, block of 16,
# head_dim 32 float32 (128 bytes): a block of one layer is 4 x 16 x 2 x 128 = 16384 bytes.
VLLM_SPEC = KVSpec(
    page_size=16, dtype="float32", num_layers_total=3, layers=(0, 3), heads=Heads(local=4, total=4, bytes_per_token_head=128),
    page_order=PageOrder.HEAD_MAJOR, kv_packing=KVPacking.PACKED_PER_TOKEN,
)
VLLM_PAGE = 4 * 16 * 2 * 128


def vllm_regions(num_pages: int = 6) -> tuple[KVRegion, ...]:
    return tuple(KVRegion(buffer=0, offset=l * num_pages * VLLM_PAGE, page_bytes=VLLM_PAGE, num_pages=num_pages, layer=l, kind=KV) for l in range(3))


def test_regions_pair_up_by_layer_and_kind_whatever_order_the_engine_lists_them():
    k_first, interleaved = sglang_regions("k_first"), sglang_regions("interleaved")
    assert [(r.layer, r.kind) for r in canonical(k_first)] == [(0, K), (0, V), (1, K), (1, V)]
    assert [(r.layer, r.kind) for r in canonical(interleaved)] == [(0, K), (0, V), (1, K), (1, V)]
    assert compat_of(SGL_SPEC, k_first, 96) == compat_of(SGL_SPEC, interleaved, 96)
    # The buffers keep their own order: K-first buffer 2 is V0, interleaved buffer 2 is K1.
    assert [r.buffer for r in canonical(k_first)] == [0, 2, 1, 3]
    assert [r.buffer for r in canonical(interleaved)] == [0, 1, 2, 3]


def test_region_addresses_come_from_each_buffers_mapped_base():
    # SGLang: four buffers mapped wherever the daemon put them; canonical order K0 V0 K1 V1.
    sgl = canonical(sglang_regions("k_first"))
    assert region_addresses([0x10000, 0x20000, 0x30000, 0x40000], sgl) == (0x10000, 0x30000, 0x20000, 0x40000)
    # vLLM: one buffer, a layer every 6 x 16384 bytes.
    assert region_addresses([0x7000_0000], vllm_regions()) == (0x7000_0000, 0x7000_0000 + 98304, 0x7000_0000 + 196608)


def test_blocks_between_sglang_buffers_use_each_buffers_own_base():
    src = canonical(sglang_regions("k_first"))
    dst = canonical(sglang_regions("interleaved"))
    src_bases = region_addresses([0x10000, 0x80000, 0x40000, 0xC0000], src)  # K0 K1 V0 V1
    dst_bases = region_addresses([0x100000, 0x200000, 0x300000, 0x400000], dst)  # K0 V0 K1 V1
    blocks = plan_blocks(src, src_bases, dst_bases, pages(2, 3), pages(7, 8))
    assert triples(blocks) == [
        (0x10000 + 2 * 4096, 0x100000 + 7 * 4096, 8192),  # K0
        (0x40000 + 2 * 4096, 0x200000 + 7 * 4096, 8192),  # V0
        (0x80000 + 2 * 4096, 0x300000 + 7 * 4096, 8192),  # K1
        (0xC0000 + 2 * 4096, 0x400000 + 7 * 4096, 8192),  # V1
    ]


def test_blocks_between_vllm_layers_at_offsets_of_one_buffer():
    regions = vllm_regions()
    blocks = plan_blocks(regions, region_addresses([0x1000000], regions), region_addresses([0x9000000], regions), pages(5), pages(0))
    assert triples(blocks) == [(0x1000000 + l * 98304 + 5 * 16384, 0x9000000 + l * 98304, 16384) for l in range(3)]


def test_both_engines_shapes_are_valid_registrations():
    check_registration([10 * SGL_PAGE] * 4, SGL_SPEC, sglang_regions("k_first"))
    check_registration([3 * 6 * VLLM_PAGE], VLLM_SPEC, vllm_regions())


def region(**overrides) -> KVRegion:
    fields = dict(buffer=0, offset=0, page_bytes=100, num_pages=10, layer=0, kind=K)
    fields.update(overrides)
    return KVRegion(**fields)


@pytest.mark.parametrize(
    ("sizes", "layers", "regions", "error", "match"),
    [
        ([1000], (0, 1), [region(buffer=1)], errors.BadMessage, "names buffer 1, but 1 buffers"),
        ([999], (0, 1), [region()], errors.InsufficientCapacity, "ends at byte 1000 of buffer 0, which has 999"),
        ([2000], (0, 1), [region(), region(offset=1000, num_pages=9, kind=V)], errors.BadMessage, "same number of pages"),
        ([2000], (0, 1), [region(), region(offset=1000)], errors.BadMessage, "layer 0 k is registered twice"),
        ([2000], (0, 1), [region(), region(offset=999, kind=V)], errors.BadMessage, "overlap"),
        ([2000], (2, 4), [region(layer=1)], errors.BadMessage, "outside this rank's layers"),
        ([2000], (0, 5), [region()], errors.BadMessage, "not a range within the model's 4 layers"),
        ([2000], (1, 1), [region(layer=1)], errors.BadMessage, "not a range"),
    ],
)
def test_check_registration_refuses_what_the_daemon_could_not_use(sizes, layers, regions, error, match):
    spec = KVSpec(page_size=4, dtype="bf16", num_layers_total=4, layers=layers, heads=Heads(local=1, total=1, bytes_per_token_head=25))
    with pytest.raises(error, match=match):
        check_registration(sizes, spec, regions)


def test_check_registration_takes_regions_of_one_buffer_back_to_back_and_in_two_buffers_at_one_offset():
    spec = KVSpec(page_size=4, dtype="bf16", num_layers_total=1, layers=(0, 1), heads=Heads(local=1, total=1, bytes_per_token_head=25))
    check_registration([2000], spec, [region(), region(offset=1000, kind=V)])
    check_registration([1000, 1000], spec, [region(), region(buffer=1, kind=V)])


# --- positions: chunks and a prefix the decode holds


@pytest.mark.parametrize(
    ("first", "src", "skip", "kept", "dst"),
    [
        (0, [10, 11, 12], 0, [10, 11, 12], [50, 51, 52]),  # the whole room, no prefix
        (0, [10, 11, 12, 13, 14], 2, [12, 13, 14], [50, 51, 52]),  # the engine sends the prefix too: dropped
        (2, [12, 13, 14], 2, [12, 13, 14], [50, 51, 52]),  # it sends only what follows the prefix
        (0, [10, 11], 2, [], []),  # a chunk all inside the prefix writes nothing
        (1, [11, 12, 13], 2, [12, 13], [50, 51]),  # a chunk across the prefix's end
        (3, [13, 14], 2, [13, 14], [51, 52]),  # a later chunk
        (4, [14], 2, [14], [52]),  # the last position the decode wants
    ],
)
def test_chunk_pages_maps_position_j_to_destination_j_minus_skip(first, src, skip, kept, dst):
    got_kept, got_dst = chunk_pages(first, pages(*src), skip, pages(50, 51, 52), room=1)
    assert got_kept.tolist() == kept and got_dst.tolist() == dst


def test_chunk_pages_refuses_a_position_past_the_decodes_pages_naming_both():
    with pytest.raises(errors.InsufficientCapacity, match=r"positions up to 6 but the decode expects 5 \(2 skipped \+ 3 pages\)") as caught:
        chunk_pages(3, pages(13, 14, 15), 2, pages(50, 51, 52), room=9)
    assert caught.value.room == 9


@pytest.mark.parametrize(
    ("first", "end", "skip", "dst", "drafts", "last", "error", "match"),
    [
        (0, 5, 2, 3, 0, True, None, None),  # all positions, the prefix dropped
        (2, 5, 2, 3, 0, True, None, None),  # only those after the prefix
        (0, 3, 2, 3, 0, False, None, None),  # not the last chunk yet: the end is not checked
        (3, 5, 2, 3, 0, True, errors.BadMessage, r"starts at position 3, but the decode skips only 2: positions 2..2"),
        (3, 4, 2, 3, 0, False, errors.BadMessage, "starts at position 3"),  # found at the first chunk
        (0, 6, 2, 3, 0, True, errors.InsufficientCapacity, r"has 6 page positions but the decode expects 5 \(2 skipped \+ 3 pages\)"),
        (0, 4, 2, 3, 0, True, errors.BadMessage, r"has 4 page positions but the decode expects 5"),
        (0, 4, 2, 3, 8, True, None, None),  # room for draft tokens: the decode's pages may be more (C1 decides)
        (0, 6, 2, 3, 8, True, errors.InsufficientCapacity, "has 6 page positions"),
    ],
)
def test_check_positions(first, end, skip, dst, drafts, last, error, match):
    if error is None:
        check_positions(first, end, skip, dst, drafts, last, room=3)
        return
    with pytest.raises(error, match=match) as caught:
        check_positions(first, end, skip, dst, drafts, last, room=3)
    assert caught.value.room == 3


def test_chunks_planned_one_by_one_write_what_the_whole_room_would():
    """Four chunks of a room of 12 positions, the decode holding 3: the blocks of the
    chunks together copy exactly the pages one send of the whole room copies."""
    rng = np.random.default_rng(5)
    src = pages(*rng.permutation(40)[:12].tolist())
    dst = pages(*rng.permutation(40)[:9].tolist())
    regions = canonical(sglang_regions("interleaved", num_pages=40))
    bases = region_addresses([0, 1 << 30, 2 << 30, 3 << 30], regions)
    whole = plan_blocks(regions, bases, bases, *chunk_pages(0, src, 3, dst))
    parts = [plan_blocks(regions, bases, bases, *chunk_pages(at, src[at : at + 3], 3, dst)) for at in range(0, 12, 3)]
    per_byte = lambda blocks: sorted((s + i, d + i) for s, d, n in triples(blocks) for i in range(0, n, SGL_PAGE))  # noqa: E731
    assert per_byte(whole) == sorted(x for part in parts for x in per_byte(part))
    assert len(per_byte(whole)) == 9 * 4  # 9 pages written in each of the 4 regions


# --- coalesce


def runs_of(src, dst):
    r = coalesce(pages(*src), pages(*dst))
    return list(zip(r.src_start.tolist(), r.dst_start.tolist(), r.length.tolist()))


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([3, 4, 5], [10, 11, 12], [(3, 10, 3)]),  # contiguous on both sides: one run
        ([7], [0], [(7, 0, 1)]),
        ([3, 4, 6], [10, 11, 12], [(3, 10, 2), (6, 12, 1)]),  # break on the source side
        ([3, 4, 5], [10, 11, 13], [(3, 10, 2), (5, 13, 1)]),  # break on the destination side
        ([3, 4, 5, 6], [10, 11, 0, 1], [(3, 10, 2), (5, 0, 2)]),
        ([5, 4], [1, 2], [(5, 1, 1), (4, 2, 1)]),  # descending is not contiguous
        ([2, 2], [0, 1], [(2, 0, 1), (2, 1, 1)]),  # a repeated page is not contiguous
        ([0, 1, 9, 10, 11], [4, 5, 6, 7, 8], [(0, 4, 2), (9, 6, 3)]),
    ],
)
def test_coalesce(src, dst, expected):
    assert runs_of(src, dst) == expected


def test_coalesce_empty_and_mismatched():
    assert runs_of([], []) == []
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        coalesce(pages(1, 2, 3), pages(1, 2))


# --- plan_blocks with literal addresses


def test_plan_blocks_mha_literal():
    regions = layout_regions(MHA)
    src_bases = region_bases(0x1000, regions)  # 0x1000 0x1200 0x1400 0x1600
    dst_bases = region_bases(0x100000, regions)  # 0x100000 0x100200 0x100400 0x100600
    blocks = plan_blocks(regions, src_bases, dst_bases, pages(0, 1, 3), pages(2, 3, 0))
    # Runs: src 0..1 -> dst 2..3 (2 pages), src 3 -> dst 0 (1 page); per region, in order.
    assert triples(blocks) == [
        (0x1000, 0x100100, 256),  # K0
        (0x1180, 0x100000, 128),
        (0x1200, 0x100300, 256),  # V0
        (0x1380, 0x100200, 128),
        (0x1400, 0x100500, 256),  # K1
        (0x1580, 0x100400, 128),
        (0x1600, 0x100700, 256),  # V1
        (0x1780, 0x100600, 128),
    ]
    assert len(blocks) == 8
    assert blocks.nbytes == 3 * 4 * 128
    assert blocks.src.dtype == blocks.dst.dtype == blocks.length.dtype == np.uint64


def test_plan_blocks_page_first_literal():
    regions = layout_regions(PAGE_FIRST)  # one region of 512-byte pages
    blocks = plan_blocks(regions, [0x10000], [0x20000], pages(5, 6, 7, 1), pages(0, 1, 2, 3))
    assert triples(blocks) == [
        (0x10A00, 0x20000, 1536),  # pages 5..7 -> 0..2
        (0x10200, 0x20600, 512),  # page 1 -> 3
    ]


def test_plan_blocks_page_first_kv_literal():
    regions = layout_regions(PAGE_FIRST_KV)  # K at 0, V at 2048; 256-byte pages
    blocks = plan_blocks(regions, region_bases(0, regions), region_bases(0x8000, regions), pages(2, 3), pages(6, 7))
    assert triples(blocks) == [(512, 0x8000 + 1536, 512), (2048 + 512, 0x8000 + 2048 + 1536, 512)]


def test_plan_blocks_writes_only_the_first_destination_pages():
    # The destination may hold more pages than the prompt (room for draft tokens).
    regions = [Region(0, 100)]
    blocks = plan_blocks(regions, [0], [10_000], pages(0, 1), pages(4, 5, 6, 7))
    assert triples(blocks) == [(0, 10_400, 200)]


def test_plan_blocks_handles_addresses_above_2_to_63():
    # Device addresses are uint64; high addresses must not overflow or go negative.
    base = 0xFFFF_8000_0000_0000
    blocks = plan_blocks([Region(0, 4096)], [base], [base + 0x1000_0000], pages(1), pages(2))
    assert triples(blocks) == [(base + 4096, base + 0x1000_0000 + 8192, 4096)]


def test_million_contiguous_pages_plan_one_block_per_region():
    regions = layout_regions(kv(Layout.MHA, num_layers=3, num_pages=2_000_000, page_size=1, token_bytes=2))
    src = np.arange(1_000_000, dtype="<i4")
    dst = np.arange(500_000, 1_500_000, dtype="<i4")
    blocks = plan_blocks(regions, region_bases(0, regions), region_bases(1 << 40, regions), src, dst)
    assert len(blocks) == len(regions) == 6
    assert blocks.length.tolist() == [1_000_000 * 2] * 6


# --- checks before anything is planned


def test_check_pages_accepts_the_whole_pool():
    check_pages(pages(0, 7, 3), num_pages=8, what="source")


@pytest.mark.parametrize(
    ("values", "index", "position"),
    [
        ((0, 1, 8, 9), 8, 2),  # == num_pages: the off-by-one a clamp would hide
        ((-1,), -1, 0),
        ((3, 4, 5, 1_000_000), 1_000_000, 3),
        ((0, -5, 9), -5, 1),  # the first bad index is named
    ],
)
def test_check_pages_out_of_range_names_index_position_and_bound(values, index, position):
    arr = pages(*values)
    original = arr.copy()
    with pytest.raises(errors.PageOutOfRange) as info:
        check_pages(arr, num_pages=8, what="destination", room=77)
    message = str(info.value)
    assert f"page index {index} at position {position}" in message
    assert "0..7" in message  # the bound
    assert "destination" in message
    assert info.value.room == 77 and info.value.code is ErrorCode.PAGE_OUT_OF_RANGE
    # Never clamped: the caller's array is left as it was.
    np.testing.assert_array_equal(arr, original)


def test_check_pages_counts_every_bad_index():
    with pytest.raises(errors.PageOutOfRange, match=r"\(3 bad indices in all\)"):
        check_pages(pages(8, 0, -1, 100), num_pages=8, what="source")


def test_check_pages_refuses_an_empty_list():
    with pytest.raises(errors.PageOutOfRange, match="empty"):
        check_pages(pages(), num_pages=8, what="source")


def test_check_memory_version():
    check_memory_version(3, 3, "destination")
    with pytest.raises(errors.StaleMemoryVersion) as info:
        check_memory_version(2, 3, "destination", room=5)
    assert "memory version 2" in str(info.value) and "registered version is 3" in str(info.value)
    assert info.value.room == 5 and info.value.code is ErrorCode.STALE_MEMORY_VERSION
    # A version from the future is just as wrong as an old one.
    with pytest.raises(errors.StaleMemoryVersion):
        check_memory_version(4, 3, "source")


def test_check_capacity_counts_draft_tokens():
    # 4 pages x 16 tokens = 64 tokens: exactly prompt 60 + draft 4.
    check_capacity(60, 4, dst_pages=4, page_size=16)
    # Without draft tokens 60 would fit; with 5 drafts it is one token short (F4).
    check_capacity(60, 0, dst_pages=4, page_size=16)
    with pytest.raises(errors.InsufficientCapacity) as info:
        check_capacity(60, 5, dst_pages=4, page_size=16, room=9)
    message = str(info.value)
    assert "60 prompt + 5 draft = 65" in message
    assert "4 pages x 16 tokens = 64 tokens" in message
    assert info.value.room == 9 and info.value.code is ErrorCode.INSUFFICIENT_CAPACITY
    with pytest.raises(errors.InsufficientCapacity, match="61 prompt \\+ 4 draft = 65"):
        check_capacity(61, 4, dst_pages=4, page_size=16)


def test_check_source():
    assert pages_for_tokens(33, 16) == 3
    assert pages_for_tokens(32, 16) == 2
    check_source(33, 3, 16)
    for wrong in (2, 4):
        with pytest.raises(errors.InsufficientCapacity, match=f"33 tokens need 3 pages of 16 tokens, but send\\(\\) named {wrong}"):
            check_source(33, wrong, 16)


# --- page lists on the wire


def test_pages_bytes_round_trip():
    values = [0, 1, -1, 2**31 - 1, -(2**31), 12345]
    raw = pages_to_bytes(values)
    assert len(raw) == 4 * len(values)
    assert raw[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"  # little-endian int32
    assert pages_from_bytes(raw).tolist() == values
    assert pages_from_bytes(b"").size == 0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pages_from_odd_length_bytes_is_rejected(n):
    with pytest.raises(ValueError, match=f"{n} bytes is not a whole number"):
        pages_from_bytes(b"\x01" * n)


# --- properties

page_pairs = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 63), min_size=n, max_size=n),
        st.lists(st.integers(0, 63), min_size=n, max_size=n),
    )
)
region_lists = st.lists(st.integers(1, 4096), min_size=1, max_size=5).map(
    lambda sizes: [Region(offset=i * 64 * max(sizes), page_bytes=s) for i, s in enumerate(sizes)]
)


def naive_runs(src, dst) -> int:
    return 1 + sum(1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)


def expand(blocks, regions, src_bases, dst_bases) -> list[tuple[int, int, int]]:
    """Blocks back to (region, src page, dst page), in order."""
    out = []
    n_per_region = len(blocks) // len(regions)
    for b, (src, dst, length) in enumerate(triples(blocks)):
        r = b // n_per_region
        pb = regions[r].page_bytes
        assert length % pb == 0 and length > 0
        s0, rem_s = divmod(src - src_bases[r], pb)
        d0, rem_d = divmod(dst - dst_bases[r], pb)
        assert rem_s == rem_d == 0  # blocks start on page boundaries
        out.extend((r, s0 + k, d0 + k) for k in range(length // pb))
    return out


@settings(max_examples=200, deadline=None)
@given(pp=page_pairs, regions=region_lists, src_base=st.integers(0, 2**40), dst_base=st.integers(0, 2**40))
def test_plan_blocks_covers_exactly_each_page_pair(pp, regions, src_base, dst_base):
    src, dst = pp
    src_bases = region_bases(src_base, regions)
    dst_bases = region_bases(dst_base, regions)
    blocks = plan_blocks(regions, src_bases, dst_bases, pages(*src), pages(*dst))
    naive = [(r, s, d) for r in range(len(regions)) for s, d in zip(src, dst)]
    assert expand(blocks, regions, src_bases, dst_bases) == naive
    assert len(blocks) == naive_runs(src, dst) * len(regions)
    assert blocks.nbytes == len(src) * sum(r.page_bytes for r in regions)


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 500), s0=st.integers(0, 10_000), d0=st.integers(0, 10_000), regions=region_lists)
def test_contiguous_run_is_one_block_per_region(k, s0, d0, regions):
    src = np.arange(s0, s0 + k, dtype="<i4")
    dst = np.arange(d0, d0 + k, dtype="<i4")
    bases = region_bases(0, regions)
    blocks = plan_blocks(regions, bases, bases, src, dst)
    assert len(blocks) == len(regions)
    assert triples(blocks) == [
        (bases[r] + s0 * reg.page_bytes, bases[r] + d0 * reg.page_bytes, k * reg.page_bytes)
        for r, reg in enumerate(regions)
    ]


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 300).flatmap(lambda n: st.tuples(*[st.lists(st.integers(0, 400), min_size=n, max_size=n)] * 2)),
       regions=region_lists, cut=st.tuples(st.integers(0, 2000), st.integers(0, 2000)))
def test_block_lists_are_the_blocks_as_python_ints_whether_lengths_are_equal_or_not(pp, regions, cut):
    """The lists the pump hands the transfer engine: equal lengths are repeated rather
    than converted, which must not change a single value."""
    blocks = plan_blocks(regions, region_bases(0, regions), region_bases(1 << 40, regions), pages(*pp[0]), pages(*pp[1]))
    lengths = blocks.length.tolist()
    assert blocks.uniform == (lengths[0] if len(set(lengths)) == 1 else 0)
    start, end = sorted(min(c, len(blocks)) for c in cut)
    src, dst, length = blocks.lists(start, end)
    assert (src, dst, length) == (blocks.src[start:end].tolist(), blocks.dst[start:end].tolist(), lengths[start:end])
    assert all(type(v) is int for column in (src, dst, length) for v in column)
