"""A6: the blocks of one leg between a prefill rank and a decode rank whose TP sizes
may differ (plan.leg_region_pairs, plan.plan_leg_blocks).

The end-to-end cases build every rank's KV cache in real byte buffers, from one model
whose KV is known for every global head, drive the legs from topology, run the blocks
with a small executor, and compare every byte of each decode rank's buffer with a
reference made here by slicing that decode rank's global heads out of the model with
numpy: written pages must hold its heads, every other byte must be as it was."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from pdxfer.core import errors
from pdxfer.core.plan import Blocks, canonical, leg_region_pairs, plan_blocks, plan_leg_blocks
from pdxfer.core.protocol import KVRegion, PageOrder, RegionKind
from pdxfer.core.topology import first_head, legs_for_decode_rank, local_heads, stage_layers

K, V, KV, LATENT = RegionKind.K, RegionKind.V, RegionKind.KV, RegionKind.LATENT
TOKEN, HEAD = PageOrder.TOKEN_MAJOR, PageOrder.HEAD_MAJOR
PAGE_SIZE = 4
LAYERS = 3  # odd, so a PP-2 split is uneven
PAD = 24  # bytes before the first region, so a planner that ignores the bases is caught


@dataclass
class Rank:
    """One rank's KV cache: a byte buffer, its regions (canonical) and their addresses
    (offsets into the buffer), and how a region's bytes are [page, token, head, unit]."""

    buf: np.ndarray
    regions: tuple[KVRegion, ...]
    bases: tuple[int, ...]
    heads: int
    order: PageOrder

    def view(self, buf: np.ndarray, layer: int, kind: RegionKind) -> np.ndarray:
        """Region (layer, kind) of ``buf`` (this rank's buffer or a copy of it) as [page, token, head, unit]."""
        r = next(r for r in self.regions if (r.layer, r.kind) == (layer, kind))
        flat = buf[r.offset : r.offset + r.num_pages * r.page_bytes]
        if self.order is TOKEN:
            return flat.reshape(r.num_pages, PAGE_SIZE, self.heads, -1)
        return flat.reshape(r.num_pages, self.heads, PAGE_SIZE, -1).transpose(0, 2, 1, 3)


def build_rank(order: PageOrder, kinds, layers: range, heads: int, unit: int, num_pages: int, rng) -> Rank:
    """token_major: SGLang's pool, a [tokens, heads, unit] tensor per (layer, kind), every
    layer's K before any V. head_major: vLLM's CPU cache, one [layers, blocks, heads,
    block_size, unit] storage (with kinds (KV,): K and V packed per token). Filled with
    random bytes."""
    page_bytes = PAGE_SIZE * heads * unit
    if order is TOKEN:
        keys = [(layer, kind) for kind in kinds for layer in layers]
    else:
        keys = [(layer, kind) for layer in layers for kind in kinds]
    buf = rng.integers(0, 256, PAD + len(keys) * num_pages * page_bytes, dtype=np.uint8)
    regions = canonical([
        KVRegion(buffer=0, offset=PAD + i * num_pages * page_bytes, page_bytes=page_bytes, num_pages=num_pages,
                 layer=layer, kind=kind)
        for i, (layer, kind) in enumerate(keys)
    ])
    return Rank(buf, regions, tuple(r.offset for r in regions), heads, order)


def execute(blocks: Blocks, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(*blocks.lists(0, len(blocks))):
        assert s + n <= src.size and d + n <= dst.size, "a block runs past its buffer"
        dst[d : d + n] = src[s : s + n]


def spans(blocks: Blocks) -> list[tuple[int, int]]:
    return sorted(zip(blocks.dst.tolist(), (blocks.dst + blocks.length).tolist()))


PAGE_LISTS = {
    # (source pages, destination pages): the decode pool is larger and lists extra pages
    # that must stay untouched
    "scattered": ([7, 2, 9, 0, 5], [3, 11, 0, 14, 6, 8, 1]),
    "contiguous": ([2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14]),
}
SRC_POOL, DST_POOL = 10, 16

CASES = {
    # name: (prefill TP, decode TP, total heads, mla, prefill PP)
    "tp2-tp1": (2, 1, 4, False, 1),
    "tp1-tp2": (1, 2, 4, False, 1),
    "tp4-tp2-gqa-h2": (4, 2, 2, False, 1),
    "tp8-tp2-h8": (8, 2, 8, False, 1),
    "mla-tp4-tp2": (4, 2, 1, True, 1),
    "pp2-pp1": (1, 1, 4, False, 2),
    "tp2pp2-tp1pp1": (2, 1, 4, False, 2),
}
LAYOUTS = {"sglang": TOKEN, "vllm_cpu": HEAD}
HEAD_DIM = 6  # bytes of one head's K (or V) for one token


def layout_kinds(order: PageOrder, mla: bool) -> tuple[tuple[RegionKind, ...], int]:
    if mla:
        return (LATENT,), 10
    return ((K, V), HEAD_DIM) if order is TOKEN else ((KV,), 2 * HEAD_DIM)


@pytest.mark.parametrize("pages", PAGE_LISTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_every_decode_rank_gets_its_heads_and_nothing_else(case, layout, pages):
    p_tp, d_tp, total, mla, p_pp = CASES[case]
    order = LAYOUTS[layout]
    kinds, unit = layout_kinds(order, mla)
    src_pages, dst_pages = (np.array(x, dtype="<i4") for x in PAGE_LISTS[pages])
    n = src_pages.size
    rng = np.random.default_rng(27)
    # The model's KV: every global head of every (layer, kind), for the room's n pages.
    model = {(layer, kind): rng.integers(0, 256, (n, PAGE_SIZE, total, unit), dtype=np.uint8)
             for layer in range(LAYERS) for kind in kinds}

    stages = stage_layers(LAYERS, p_pp)
    h_p, h_d = local_heads(total, p_tp), local_heads(total, d_tp)
    prefill = {}
    for tp, pp in itertools.product(range(p_tp), range(p_pp)):
        rank = build_rank(order, kinds, range(*stages[pp]), h_p, unit, SRC_POOL, rng)
        h0 = first_head(total, p_tp, tp)
        for r in rank.regions:
            rank.view(rank.buf, r.layer, r.kind)[src_pages] = model[r.layer, r.kind][:, :, h0 : h0 + h_p]
        prefill[tp, pp] = rank

    moved = []
    for d in range(d_tp):
        decode = build_rank(order, kinds, range(LAYERS), h_d, unit, DST_POOL, rng)
        expect = decode.buf.copy()
        h0 = first_head(total, d_tp, d)
        for r in decode.regions:
            decode.view(expect, r.layer, r.kind)[dst_pages[:n]] = model[r.layer, r.kind][:, :, h0 : h0 + h_d]

        legs = legs_for_decode_rank(p_tp, d_tp, total, d, mla, p_pp, num_layers=LAYERS)
        written, real = [], 0
        for leg in legs:
            src = prefill[leg.prefill_tp, leg.prefill_pp]
            blocks = plan_leg_blocks(
                src.regions, src.bases, src.heads, decode.regions, decode.bases, decode.heads, PAGE_SIZE, order,
                leg.src_head_start, leg.head_count, leg.dst_head_start, (leg.layer_start, leg.layer_end),
                src_pages, dst_pages,
            )
            assert (len(blocks) > 0) == leg.real
            real += leg.real
            execute(blocks, src.buf, decode.buf)
            written += spans(blocks)
            moved.append(blocks.nbytes)
        assert np.array_equal(decode.buf, expect), f"decode rank {d} differs at bytes {np.flatnonzero(decode.buf != expect)[:8]}"
        # every byte of the written pages comes from exactly one block
        written.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(written, written[1:]))
        assert sum(e - s for s, e in written) == n * sum(r.page_bytes for r in decode.regions)
        if mla:
            assert real == 1
    if mla:  # each decode rank takes the one latent copy: D copies in all, not P
        assert sum(moved) == d_tp * n * sum(r.page_bytes for r in prefill[0, 0].regions)


def regions_of(layers, kinds, page_bytes, num_pages=8):
    return canonical([
        KVRegion(buffer=0, offset=i * num_pages * page_bytes, page_bytes=page_bytes, num_pages=num_pages, layer=layer, kind=kind)
        for i, (layer, kind) in enumerate(itertools.product(layers, kinds))
    ])


def triples(blocks):
    return list(zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist()))


@pytest.mark.parametrize("order", [TOKEN, HEAD])
@pytest.mark.parametrize("src_pages,dst_pages", [
    ([4, 5, 6, 1, 2], [0, 1, 2, 6, 7, 3]),  # the small path of plan_blocks
    (list(range(30, 10, -1)) + list(range(40, 60)), list(range(100, 140)) + [7]),  # the numpy path
], ids=["small", "large"])
def test_whole_pages_are_plan_blocks_exactly(order, src_pages, dst_pages):
    src_pages, dst_pages = np.array(src_pages, "<i4"), np.array(dst_pages, "<i4")
    regions = regions_of(range(3), (K, V), PAGE_SIZE * 2 * 8, num_pages=200)
    src_bases = tuple(1 << 30 | r.offset for r in regions)
    dst_bases = tuple(1 << 31 | 3 * r.offset for r in regions)
    got = plan_leg_blocks(regions, src_bases, 2, regions, dst_bases, 2, PAGE_SIZE, order, 0, 2, 0, (0, 3), src_pages, dst_pages)
    want = plan_blocks(regions, src_bases, dst_bases, src_pages, dst_pages)
    assert triples(got) == triples(want)
    assert (got.nbytes, got.uniform) == (want.nbytes, want.uniform)
    assert len(got) < len(regions) * src_pages.size  # runs of pages were coalesced


def test_token_major_hetero_has_page_size_blocks_per_region_page():
    src = regions_of(range(2), (K, V), PAGE_SIZE * 4 * 8)  # 4 heads of 8 bytes
    dst = regions_of(range(2), (K, V), PAGE_SIZE * 2 * 8)  # 2 heads
    pages = np.array([3, 4, 5], "<i4")
    blocks = plan_leg_blocks(src, [r.offset for r in src], 4, dst, [r.offset for r in dst], 2, PAGE_SIZE, TOKEN,
                             2, 2, 0, (0, 2), pages, pages)
    assert len(blocks) == len(src) * pages.size * PAGE_SIZE
    assert blocks.uniform == 2 * 8 and blocks.nbytes == len(blocks) * 16
    # region 0 (layer 0 k), page 3, tokens 0..3: rows of 4 heads, the upper two
    page = 3 * PAGE_SIZE * 4 * 8
    assert blocks.src[:PAGE_SIZE].tolist() == [page + t * 32 + 16 for t in range(PAGE_SIZE)]
    assert blocks.dst[:PAGE_SIZE].tolist() == [3 * PAGE_SIZE * 16 + t * 16 for t in range(PAGE_SIZE)]


def test_head_major_hetero_has_one_block_per_region_page():
    src = regions_of(range(2), (KV,), PAGE_SIZE * 1 * 16)  # 1 head, K and V packed: 16 bytes a token
    dst = regions_of(range(2), (KV,), PAGE_SIZE * 2 * 16)  # 2 heads
    pages = np.array([0, 2], "<i4")
    blocks = plan_leg_blocks(src, [r.offset for r in src], 1, dst, [r.offset for r in dst], 2, PAGE_SIZE, HEAD,
                             0, 1, 1, (0, 2), pages, np.array([5, 1], "<i4"))
    assert len(blocks) == len(src) * pages.size and blocks.uniform == PAGE_SIZE * 16
    # destination head 1 starts half way into the page
    assert blocks.dst[:2].tolist() == [5 * 128 + 64, 1 * 128 + 64]


def test_leg_region_pairs_match_by_layer_and_kind_within_the_layers():
    src = regions_of(range(2, 4), (K, V), 32)
    dst = regions_of(range(5), (K, V), 32)
    assert leg_region_pairs(src, dst, (2, 4)) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert leg_region_pairs(src, dst, (3, 4)) == ((2, 6), (3, 7))


def test_missing_layer_kind_is_refused_naming_each():
    src = regions_of(range(4), (K, V), 32)
    dst = tuple(r for r in src if (r.layer, r.kind) != (3, V))
    with pytest.raises(errors.Unsupported, match="decode lacks layer 3 v"):
        leg_region_pairs(src, dst, (0, 4))
    with pytest.raises(errors.Unsupported, match="prefill lacks layer 3 v.*prefill lacks layer 4 k"):
        leg_region_pairs(dst, regions_of(range(5), (K, V), 32)[:-1], (0, 5))
    with pytest.raises(errors.Unsupported, match="decode lacks layer 0 k, prefill lacks layer 0 kv"):
        plan_leg_blocks(regions_of([0], (K,), 32), [0], 1, regions_of([0], (KV,), 32), [0], 1,
                        PAGE_SIZE, TOKEN, 0, 1, 0, (0, 1), np.array([0], "<i4"), np.array([0], "<i4"))


def test_unit_mismatch_is_refused_naming_the_region_and_both_units():
    src = regions_of(range(2), (K, V), PAGE_SIZE * 2 * 8)  # 2 heads of 8 bytes
    dst = regions_of(range(2), (K, V), PAGE_SIZE * 1 * 16)  # 1 head of 16 bytes
    pages = np.array([1], "<i4")
    with pytest.raises(errors.Unsupported, match=r"layer 0 k: .* 8 bytes on the prefill but 16 on the decode"):
        plan_leg_blocks(src, [0] * 4, 2, dst, [0] * 4, 1, PAGE_SIZE, HEAD, 0, 1, 0, (0, 2), pages, pages)
    odd = regions_of(range(2), (K, V), PAGE_SIZE * 2 * 8 + 2)
    with pytest.raises(errors.Unsupported, match=r"layer 0 k on the prefill: a page of 66 bytes is not 4 tokens x 2 heads"):
        plan_leg_blocks(odd, [0] * 4, 2, dst, [0] * 4, 1, PAGE_SIZE, HEAD, 0, 1, 0, (0, 2), pages, pages)
    with pytest.raises(errors.Unsupported, match=r"layer 0 k: pages of 66 bytes on the prefill but 64 on the decode"):
        plan_leg_blocks(odd, [0] * 4, 2, src, [0] * 4, 2, PAGE_SIZE, HEAD, 0, 2, 0, (0, 2), pages, pages)


def test_capacity_head_slices_and_dummy_legs():
    regions = regions_of(range(2), (K, V), PAGE_SIZE * 4 * 8)
    bases = [r.offset for r in regions]

    def plan(src_start, count, dst_start, src_pages=(1, 2), dst_pages=(3, 4)):
        return plan_leg_blocks(regions, bases, 4, regions, bases, 4, PAGE_SIZE, TOKEN, src_start, count, dst_start, (0, 2),
                               np.array(src_pages, "<i4"), np.array(dst_pages, "<i4"))

    with pytest.raises(errors.InsufficientCapacity, match="3 source pages but only 2 destination pages"):
        plan(0, 2, 0, src_pages=(1, 2, 3))
    for args, side in [((3, 2, 0), "prefill"), ((0, 2, 3), "decode"), ((-1, 2, 0), "prefill")]:
        with pytest.raises(errors.BadMessage, match=f"outside the {side} rank's 4 heads"):
            plan(*args)
    dummy = plan(0, 0, 0)
    assert (len(dummy), dummy.nbytes) == (0, 0)
