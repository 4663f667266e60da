"""Which prefill ranks a decode rank reads from, and what each one sends (issue 27 item 3).

A room is made of legs (docs/engines.md §A4): one leg per (prefill rank, decode rank) pair
that takes part, real (it moves KV bytes) or dummy (it moves nothing, so the prefill
rank's status still completes). Legs are computed on the decode side by the pure
functions here; nothing in this module does I/O.

What it reproduces, paraphrasing docs/engines.md §G3 (SGLang 0.5.23's rank mapping) and
§A6-A8:

- Equal TP: decode rank d pairs with prefill rank d.
- Decode TP D > prefill TP P (fan-out): d reads from prefill rank d // (D/P); that
  prefill rank serves D/P decode ranks (SGLang's required_dst_info_num).
- D < P (fan-in): a non-MLA decode rank reads from every p in [d*P/D, (d+1)*P/D), each
  contributing its heads at a destination offset; an MLA decode rank reads the whole
  (replicated) latent cache from the first p of that group only, and the others get
  dummy legs.
- Heads (A6): a prefill rank holds hP = max(1, H/P) KV heads, a decode rank
  hD = max(1, H/D). When H is smaller than the TP size, heads are replicated by integer
  division (GQA): rank r of T holds global heads starting at r*H // T. A leg's source
  slice is the overlap of the two ranks' global head ranges, expressed relative to the
  prefill rank's first head; its destination offset is the same overlap relative to the
  decode rank's first head. Where several prefill ranks of a fan-in group hold the same
  replicated head (H < P), only the first sends it ("one p per unique head", A6) and the
  others get dummy legs, so destination heads are written exactly once.
- PP (A8): a decode with PP 1 gets one leg per prefill stage, carrying that stage's
  layer range; equal PP pairs stage s with stage s; anything else is refused.
  Layers are split as SGLang does by default: every stage gets num_layers // pp, and the
  last stage also takes the remainder. A caller holding the ranges the stages actually
  registered passes them as ``stage_layer_ranges`` instead.
- Aux (A4): exactly one real leg per decode rank carries the aux record: the real leg
  of lowest prefill TP rank, taken from the last prefill stage the decode rank reads
  (only the last PP stage has the sampled token; SGLang sends aux from there alone).

CP > 1 is not a parameter here; v1 refuses it where ranks are registered.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import BadMessage, Unsupported


class LegKind(str, enum.Enum):
    REAL = "real"
    DUMMY = "dummy"


@dataclass(frozen=True, slots=True, kw_only=True)
class Leg:
    """One prefill rank -> one decode rank part of a room.

    Head slices are in local heads: ``src_head_start`` counts from the prefill rank's
    first head, ``dst_head_start`` from the decode rank's. A dummy leg moves nothing
    (``head_count`` 0). For MLA a real leg moves the whole latent page: heads 0.. all.
    Layers are global layer ids, [layer_start, layer_end)."""

    prefill_tp: int
    prefill_pp: int
    decode_tp: int
    decode_pp: int
    kind: LegKind
    src_head_start: int
    head_count: int
    dst_head_start: int
    layer_start: int
    layer_end: int
    carries_aux: bool

    @property
    def real(self) -> bool:
        return self.kind is LegKind.REAL


def _check_tp(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp < 1 or decode_tp < 1:
        raise Unsupported(f"TP sizes must be at least 1: prefill TP {prefill_tp}, decode TP {decode_tp}")
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise Unsupported(
            f"prefill TP {prefill_tp} and decode TP {decode_tp}: neither divides the other, "
            "so no rank mapping exists"
        )


def _check_heads(total_heads: int, tp: int, side: str) -> None:
    if total_heads < 1:
        raise Unsupported(f"total KV heads must be at least 1, got {total_heads}")
    if total_heads % tp and tp % total_heads:
        raise Unsupported(
            f"{side} TP {tp} and {total_heads} total KV heads: neither divides the other, "
            "so heads cannot be split or replicated evenly"
        )


def _check_rank(rank: int, size: int, what: str) -> None:
    if not 0 <= rank < size:
        raise BadMessage(f"{what} {rank} is outside [0, {size})")


def local_heads(total_heads: int, tp: int) -> int:
    """KV heads one rank of a TP group holds: max(1, H/TP)."""
    return max(1, total_heads // tp)


def first_head(total_heads: int, tp: int, rank: int) -> int:
    """The global index of the first KV head that TP rank ``rank`` holds (GQA
    replication by integer division when H < TP)."""
    return rank * total_heads // tp


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Each PP stage's [start, end): num_layers // pp each, the last stage also takes
    the remainder (SGLang's default split)."""
    if pp < 1:
        raise Unsupported(f"PP size must be at least 1, got {pp}")
    if num_layers < pp:
        raise Unsupported(f"{num_layers} layers cannot be split over PP {pp}: a stage would hold none")
    per = num_layers // pp
    ranges = [(s * per, (s + 1) * per) for s in range(pp)]
    ranges[-1] = (ranges[-1][0], num_layers)
    return ranges


def _check_stage_layers(ranges: Sequence[tuple[int, int]], pp: int, num_layers: int) -> list[tuple[int, int]]:
    ranges = [(int(a), int(b)) for a, b in ranges]
    if len(ranges) != pp:
        raise Unsupported(f"{len(ranges)} stage layer ranges given for prefill PP {pp}")
    expect = 0
    for s, (a, b) in enumerate(ranges):
        if a != expect or b <= a:
            raise Unsupported(f"stage {s} layers [{a}, {b}) do not continue the stages before it at {expect}")
        expect = b
    if expect != num_layers:
        raise Unsupported(f"stage layer ranges end at {expect}, not at the model's {num_layers} layers")
    return ranges


def prefill_group(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill TP ranks decode rank ``decode_rank`` has a leg with (real or dummy)."""
    _check_tp(prefill_tp, decode_tp)
    _check_rank(decode_rank, decode_tp, "decode TP rank")
    if decode_tp >= prefill_tp:
        p = decode_rank // (decode_tp // prefill_tp)
        return range(p, p + 1)
    k = prefill_tp // decode_tp
    return range(decode_rank * k, (decode_rank + 1) * k)


def prefill_fan_out(prefill_tp: int, decode_tp: int, prefill_rank: int, mla: bool) -> int:
    """How many decode ranks one prefill TP rank has legs with, per stage (SGLang's
    required_dst_info_num): D/P when D >= P, else 1 (a real or a dummy leg). The same
    for MLA and MHA: MLA only turns some of those legs into dummies."""
    del mla  # the count is the same; kept so callers state what they mean
    _check_tp(prefill_tp, decode_tp)
    _check_rank(prefill_rank, prefill_tp, "prefill TP rank")
    return max(1, decode_tp // prefill_tp)


def _pp_pairs(prefill_pp: int, decode_pp: int, decode_stage: int) -> list[int]:
    if prefill_pp < 1 or decode_pp < 1:
        raise Unsupported(f"PP sizes must be at least 1: prefill PP {prefill_pp}, decode PP {decode_pp}")
    if decode_pp == 1:
        _check_rank(decode_stage, 1, "decode PP rank")
        return list(range(prefill_pp))
    if decode_pp == prefill_pp:
        _check_rank(decode_stage, decode_pp, "decode PP rank")
        return [decode_stage]
    raise Unsupported(
        f"prefill PP {prefill_pp} and decode PP {decode_pp}: the decode PP must be 1 or equal the prefill's"
    )


def legs_for_decode_rank(
    prefill_tp: int,
    decode_tp: int,
    total_heads: int,
    decode_rank: int,
    mla: bool,
    prefill_pp: int = 1,
    decode_pp: int = 1,
    *,
    num_layers: int,
    decode_stage: int = 0,
    stage_layer_ranges: Sequence[tuple[int, int]] | None = None,
) -> list[Leg]:
    """Every leg of one decode rank (TP rank ``decode_rank``, PP rank ``decode_stage``),
    ordered by prefill stage, then prefill TP rank. ``total_heads`` is the model's KV
    head count (for MLA, the latent's, usually 1). Raises Unsupported for sizes that
    have no mapping, naming both, and BadMessage for a rank outside its sizes."""
    _check_tp(prefill_tp, decode_tp)
    if not mla:
        _check_heads(total_heads, prefill_tp, "prefill")
        _check_heads(total_heads, decode_tp, "decode")
    elif total_heads < 1:
        raise Unsupported(f"total KV heads must be at least 1, got {total_heads}")
    stages = _pp_pairs(prefill_pp, decode_pp, decode_stage)
    if stage_layer_ranges is None:
        layers = stage_layers(num_layers, prefill_pp)
    else:
        layers = _check_stage_layers(stage_layer_ranges, prefill_pp, num_layers)
    group = prefill_group(prefill_tp, decode_tp, decode_rank)

    # The per-stage head plan is the same for every stage: (p, kind, src, count, dst).
    plan: list[tuple[int, LegKind, int, int, int]] = []
    if mla:
        for i, p in enumerate(group):
            if i == 0:
                plan.append((p, LegKind.REAL, 0, total_heads, 0))
            else:
                plan.append((p, LegKind.DUMMY, 0, 0, 0))
    else:
        h_p, h_d = local_heads(total_heads, prefill_tp), local_heads(total_heads, decode_tp)
        d0 = first_head(total_heads, decode_tp, decode_rank)
        covered: set[int] = set()
        for p in group:
            p0 = first_head(total_heads, prefill_tp, p)
            lo, hi = max(p0, d0), min(p0 + h_p, d0 + h_d)
            if hi <= lo:  # cannot happen for sizes that passed the checks above
                raise Unsupported(f"prefill TP rank {p} holds no head of decode TP rank {decode_rank}")
            if lo in covered:  # a replica of a head an earlier rank of the group sends
                plan.append((p, LegKind.DUMMY, 0, 0, 0))
                continue
            covered.update(range(lo, hi))
            plan.append((p, LegKind.REAL, lo - p0, hi - lo, lo - d0))

    aux_stage = stages[-1]
    aux_tp = min(p for p, kind, *_ in plan if kind is LegKind.REAL)
    legs = []
    for s in stages:
        start, end = layers[s]
        for p, kind, src, count, dst in plan:
            legs.append(
                Leg(
                    prefill_tp=p,
                    prefill_pp=s,
                    decode_tp=decode_rank,
                    decode_pp=decode_stage,
                    kind=kind,
                    src_head_start=src,
                    head_count=count,
                    dst_head_start=dst,
                    layer_start=start,
                    layer_end=end,
                    carries_aux=(s == aux_stage and p == aux_tp),
                )
            )
    return legs


def all_legs(
    prefill_tp: int,
    decode_tp: int,
    total_heads: int,
    mla: bool,
    prefill_pp: int = 1,
    decode_pp: int = 1,
    *,
    num_layers: int,
    stage_layer_ranges: Sequence[tuple[int, int]] | None = None,
) -> list[Leg]:
    """The legs of every decode rank of a room, decode stage then decode TP rank."""
    return [
        leg
        for stage in range(decode_pp)
        for d in range(decode_tp)
        for leg in legs_for_decode_rank(
            prefill_tp,
            decode_tp,
            total_heads,
            d,
            mla,
            prefill_pp,
            decode_pp,
            num_layers=num_layers,
            decode_stage=stage,
            stage_layer_ranges=stage_layer_ranges,
        )
    ]


# --- rooms of ranks: how a room's per-rank parts are named inside a daemon and on the wire

RANK_LIMIT = 1 << 16  # a TP or PP rank fits 16 bits in a leg code
_ROOM_BITS = 64


def rank_code(pp: int, tp: int) -> int:
    """A (PP, TP) rank as 32 bits; rank (0, 0) is 0."""
    if not (0 <= pp < RANK_LIMIT and 0 <= tp < RANK_LIMIT):
        raise Unsupported(f"rank pp={pp} tp={tp}: pdxfer names ranks below {RANK_LIMIT}")
    return (pp << 16) | tp


def leg_code(leg: Leg) -> int:
    """A leg's ranks as one integer (LegRequest.leg): prefill (pp, tp), then decode (pp, tp)."""
    return (rank_code(leg.prefill_pp, leg.prefill_tp) << 32) | rank_code(leg.decode_pp, leg.decode_tp)


def prefill_rank_of(code: int) -> int:
    return code >> 32


def decode_rank_of(code: int) -> int:
    return code & 0xFFFFFFFF


def leg_layers(layers: tuple[int, int], num_layers: int) -> tuple[int, int]:
    """A leg's layer range [start, end) as a LegRequest names it: (0, 0) is every one of ``num_layers``."""
    return layers if layers != (0, 0) else (0, num_layers)


def room_key(room: int, rank: int) -> int:
    """The key of one rank's part of ``room`` in a daemon's room table: the room id
    itself for rank (0, 0), so a one-rank engine's rooms are keyed by their ids."""
    return room | (rank << _ROOM_BITS)


def fan_key(room: int, leg: int) -> int:
    """The key of a prefill rank's part of ``room`` that writes to another decode rank
    than its first (fan-out: decode TP above prefill TP): one per further leg."""
    return room_key(room, (1 << 64) | leg)


def room_of(key: int) -> int:
    """The room id a room-table key is part of (what the wire and the engine call it)."""
    return key & ((1 << _ROOM_BITS) - 1)


def rank_of(key: int) -> int:
    return key >> _ROOM_BITS


def key_label(key: int) -> str:
    """A room-table key as logs name it: the room id, then the rank part it is of
    (``11@pp=0,tp=1``; a fan-out part ``11@leg=0x...``), none for rank (0, 0)."""
    room, rank = room_of(key), rank_of(key)
    if not rank:
        return str(room)
    if rank >> 64:
        return f"{room}@leg={rank & ((1 << 64) - 1):#x}"
    return f"{room}@pp={rank >> 16},tp={rank & 0xFFFF}"


def prefill_sources(legs: Sequence[Leg], prefill_tp: int, prefill_pp: int = 0) -> list[Leg]:
    """The legs prefill rank (tp, pp) sources, out of a room's legs: what it must see
    acknowledged before its status reaches Success."""
    return [leg for leg in legs if leg.prefill_tp == prefill_tp and leg.prefill_pp == prefill_pp]
