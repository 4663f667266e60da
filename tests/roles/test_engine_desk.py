"""EngineDesk on its own (roles/engine.py): what both roles answer their engines, and
how. The role's own requests (send, expect, announce, failing a room) go to a recording
stand-in (``Requests``); the room book and lanes are the real ones, over the recording
port and the fake clock."""

from __future__ import annotations

import pytest

from pdxfer.core.errors import InsufficientCapacity
from pdxfer.core.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AllocSlot,
    Announce,
    Busy,
    EngineHello,
    Error,
    ErrorCode,
    Expect,
    FreeSlot,
    GetStats,
    Ok,
    Poll,
    Rank,
    Release,
    Role,
    RoomState,
    RoomStatus,
    Send,
    SlotGrant,
    Stats,
    Welcome,
)
from pdxfer.core.rooms import Event
from pdxfer.core.slots import SlotState
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.core.topology import room_key
from pdxfer.roles.engine import EngineDesk

from .pieces import BookParts, engine, kv_registration, made_book
from .rig import SLOT_BYTES, SLOTS, done

INCARNATION = "d" * 16
FENCE_BOUND = 40.0
B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS, RoomState.FAILED)


class Requests(BookParts):
    """The role, as its desk and its book see it: a request for a room of its own (expect
    on decode, send or announce on prefill) makes a room on the engine's lane and says
    Ok, unless ``bug`` is set (then it raises that); failing and releasing go to the
    book; a room's memory version is what ``versions`` says."""

    def __init__(self, role: Role) -> None:
        super().__init__()
        self.room_messages = {Expect: self.on_room} if role is Role.DECODE else {Send: self.on_room, Announce: self.on_room}
        self.asked: list = []
        self.bug: Exception | None = None
        self.versions: dict[int, int] = {}
        self.registrations = 0
        self.disowned: list[int] = []

    def on_room(self, identity, msg):
        if self.bug is not None:
            raise self.bug
        self.asked.append((identity, msg))
        lane = self.book.lanes.of(identity)
        room = self.book.create(room_key(msg.room, lane.code), Role.DECODE, lane.index)
        self.engines[room.id] = identity
        return Ok(req=msg.req)

    def fail(self, room, code, reason):
        return self.book.fail(room, code, reason)

    def memory_version(self, room):
        return self.versions.get(room.id, 1)

    def registered(self):
        self.registrations += 1

    def disown(self, room):
        self.disowned.append(room.id)
        self.engines.pop(room.id, None)

    def peer_count(self):
        return 2


def desk_of(role: Role = Role.DECODE, ranks: int = 1, **options) -> EngineDesk:
    book = made_book(role, ranks=ranks, parts=Requests(role), **options)
    return EngineDesk(role, INCARNATION, "10.0.0.1:8998" if role is Role.PREFILL else "", FENCE_BOUND, book.port, book.lanes, book, book.parts)


def ask(desk: EngineDesk, msg, identity: bytes = engine(0)):
    """The engine ``identity`` sends ``msg``; the reply (a registration's, awaited)."""
    reply = desk.on_engine(identity, msg)
    return done(reply) if hasattr(reply, "send") else reply


def expect(room: int, req: int = 5) -> Expect:
    return Expect(req=req, room=room, bootstrap="10.0.0.1:8998", pages=b"", slot=0, generation=1, memory_version=1)


def send(room: int, req: int = 5) -> Send:
    return Send(req=req, room=room, pages=b"", memory_version=1)


def opening(desk: EngineDesk, room: int, req: int = 5):
    """The message of desk's role that opens ``room``."""
    return expect(room, req) if desk.role is Role.DECODE else send(room, req)


def opened(desk: EngineDesk, room: int, identity: bytes = engine(0), to: RoomState = T):
    """A room of the engine ``identity``, moved on to ``to``."""
    assert ask(desk, opening(desk, room), identity) == Ok(req=5)
    found = desk.book.rooms.get(room_key(room, desk.lanes.of(identity).code))
    if to is not B:
        desk.book.advance(found, Event.BOOTSTRAPPED)
    if to is T:
        desk.book.advance(found, Event.INPUT_READY)
    desk.port.take(), desk.book.parts.take()
    return found


# --- polls and releases


def test_a_poll_answers_a_live_rooms_status_and_a_forgotten_rooms_outcome_fenced():
    desk = desk_of()
    room = opened(desk, 7)
    assert ask(desk, Poll(req=6, room=7)) == RoomStatus(req=6, room=7, state=T)
    desk.book.parts.engines.pop(room.id)  # nobody to tell: a failed room goes once fenced
    desk.book.fail(room, ErrorCode.PEER_DEAD, "prefill gone")
    assert desk.book.rooms.find(7) is None
    assert ask(desk, Poll(req=7, room=7)) == RoomStatus(req=7, room=7, state=F, code=ErrorCode.PEER_DEAD, reason="prefill gone", fenced=True)
    reply = ask(desk, Poll(req=8, room=9))
    assert isinstance(reply, Error) and (reply.req, reply.code, reply.room) == (8, ErrorCode.UNKNOWN_ROOM, 9)


def test_a_poll_and_a_release_name_the_room_of_the_asking_engines_rank():
    desk = desk_of(ranks=2)
    mine = opened(desk, 7, engine(1))
    assert mine.id == room_key(7, 1) and mine.lane == 1
    assert ask(desk, Poll(req=6, room=7), engine(1)) == RoomStatus(req=6, room=7, state=T)
    assert ask(desk, Poll(req=6, room=7), engine(0)).code is ErrorCode.UNKNOWN_ROOM  # rank 0 has no room 7


def test_a_live_room_cannot_be_released_the_refusal_says_abort_it_first():
    desk = desk_of()
    room = opened(desk, 7)
    reply = ask(desk, Release(req=6, room=7))
    assert reply == Error(req=6, code=ErrorCode.BAD_MESSAGE, message="room 7 is transferring; abort it before releasing it", room=7)
    assert desk.book.rooms.find(7) is room and not room.released and desk.book.parts.take() == []
    assert ask(desk, Release(req=0, room=7)) is None  # fire and forget: the refusal is logged, not sent
    room.writers.add("leg")
    desk.book.fail(room, ErrorCode.TRANSFER_FAILED, "write failed")
    desk.book.parts.take()
    assert ask(desk, Release(req=7, room=7)) == Ok(req=7)
    assert desk.book.parts.take() == [("release", 7, None)]
    assert room.released and desk.book.rooms.find(7) is room  # not fenced yet: it stays


def test_a_finished_room_released_without_a_reply_asked_for_gets_none():
    desk = desk_of()
    room = opened(desk, 7)
    desk.book.succeed(room, Event.AUX_LANDED)
    assert ask(desk, Release(req=0, room=7)) is None and desk.book.rooms.find(7) is None


# --- aborts


def test_an_abort_fails_a_live_room_naming_the_engine_and_its_reason():
    desk = desk_of(Role.PREFILL)
    room = opened(desk, 7)
    assert ask(desk, Abort(req=6, room=7, reason="client went away")) == Ok(req=6)
    assert (room.state, room.code, room.reason) == (F, ErrorCode.ABORTED, "aborted by the prefill engine: client went away")


def test_an_abort_of_a_room_never_seen_leaves_a_tombstone_a_late_peer_or_poll_finds():
    desk = desk_of()
    assert ask(desk, Abort(req=6, room=9, reason="client went away")) == Ok(req=6)
    reason = "aborted by the decode engine: client went away"
    assert desk.book.rooms.find(9) is None  # nothing can land for it and no engine holds it: gone at once
    assert desk.book.finished[9] == (F, ErrorCode.ABORTED, reason)
    assert ask(desk, Poll(req=7, room=9)) == RoomStatus(req=7, room=9, state=F, code=ErrorCode.ABORTED, reason=reason, fenced=True)
    assert desk.book.outcomes["failed"] == 1


def test_an_abort_asking_no_reply_gets_none_but_still_fails_the_room():
    desk = desk_of()
    room = opened(desk, 7)
    assert ask(desk, Abort(req=0, room=7)) is None and room.state is F


# --- new rooms, and refusing them


@pytest.mark.parametrize("role, message", [
    (Role.DECODE, expect(7)),
    (Role.PREFILL, send(7)),
    (Role.PREFILL, Announce(req=5, room=7)),
])
def test_a_draining_daemon_refuses_new_rooms_as_busy_and_its_role_never_hears_of_them(role, message):
    desk = desk_of(role)
    desk.draining = True
    reply = ask(desk, message)
    assert isinstance(reply, Busy) and (reply.req, reply.room, reply.retry_after_ms) == (5, 7, 1000)
    assert "draining for shutdown" in reply.reason
    assert desk.book.parts.asked == [] and len(desk.book.rooms) == 0


def test_a_draining_daemon_still_answers_about_rooms_it_holds():
    desk = desk_of()
    opened(desk, 7)
    desk.draining = True
    assert ask(desk, Poll(req=6, room=7)) == RoomStatus(req=6, room=7, state=T)
    assert ask(desk, Abort(req=7, room=7)) == Ok(req=7)


def test_a_bug_in_a_handler_answers_that_request_alone_as_internal_and_is_counted():
    """H1: the daemon goes on; the next request is served as usual."""
    desk = desk_of()
    desk.book.parts.bug = RuntimeError("boom")
    reply = ask(desk, expect(7))
    assert reply == Error(req=5, code=ErrorCode.INTERNAL, message="internal error: RuntimeError('boom')", room=7)
    assert desk.book.failures["internal"] == 1
    desk.book.parts.bug = None
    assert ask(desk, expect(8, req=6)) == Ok(req=6)
    stats = ask(desk, GetStats(req=9))
    assert stats == Stats(req=9, rooms={**{s.value: 0 for s in RoomState}, "bootstrapping": 1},
                          slots={**{s.value: 0 for s in SlotState}, "free": SLOTS}, failures={"internal": 1}, peers=2)


def test_a_refusal_the_role_raises_keeps_its_code_and_is_not_counted_as_a_bug():
    desk = desk_of()
    desk.book.parts.bug = InsufficientCapacity("too many pages", room=7)
    assert ask(desk, expect(7)) == Error(req=5, code=ErrorCode.INSUFFICIENT_CAPACITY, message="too many pages", room=7)
    assert desk.book.failures["internal"] == 0


def test_an_unexpected_message_is_refused():
    desk = desk_of()
    reply = ask(desk, Ok(req=4))
    assert (reply.code, reply.message) == (ErrorCode.BAD_MESSAGE, "unexpected message Ok")


@pytest.mark.parametrize("role, message, says", [
    (Role.DECODE, send(7), "send() goes to a prefill daemon; this one is decode"),
    (Role.DECODE, Announce(req=5, room=7), "announce() goes to a prefill daemon; this one is decode"),
    (Role.PREFILL, expect(7), "expect() goes to a decode daemon; this one is prefill"),
])
def test_a_room_request_of_the_other_role_is_refused_naming_the_daemon_it_goes_to(role, message, says):
    desk = desk_of(role)
    assert ask(desk, message) == Error(req=5, code=ErrorCode.BAD_MESSAGE, message=says, room=7)
    assert desk.book.parts.asked == [] and desk.book.failures["internal"] == 0


# --- hello


def test_an_engine_speaking_another_protocol_is_refused_naming_both_versions():
    desk = desk_of()
    lanes = len(desk.lanes)
    hello = EngineHello(req=1, version=PROTOCOL_VERSION + 1, engine_id="x", role=Role.DECODE, pid=4321)
    reply = ask(desk, hello, b"new")
    assert isinstance(reply, Error) and reply.code is ErrorCode.VERSION_MISMATCH
    assert reply.message == f"engine speaks protocol {PROTOCOL_VERSION + 1}, this daemon speaks {PROTOCOL_VERSION}"
    assert len(desk.lanes) == lanes and desk.port.watched == {}  # nothing of it kept


def test_an_engine_hello_is_welcomed_with_what_this_daemon_is_and_its_process_watched():
    desk = desk_of(Role.PREFILL)
    hello = EngineHello(req=1, version=PROTOCOL_VERSION, engine_id="x", role=Role.PREFILL, rank=Rank(tp=1), sizes=Rank(tp=2), pid=4321, pid_namespace=99)
    assert ask(desk, hello, b"new") == Welcome(req=1, version=PROTOCOL_VERSION, role=Role.PREFILL, incarnation=INCARNATION,
                                               bootstrap="10.0.0.1:8998", fence_bound=FENCE_BOUND)
    assert desk.lanes.of(b"new").name == "x rank pp=0 tp=1" and desk.port.watched == {b"new": (4321, 99)}
    ask(desk, EngineHello(req=2, version=PROTOCOL_VERSION, engine_id="y", role=Role.PREFILL), b"pidless")
    assert b"pidless" not in desk.port.watched


# --- replies the engine did not ask for


def test_messages_sent_without_a_request_id_get_no_ok():
    desk = desk_of()
    grant = ask(desk, AllocSlot(req=0, count=2))
    assert isinstance(grant, SlotGrant)  # an answer, not an ok: it is sent
    assert ask(desk, FreeSlot(req=0, slot=grant.slot, generation=grant.generation)) is None
    assert desk.lanes[0].aux.slots.slots[grant.slot].state is SlotState.FREE
    assert ask(desk, FreeSlot(req=0, slot=grant.slot, generation=grant.generation)) is None  # stale now: logged, not sent
    assert ask(desk, expect(7, req=0)) is None and desk.book.rooms.find(7) is not None
    assert ask(desk, FreeSlot(req=3, slot=grant.slot, generation=grant.generation)).code is ErrorCode.STALE_SLOT


def test_slots_are_granted_as_many_as_asked_and_free():
    desk = desk_of()
    grant = ask(desk, AllocSlot(req=3, count=3))
    assert (grant.req, grant.payload_bytes, len(grant.more)) == (3, SLOT_BYTES - HEADER_BYTES, 2)
    assert len({grant.slot, *(slot for slot, _ in grant.more)}) == 3
    rest = ask(desk, AllocSlot(req=4, count=SLOTS))
    assert len(rest.more) == SLOTS - 3 - 1  # what was left
    busy = ask(desk, AllocSlot(req=5))
    assert isinstance(busy, Busy) and busy.retry_after_ms == 20 and "no free aux slot" in busy.reason


# --- registrations


def test_a_registration_is_answered_once_mapped_and_its_role_hears_of_it():
    desk = desk_of()
    assert ask(desk, kv_registration("kv-0", version=2)) == Ok(req=1)
    assert desk.book.parts.registrations == 1
    reply = ask(desk, kv_registration("kv-0", version=2))
    assert reply.code is ErrorCode.STALE_MEMORY_VERSION and "pass memory_version=3 or above" in reply.message
    assert desk.book.parts.registrations == 1


def test_the_same_memory_registered_again_fails_the_lanes_live_rooms_planned_against_the_old_version():
    desk = desk_of(ranks=2)
    stale, current, finished = opened(desk, 7), opened(desk, 8), opened(desk, 9)
    desk.book.parts.versions[current.id] = 2
    desk.book.succeed(finished, Event.AUX_LANDED)
    elsewhere = opened(desk, 7, engine(1))
    assert ask(desk, kv_registration("kv-0", version=2)) == Ok(req=1)
    assert (stale.state, stale.code) == (F, ErrorCode.STALE_MEMORY_VERSION)
    assert stale.reason == "the engine re-registered its KV cache (memory version 1 -> 2) while this room was transferring"
    assert current.state is T and finished.state is S and elsewhere.state is T  # newer, finished, or another rank's


def test_new_memory_fails_every_live_room_of_the_lane_whatever_its_version():
    desk = desk_of()
    room = opened(desk, 7, to=W)
    desk.book.parts.versions[room.id] = 5
    assert ask(desk, kv_registration("kv-new", version=1)) == Ok(req=1)
    assert (room.code, room.reason) == (ErrorCode.STALE_MEMORY_VERSION,
                                        "the engine registered new KV memory (a restarted engine?) while this room was waiting_for_input")


# --- engines that go, and shutdown


def test_an_engine_gone_fails_and_disowns_exactly_its_rooms_and_those_fenced_go():
    desk = desk_of(ranks=2)
    quiet, busy, other = opened(desk, 7), opened(desk, 8), opened(desk, 7, engine(1))
    busy.writers.add("leg")
    assert desk.engine_gone(engine(0), "its process exited") == 2
    assert desk.book.parts.disowned == [quiet.id, busy.id]
    assert (busy.code, busy.reason) == (ErrorCode.ENGINE_GONE, "e: its process exited")
    assert desk.book.rooms.find(quiet.id) is None and desk.book.finished[quiet.id][1] is ErrorCode.ENGINE_GONE  # fenced: nobody releases it
    assert desk.book.rooms.find(busy.id) is busy  # it waits for its fence, then goes
    assert other.state is T and engine(0) not in desk.lanes.engines and engine(1) in desk.lanes.engines
    assert desk.port.take() == []  # the engine is gone: nobody to tell


def test_shutdown_fails_every_live_room_and_counts_them():
    desk = desk_of()
    live, done_ = opened(desk, 7), opened(desk, 8)
    desk.book.succeed(done_, Event.AUX_LANDED)
    assert desk.fail_live(ErrorCode.ABORTED, "the daemon shut down") == 1
    assert (live.code, live.reason, done_.state) == (ErrorCode.ABORTED, "the daemon shut down", S)
    counters = desk.counters()
    assert (counters["rooms_succeeded"], counters["rooms_failed"], counters["lanes"]) == (1.0, 1.0, 1.0)
    assert counters["engine_messages"] == desk.messages == 2
