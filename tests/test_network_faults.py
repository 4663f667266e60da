"""Network faults between a prefill and a decode daemon in separate network
namespaces joined by a veth pair (see netns.py).

What is faulted, and what is not:

* Delay and loss act on the **bootstrap channel only**: the decode daemon reaches the
  prefill's bootstrap port through tests/faultproxy.py, running inside the decode's
  namespace. The transfer engine's data path (KV pages, and the aux record on the
  transfer-engine aux path) goes directly over the veth, not through the proxy.
  ``tc netem`` is not available in this kernel, so there is no packet-level loss:
  TCP would retransmit a lost segment anyway, and what an application sees of loss
  is latency or a broken connection, which the proxy injects as random resets.
* The partition takes the veth link down, which cuts both the bootstrap channel and
  the data path, for longer than the heartbeat bound, then brings it back.

Bounds are liveness bounds with a generous slack (roomkit.SLACK); nothing here
asserts on speed, except a lower bound showing that the proxy's delay was applied.
"""

from __future__ import annotations

import time

import pytest

from pdxfer.core import errors
from pdxfer.core.protocol import RoomState
from pdxfer.ops.inspection import daemon_counters
from pdxfer.tools.launch import stop_all

from . import netns
from .conftest import ENGINE_PATH, needs_mooncake
from .faultproxy import FaultProxy
from .roomkit import (
    HB_BOUND, HB_FLAGS, SLACK, all_in, assert_nothing_written, engine, reuse_pages, room_ids, send_room, start_room,
    wait_until,
)

NETNS_MISSING = netns.unavailable()

pytestmark = [
    needs_mooncake,
    pytest.mark.integration,
    pytest.mark.skipif(bool(NETNS_MISSING), reason=f"network namespaces unavailable: {NETNS_MISSING or '-'}"),
    pytest.mark.timeout(120),
]

S, F, T = RoomState.SUCCESS, RoomState.FAILED, RoomState.TRANSFERRING
BOOTSTRAP_PORT = 18998  # a fresh namespace has every port free
# Per-state room timeouts, short so that a room whose messages a reset lost ends soon.
B_TIMEOUT, W_TIMEOUT, T_TIMEOUT = 2.0, 2.0, 3.0
TIMEOUTS = ("--bootstrap-timeout", str(B_TIMEOUT), "--waiting-timeout", str(W_TIMEOUT),
            "--transfer-timeout", str(T_TIMEOUT), "--fence-timeout", "1")
# The longest a room can live: every state to its timeout, plus detecting a dead peer.
ROOM_BOUND = B_TIMEOUT + W_TIMEOUT + T_TIMEOUT + HB_BOUND


def pages(i: int) -> list[int]:
    i %= 63
    return [2 + 4 * i, 3 + 4 * i]


@pytest.fixture
def hb_flags():
    """Heartbeat flags for both daemons (a test may parametrize this)."""
    return HB_FLAGS


@pytest.fixture
def net(runtime_dir, tmp_path, hb_flags):
    """A fresh namespace pair; start(role, *flags) starts a daemon in its namespace.
    Daemons are stopped and the namespaces deleted at teardown, also on failure."""
    pair = netns.NetPair().create()
    started = []

    def start(role: str, *flags: str):
        ns, addr = (pair.ns_prefill, pair.PREFILL_ADDR) if role == "prefill" else (pair.ns_decode, pair.DECODE_ADDR)
        extra = ("--bootstrap-port", str(BOOTSTRAP_PORT)) if role == "prefill" else ()
        log = open(tmp_path / f"{role}.log", "w")
        daemon = netns.start_daemon_in(ns, role, runtime_dir, "--host", addr, *extra, *hb_flags, *TIMEOUTS, *ENGINE_PATH, *flags,
                                       name=role, stderr=log)
        daemon.log_path = log.name
        started.append(daemon)
        return daemon

    pair.start = start
    try:
        yield pair
        codes = dict(zip((d.role for d in started), stop_all(started)))
        assert all(code in (0, -9) for code in codes.values()), f"daemons exited abnormally: {codes}"
    finally:
        for daemon in started:
            if daemon.alive():
                daemon.proc.kill()
                daemon.proc.wait()
        pair.destroy()


@pytest.fixture
def proxied(net):
    """Both daemons, their engines, and the fault proxy in the decode's namespace in
    front of the prefill's bootstrap port. Returns (net, prefill client, decode client, proxy)."""
    p = net.start("prefill")
    d = net.start("decode")
    proxy = FaultProxy("127.0.0.1:0", f"{net.PREFILL_ADDR}:{BOOTSTRAP_PORT}", prefix=net.prefix(net.ns_decode), seed=11)
    cp, cd = engine(p, slots=64), engine(d, slots=64)
    net.daemons = (p, d)
    try:
        yield net, cp, cd, proxy
    finally:
        cp.close()
        cd.close()
        proxy.close()


# With the proxy's delay, setting up the link takes several round trips (the ZMTP
# handshake, then peer_hello / peer_welcome), and the decode counts them against the
# heartbeat bound, from the moment it opened the link. So this test uses a heartbeat
# bound well above that: 0.5 s x 4 + tick, against 100 ms each way.
SLOW_LINK_HB = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "4")


@pytest.mark.parametrize("hb_flags", [SLOW_LINK_HB], ids=["hb-2s"])
def test_added_delay_on_the_bootstrap_channel_every_room_succeeds(proxied):
    net, cp, cd, proxy = proxied
    delay = 0.1
    proxy.set(delay_ms=delay * 1000)
    t0 = time.monotonic()
    first = start_room(cp, cd, proxy.address, 100, pages(0), pages(0), seed=0)
    assert cd.wait(first.id).state is S
    # hello, room request (decode -> prefill) and the aux record (back) each crossed the delay.
    assert time.monotonic() - t0 >= 2 * delay, "the proxy's delay was not in the path"
    cases = [first] + [start_room(cp, cd, proxy.address, 101 + i, pages(1 + i), pages(1 + i), seed=1 + i) for i in range(7)]
    for case in cases:
        assert cd.wait(case.id).state is S
        case.check_bytes()
        assert cp.wait(case.id).state is S
    stats = proxy.stats()
    assert stats["accepted"] >= 1 and stats["bytes"] > 0 and stats["resets"] == 0, stats
    assert all(d.alive() for d in net.daemons)


def _start_or_record(cp, cd, bootstrap, room, seed, refused):
    """Start a room; a send() the prefill refuses because the room already failed
    (its decode half failed first, its failure arrived before the send) is an outcome
    too, recorded with its code."""
    case = start_room(cp, cd, bootstrap, room, pages(seed), pages(seed), seed=seed, send=False)
    try:
        send_room(case)
    except errors.PdxferError as exc:
        assert exc.code.value != "internal", exc
        refused[room] = exc
    return case


def test_connection_resets_every_room_ends_and_rooms_succeed_once_clean(proxied):
    net, cp, cd, proxy = proxied
    p, d = net.daemons
    proxy.set(delay_ms=5, reset_prob=0.08)
    cases, refused = [], {}
    deadline = time.monotonic() + 20
    while (len(cases) < 16 or proxy.stats()["resets"] < 2) and len(cases) < 40:
        assert time.monotonic() < deadline, f"the proxy injected only {proxy.stats()['resets']} resets"
        cases.append(_start_or_record(cp, cd, proxy.address, 100 + len(cases), len(cases), refused))
        time.sleep(0.15)
    last_start = time.monotonic()
    ids = room_ids(cases)
    sent = [r for r in ids if r not in refused]  # a refused send() left the prefill engine no room to follow

    # Every room ends, Success or Failed with a reason, on both sides, within its timeouts.
    ended = (S, F)
    dec = wait_until(lambda: all_in(cd, ids, *ended), ROOM_BOUND + SLACK, "every decode room to end")
    pre = wait_until(lambda: all_in(cp, sent, *ended), ROOM_BOUND + SLACK, "every prefill room to end")
    assert time.monotonic() - last_start <= ROOM_BOUND + SLACK
    for room in ids:
        for side, status in (("decode", dec[room]), ("prefill", pre.get(room))):
            if status is not None and status.state is F:
                assert status.code is not None and status.reason, (side, status)
                assert status.code.value != "internal", (side, status)
        if room in pre and pre[room].state is S:  # the prefill succeeds only on the decode's ack
            assert dec[room].state is S, (dec[room], pre[room])
    for case in cases:
        if dec[case.id].state is S:
            case.check_bytes()
    outcomes = {}
    for status in dec.values():
        key = status.state.value if status.state is S else status.code.value
        outcomes[key] = outcomes.get(key, 0) + 1
    assert all(x.alive() for x in (p, d)), "a daemon died"
    assert proxy.stats()["resets"] >= 2
    print("reset outcomes:", outcomes, "refused at send:", {r: e.code.value for r, e in refused.items()},
          "prefill:", sorted(s.state.value if s.state is S else s.code.value for s in pre.values()), proxy.stats())

    # Clean again: rooms succeed.
    proxy.set(delay_ms=0, reset_prob=0)
    for room in ids:
        cd.release(room)
    for room in sent:
        cp.release(room)
    wait_until(lambda: cp.stats().peers == 1, HB_BOUND + SLACK, "the prefill to know the decode")
    time.sleep(2 * HB_BOUND)  # replies to messages sent before a reconnect have drained
    fresh = [start_room(cp, cd, proxy.address, 500 + i, pages(50 + i), pages(50 + i), seed=50 + i) for i in range(5)]
    for case in fresh:
        status = cd.wait(case.id)
        assert status.state is S, (status, outcomes)
        case.check_bytes()
        assert cp.wait(case.id).state is S


PARTITION = 2.5  # seconds the link stays down: several times the heartbeat bound


def test_partition_longer_than_the_heartbeat_bound_fails_rooms_in_flight_then_heals(net):
    assert PARTITION > 2 * HB_BOUND
    # Completions are held back so the rooms are still Transferring when the link goes.
    p = net.start("prefill", "--inject-faults", "delay=1.0:3000,seed=5")
    d = net.start("decode")
    cp, cd = engine(p), engine(d)
    bootstrap = f"{net.PREFILL_ADDR}:{BOOTSTRAP_PORT}"  # direct: the partition cuts the channel itself
    try:
        cases = [start_room(cp, cd, bootstrap, 100 + i, pages(i), pages(i), seed=i) for i in range(4)]
        ids = room_ids(cases)
        wait_until(lambda: all_in(cd, ids, T) and all_in(cp, ids, T), 10 + SLACK, "every room Transferring on both sides")

        t_down = time.monotonic()
        net.set_link(False)
        try:
            dec = wait_until(lambda: all_in(cd, ids, F), HB_BOUND + SLACK, "the decode to fail the rooms")
            t_dec = time.monotonic() - t_down
            pre = wait_until(lambda: all_in(cp, ids, F), HB_BOUND + SLACK, "the prefill to fail the rooms")
            t_pre = time.monotonic() - t_down
            assert max(t_dec, t_pre) <= HB_BOUND + SLACK, (t_dec, t_pre)
            for status in [*dec.values(), *pre.values()]:
                assert status.code.value in ("peer_dead", "timeout"), status
            time.sleep(max(0.0, PARTITION - (time.monotonic() - t_down)))
        finally:
            net.set_link(True)
        assert p.alive() and d.alive()

        # Healed: the daemons find each other again and new rooms succeed.
        for room in ids:
            cd.release(room)
            cp.release(room)
        wait_until(lambda: cp.stats().peers == 1, 15 + SLACK, "the decode to say hello to the prefill again")
        time.sleep(2 * HB_BOUND)
        fresh = [start_room(cp, cd, bootstrap, 200 + i, pages(10 + i), pages(10 + i), seed=10 + i) for i in range(3)]
        for case in fresh:
            assert cd.wait(case.id).state is S
            case.check_bytes()
            assert cp.wait(case.id).state is S
    finally:
        cp.close()
        cd.close()


def test_a_request_held_up_by_a_partition_past_its_leave_to_write_writes_nothing(net):
    """The decode side gives up on a room while the link is down (and keeps its pages,
    fence-pending, with sentinel bytes the test wrote into them). The prefill, whose heartbeat bound is longer than the partition, still knows the
    decode daemon when the link heals, holds the room's input, and only then reads the
    room's request (retransmitted by TCP). The request's leave to write has run out, so
    the prefill starts no write: not one block, whatever the two daemons' settings; it
    says so, and only then is the room fenced."""
    # Prefill: 20 s of silence before it declares a peer dead; rooms wait up to 30 s.
    p = net.start("prefill", "--heartbeat-misses", "100", "--bootstrap-timeout", "30")
    # Decode: leave to write 1.5 s after sending (lease 1 s + fence 0.5 s).
    d = net.start("decode", "--transfer-timeout", "1", "--fence-timeout", "0.5")
    cp, cd = engine(p), engine(d)
    bootstrap = f"{net.PREFILL_ADDR}:{BOOTSTRAP_PORT}"
    try:
        warm = start_room(cp, cd, bootstrap, 100, pages(0), pages(0), seed=0)  # the link is up and knows the prefill's clock
        assert cd.wait(warm.id).state is S and cp.wait(warm.id).state is S
        blocks_before = daemon_counters(p.ready["admin"])["blocks_submitted"]

        t_down = time.monotonic()
        net.set_link(False)
        try:
            late = start_room(cp, cd, bootstrap, 101, pages(1), pages(1), seed=1, send=False)  # its request sits in TCP's buffers
            send_room(late)  # the prefill holds the input, waiting for the request
            status = wait_until(lambda: (s := cd.poll(late.id)).state is F and s, HB_BOUND + SLACK, "the decode to fail the room")
            assert not status.fenced, "its writer is cut off, not proven idle: fence-pending (S2)"
            reused = reuse_pages(late, 0xA5)  # sentinel bytes in the held pages: any write that lands shows
            time.sleep(max(0.0, 3.5 - (time.monotonic() - t_down)))
        finally:
            net.set_link(True)

        failed = wait_until(lambda: all_in(cp, [late.id], F), 10 + SLACK, "the prefill to read the late request")[late.id]
        assert failed.code.value == "lease_expired" and "leave to write ran out" in failed.reason, failed
        assert_nothing_written(p, blocks_before, late, reused)
        assert cd.wait(late.id, timeout=SLACK).fenced  # the prefill confirmed once the link healed
        assert p.alive() and d.alive()
    finally:
        cp.close()
        cd.close()
