"""The decode role's Requester on its own (roles/decode/requester.py): a rank's legs of
a room (core/topology.py), gathered with its sibling ranks' into one request per room
per prefill daemon (A5), held for the link's clock, and withdrawn when their room fails
before they leave. Built as DecodeService builds it (pieces.decode_parts), with the
recording port and the fake clock; no staging buffer (test_staging.py has those)."""

from __future__ import annotations

import pytest

from pdxfer.core import errors
from pdxfer.core.plan import pages_to_bytes
from pdxfer.core.protocol import ErrorCode, Expect, Heads, Heartbeat, KVSpec, LegRequest, Rank, RoomRequest, RoomState
from pdxfer.core.rooms import Event
from pdxfer.roles.decode.state import PrefillLink

from .pieces import DecodeParts, decode_parts, decode_room, leg
from .rig import ENDPOINT

# A decode rank of TP 2: one of the model's two KV heads.
HALF = KVSpec(page_size=4, dtype="bfloat16", num_layers_total=2, layers=(0, 2), heads=Heads(local=1, total=2, bytes_per_token_head=8))
# A decode rank of TP 1 holding both heads.
BOTH = KVSpec(page_size=4, dtype="bfloat16", num_layers_total=2, layers=(0, 2), heads=Heads(local=2, total=2, bytes_per_token_head=8))
PREFILL_CLOCK = 5_000.25  # the prefill's clock as its welcome read it, at our 1000.0 s: 4000.25 s ahead
LEAVE = 1_000.0 + 4_000.25 + 30.0 + 10.0  # a request sent at our 1000.0 s: its leave to write on the prefill's clock


def expect(room: int = 7, prefill_tp: int = 1, **fields) -> Expect:
    fields = {"slot": 3, "generation": 4, "memory_version": 1, **fields}
    return Expect(req=5, room=room, bootstrap="10.0.0.1:8998", pages=pages_to_bytes([5, 6]), prefill_sizes=Rank(tp=prefill_tp), **fields)


def heads(legs: list[LegRequest]) -> list[tuple]:
    """Each leg's (code, src head, heads, dst head, slot, generation, fan-out)."""
    return [(x.leg, x.src_head_start, x.head_count, x.dst_head_start, x.slot, x.generation, x.fan_out) for x in legs]


def clocked(parts: DecodeParts, endpoint: str = ENDPOINT) -> PrefillLink:
    """The link to ``endpoint``, whose welcome told the prefill's clock."""
    now = parts.port.clock()
    link = parts.state.links.setdefault(endpoint, PrefillLink(endpoint, last_heard=now, last_word=now))
    link.clock_sample(PREFILL_CLOCK, now)
    return link


def expects(parts: DecodeParts, link: PrefillLink, tp: int, room: int = 7):
    """Rank ``tp`` of a TP-2 decode engine expects ``room``, with its one leg from prefill
    rank 0, as the service does: the room is made, then its legs gathered. The room."""
    made = decode_room(parts, room, [leg(tp, lane=tp)], lane=tp, to=RoomState.BOOTSTRAPPING)  # each rank's own aux slot
    parts.requester.gather(link, room, parts.lanes[tp], legs_of(parts, made))
    return made


def legs_of(parts: DecodeParts, room) -> list[LegRequest]:
    return [state.request for state in parts.state.work[room.id].legs.values()]


def requests(parts: DecodeParts) -> list[RoomRequest]:
    sent = parts.port.take()
    assert all(kind == "link" and to == ENDPOINT for kind, to, _ in sent), sent
    return [message for _, _, message in sent]


# --- a rank's legs


def test_at_equal_tp_a_rank_has_one_leg_of_whole_pages_carrying_the_aux_record():
    parts = decode_parts()
    msg = expect(num_draft_tokens=2, skip_pages=1)
    assert parts.requester.legs(parts.lanes[0], msg) == [LegRequest(
        leg=0, lane=0, pages=msg.pages, slot=3, generation=4, memory_version=1, num_draft_tokens=2, skip_pages=1)]


def test_from_a_prefill_of_twice_the_tp_each_prefill_rank_writes_its_own_head_and_the_first_carries_the_aux():
    parts = decode_parts(spec=BOTH)
    legs = parts.requester.legs(parts.lanes[0], expect(prefill_tp=2))
    assert heads(legs) == [(0, 0, 1, 0, 3, 4, 1), (1 << 32, 0, 1, 1, 0, 0, 1)]
    assert [x.carries_aux for x in legs] == [True, False] and all(x.real and x.layers == (0, 0) for x in legs)


def test_each_rank_of_a_decode_of_twice_the_tp_takes_its_heads_from_the_one_prefill_rank_which_fans_out():
    parts = decode_parts(ranks=2, spec=HALF)
    assert heads(parts.requester.legs(parts.lanes[0], expect())) == [(0, 0, 1, 0, 3, 4, 2)]
    assert heads(parts.requester.legs(parts.lanes[1], expect())) == [(1, 1, 1, 0, 3, 4, 2)]


def test_a_rank_registering_heads_its_tp_does_not_give_it_is_refused_naming_the_room():
    parts = decode_parts(ranks=2, spec=BOTH)  # two heads on each of two ranks: one model's two heads split in two is one each
    with pytest.raises(errors.PdxferError) as refused:
        parts.requester.legs(parts.lanes[1], expect(room=9))
    assert (refused.value.code, refused.value.room) == (ErrorCode.BAD_MESSAGE, 9)
    assert refused.value.message == "e rank pp=0 tp=1 registered 2 local KV heads, but 2 heads over TP 2 give each rank 1"


def test_a_room_sent_now_keeps_its_pages_for_its_lease_then_the_fence_timeout():
    assert decode_parts(transfer_timeout=12.0, fence_timeout=3.0).requester.leave_span == 15.0


# --- one request per room per prefill daemon


def test_the_ranks_legs_leave_as_one_request_once_every_rank_expected_the_room():
    parts = decode_parts(ranks=2, spec=HALF)
    port, link = parts.port, clocked(parts)
    first = expects(parts, link, 0)
    assert port.take() == [] and port.timers() == [port.ms + 20]  # the other rank has expect_batch_ms to follow
    second = expects(parts, link, 1)
    assert requests(parts) == [RoomRequest(room=7, legs=(*legs_of(parts, first), *legs_of(parts, second)), lease_ms=30_000, writes_until=LEAVE)]
    port.advance(20)
    assert port.take() == [] and parts.state.pending == {}  # it left already


def test_a_rank_that_does_not_expect_holds_the_request_back_expect_batch_ms_at_most():
    parts = decode_parts(ranks=2, spec=HALF, expect_batch_ms=50.0)
    port, link = parts.port, clocked(parts)
    first = expects(parts, link, 0)
    port.advance(49)
    assert port.take() == []
    port.advance(1)
    (request,) = requests(parts)
    assert request.legs == tuple(legs_of(parts, first)) and request.writes_until == LEAVE + 0.05  # its leave from when it left


def test_one_rank_alone_asks_at_once():
    parts = decode_parts()
    link = clocked(parts)
    room = decode_room(parts, 7, to=RoomState.BOOTSTRAPPING)
    parts.requester.gather(link, 7, parts.lanes[0], legs_of(parts, room))
    assert [r.room for r in requests(parts)] == [7] and parts.port.timers() == []


def test_requests_wait_for_the_links_clock_gathering_late_ranks_and_leave_with_their_leave_from_then():
    parts = decode_parts(ranks=2, spec=HALF)
    port = parts.port
    link = parts.state.links[ENDPOINT] = PrefillLink(ENDPOINT, last_heard=port.clock())  # no welcome yet
    first = expects(parts, link, 0)
    port.advance(20)  # the batch ends: held, for the link has no clock
    assert port.take() == [] and link.held[7].legs == tuple(legs_of(parts, first)) and link.held[7].writes_until == 0.0
    second = expects(parts, link, 1)  # joins the request held
    assert port.take() == [] and len(link.held[7].legs) == 2
    port.advance(480)
    link.clock_sample(PREFILL_CLOCK, port.clock())  # the welcome, 0.5 s on: the prefill is 4000.25 - 0.5 s ahead
    parts.requester.send_held(link)
    (request,) = requests(parts)
    assert request.legs == (*legs_of(parts, first), *legs_of(parts, second)) and request.writes_until == LEAVE
    assert link.held == {}


# --- withdrawing legs that never left


def test_a_failed_rooms_legs_still_gathering_are_withdrawn_and_it_is_fenced_at_once():
    parts = decode_parts(ranks=2, spec=HALF)
    port, link = parts.port, clocked(parts)
    first = expects(parts, link, 0)
    parts.book.fail(first, ErrorCode.ABORTED, "aborted")
    assert not first.fenced  # its leg may still go: nothing proves otherwise yet
    parts.requester.withdraw(link, first)
    assert first.fenced and parts.state.work[first.id].legs[0].peer_failed and first.writers == set()
    second = expects(parts, link, 1)
    (request,) = requests(parts)
    assert request.legs == tuple(legs_of(parts, second))  # the prefill never hears of the withdrawn leg
    port.advance(20)
    assert port.take() == []


def test_a_failed_rooms_legs_held_for_the_links_clock_are_withdrawn_rank_by_rank():
    parts = decode_parts(ranks=2, spec=HALF)
    link = parts.state.links[ENDPOINT] = PrefillLink(ENDPOINT, last_heard=parts.port.clock())
    first, second = expects(parts, link, 0), expects(parts, link, 1)
    assert len(link.held[7].legs) == 2
    for room in (first, second):
        parts.book.fail(room, ErrorCode.ABORTED, "aborted")
    parts.requester.withdraw(link, first)
    assert link.held[7].legs == tuple(legs_of(parts, second)) and first.fenced and not second.fenced
    parts.requester.withdraw(link, second)
    assert link.held == {} and second.fenced


def test_a_leg_that_left_already_is_not_withdrawn():
    parts = decode_parts()
    link = clocked(parts)
    room = decode_room(parts, 7, to=RoomState.BOOTSTRAPPING)
    parts.requester.gather(link, 7, parts.lanes[0], legs_of(parts, room))
    parts.port.take()
    parts.book.fail(room, ErrorCode.ABORTED, "aborted")
    parts.requester.withdraw(link, room)
    assert not room.fenced and room.writers == {0}  # the prefill has it: only its word fences the room


def test_a_request_posted_while_the_link_was_down_goes_only_while_its_room_lives():
    parts = decode_parts()
    room = decode_room(parts, 7)
    request = RoomRequest(room=7, legs=tuple(legs_of(parts, room)))
    assert parts.requester.rooms_of(request) == [room]
    assert parts.requester.still_wanted(request) and parts.requester.still_wanted(Heartbeat(seq=1))
    parts.book.fail(room, ErrorCode.TIMEOUT, "slow")
    assert not room.fenced
    assert not parts.requester.still_wanted(request)  # its pages may be another room's once released
    assert room.fenced and parts.book.parts.calls[-1] == ("fenced", room.id, True)  # and the prefill never heard of it


def test_a_room_that_succeeded_meanwhile_is_not_asked_for_again():
    parts = decode_parts()
    room = decode_room(parts, 7)
    parts.book.succeed(room, Event.AUX_LANDED)
    assert not parts.requester.still_wanted(RoomRequest(room=7, legs=tuple(legs_of(parts, room))))
    assert room.state is RoomState.SUCCESS
