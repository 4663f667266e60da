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
    check_capacity,
    check_memory_version,
    check_pages,
    check_source,
    coalesce,
    compat_of,
    layout_regions,
    pages_for_tokens,
    pages_from_bytes,
    pages_to_bytes,
    plan_blocks,
    pool_bytes,
    region_bases,
)
from pdxfer.core.protocol import PROTOCOL_VERSION, ErrorCode, KVLayout, Layout


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


def test_compat_of_carries_region_page_bytes():
    compat = compat_of(PAGE_FIRST_KV, aux_slot_bytes=4096)
    assert compat.version == PROTOCOL_VERSION
    assert compat.layout is Layout.PAGE_FIRST_KV
    assert compat.region_page_bytes == (256, 256)
    assert (compat.page_size, compat.num_layers, compat.dtype, compat.aux_slot_bytes) == (16, 2, "bf16", 4096)


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
