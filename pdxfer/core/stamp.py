"""The aux record stamp (invariant S3): (room, generation, length, checksum).

Each aux slot starts with a 32-byte header holding the stamp of the record in it,
then the payload. The receiver accepts a record only if the stamp names the room
and generation its slot is armed for, and the length and checksum match the bytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from .errors import AuxStampMismatch

HEADER = struct.Struct("<IIQQII")  # magic, length, room, generation, checksum, reserved
HEADER_BYTES = HEADER.size
MAGIC = 0x41584450  # "PDXA"


@dataclass(frozen=True)
class Stamp:
    room: int
    generation: int
    length: int
    checksum: int


def stamp_for(room: int, generation: int, payload) -> Stamp:
    return Stamp(room, generation, len(payload), zlib.crc32(payload))


def pack_header(stamp: Stamp) -> bytes:
    return HEADER.pack(MAGIC, stamp.length, stamp.room, stamp.generation, stamp.checksum, 0)


def unpack_header(raw) -> Stamp | None:
    """The stamp in a slot header, or None if the header holds no record."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, length, room, generation, checksum, _ = HEADER.unpack_from(raw)
    if magic != MAGIC:
        return None
    return Stamp(room, generation, length, checksum)


def verify(
    stamp: Stamp | None,
    *,
    slot: int,
    expected_room: int,
    expected_generation: int,
    payload,
) -> None:
    """Raise AuxStampMismatch (naming both rooms, the slot and the generations)
    unless ``stamp`` is exactly the record slot ``slot`` waits for."""
    where = f"aux slot {slot} (armed for room {expected_room} generation {expected_generation})"
    if stamp is None:
        raise AuxStampMismatch(f"{where} holds no stamped record", room=expected_room)
    if (stamp.room, stamp.generation) != (expected_room, expected_generation):
        raise AuxStampMismatch(
            f"{where} received a record stamped for room {stamp.room} generation {stamp.generation}",
            room=expected_room,
        )
    if stamp.length != len(payload):
        raise AuxStampMismatch(
            f"{where}: stamp says {stamp.length} bytes but {len(payload)} arrived", room=expected_room
        )
    actual = zlib.crc32(payload)
    if actual != stamp.checksum:
        raise AuxStampMismatch(
            f"{where}: checksum {actual:#010x} does not match the stamp's {stamp.checksum:#010x}",
            room=expected_room,
        )
