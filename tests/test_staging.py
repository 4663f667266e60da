"""Staging a head slice on the decode side (core/staging.py): the extents' allocator, the
blocks a staged leg is written as, and the copy into the pages, checked against pages
built in the test by slicing heads out of the source ranks' pages with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.core.plan import plan_from_staging, plan_leg_blocks, plan_staged_blocks, staged_layout
from pdxfer.core.protocol import Heads, KVRegion, KVSpec, PageOrder, RegionKind
from pdxfer.core.staging import ALIGN, StagingArena, slice_span, stage_spans_below, staging_mib, worth_staging
from pdxfer.roles.lanes import MappedKV


def test_worth_staging_only_a_whole_rank_against_short_spans_of_a_slice_in_host_pages():
    small, tcp = 1024, stage_spans_below("tcp", "prefill")
    # TP2 -> TP1 at the decode (every head of the prefill rank, a slice of the decode's), TP1 -> TP2 at the prefill.
    assert worth_staging(head_count=4, whole_heads=4, sliced_heads=8, host_memory=True, span=small, below=tcp)
    assert not worth_staging(4, 4, 8, False, small, tcp)  # a device pool: the daemon copies with the CPU
    assert not worth_staging(4, 4, 4, True, small, tcp)  # equal TP: whole pages already
    assert not worth_staging(2, 4, 8, True, small, tcp)  # a slice on both sides (replicated heads): no runs to keep
    assert not worth_staging(0, 4, 8, True, small, tcp)  # a dummy leg
    # A span a block costs little to write goes straight into the pages: long ones over TCP, all but short ones over RDMA.
    assert worth_staging(4, 4, 8, True, 12 * 1024, tcp) and not worth_staging(4, 4, 8, True, 64 * 1024, tcp)
    rdma = stage_spans_below("rdma", "decode")
    assert worth_staging(4, 4, 8, True, small, rdma) and not worth_staging(4, 4, 8, True, 12 * 1024, rdma)


def test_over_tcp_the_decode_stages_head_major_slices_and_the_prefill_gathers_only_token_major_ones():
    """The decode copies staged legs beside its loop, the prefill gathers on it before the
    first write: over TCP a 4:2 or 2:1 head-major slice of a 128 KiB page (32 or 64 KiB)
    is staged at the decode, not gathered at the prefill; token-major spans are on both."""
    head_major = [slice_span(128 * 1024, 8, n, 64, head_major=True) for n in (2, 4)]
    token_major = slice_span(128 * 1024, 8, 4, 64, head_major=False)
    decode, prefill = stage_spans_below("tcp", "decode"), stage_spans_below("tcp", "prefill")
    assert all(worth_staging(4, 4, 8, True, span, decode) for span in head_major)
    assert not any(worth_staging(4, 4, 8, True, span, prefill) for span in head_major)
    assert worth_staging(4, 4, 8, True, token_major, decode) and worth_staging(4, 4, 8, True, token_major, prefill)
    assert not worth_staging(4, 4, 8, True, 128 * 1024, decode)  # a whole page's worth: one block already


def test_the_staging_buffer_holds_legs_in_flight_over_tcp_and_stays_small_where_registering_pins_it():
    assert staging_mib("tcp") == 512 and staging_mib("rdma") == 64
    assert staging_mib("tcp", 0) == 0 and staging_mib("rdma", 100) == 100  # an operator's size stands, 0 included


def test_an_operators_span_limit_stands_in_for_the_measured_one():
    assert stage_spans_below("tcp", "prefill", 128) == 128 * 1024 and stage_spans_below("rdma", "decode", 128) == 128 * 1024
    assert stage_spans_below("tcp", "prefill", 0) == stage_spans_below("tcp", "prefill") == 16 * 1024
    assert worth_staging(4, 4, 8, True, 64 * 1024, stage_spans_below("tcp", "prefill", 128))


def test_a_slices_span_is_the_whole_slice_head_major_and_one_tokens_token_major():
    assert slice_span(page_bytes=8 * 64 * 128, heads=8, head_count=4, page_size=64, head_major=True) == 4 * 64 * 128
    assert slice_span(page_bytes=8 * 64 * 128, heads=8, head_count=4, page_size=64, head_major=False) == 4 * 128


def test_an_arena_hands_out_aligned_extents_and_merges_them_back():
    arena = StagingArena(4 * ALIGN + 100)  # the tail short of a page is not used
    assert arena.size == 4 * ALIGN
    a, b, c = arena.take(1), arena.take(ALIGN + 1), arena.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert arena.take(1) is None and arena.taken_bytes == 4 * ALIGN
    arena.give(b)
    assert arena.take(3 * ALIGN) is None  # two pages free, not three
    arena.give(a)
    arena.give(c)
    assert len(arena) == 0 and arena.take(4 * ALIGN) == 0  # merged into one again


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_extents_never_overlap_and_every_byte_comes_back(ops):
    arena = StagingArena(16 * ALIGN)
    held: dict[int, int] = {}
    for give, nbytes in ops:
        if give and held:
            offset = sorted(held)[nbytes % len(held)]
            arena.give(offset)
            del held[offset]
            continue
        offset = arena.take(nbytes)
        if offset is None:
            assert arena.size - arena.taken_bytes < nbytes or len(held) > 1  # full, or only fragmented
            continue
        assert offset % ALIGN == 0 and offset + nbytes <= arena.size
        assert all(offset + nbytes <= at or at + size <= offset for at, size in held.items())
        held[offset] = nbytes
    for offset in list(held):
        arena.give(offset)
    assert arena.taken_bytes == 0 and arena.take(arena.size) == 0


class _Mapped:
    """Process memory standing in for a mapped shared-memory buffer."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.address = array.ctypes.data


def _regions(layers: int, page_bytes: int, pages: int) -> tuple[KVRegion, ...]:
    return tuple(KVRegion(buffer=0, offset=(2 * layer + i) * page_bytes * pages, page_bytes=page_bytes, num_pages=pages, layer=layer, kind=kind)
                 for layer in range(layers) for i, kind in enumerate((RegionKind.K, RegionKind.V)))


def _execute(blocks, memory: dict[int, np.ndarray]) -> None:
    """Do what the transfer engine does with the blocks, between the test's arrays (by address)."""
    def at(address: int, length: int) -> np.ndarray:
        for base, array in memory.items():
            if base <= address and address + length <= base + array.size:
                return array[address - base : address - base + length]
        raise AssertionError(f"block at {address:#x} (+{length}) is in no buffer")
    for src, dst, length in zip(*blocks.lists(0, len(blocks))):
        at(dst, length)[:] = at(src, length)


@pytest.mark.parametrize("order", [PageOrder.HEAD_MAJOR, PageOrder.TOKEN_MAJOR])
@pytest.mark.parametrize("prefill_tp,decode_tp,total", [(2, 1, 8), (4, 2, 8), (4, 1, 4)])
def test_staged_legs_land_as_slicing_heads_in_numpy_says(order, prefill_tp, decode_tp, total):
    """Every prefill rank of a decode rank writes its pages into an extent of the staging
    buffer; copied into the pages, they equal the source ranks' heads placed in the
    decode rank's pages by numpy (heads axis concatenated in rank order)."""
    layers, tokens, unit, num_pages = 2, 4, 16, 12
    rng = np.random.default_rng(7)
    src_heads, dst_heads = total // prefill_tp, total // decode_tp
    src_pages = np.array([2, 3, 4, 5, 9, 10])  # two runs
    dst_pages = np.array([7, 1, 2, 3, 11, 0])
    shape = (tokens, src_heads, unit) if order is PageOrder.TOKEN_MAJOR else (src_heads, tokens, unit)
    src_regions = _regions(layers, tokens * src_heads * unit, num_pages)
    dst_regions = _regions(layers, tokens * dst_heads * unit, num_pages)
    staging = np.zeros(1 << 20, np.uint8)
    decode_pool = np.zeros(2 * layers * num_pages * tokens * dst_heads * unit, np.uint8)
    spec = KVSpec(page_size=tokens, dtype="uint8", num_layers_total=layers, layers=(0, layers), page_order=order,
                  heads=Heads(local=dst_heads, total=total, bytes_per_token_head=unit))
    decode_kv = MappedKV({"d": _Mapped(decode_pool)}, ("d",), spec, dst_regions, 1, "shm")
    head_axis = 1 if order is PageOrder.TOKEN_MAJOR else 0
    expected = {}
    taken = StagingArena(staging.size)
    for rank in range(dst_heads // src_heads):  # the prefill ranks writing to decode rank 0
        src_pool = rng.integers(0, 256, 2 * layers * num_pages * tokens * src_heads * unit, dtype=np.uint8)
        layout = staged_layout(src_regions, dst_regions, dst_heads, src_heads, (0, layers), dst_pages.size)
        offset = taken.take(layout.nbytes)
        bases = tuple(src_pool.ctypes.data + r.offset for r in src_regions)
        blocks = plan_staged_blocks(src_regions, bases, src_heads, dst_regions, dst_heads, tokens, order, 0, src_heads,
                                    (0, layers), src_pages, np.arange(src_pages.size), staging.ctypes.data + offset, layout)
        assert len(blocks) == 2 * 2 * layers  # a block per run of source pages per region
        _execute(blocks, {src_pool.ctypes.data: src_pool, staging.ctypes.data: staging})
        decode_kv.copy_heads(staging[offset : offset + layout.nbytes], layout, (0, layers), rank * src_heads, src_heads, dst_pages, into_pages=True)
        for k, region in enumerate(src_regions):
            pages = src_pool[region.offset : region.offset + num_pages * region.page_bytes].reshape(num_pages, *shape)
            expected.setdefault(k, []).append(pages[src_pages])
    for k, region in enumerate(dst_regions):
        want = np.concatenate(expected[k], axis=1 + head_axis).reshape(dst_pages.size, -1)
        got = decode_pool[region.offset : region.offset + num_pages * region.page_bytes].reshape(num_pages, -1)[dst_pages]
        assert np.array_equal(got, want), f"region {k}"


@pytest.mark.parametrize("order", [PageOrder.HEAD_MAJOR, PageOrder.TOKEN_MAJOR])
@pytest.mark.parametrize("prefill_tp,decode_tp,total", [(1, 2, 8), (2, 4, 8), (1, 4, 4)])
def test_gathered_chunks_land_as_slicing_heads_in_numpy_says(order, prefill_tp, decode_tp, total):
    """The prefill side: prefill rank 0's slice for each decode rank it writes to is
    gathered into an extent and written from there; each decode rank's pages then
    hold the prefill rank's heads numpy slices out for it."""
    layers, tokens, unit, num_pages = 2, 4, 16, 12
    rng = np.random.default_rng(11)
    src_heads, dst_heads = total // prefill_tp, total // decode_tp
    src_pages = np.array([6, 1, 2, 3, 8, 9])
    dst_pages = np.array([2, 3, 4, 5, 10, 11])  # two runs
    src_regions = _regions(layers, tokens * src_heads * unit, num_pages)
    dst_regions = _regions(layers, tokens * dst_heads * unit, num_pages)
    src_pool = rng.integers(0, 256, 2 * layers * num_pages * tokens * src_heads * unit, dtype=np.uint8)
    spec = KVSpec(page_size=tokens, dtype="uint8", num_layers_total=layers, layers=(0, layers), page_order=order,
                  heads=Heads(local=src_heads, total=total, bytes_per_token_head=unit))
    prefill_kv = MappedKV({"p": _Mapped(src_pool)}, ("p",), spec, src_regions, 1, "shm")
    staging = np.zeros(1 << 20, np.uint8)
    shape = (tokens, -1, unit) if order is PageOrder.TOKEN_MAJOR else (-1, tokens, unit)
    head_axis = 2 if order is PageOrder.TOKEN_MAJOR else 1
    for rank in range(src_heads // dst_heads):  # the decode ranks prefill rank 0 writes to
        decode_pool = np.zeros(2 * layers * num_pages * tokens * dst_heads * unit, np.uint8)
        layout = staged_layout(src_regions, dst_regions, dst_heads, dst_heads, (0, layers), src_pages.size)
        prefill_kv.copy_heads(staging[: layout.nbytes], layout, (0, layers), rank * dst_heads, dst_heads, src_pages, into_pages=False)
        blocks = plan_from_staging(src_regions, dst_regions, tuple(decode_pool.ctypes.data + r.offset for r in dst_regions), dst_heads,
                                   tokens, order, dst_heads, 0, (0, layers), dst_pages, staging.ctypes.data, layout)
        assert len(blocks) == 2 * 2 * layers  # a block per run of destination pages per region
        _execute(blocks, {staging.ctypes.data: staging, decode_pool.ctypes.data: decode_pool})
        for k, (s, d) in enumerate(zip(src_regions, dst_regions)):
            source = src_pool[s.offset : s.offset + num_pages * s.page_bytes].reshape(num_pages, *shape)[src_pages]
            want = np.take(source, range(rank * dst_heads, (rank + 1) * dst_heads), axis=head_axis).reshape(src_pages.size, -1)
            got = decode_pool[d.offset : d.offset + num_pages * d.page_bytes].reshape(num_pages, -1)[dst_pages]
            assert np.array_equal(got, want), f"decode rank {rank} region {k}"


def test_a_staged_leg_is_fewer_blocks_than_the_same_slice_written_into_the_pages():
    """TP2 -> TP1, head-major, 8 contiguous pages: a block per page and region into the
    pages, one per region into the staging buffer; the same bytes either way."""
    tokens, unit, pages = 4, 16, np.arange(8)
    src = _regions(1, tokens * 4 * unit, 16)
    dst = _regions(1, tokens * 8 * unit, 16)
    direct = plan_leg_blocks(src, (0, 1 << 30), 4, dst, (1 << 40, 1 << 41), 8, tokens, PageOrder.HEAD_MAJOR, 0, 4, 4, (0, 1), pages, pages)
    layout = staged_layout(src, dst, 8, 4, (0, 1), pages.size)
    staged = plan_staged_blocks(src, (0, 1 << 30), 4, dst, 8, tokens, PageOrder.HEAD_MAJOR, 0, 4, (0, 1), pages, pages, 1 << 42, layout)
    assert (len(direct), len(staged)) == (16, 2)
    assert direct.nbytes == staged.nbytes == layout.nbytes


def test_a_position_past_the_staged_leg_is_refused():
    src = _regions(1, 64, 4)
    layout = staged_layout(src, _regions(1, 128, 4), 2, 1, (0, 1), positions=2)
    with pytest.raises(Exception, match="outside the staged leg"):
        plan_staged_blocks(src, (0, 1000), 1, _regions(1, 128, 4), 2, 4, PageOrder.HEAD_MAJOR, 0, 1, (0, 1),
                           np.array([0, 1, 2]), np.arange(3), 1 << 40, layout)
