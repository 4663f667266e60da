"""A peer's messages touch only that peer's rooms (issue 30), with real daemons: a
room id that a second decode daemon also expects fails only there, not for the
first one."""

from __future__ import annotations

import time

import pytest

from pdxfer import protocol as p
from pdxfer.protocol import RoomState

from .conftest import needs_mooncake
from .roomkit import HB_FLAGS, SLACK, engine, send_room, start_room, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration, pytest.mark.timeout(180)]



def test_a_room_a_second_decode_daemon_also_expects_fails_only_there(daemons):
    """Decode A expects room R from a prefill, then decode B expects R too: the prefill
    refuses B's request, B's room fails (and is fenced: nothing was written for it),
    and B's room_failed for R, which the prefill knows as A's, leaves A's room alone."""
    prefill = daemons("prefill", *HB_FLAGS)
    first = daemons("decode", *HB_FLAGS, name="decode-a")
    second = daemons("decode", *HB_FLAGS, name="decode-b")
    pc, ac, bc = engine(prefill), engine(first), engine(second)
    try:
        room = 42
        case = start_room(pc, ac, prefill.bootstrap, room, [1, 2], [3, 4], seed=1, send=False)
        wait_until(lambda: ac.poll(room).state is RoomState.WAITING_FOR_INPUT, 10 + SLACK, "A's room to be accepted")
        bc.expect(room, prefill.bootstrap, [5, 6], bc.alloc_slot())
        theirs = wait_until(lambda: (s := bc.poll(room)).state is RoomState.FAILED and s, 5 + SLACK, "B's room to fail")
        assert theirs.state is RoomState.FAILED and theirs.code is p.ErrorCode.DUPLICATE_ROOM, theirs
        time.sleep(0.5)  # B's room_failed has reached the prefill by now
        assert ac.poll(room).state is RoomState.WAITING_FOR_INPUT, ac.poll(room)
        # The prefill wrote nothing for B's room: it says so, and B may reuse its pages.
        wait_until(lambda: bc.poll(room).fenced, 5 + SLACK, "B's failed room to be fenced")
        send_room(case)
        assert ac.wait(room).state is RoomState.SUCCESS, ac.poll(room)
        case.check_bytes()
        assert pc.wait(room).state is RoomState.SUCCESS, pc.poll(room)
        assert pc.stats().failures.get("ignored:room-of-another-peer") == 1, pc.stats().failures
    finally:
        for client in (pc, ac, bc):
            client.close()
