"""The prefill role's Writer on its own (roles/prefill/writer.py): once both halves of
a room part are in, every check, then the chunks planned into blocks and submitted as
Jobs as they come; the aux record only after every KV job completed (A3); a failed job
fails the room; no write submitted after the room's lease or the decode's leave to
write. Built as PrefillService builds it (pieces.prefill_parts); the pump is the test,
settling the jobs the port recorded."""

from __future__ import annotations

import zlib

import pytest

from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import AuxRecord, ErrorCode, LegRequest, LegWritten, RoomAccepted, RoomState, TransferStarted
from pdxfer.core.stamp import HEADER_BYTES, Stamp
from pdxfer.transport import Job

from .pieces import PrefillParts, chunk, hand_over, prefill_parts, prefill_room
from .rig import DECODE, DECODE_SESSIONS, DST_AUX, DST_KV, DST_PROBE, PAGE_BYTES, SLOT_BYTES

T, S, F = RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED
P = PAGE_BYTES
AUX = b"aux bytes"
ACCEPT = RoomAccepted(room=7, input_ready=True, legs=(0,))


def blocks(job: Job) -> list[tuple[int, int, int]]:
    return list(zip(job.blocks.src.tolist(), job.blocks.dst.tolist(), job.blocks.length.tolist()))


def settle(job: Job, error: str = "") -> None:
    """The pump's report: every block of ``job`` it submitted settled."""
    job.error, job.settled = error, True
    job.on_done(job)


def src(parts: PrefillParts, page: int) -> int:
    return parts.lanes[0].kv.bases[0] + page * P


def with_aux(parts: PrefillParts, w) -> None:
    """The engine's aux record for the room, in the slot it bound."""
    aux = parts.lanes[0].aux
    aux.memory.array[w.aux_slot * SLOT_BYTES + HEADER_BYTES:][:len(AUX)] = list(AUX)


def started(parts: PrefillParts, first, dst=(5, 6), lease_ms: int = 30_000, request: LegRequest | None = None):
    """Room 7, into ``dst`` (or ``request``'s pages), its first chunk ``first`` handed
    over, started; its room and work. What its engine heard so far is forgotten."""
    room, w = prefill_room(parts, 7, dst, request=request, lease_ms=lease_ms)
    with_aux(parts, w)
    hand_over(parts, room, w, first)
    parts.port.take()
    parts.writer.start(room, w, announce=ACCEPT)
    return room, w


def to_peer(parts: PrefillParts) -> list:
    """What the decode daemon was sent since the last look (the engine's statuses left out)."""
    return [(kind, to, m) for kind, to, m in parts.port.take() if kind == "peer"]


# --- chunks, blocks and jobs


def test_chunks_are_planned_and_submitted_as_jobs_as_they_come_and_the_aux_record_follows_every_kv_job():
    parts = prefill_parts()
    port = parts.port
    room, w = started(parts, chunk(0, [1, 2], last=False), dst=(5, 6, 9))
    assert port.take() == [("peer", DECODE, ACCEPT)]  # the decode side hears writes begin, before any
    (first,) = port.submitted
    assert blocks(first) == [(src(parts, 1), DST_KV + 5 * P, 2 * P)]  # contiguous on both sides: one block
    assert (first.id, first.peer, first.probe, first.deadline) == (7, DECODE_SESSIONS, DST_PROBE, port.clock() + 30.0)
    assert room.writers == {first} and room.bytes_planned == 2 * P

    hand_over(parts, room, w, chunk(2, [4], aux_bytes=len(AUX)))
    second = port.submitted[1]
    assert blocks(second) == [(src(parts, 4), DST_KV + 9 * P, P)] and second.deadline == first.deadline
    assert room.writers == {first, second} and room.bytes_planned == 3 * P + HEADER_BYTES + len(AUX)

    settle(second)
    assert port.take() == []  # the first chunk's writes are still in flight: no aux record (A3)
    settle(first)
    assert port.take() == [("peer", DECODE, AuxRecord(room=7, slot=3, generation=1, length=len(AUX), checksum=zlib.crc32(AUX),
                                                        payload=AUX, kv_pages=3))]
    assert room.state is T and room.writers == set() and room.bytes_moved == 3 * P  # success waits for the decode's ack (A1)


def test_positions_the_decode_skips_are_not_written():
    parts = prefill_parts()
    request = LegRequest(pages=pages_to_bytes([5, 6]), slot=3, generation=1, memory_version=1, skip_pages=1)
    room, w = started(parts, chunk(0, [1, 2, 3]), dst=(5, 6), request=request)
    (job,) = parts.port.submitted
    assert blocks(job) == [(src(parts, 2), DST_KV + 5 * P, 2 * P)]
    assert w.written == 2 and w.source_pages().tolist() == [2, 3]


def test_a_chunk_waiting_for_its_cuda_event_holds_back_the_chunks_after_it():
    parts = prefill_parts()
    port = parts.port
    waits = chunk(0, [1], last=False)
    waits.waiting = True
    room, w = started(parts, waits, dst=(5, 6, 9))
    hand_over(parts, room, w, chunk(1, [2, 3]))
    assert port.submitted == [] and len(w.chunks) == 2
    waits.waiting = False  # its event completed
    parts.writer.write_chunks(room, w)
    assert [blocks(job) for job in port.submitted] == [[(src(parts, 1), DST_KV + 5 * P, P)], [(src(parts, 2), DST_KV + 6 * P, P),
                                                                                              (src(parts, 3), DST_KV + 9 * P, P)]]


def test_a_leg_that_does_not_carry_the_aux_record_says_its_kv_is_written():
    parts = prefill_parts()
    request = LegRequest(leg=1 << 32, pages=pages_to_bytes([5, 6]), memory_version=1)
    room, w = started(parts, chunk(0, [1, 2]), dst=(5, 6), request=request)
    parts.port.take()
    settle(parts.port.submitted[0])
    assert parts.port.take() == [("peer", DECODE, LegWritten(room=7, leg=1 << 32, kv_pages=2))]
    assert room.bytes_planned == 2 * P  # no aux record of its own


def test_a_dummy_leg_writes_nothing_and_its_part_is_over_with_its_input():
    parts = prefill_parts()
    request = LegRequest(leg=1 << 32, pages=pages_to_bytes([5, 6]), memory_version=1, real=False)
    room, w = started(parts, chunk(0, [1], last=False), dst=(5, 6), request=request)
    assert room.state is T and parts.port.submitted == []
    hand_over(parts, room, w, chunk(1, [2]))
    assert room.state is S and parts.port.submitted == []


def test_the_aux_record_written_by_the_transfer_engine_follows_every_kv_job_then_is_announced():
    parts = prefill_parts(aux_path="transfer_engine")
    port = parts.port
    room, w = started(parts, chunk(0, [1, 2], aux_bytes=len(AUX)), dst=(5, 6))
    port.take()
    (kv,) = port.submitted
    settle(kv)
    aux_job = port.submitted[1]
    stamp = Stamp(7, 1, len(AUX), zlib.crc32(AUX))
    assert parts.lanes[0].aux.header(w.aux_slot) == stamp  # the header is written into our slot, then copied with the payload
    assert blocks(aux_job) == [(parts.lanes[0].aux.slot_address(w.aux_slot), DST_AUX + 3 * SLOT_BYTES, HEADER_BYTES + len(AUX))]
    assert aux_job.deadline == kv.deadline and port.take() == []
    settle(aux_job)
    assert port.take() == [("peer", DECODE, AuxRecord(room=7, slot=3, generation=1, length=len(AUX), checksum=stamp.checksum,
                                                        via_transfer_engine=True, kv_pages=2))]
    assert room.bytes_moved == 2 * P + HEADER_BYTES + len(AUX)


# --- failures


def test_a_failed_job_fails_the_room_which_is_fenced_only_once_its_other_jobs_settled_and_no_aux_follows():
    parts = prefill_parts()
    port = parts.port
    room, w = started(parts, chunk(0, [1], last=False))
    hand_over(parts, room, w, chunk(1, [2], aux_bytes=len(AUX)))
    first, second = port.submitted
    settle(first, "connection reset by peer")
    assert (room.state, room.code, room.reason) == (F, ErrorCode.TRANSFER_FAILED, "connection reset by peer")
    assert ("stop_writes", 7, frozenset({second})) in parts.book.parts.calls and not room.fenced
    settle(second)
    assert room.fenced
    assert to_peer(parts) == [("peer", DECODE, ACCEPT)]  # no aux record; telling it of the failure is the role's (stop_writes)


def test_a_cancelled_job_fails_its_room_too():
    parts = prefill_parts()
    room, _ = started(parts, chunk(0, [1]), dst=(5,))
    (job,) = parts.port.submitted
    job.cancelled = True
    settle(job)
    assert (room.code, room.reason) == (ErrorCode.TRANSFER_FAILED, "cancelled")


@pytest.mark.parametrize("request_fields, hello_fields, code, says", [
    ({"memory_version": 2}, {}, ErrorCode.STALE_MEMORY_VERSION, "destination"),
    ({"slot": 8}, {}, ErrorCode.PAGE_OUT_OF_RANGE, "destination aux slot 8 is out of range: the peer has slots 0..7"),
    ({"pages": pages_to_bytes([5, 16])}, {}, ErrorCode.PAGE_OUT_OF_RANGE, "destination"),
    ({"lane": 3}, {}, ErrorCode.BAD_MESSAGE, "the decode daemon's request names its lane 3, which its hello does not list"),
])
def test_a_destination_the_room_cannot_be_written_into_fails_it_before_a_byte_moves(request_fields, hello_fields, code, says):
    parts = prefill_parts(hello_fields)
    fields = {"pages": pages_to_bytes([5, 6]), "slot": 3, "generation": 1, "memory_version": 1, **request_fields}
    room, _ = started(parts, chunk(0, [1, 2]), dst=(5, 6), request=LegRequest(**fields))
    assert room.code is code and says in room.reason
    assert parts.port.submitted == [] and to_peer(parts) == []  # not even the accept


def test_a_room_whose_decode_daemon_is_gone_fails_unreachable():
    parts = prefill_parts()
    room, w = prefill_room(parts, 7)
    hand_over(parts, room, w, chunk(0, [1, 2]))
    del parts.state.peers[DECODE]
    parts.writer.start(room, w, announce=ACCEPT)
    assert (room.code, room.reason) == (ErrorCode.PEER_UNREACHABLE, "the decode daemon that requested this room is gone")


# --- the lease and the leave to write


def test_a_room_is_leased_the_shorter_of_its_own_transfer_timeout_and_the_decodes_from_when_writes_start():
    parts = prefill_parts(transfer_timeout=20.0)
    port = parts.port
    room, w = started(parts, chunk(0, [1], last=False), lease_ms=12_000)
    start = port.clock()
    assert port.submitted[0].deadline == w.lease_end == start + 12.0
    port.advance(5_000)
    hand_over(parts, room, w, chunk(1, [2]))
    assert port.submitted[1].deadline == start + 12.0  # a later chunk keeps the room's lease
    other = prefill_parts(transfer_timeout=20.0)
    started(other, chunk(0, [1]), dst=(5,), lease_ms=0)  # the decode gave none: ours
    assert other.port.submitted[0].deadline == other.port.clock() + 20.0


def test_a_leave_to_write_sooner_than_the_lease_bounds_the_writes():
    parts = prefill_parts()
    parts.peer.writes_until = parts.port.clock() + 4.5
    started(parts, chunk(0, [1, 2]))
    assert parts.port.submitted[0].deadline == parts.port.clock() + 4.5


def test_no_write_is_submitted_once_the_decodes_leave_to_write_ran_out():
    parts = prefill_parts()
    parts.peer.writes_until = parts.port.clock() - 1.5
    room, _ = started(parts, chunk(0, [1, 2]))
    assert (room.code, parts.port.submitted) == (ErrorCode.LEASE_EXPIRED, [])
    assert room.reason.startswith("the decode daemon's leave to write ran out 1.5s ago")
    assert to_peer(parts) == []  # no accept: its failure tells the decode side


def test_a_started_room_told_by_transfer_started_when_its_input_came_last():
    parts = prefill_parts()
    room, w = prefill_room(parts, 7, (5, 6))
    hand_over(parts, room, w, chunk(0, [1, 2]))
    parts.writer.start(room, w, announce=TransferStarted(room=7))
    assert to_peer(parts) == [("peer", DECODE, TransferStarted(room=7))] and len(parts.port.submitted) == 1
