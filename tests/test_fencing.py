"""Fencing against a frozen writer (S2), with real daemons and the real transfer engine.

A prefill daemon frozen (SIGSTOP) while its transfer engine still holds writes it
was handed keeps those writes: on SIGCONT the engine's threads send them, whatever
leases ran out meanwhile. So the decode side may hand a failed room's pages back to
its engine only on proof that nothing of the room can land: the prefill's own word
(it confirms once its writes settled), a new incarnation, or an operator cut that
replaces the decode's transfer sessions. Here the rooms are large (tens of MB in
flight) so that SIGSTOP catches writes inside the engine, and every byte of every
reused room is checked after the writer resumed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdxfer.core.protocol import AdminPeers, RoomState
from pdxfer.ops.inspection import AdminClient

from .conftest import needs_mooncake, small_layout
from .roomkit import HB_BOUND, HB_FLAGS, SLACK, Freezer, engine, reuse_pages, send_room, start_room, statuses, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

S, F = RoomState.SUCCESS, RoomState.FAILED
T_TIMEOUT, F_TIMEOUT = 2.0, 0.5  # the decode's lease: before this change it fenced by then
LEASE_SPAN = T_TIMEOUT + F_TIMEOUT
ROOMS = 8
SPAN = 48  # pages per room's stretch; a room takes every other one (scattered: many blocks)
# 4 regions of 16 tokens x 8 KiB: 512 KiB per page index; a room is 24 pages, 12 MiB.
LAYOUT = small_layout(num_layers=2, num_pages=ROOMS * SPAN + 2, page_size=16, token_bytes=8192)
PREFILL_FLAGS = (*HB_FLAGS, "--stall-timeout", "60", "--bootstrap-timeout", "30")  # a long freeze is not a stall
DECODE_FLAGS = (*HB_FLAGS, "--transfer-timeout", str(T_TIMEOUT), "--fence-timeout", str(F_TIMEOUT), "--admin-writes")
WANTED_RUNS = 20  # runs in which the freeze caught at least one room mid-transfer
MAX_TRIES = 45


def room_pages(k: int) -> np.ndarray:
    return np.arange(2 + k * SPAN, 2 + (k + 1) * SPAN, 2)


def fence_pending(decode) -> int:
    with AdminClient(decode.ready["admin"]) as admin:
        return sum(p.fence_pending for p in admin.call(AdminPeers).peers)


def start_rooms(cp, cd, bootstrap: str, first_id: int, seed: int) -> list:
    """Every room's pages filled and expected first, then every send() at once: the
    freeze that follows finds them all in flight."""
    cases = [start_room(cp, cd, bootstrap, first_id + k, room_pages(k), room_pages(k), seed=seed + k, send=False) for k in range(ROOMS)]
    for case in cases:
        send_room(case)
    return cases


def release_all(cases) -> None:
    for case in cases:
        case.decode.release(case.id)
        case.prefill.release(case.id)


def settled_on_prefill(cp, cases) -> bool:
    """Every room finished on the prefill and, failed ones, fenced there: its writes settled."""
    return all(s.state is S or (s.state is F and s.fenced) for s in statuses(cp, [c.id for c in cases]).values())


@pytest.mark.timeout(900)
def test_a_frozen_prefill_s_queued_writes_never_land_in_reused_pages(daemons):
    p = daemons("prefill", *PREFILL_FLAGS, name="p")
    d = daemons("decode", *DECODE_FLAGS, name="d")
    cp, cd = engine(p, LAYOUT), engine(d, LAYOUT)
    freezer = Freezer(p)
    caught = tries = checked_rooms = 0
    try:
        while caught < WANTED_RUNS:
            tries += 1
            assert tries <= MAX_TRIES, f"only {caught} of {tries - 1} freezes caught a room mid-transfer"
            cases = start_rooms(cp, cd, p.bootstrap, 1000 * tries, seed=tries * 100)
            time.sleep(0.001 * (tries % 4))  # freeze at varied points of the transfers
            freezer.stop()
            ended = wait_until(lambda: (got := statuses(cd, [c.id for c in cases])) and all(s.state in (S, F) for s in got.values()) and got,
                               HB_BOUND + SLACK, "every room to end on the decode")
            failed = [c for c in cases if ended[c.id].state is F]
            if failed:
                caught += 1
                time.sleep(LEASE_SPAN + 0.3)  # the old lease has run out: a timer would have fenced by now
                early = [c.id for c in failed if statuses(cd, [c.id])[c.id].fenced]
                reused = {c.id: reuse_pages(c, 0xA5) for c in failed if c.id in early}  # what an engine would do
                assert not early, f"run {tries}: rooms {early} fenced while their writer was frozen"
                assert fence_pending(d) == len(failed)
            freezer.resume()
            # The prefill wakes, fails the rooms too, lets its queued writes settle, and says so.
            wait_until(lambda: settled_on_prefill(cp, cases), 30, "the prefill's writes to settle")
            for case in failed:
                status = cd.wait(case.id, timeout=SLACK)
                assert status.state is F and status.fenced, status
                reused.setdefault(case.id, reuse_pages(case, 0xA5))
            time.sleep(0.2)
            for case in failed:
                for region, (arr, data) in enumerate(zip(cd.kv.arrays(), reused[case.id])):
                    assert np.array_equal(arr[case.dst], data), f"run {tries}, room {case.id}, KV region {region}: a write landed in reused pages"
                checked_rooms += 1
            for case in cases:
                if ended[case.id].state is S:
                    case.check_bytes()
            release_all(cases)
            wait_until(lambda: cp.stats().peers == 1, HB_BOUND + SLACK, "the decode to be known to the prefill again")
            time.sleep(2 * HB_BOUND)  # messages the freeze held back drain before the next run
        assert fence_pending(d) == 0 and cd.stats().slots["quarantined"] == 0
        print(f"{caught} freezes caught rooms mid-transfer in {tries} runs; {checked_rooms} reused rooms checked byte for byte")
        assert p.alive() and d.alive()
    finally:
        freezer.thaw()
        cp.close()
        cd.close()
