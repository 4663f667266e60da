"""Fencing that ends (proto/PROTOCOL.md, "Fencing"), with real daemons and the real
transfer engine: a prefill that goes silent with writes queued has its rooms fenced by
ending the decode's transfer sessions, by an operator's cut or by the fence bound, and
nothing it resumes with lands in pages a new room took; another prefill writing
throughout loses nothing.

Each test runs a frozen (or killed) prefill ``p1``, a live prefill ``p2`` and a decode
daemon ``d``. A thread moves rooms from p2 to d the whole time, into pages of their own,
every byte checked. The rooms from p1 are large (12 MiB, scattered pages) so that the
freeze catches writes inside p1's transfer engine. Once they are fenced, p2 writes new
rooms into the very same pages (what an engine does with pages it got back); p1
resumes; every byte of those rooms is checked again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from pdxfer.client import Client
from pdxfer.core.protocol import AdminPeers, RoomState
from pdxfer.ops.inspection import AdminClient

from .conftest import needs_mooncake, small_layout
from .roomkit import HB_BOUND, HB_FLAGS, SLACK, Freezer, kill, start_room, send_room, statuses, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

S, F = RoomState.SUCCESS, RoomState.FAILED
ROOMS = 8
SPAN = 48  # pages per room's stretch; a room takes every other one (scattered: many blocks)
LAYOUT = small_layout(num_layers=2, num_pages=ROOMS * SPAN + 2, page_size=16, token_bytes=8192)  # 12 MiB a room
LIVE_LAYOUT = small_layout(num_layers=2, num_pages=64, page_size=16, token_bytes=1024)
FENCE_BOUND = HB_BOUND + 1.5  # the decode's --fence-bound: at least 1 s over the heartbeat bound
PREFILL_FLAGS = (*HB_FLAGS, "--stall-timeout", "60", "--bootstrap-timeout", "30")  # a long freeze is not a stall
WANTED_RUNS = 20  # runs in which the freeze caught at least one room mid-transfer
MAX_TRIES = 45


def decode_flags(fence_bound: float) -> tuple[str, ...]:
    return (*HB_FLAGS, "--fence-bound", str(fence_bound), "--admin-writes")


def room_pages(k: int) -> np.ndarray:
    return np.arange(2 + k * SPAN, 2 + (k + 1) * SPAN, 2)


def client(daemon, layout, engine_id: str = "") -> Client:
    c = Client(daemon.engine, timeout=30, engine_id=engine_id)
    c.connect()
    c.create_kv_pool(layout)
    c.create_aux_buffer(32, 64)
    return c


def peers(decode) -> dict:
    with AdminClient(decode.ready["admin"]) as admin:
        return {p.address: p for p in admin.call(AdminPeers).peers}


def fence_pending(decode) -> int:
    return sum(p.fence_pending for p in peers(decode).values())


class LiveTraffic:
    """Rooms from the live prefill to the decode, one after another on a thread of their
    own (engines of their own on both daemons), every byte checked, until stopped."""

    def __init__(self, prefill, decode) -> None:
        self.cp, self.cd = client(prefill, LIVE_LAYOUT, "live"), client(decode, LIVE_LAYOUT, "live")
        self.bootstrap = prefill.bootstrap
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-traffic", daemon=True)

    def __enter__(self) -> LiveTraffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        room = 900_000
        while not self._stop.is_set():
            room += 1
            pages = np.arange(1 + room % 4 * 8, 9 + room % 4 * 8)
            try:
                case = start_room(self.cp, self.cd, self.bootstrap, room, pages, pages, seed=room)
                status = self.cd.wait(room, timeout=30)
                if status.state is not S:
                    self.failures.append(f"room {room}: {status.state.value} {status.reason}")
                else:
                    case.check_bytes()
                    self.done += 1
                self.cp.wait(room, timeout=30)
                self.cd.release(room)
                self.cp.release(room)
            except Exception as exc:  # noqa: BLE001 (a test thread: every failure is reported)
                self.failures.append(f"room {room}: {exc!r}")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        self.cp.close()
        self.cd.close()


def start_rooms(cp, cd, bootstrap: str, first_id: int, seed: int) -> list:
    """Every room's pages filled and expected first, then every send() at once: the
    freeze that follows finds them in flight."""
    cases = [start_room(cp, cd, bootstrap, first_id + k, room_pages(k), room_pages(k), seed=seed + k, send=False) for k in range(ROOMS)]
    for case in cases:
        send_room(case)
    return cases


def reuse(cp2, cd, bootstrap2: str, failed, first_id: int, seed: int) -> list:
    """Rooms from the live prefill into the failed rooms' pages, each succeeded with its bytes checked."""
    cases = [start_room(cp2, cd, bootstrap2, first_id + i, room_pages(i), case.dst, seed=seed + i) for i, case in enumerate(failed)]
    for case in cases:
        assert cd.wait(case.id, timeout=SLACK + 10).state is S
        case.check_bytes()
    return cases


def settled_on_prefill(cp, cases) -> bool:
    return all(s.state is S or (s.state is F and s.fenced) for s in statuses(cp, [c.id for c in cases]).values())


def release(cases) -> None:
    for case in cases:
        case.decode.release(case.id)
        case.prefill.release(case.id)


def freeze_runs(daemons, fence) -> None:
    """The runs both fencing tests share: ``fence(decode, p1, failed)`` must get the failed
    rooms fenced while p1 stays frozen."""
    p1 = daemons("prefill", *PREFILL_FLAGS, name="p1")
    p2 = daemons("prefill", *PREFILL_FLAGS, "--bootstrap-port", "0", name="p2")
    d = daemons("decode", *decode_flags(FENCE_BOUND if fence is None else 60.0), name="d")
    cp1, cp2, cd = client(p1, LAYOUT), client(p2, LAYOUT), client(d, LAYOUT)
    freezer = Freezer(p1)
    caught = tries = checked = 0
    try:
        with LiveTraffic(p2, d) as live:
            while caught < WANTED_RUNS:
                tries += 1
                assert tries <= MAX_TRIES, f"only {caught} of {tries - 1} freezes caught a room mid-transfer"
                cases = start_rooms(cp1, cd, p1.bootstrap, 1000 * tries, seed=tries * 100)
                time.sleep(0.001 * (tries % 4))  # freeze at varied points of the transfers
                frozen_at = freezer.stop()
                ended = wait_until(lambda: (got := statuses(cd, [c.id for c in cases])) and all(s.state in (S, F) for s in got.values()) and got,
                                   HB_BOUND + SLACK, "every room to end on the decode")
                failed = [c for c in cases if ended[c.id].state is F]
                reused = []
                if failed:
                    caught += 1
                    assert time.monotonic() - frozen_at <= HB_BOUND + SLACK
                    (fence or fenced_by_bound)(d, p1, failed, frozen_at)
                    assert all(s.fenced for s in statuses(cd, [c.id for c in failed]).values())
                    assert fence_pending(d) == 0
                    for case in failed:  # the decode engine takes its pages back; the frozen prefill's side waits
                        cd.release(case.id)
                    reused = reuse(cp2, cd, p2.bootstrap, failed, 500_000 + 1000 * tries, seed=tries * 100 + 50)
                freezer.resume()
                # The prefill wakes, fails its rooms, and its queued writes fail against the ended sessions.
                wait_until(lambda: settled_on_prefill(cp1, cases), 30, "the frozen prefill's writes to settle")
                time.sleep(0.3)
                for case in reused:
                    case.check_bytes()  # not a byte of the frozen prefill's landed in the reused pages
                    checked += 1
                for case in cases:
                    if ended[case.id].state is S:
                        case.check_bytes()
                release(reused)
                release([c for c in cases if c not in failed])
                for case in failed:
                    cp1.release(case.id)
                wait_until(lambda: cp1.stats().peers == 1, HB_BOUND + SLACK, "the decode to be known to the frozen prefill again")
                time.sleep(2 * HB_BOUND)  # messages the freeze held back drain before the next run
            assert not live.failures, live.failures[:5]
            assert live.done > WANTED_RUNS, f"the live prefill moved only {live.done} rooms"
        assert fence_pending(d) == 0 and cd.stats().slots["quarantined"] == 0
        print(f"{caught} freezes caught rooms mid-transfer in {tries} runs; {checked} reused rooms checked byte for byte; "
              f"{live.done} rooms of the live prefill meanwhile, none failed")
        assert p1.alive() and p2.alive() and d.alive()
    finally:
        freezer.thaw()
        for c in (cp1, cp2, cd):
            c.close()


def fenced_by_bound(decode, p1, failed, frozen_at: float) -> None:
    """No one acts: the decode says the frozen prefill is silent, with its rooms waiting
    and when they will be fenced, and fences them by the bound."""
    def shown():
        info = peers(decode).get(f"tcp://{p1.bootstrap}")
        return info if info is not None and info.state == "silent" and info.fence_pending == len(failed) else None

    info = wait_until(shown, HB_BOUND + SLACK, "the decode to show the frozen prefill silent with its rooms waiting")
    assert 0 <= info.fence_in <= FENCE_BOUND
    wait_until(lambda: all(s.fenced for s in statuses(failed[0].decode, [c.id for c in failed]).values()),
               FENCE_BOUND + SLACK, "the automatic fence")
    assert time.monotonic() - frozen_at <= FENCE_BOUND + SLACK


def cut(decode, p1, failed, frozen_at: float) -> None:
    """The operator cuts the frozen prefill: answered once its rooms are fenced."""
    assert fence_pending(decode) == len(failed)
    with AdminClient(decode.ready["admin"], timeout=30) as admin:
        reply = admin.call(AdminPeers, cut=p1.bootstrap)
    assert sum(p.fence_pending for p in reply.peers) == 0 and reply.fenced == len(failed)  # what `pdxfer peer P --cut` prints


@pytest.mark.timeout(900)
def test_a_prefill_frozen_past_the_fence_bound_is_fenced_by_it_and_its_queued_writes_never_land(daemons):
    freeze_runs(daemons, None)


@pytest.mark.timeout(900)
def test_an_operator_cut_of_a_frozen_prefill_really_cuts_and_its_queued_writes_never_land(daemons):
    freeze_runs(daemons, cut)


@pytest.mark.timeout(300)
def test_a_prefill_killed_and_never_back_has_its_rooms_fenced_within_the_bound_while_another_goes_on(daemons):
    p1 = daemons("prefill", *PREFILL_FLAGS, name="p1")
    p2 = daemons("prefill", *PREFILL_FLAGS, "--bootstrap-port", "0", name="p2")
    d = daemons("decode", *decode_flags(FENCE_BOUND), name="d")
    cp1, cd = client(p1, LAYOUT), client(d, LAYOUT)
    try:
        with LiveTraffic(p2, d) as live:
            time.sleep(1.0)
            cases = start_rooms(cp1, cd, p1.bootstrap, 1000, seed=100)
            time.sleep(0.002)
            killed_at = kill(p1)
            os.kill(p1.ready["engine_pid"], signal.SIGKILL)  # its transfer engine's process with it
            ended = wait_until(lambda: (got := statuses(cd, [c.id for c in cases])) and all(s.state in (S, F) for s in got.values()) and got,
                               HB_BOUND + SLACK, "every room to end on the decode")
            failed = [c for c in cases if ended[c.id].state is F]
            assert failed, "the kill caught no room mid-transfer"
            assert time.monotonic() - killed_at <= HB_BOUND + SLACK
            wait_until(lambda: all(s.fenced for s in statuses(cd, [c.id for c in failed]).values()), FENCE_BOUND + SLACK, "the fence")
            assert time.monotonic() - killed_at <= FENCE_BOUND + SLACK
            for case in cases:
                cd.release(case.id)
            time.sleep(1.0)
        assert not live.failures, live.failures[:5]
        assert live.done > 0
        assert fence_pending(d) == 0 and cd.stats().slots["quarantined"] == 0
        info = peers(d)[f"tcp://{p1.bootstrap}"]
        assert info.state in ("silent", "connecting") and info.fence_pending == 0
        print(f"{len(failed)} rooms lost with the killed prefill, fenced; {live.done} rooms of the live prefill meanwhile, none failed")
    finally:
        cp1.close()
        cd.close()
