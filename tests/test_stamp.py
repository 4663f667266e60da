"""The aux record stamp (S3): a record is accepted only by the slot, room and
generation it was written for, with the right length and checksum; every rejection
names both rooms, the slot and the generation so F1 can be diagnosed from one line."""

from __future__ import annotations

import zlib

import pytest

from pdxfer.core import errors
from pdxfer.core.protocol import ErrorCode
from pdxfer.core.stamp import HEADER_BYTES, MAGIC, Stamp, pack_header, stamp_for, unpack_header, verify

PAYLOAD = b"aux metadata: first token id, logprobs, ..." * 3
ROOM = 0x1234_5678_9ABC_DEF0  # 64-bit room ids survive the header
GEN = 41
SLOT = 6


def test_stamp_for():
    stamp = stamp_for(ROOM, GEN, PAYLOAD)
    assert stamp == Stamp(ROOM, GEN, len(PAYLOAD), zlib.crc32(PAYLOAD))


def test_pack_unpack_round_trip():
    stamp = stamp_for(ROOM, GEN, PAYLOAD)
    header = pack_header(stamp)
    assert len(header) == HEADER_BYTES == 32
    assert int.from_bytes(header[:4], "little") == MAGIC
    assert unpack_header(header) == stamp
    # The header sits at the start of a larger slot; the payload after it is ignored.
    assert unpack_header(header + PAYLOAD) == stamp
    assert unpack_header(memoryview(bytearray(header + b"\0" * 64))) == stamp


def test_unpack_without_magic_is_no_record():
    assert unpack_header(bytes(HEADER_BYTES)) is None  # a never-written slot
    corrupted = bytearray(pack_header(stamp_for(ROOM, GEN, PAYLOAD)))
    corrupted[0] ^= 0xFF
    assert unpack_header(bytes(corrupted)) is None


def test_verify_accepts_the_exact_record():
    stamp = unpack_header(pack_header(stamp_for(ROOM, GEN, PAYLOAD)))
    verify(stamp, slot=SLOT, expected_room=ROOM, expected_generation=GEN, payload=PAYLOAD)
    verify(stamp_for(ROOM, GEN, b""), slot=SLOT, expected_room=ROOM, expected_generation=GEN, payload=b"")


def rejected(stamp, payload=PAYLOAD) -> errors.AuxStampMismatch:
    with pytest.raises(errors.AuxStampMismatch) as info:
        verify(stamp, slot=SLOT, expected_room=ROOM, expected_generation=GEN, payload=payload)
    exc = info.value
    # The room that fails is the one the slot was armed for, and the peer is blamed.
    assert exc.room == ROOM and exc.code is ErrorCode.AUX_STAMP_MISMATCH and exc.side is errors.Side.PEER
    message = str(exc)
    assert f"aux slot {SLOT}" in message
    assert f"room {ROOM} generation {GEN}" in message
    return exc


def test_wrong_room_names_both_rooms_the_slot_and_the_generation():
    other = 99
    exc = rejected(stamp_for(other, GEN, PAYLOAD))
    message = str(exc)
    assert f"armed for room {ROOM} generation {GEN}" in message
    assert f"stamped for room {other} generation {GEN}" in message


def test_wrong_generation():
    exc = rejected(stamp_for(ROOM, GEN - 1, PAYLOAD))  # a late write for the previous owner
    assert f"stamped for room {ROOM} generation {GEN - 1}" in str(exc)


def test_wrong_length():
    stamp = stamp_for(ROOM, GEN, PAYLOAD)
    exc = rejected(stamp, payload=PAYLOAD[:-1])
    assert f"stamp says {len(PAYLOAD)} bytes but {len(PAYLOAD) - 1} arrived" in str(exc)


def test_wrong_checksum():
    flipped = bytes([PAYLOAD[0] ^ 1]) + PAYLOAD[1:]  # same length, one bit off
    exc = rejected(stamp_for(ROOM, GEN, PAYLOAD), payload=flipped)
    assert "checksum" in str(exc)
    assert f"{zlib.crc32(PAYLOAD):#010x}" in str(exc) and f"{zlib.crc32(flipped):#010x}" in str(exc)


def test_missing_header():
    exc = rejected(unpack_header(bytes(HEADER_BYTES)))
    assert "no stamped record" in str(exc)
