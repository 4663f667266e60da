"""A4/A6/A7/A8: the legs of a room, computed on the decode side (pdxfer/core/topology.py).

The exhaustive tables compare every leg with an expected table built here from the
formulas in docs/engines.md §A6 (unique-head index, "(u*hD) mod hP", "(u_p*hP) mod hD"),
which the module does not use (it intersects global head ranges), and check the
invariants a transfer relies on. Literal cases written out by hand follow."""

from __future__ import annotations

import itertools

import pytest

from pdxfer.core.errors import BadMessage, PdxferError, Unsupported
from pdxfer.core.topology import (
    Leg,
    LegKind,
    all_legs,
    fan_key,
    key_label,
    legs_for_decode_rank,
    prefill_fan_out,
    prefill_group,
    prefill_sources,
    rank_code,
    room_key,
    stage_layers,
)

SIZES = [1, 2, 4, 8]
HEADS = [1, 2, 8, 32]
TABLE = list(itertools.product(SIZES, SIZES, HEADS, [False, True]))
L = 12  # layers


def table_id(case):
    p, d, h, mla = case
    return f"P{p}-D{d}-H{h}-{'mla' if mla else 'mha'}"


def expected(p_tp: int, d_tp: int, h: int, d: int, mla: bool) -> list[tuple]:
    """(prefill tp, kind, src start, count, dst start) for decode rank d, from A6/A7."""
    h_p, h_d = max(1, h // p_tp), max(1, h // d_tp)
    if d_tp >= p_tp:
        p = d // (d_tp // p_tp)
        if mla:
            return [(p, "real", 0, h, 0)]
        u = d // max(1, d_tp // h)  # unique-head index of d
        return [(p, "real", (u * h_d) % h_p, h_d, 0)]
    group = range(d * p_tp // d_tp, (d + 1) * p_tp // d_tp)
    if mla:
        return [(p, "real" if p == group[0] else "dummy", 0, h if p == group[0] else 0, 0) for p in group]
    rows, seen = [], set()
    for p in group:
        u_p = p // max(1, p_tp // h)
        if u_p in seen:
            rows.append((p, "dummy", 0, 0, 0))
        else:
            seen.add(u_p)
            rows.append((p, "real", 0, h_p, (u_p * h_p) % h_d))
    return rows


def row(leg: Leg) -> tuple:
    return (leg.prefill_tp, leg.kind.value, leg.src_head_start, leg.head_count, leg.dst_head_start)


@pytest.mark.parametrize("case", TABLE, ids=table_id)
def test_a4_a6_a7_legs_match_the_independent_table(case):
    p_tp, d_tp, h, mla = case
    for d in range(d_tp):
        legs = legs_for_decode_rank(p_tp, d_tp, h, d, mla, num_layers=L)
        assert [row(leg) for leg in legs] == expected(p_tp, d_tp, h, d, mla)


@pytest.mark.parametrize("case", TABLE, ids=table_id)
def test_a4_a6_a7_invariants(case):
    p_tp, d_tp, h, mla = case
    h_p, h_d = max(1, h // p_tp), max(1, h // d_tp)
    for d in range(d_tp):
        legs = legs_for_decode_rank(p_tp, d_tp, h, d, mla, num_layers=L)
        real = [leg for leg in legs if leg.real]
        dummy = [leg for leg in legs if not leg.real]
        assert all(leg.decode_tp == d and leg.decode_pp == 0 for leg in legs)
        assert all((leg.layer_start, leg.layer_end) == (0, L) for leg in legs)
        assert [leg.prefill_tp for leg in legs] == list(prefill_group(p_tp, d_tp, d))
        assert len(legs) == max(1, p_tp // d_tp)
        # exactly one aux carrier, a real leg, the lowest-ranked real one
        aux = [leg for leg in legs if leg.carries_aux]
        assert len(aux) == 1 and aux[0].real and aux[0].prefill_tp == min(leg.prefill_tp for leg in real)
        assert all(leg.head_count == 0 and leg.src_head_start == 0 for leg in dummy)
        if mla:
            assert len(real) == 1 and real[0].prefill_tp == legs[0].prefill_tp
            assert len(dummy) == max(0, p_tp // d_tp - 1)
            assert (real[0].src_head_start, real[0].head_count, real[0].dst_head_start) == (0, h, 0)
            continue
        for leg in real:  # the source slice lies inside the prefill rank's heads
            assert 0 <= leg.src_head_start and leg.src_head_start + leg.head_count <= h_p
            assert leg.head_count >= 1
        # destination slices tile [0, hD) exactly, no overlap
        dst = sorted((leg.dst_head_start, leg.dst_head_start + leg.head_count) for leg in real)
        assert dst[0][0] == 0 and dst[-1][1] == h_d
        assert all(a[1] == b[0] for a, b in zip(dst, dst[1:]))
        # and they name the decode rank's global heads: same global head on both ends
        for leg in real:
            src_global = leg.prefill_tp * h // p_tp + leg.src_head_start
            dst_global = d * h // d_tp + leg.dst_head_start
            assert src_global == dst_global


@pytest.mark.parametrize("case", TABLE, ids=table_id)
def test_a4_fan_out_counts_every_leg(case):
    p_tp, d_tp, h, mla = case
    legs = all_legs(p_tp, d_tp, h, mla, num_layers=L)
    fan_out = [prefill_fan_out(p_tp, d_tp, p, mla) for p in range(p_tp)]
    assert sum(fan_out) == len(legs)
    for p in range(p_tp):  # each prefill rank sources exactly its fan-out
        assert len(prefill_sources(legs, p)) == fan_out[p]
    # MLA moves exactly D copies of the latent; MHA exactly D * hD heads, none twice
    if mla:
        assert sum(leg.real for leg in legs) == d_tp
    else:
        assert sum(leg.head_count for leg in legs if leg.real) == d_tp * max(1, h // d_tp)
    assert sum(leg.carries_aux for leg in legs) == d_tp


def test_a7_mla_p4_d2_two_real_two_dummy():
    legs = all_legs(4, 2, 1, True, num_layers=L)
    assert [(leg.prefill_tp, leg.decode_tp, leg.kind) for leg in legs] == [
        (0, 0, LegKind.REAL),
        (1, 0, LegKind.DUMMY),
        (2, 1, LegKind.REAL),
        (3, 1, LegKind.DUMMY),
    ]
    assert [leg.carries_aux for leg in legs] == [True, False, True, False]


# Literal cases, written out by hand.


def test_a6_p2_d1_h8_gathers_both_halves():
    legs = legs_for_decode_rank(2, 1, 8, 0, False, num_layers=4)
    assert legs == [
        Leg(prefill_tp=0, prefill_pp=0, decode_tp=0, decode_pp=0, kind=LegKind.REAL, src_head_start=0,
            head_count=4, dst_head_start=0, layer_start=0, layer_end=4, carries_aux=True),
        Leg(prefill_tp=1, prefill_pp=0, decode_tp=0, decode_pp=0, kind=LegKind.REAL, src_head_start=0,
            head_count=4, dst_head_start=4, layer_start=0, layer_end=4, carries_aux=False),
    ]  # fmt: skip


def test_a6_p1_d2_h8_decode_1_takes_the_upper_half():
    (leg,) = legs_for_decode_rank(1, 2, 8, 1, False, num_layers=4)
    assert (leg.prefill_tp, leg.src_head_start, leg.head_count, leg.dst_head_start) == (0, 4, 4, 0)
    assert leg.real and leg.carries_aux
    (leg,) = legs_for_decode_rank(1, 2, 8, 0, False, num_layers=4)
    assert (leg.prefill_tp, leg.src_head_start, leg.head_count, leg.dst_head_start) == (0, 0, 4, 0)


def test_a6_gqa_h2_d8_replicates_by_integer_division():
    # P=2: prefill rank 0 holds head 0, rank 1 head 1. D=8: ranks 0-3 hold head 0, 4-7 head 1.
    got = [row(leg) for d in range(8) for leg in legs_for_decode_rank(2, 8, 2, d, False, num_layers=4)]
    assert got == [(0, "real", 0, 1, 0)] * 4 + [(1, "real", 0, 1, 0)] * 4
    # P=1 holds both heads: decode ranks 4-7 read head 1 of it.
    got = [row(leg) for d in range(8) for leg in legs_for_decode_rank(1, 8, 2, d, False, num_layers=4)]
    assert got == [(0, "real", 0, 1, 0)] * 4 + [(0, "real", 1, 1, 0)] * 4


def test_a6_gqa_h2_p8_d1_one_sender_per_unique_head():
    # prefill ranks 0-3 hold head 0, 4-7 head 1: ranks 0 and 4 send, the replicas are dummies
    got = [row(leg) for leg in legs_for_decode_rank(8, 1, 2, 0, False, num_layers=4)]
    assert got == [(0, "real", 0, 1, 0)] + [(p, "dummy", 0, 0, 0) for p in (1, 2, 3)] + [
        (4, "real", 0, 1, 1)
    ] + [(p, "dummy", 0, 0, 0) for p in (5, 6, 7)]


def test_a6_p4_d2_h8():
    got = [row(leg) for leg in legs_for_decode_rank(4, 2, 8, 1, False, num_layers=4)]
    assert got == [(2, "real", 0, 2, 0), (3, "real", 0, 2, 2)]


# A8: pipeline parallelism.


def test_a8_stage_layers_last_stage_takes_the_remainder():
    assert stage_layers(12, 1) == [(0, 12)]
    assert stage_layers(12, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert stage_layers(10, 4) == [(0, 2), (2, 4), (4, 6), (6, 10)]
    with pytest.raises(Unsupported, match="3 layers"):
        stage_layers(3, 4)


@pytest.mark.parametrize("p_pp", [1, 2, 4])
@pytest.mark.parametrize("case", [(2, 1, 8, False), (1, 2, 8, False), (4, 2, 1, True), (2, 2, 32, False)])
def test_a8_pp1_decode_gathers_every_stage(p_pp, case):
    p_tp, d_tp, h, mla = case
    for d in range(d_tp):
        legs = legs_for_decode_rank(p_tp, d_tp, h, d, mla, p_pp, 1, num_layers=10)
        one_stage = legs_for_decode_rank(p_tp, d_tp, h, d, mla, num_layers=10)
        assert len(legs) == p_pp * len(one_stage)
        # the stages' layer ranges tile [0, 10), each stage with the same head plan
        for s, (a, b) in enumerate(stage_layers(10, p_pp)):
            stage = [leg for leg in legs if leg.prefill_pp == s]
            assert all((leg.layer_start, leg.layer_end) == (a, b) for leg in stage)
            assert [row(leg) for leg in stage] == [row(leg) for leg in one_stage]
        # one aux carrier: the lowest real leg of the last stage
        aux = [leg for leg in legs if leg.carries_aux]
        assert len(aux) == 1 and aux[0].prefill_pp == p_pp - 1 and aux[0].real
        # fan-out per stage still counts every leg
        room = all_legs(p_tp, d_tp, h, mla, p_pp, 1, num_layers=10)
        for s, p in itertools.product(range(p_pp), range(p_tp)):
            assert len(prefill_sources(room, p, s)) == prefill_fan_out(p_tp, d_tp, p, mla)


def test_a8_pp2_to_pp1_literal():
    legs = legs_for_decode_rank(1, 1, 8, 0, False, 2, 1, num_layers=7)
    assert [(leg.prefill_pp, leg.layer_start, leg.layer_end, leg.carries_aux) for leg in legs] == [
        (0, 0, 3, False),
        (1, 3, 7, True),
    ]
    assert all((leg.src_head_start, leg.head_count, leg.dst_head_start) == (0, 8, 0) for leg in legs)


def test_a8_equal_pp_pairs_stage_to_stage():
    for s in range(2):
        legs = legs_for_decode_rank(2, 1, 8, 0, False, 2, 2, num_layers=8, decode_stage=s)
        assert [(leg.prefill_tp, leg.prefill_pp, leg.decode_pp) for leg in legs] == [(0, s, s), (1, s, s)]
        assert all((leg.layer_start, leg.layer_end) == (4 * s, 4 * s + 4) for leg in legs)
        assert [leg.carries_aux for leg in legs] == [True, False]


def test_a8_registered_stage_ranges_are_used_and_checked():
    legs = legs_for_decode_rank(1, 1, 8, 0, False, 2, 1, num_layers=8, stage_layer_ranges=[(0, 5), (5, 8)])
    assert [(leg.layer_start, leg.layer_end) for leg in legs] == [(0, 5), (5, 8)]
    for bad in ([(0, 5)], [(0, 5), (6, 8)], [(0, 5), (5, 7)], [(0, 0), (0, 8)]):
        with pytest.raises(Unsupported):
            legs_for_decode_rank(1, 1, 8, 0, False, 2, 1, num_layers=8, stage_layer_ranges=bad)


# Errors.


@pytest.mark.parametrize("p_pp,d_pp", [(2, 4), (4, 2), (1, 2), (3, 2)])
def test_a8_other_pp_pairs_are_refused_naming_both(p_pp, d_pp):
    with pytest.raises(Unsupported) as e:
        legs_for_decode_rank(1, 1, 8, 0, False, p_pp, d_pp, num_layers=8)
    assert f"prefill PP {p_pp}" in str(e.value) and f"decode PP {d_pp}" in str(e.value)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 3), (3, 2), (4, 6), (6, 4)])
def test_non_divisible_tp_is_refused_naming_both(p_tp, d_tp):
    for call in (
        lambda: legs_for_decode_rank(p_tp, d_tp, 24, 0, False, num_layers=4),
        lambda: legs_for_decode_rank(p_tp, d_tp, 1, 0, True, num_layers=4),
        lambda: prefill_fan_out(p_tp, d_tp, 0, False),
    ):
        with pytest.raises(Unsupported) as e:
            call()
        assert f"prefill TP {p_tp}" in str(e.value) and f"decode TP {d_tp}" in str(e.value)
        assert isinstance(e.value, PdxferError)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(Unsupported, match="prefill TP 2 and 3 total KV heads"):
        legs_for_decode_rank(2, 1, 3, 0, False, num_layers=4)
    with pytest.raises(Unsupported, match="decode TP 4 and 6 total KV heads"):
        legs_for_decode_rank(2, 4, 6, 0, False, num_layers=4)
    # MLA does not slice heads, so the count is not checked against the TP sizes
    assert len(legs_for_decode_rank(2, 4, 3, 0, True, num_layers=4)) == 1


def test_ranks_outside_their_sizes_are_refused():
    with pytest.raises(BadMessage, match="decode TP rank 2"):
        legs_for_decode_rank(2, 2, 8, 2, False, num_layers=4)
    with pytest.raises(BadMessage, match="decode PP rank 2"):
        legs_for_decode_rank(2, 2, 8, 0, False, 2, 2, num_layers=4, decode_stage=2)
    with pytest.raises(BadMessage, match="prefill TP rank 4"):
        prefill_fan_out(4, 2, 4, False)
    with pytest.raises(Unsupported):
        legs_for_decode_rank(0, 2, 8, 0, False, num_layers=4)


def test_legs_are_frozen():
    (leg,) = legs_for_decode_rank(1, 1, 8, 0, False, num_layers=4)
    with pytest.raises(AttributeError):
        leg.head_count = 1  # type: ignore[misc]


def test_logs_name_a_rank_s_part_of_a_room_by_room_and_rank():
    assert key_label(room_key(11, 0)) == "11"
    assert key_label(room_key(11, rank_code(pp=0, tp=1))) == "11@pp=0,tp=1"
    assert key_label(room_key(2**63, rank_code(pp=3, tp=7))) == f"{2**63}@pp=3,tp=7"
    assert key_label(fan_key(11, 0x10002)) == "11@leg=0x10002"
