"""The decode role's Verifier on its own (roles/decode/verifier.py): what a prefill rank
says landed (its LegWritten, or the aux record of the leg that carries it) is checked
against what this side armed for the room: the aux record's stamp against the slot's
room and generation and its payload, the KV digest with --verify-kv, inline KV against
the pages; only once every leg of the room landed does it succeed, and every real leg
is acked. Built as DecodeService builds it (pieces.decode_parts)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pdxfer.core.protocol import AuxRecord, ErrorCode, Heads, KVSpec, LegWritten, RoomAck, RoomState
from pdxfer.core.slots import SlotState
from pdxfer.core.stamp import HEADER_BYTES, Stamp

from .pieces import DecodeParts, decode_parts, decode_room, leg
from .rig import ENDPOINT, ENGINE, PAGE_BYTES, status

T, S, F = RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED
PAYLOAD = b"first token"
BOTH = KVSpec(page_size=4, dtype="bfloat16", num_layers_total=2, layers=(0, 2), heads=Heads(local=2, total=2, bytes_per_token_head=8))
SECOND = 1 << 32  # the leg code of prefill TP rank 1 writing into decode rank 0


def aux_leg(parts: DecodeParts, room):
    (request,) = [state.request for state in parts.state.work[room.id].legs.values() if state.request.carries_aux]
    return request


def record(parts: DecodeParts, of, payload: bytes = PAYLOAD, **fields) -> AuxRecord:
    """The aux record the prefill sends for room ``of``'s leg that carries it, stamped for it."""
    request = aux_leg(parts, of)
    fields = {"room": 7, "slot": request.slot, "generation": request.generation, "length": len(payload),
              "checksum": zlib.crc32(payload), "payload": payload, "leg": request.leg, **fields}
    return AuxRecord(**fields)


def landed(parts: DecodeParts, room, msg) -> list:
    """The prefill's ``msg`` about ``room`` arrives; what the engine and the link heard."""
    parts.verifier.leg_record(parts.state.links[ENDPOINT], room, msg)
    return parts.port.take()


def pages(parts: DecodeParts, *indices: int) -> bytes:
    array = parts.lanes[0].kv.buffers[0].array
    return b"".join(bytes(array[p * PAGE_BYTES:(p + 1) * PAGE_BYTES]) for p in indices)


# --- the aux record


def test_an_aux_record_whose_stamp_matches_is_written_into_its_slot_and_lands_the_room():
    parts = decode_parts()
    room = decode_room(parts, 7)
    slot, aux = aux_leg(parts, room).slot, parts.lanes[0].aux
    assert aux.header(slot) is None
    heard = landed(parts, room, record(parts, room, kv_pages=2))
    assert heard == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7, leg=0))]
    assert aux.header(slot) == Stamp(7, room.generation, len(PAYLOAD), zlib.crc32(PAYLOAD)) and aux.payload(slot, len(PAYLOAD)) == PAYLOAD
    assert aux.slots.slots[slot].state is SlotState.WRITTEN and room.writers == set()
    assert parts.verifier.bytes_received == room.bytes_moved == 2 * PAGE_BYTES + HEADER_BYTES + len(PAYLOAD)


@pytest.mark.parametrize("fields, says", [
    ({"generation": "+1"}, "aux record for room 7 generation {g1} aimed at slot {slot}, which holds room 7 generation {g} (armed)"),
    ({"slot": 99}, "aux record for room 7 generation {g} aimed at slot 99, which holds no slot"),
    ({"length": len(PAYLOAD) + 1}, "stamp says 12 bytes but 11 arrived"),
    ({"checksum": zlib.crc32(PAYLOAD) ^ 1}, f"checksum {zlib.crc32(PAYLOAD):#010x} does not match the stamp's {zlib.crc32(PAYLOAD) ^ 1:#010x}"),
    ({"room": 8}, "received a record stamped for room 8 generation {g}"),
])
def test_an_aux_record_not_stamped_for_what_the_slot_waits_for_fails_the_room_and_writes_nothing(fields, says):
    parts = decode_parts()
    room = decode_room(parts, 7)
    slot, aux = aux_leg(parts, room).slot, parts.lanes[0].aux
    if fields.get("generation") == "+1":
        fields["generation"] = room.generation + 1
    heard = landed(parts, room, record(parts, room, **fields))
    assert (room.state, room.code) == (F, ErrorCode.AUX_STAMP_MISMATCH)
    assert says.format(g=room.generation, g1=room.generation + 1, slot=slot) in room.reason
    assert aux.header(slot) is None  # nothing of it written
    # The record came once the prefill's writes completed: nothing more can land, so the room is fenced at once.
    assert room.fenced and aux.slots.slots[slot].state is SlotState.FREE
    assert heard == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.AUX_STAMP_MISMATCH, reason=room.reason))]


def test_a_record_the_transfer_engine_wrote_into_another_rooms_slot_fails_that_room_too():
    parts = decode_parts()
    room, other = decode_room(parts, 7), decode_room(parts, 8)
    into = aux_leg(parts, other)
    landed(parts, room, record(parts, room, slot=into.slot, generation=into.generation))
    assert room.code is ErrorCode.AUX_STAMP_MISMATCH and other.state is T  # sent here over tcp: it wrote nothing there
    room2 = decode_room(parts, 9)
    landed(parts, room2, record(parts, room2, room=9, slot=into.slot, generation=into.generation, via_transfer_engine=True))
    assert room2.code is ErrorCode.AUX_STAMP_MISMATCH and (other.state, other.code) == (F, ErrorCode.AUX_STAMP_MISMATCH)
    assert f"aimed at slot {into.slot}, which holds room 8" in other.reason


def test_a_record_from_a_leg_that_does_not_carry_it_or_none_from_the_one_that_does_fails_the_room():
    parts = decode_parts(spec=BOTH)
    legs = [leg(0, head_count=1), leg(SECOND, aux=False, head_count=1, dst_head_start=1)]
    room = decode_room(parts, 7, legs)
    landed(parts, room, record(parts, room, leg=SECOND))
    assert (room.code, room.reason) == (ErrorCode.BAD_MESSAGE, "prefill rank of leg 0x100000000 sent an aux record, but the leg that carries it is another")
    room = decode_room(parts, 8, legs)
    landed(parts, room, LegWritten(room=8, leg=0, kv_pages=2))
    assert room.reason == "prefill rank of leg 0x0 sent no aux record, but the leg that carries it is another"


def test_a_record_for_a_room_failed_meanwhile_only_fences_it():
    parts = decode_parts()
    room = decode_room(parts, 7)
    parts.book.fail(room, ErrorCode.TIMEOUT, "slow")
    parts.port.take()
    assert not room.fenced
    heard = landed(parts, room, record(parts, room))
    assert room.fenced and room.state is F and room.code is ErrorCode.TIMEOUT
    assert heard == [("engine", ENGINE, status(7, F, fenced=True, code=ErrorCode.TIMEOUT, reason="slow"))]  # no ack
    assert parts.lanes[0].aux.header(aux_leg(parts, room).slot) is None


# --- every leg


def test_a_room_succeeds_only_once_every_leg_landed_then_each_real_leg_is_acked():
    parts = decode_parts(spec=BOTH)
    room = decode_room(parts, 7, [leg(0, head_count=1), leg(SECOND, aux=False, head_count=1, dst_head_start=1)])
    assert landed(parts, room, LegWritten(room=7, leg=SECOND, kv_pages=2)) == []
    assert room.state is T and parts.state.work[room.id].legs[SECOND].landed and room.writers == {0}
    heard = landed(parts, room, record(parts, room, kv_pages=2))
    assert heard == [("engine", ENGINE, status(7, S, fenced=True)),
                     ("link", ENDPOINT, RoomAck(room=7, leg=0)), ("link", ENDPOINT, RoomAck(room=7, leg=SECOND))]
    half = PAGE_BYTES // 2  # each leg writes one of the two heads of every page
    assert room.bytes_moved == 2 * half + 2 * half + HEADER_BYTES + len(PAYLOAD)


def test_the_aux_record_before_the_other_legs_waits_for_them():
    parts = decode_parts(spec=BOTH)
    room = decode_room(parts, 7, [leg(0, head_count=1), leg(SECOND, aux=False, head_count=1, dst_head_start=1)])
    assert landed(parts, room, record(parts, room, kv_pages=2)) == []
    assert room.state is T and parts.lanes[0].aux.slots.slots[room.slot].state is SlotState.WRITTEN
    assert [m for _, _, m in landed(parts, room, LegWritten(room=7, leg=SECOND, kv_pages=2))][0].state is S


def test_a_dummy_leg_counts_as_landed_and_is_never_acked():
    parts = decode_parts()
    room = decode_room(parts, 7, [leg(0), leg(SECOND, aux=False, real=False)])
    assert room.writers == {0}
    heard = landed(parts, room, record(parts, room))
    assert heard == [("engine", ENGINE, status(7, S, fenced=True)), ("link", ENDPOINT, RoomAck(room=7, leg=0))]


# --- the KV digest (--verify-kv)


def filled(parts: DecodeParts) -> int:
    """Pages 5 and 6 written with something; the digest of them."""
    parts.lanes[0].kv.buffers[0].array[5 * PAGE_BYTES:7 * PAGE_BYTES] = np.arange(2 * PAGE_BYTES) % 253
    return zlib.crc32(pages(parts, 5, 6))


def test_with_verify_kv_a_matching_digest_lands_the_room():
    parts = decode_parts(verify_kv=True)
    room = decode_room(parts, 7)
    digest = filled(parts)
    assert digest == parts.lanes[0].kv.digest(np.array([5, 6]))
    landed(parts, room, record(parts, room, kv_pages=2, kv_digested=True, kv_digest=digest))
    assert room.state is S


def test_with_verify_kv_a_digest_that_does_not_match_is_looked_at_again_until_the_grace_then_fails_naming_both():
    parts = decode_parts(verify_kv=True, visibility_grace=0.05)
    room = decode_room(parts, 7)
    digest = filled(parts)
    parts.lanes[0].kv.buffers[0].array[5 * PAGE_BYTES] ^= 1
    actual = zlib.crc32(pages(parts, 5, 6))
    assert landed(parts, room, record(parts, room, kv_pages=2, kv_digested=True, kv_digest=digest)) == []
    parts.port.advance(49)
    assert room.state is T  # a write reported complete may not be visible yet
    parts.port.advance(2)  # the grace ends between two looks (test_decode's stamp check: the same)
    assert (room.state, room.code) == (F, ErrorCode.KV_DIGEST_MISMATCH)
    assert room.reason == f"KV digest {actual:#010x} over 2 pages does not match the prefill's {digest:#010x}"
    assert not any(isinstance(m, RoomAck) for _, _, m in parts.port.take())


def test_with_verify_kv_pages_that_become_visible_within_the_grace_land_the_room():
    parts = decode_parts(verify_kv=True, visibility_grace=0.05)
    room = decode_room(parts, 7)
    digest = filled(parts)
    parts.lanes[0].kv.buffers[0].array[5 * PAGE_BYTES:7 * PAGE_BYTES] = 0
    landed(parts, room, record(parts, room, kv_pages=2, kv_digested=True, kv_digest=digest))
    parts.port.advance(3)
    filled(parts)  # the write shows now
    parts.port.advance(20)
    assert room.state is S


def test_with_verify_kv_a_record_without_a_digest_fails_the_room():
    parts = decode_parts(verify_kv=True, visibility_grace=0.0)
    room = decode_room(parts, 7)
    landed(parts, room, record(parts, room, kv_pages=2))
    assert (room.code, room.reason) == (ErrorCode.KV_DIGEST_MISMATCH, "--verify-kv is on but the prefill sent no KV digest")


def test_with_verify_kv_slices_of_heads_carry_no_digest():
    parts = decode_parts(spec=BOTH, verify_kv=True, visibility_grace=0.0)
    room = decode_room(parts, 7, [leg(0, head_count=1), leg(SECOND, aux=False, head_count=1, dst_head_start=1)])
    landed(parts, room, LegWritten(room=7, leg=SECOND, kv_pages=2))
    landed(parts, room, record(parts, room, kv_pages=2))
    assert room.state is S


# --- inline KV


def test_kv_inside_the_record_is_written_into_the_rooms_pages():
    parts = decode_parts()
    room = decode_room(parts, 7)
    kv = bytes(range(256)) * (2 * PAGE_BYTES // 256)
    landed(parts, room, record(parts, room, kv_pages=2, kv=kv))
    assert room.state is S and pages(parts, 5, 6) == kv


@pytest.mark.parametrize("kv_pages, kv, options, code, says", [
    (2, bytes(PAGE_BYTES), {}, ErrorCode.BAD_MESSAGE, f"inline KV of {PAGE_BYTES} bytes is not 2 pages of {PAGE_BYTES} bytes"),
    (2, bytes(2 * PAGE_BYTES), {"inline_kv_bytes": PAGE_BYTES}, ErrorCode.BAD_MESSAGE,
     f"the prefill sent {2 * PAGE_BYTES} bytes of KV inline; this daemon takes at most {PAGE_BYTES}"),
    (3, bytes(3 * PAGE_BYTES), {}, ErrorCode.PAGE_OUT_OF_RANGE, "the prefill wrote 3 pages into 2"),
])
def test_inline_kv_that_does_not_fit_the_room_fails_it_and_writes_no_page(kv_pages, kv, options, code, says):
    parts = decode_parts(**options)
    room = decode_room(parts, 7)
    parts.lanes[0].kv.buffers[0].array[:] = 7
    heard = landed(parts, room, record(parts, room, kv_pages=kv_pages, kv=kv))
    assert (room.code, room.reason) == (code, says) and room.fenced
    assert set(pages(parts, *range(16))) == {7} and not any(isinstance(m, RoomAck) for _, _, m in heard)
