"""Graceful drain on SIGTERM: no new rooms, live rooms get --drain-timeout to finish,
the rest fail with a reason, then the daemon exits on its own."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from pdxfer.client import Client
from pdxfer.core import errors
from pdxfer.core.protocol import RoomState

from .conftest import needs_mooncake
from .roomkit import engine

pytestmark = [needs_mooncake, pytest.mark.integration]


def start_rooms(prefill: Client, decode: Client, bootstrap: str, rooms: range) -> None:
    for room in rooms:
        decode.expect(room, bootstrap, np.array([room % 200, room % 200 + 1]), decode.alloc_slot())
        prefill.send(room, np.array([room % 100, room % 100 + 100]), 8, prefill.alloc_slot(), aux_bytes=0)


@pytest.mark.parametrize("hold_s, drain_s, expect_success", [(1.0, 20, True), (30.0, 1, False)])
def test_sigterm_drains_rooms_in_flight_then_exits(daemons, hold_s, drain_s, expect_success):
    # The prefill's transport holds every completion up to hold_s: rooms stay in flight.
    prefill = daemons(
        "prefill", "--drain-timeout", str(drain_s), "--transfer-timeout", "60",
        "--inject-faults", f"delay=1.0:{hold_s * 1000:g},seed=3", "--stall-timeout", "60",
    )
    # A writer that leaves mid-write is released by its lease: transfer timeout + fence timeout.
    decode = daemons("decode", "--transfer-timeout", "3", "--fence-timeout", "1")
    p, d = engine(prefill), engine(decode)
    try:
        start_rooms(p, d, prefill.bootstrap, range(1, 9))
        time.sleep(0.2)
        assert p.stats().rooms["transferring"] == 8
        signalled = time.monotonic()
        prefill.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # Draining: a new room is refused as busy, with a reason and a retry hint.
        with pytest.raises(errors.Busy, match="draining") as exc:
            p.send(99, np.array([50]), 4, p.alloc_slot(), aux_bytes=0)
        assert exc.value.retry_after_ms > 0
        statuses = [d.wait(room, timeout=60) for room in range(1, 9)]
        if expect_success:
            assert all(s.state is RoomState.SUCCESS for s in statuses), statuses
        else:
            assert all(s.state is RoomState.FAILED for s in statuses), statuses
            assert all("shut down" in s.reason and "drain timeout" in s.reason for s in statuses), statuses
        assert prefill.proc.wait(drain_s + 15) == 0  # it exits by itself, cleanly
        assert time.monotonic() - signalled < drain_s + 15
    finally:
        p.close()
        d.close()
