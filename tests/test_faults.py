"""Fault injection: collisions, visibility races, transport faults, supervision and
backpressure. Daemons are real processes moving bytes through the real transfer
engine; where a fault is one the real engine cannot produce on demand (a late
duplicate write, a completion reported before the bytes land, a binding that raises)
the prefill daemon wraps its engine in pdxfer.transport.faults, which still moves
every byte through the engine and only changes when, and what it reports."""

from __future__ import annotations

import ast
import asyncio
import collections
import os
import re

import numpy as np
import pytest

from pdxfer.client import Client
from pdxfer.core import errors
from pdxfer.core.protocol import KVLayout, Layout
from pdxfer.tools.chaos import ChaosSpec, run_chaos, settled_stats

from .conftest import needs_mooncake, settle, small_layout

pytestmark = [needs_mooncake, pytest.mark.integration]

FAST = [
    "--heartbeat-interval", "0.5", "--heartbeat-misses", "10", "--fence-timeout", "1",
    "--transfer-timeout", "5", "--bootstrap-timeout", "5", "--waiting-timeout", "5",
]


def chaos(prefill, decode, spec: ChaosSpec):
    return asyncio.run(run_chaos(prefill.engine, decode.engine, prefill.bootstrap, spec))


def injected(daemon) -> collections.Counter:
    """What the fault injector says it did, from the log line it writes as its transfer
    engine's process ends: summed over every process the daemon ran."""
    daemon.stop()
    text = open(daemon.log_path).read()
    found = re.findall(r"injected faults (\{.*\})", text)
    assert found, "the daemon did not report its injected faults"
    return sum((collections.Counter(ast.literal_eval(line)) for line in found), collections.Counter())


def assert_no_leak(*daemons, slots: int) -> None:
    for daemon in daemons:
        stats = asyncio.run(settled_stats(daemon.engine, timeout=20))
        assert sum(stats.rooms.values()) == 0, f"{daemon.role} still holds rooms: {stats.rooms}"
        assert stats.slots.get("free") == slots, f"{daemon.role} leaked slots: {stats.slots}"


def test_collision_torture_4_slots_5000_rooms(daemons):
    """F1: late writes aimed at reused aux slots, random aborts on both sides, random
    stalls and out-of-order completions; 4 slots shared by 5,000 rooms."""
    prefill = daemons("prefill", *FAST, "--aux-path", "transfer_engine", "--inject-faults", "delay=0.3:3,ghost=0.4:15,seed=11")
    decode = daemons("decode", *FAST, "--aux-path", "transfer_engine")
    # As many rooms in flight as slots: more would let the two sides' slot waits
    # deadlock each other (each side allocates on its own), which only timeouts break.
    report = chaos(prefill, decode, ChaosSpec(rooms=5000, in_flight=4, slots=4, abort_rate=0.1, seed=3))
    print(report.line())
    assert report.corruptions == 0
    assert sum(report.decode.values()) == 5000 and sum(report.prefill.values()) == 5000
    assert report.verified > 2500, report.line()  # most rooms really delivered
    assert report.decode["failed:aborted"] > 0 and report.prefill["failed:aborted"] > 0
    # Late writes did land on reused slots, and every one was caught by its stamp.
    caught = report.decode["failed:aux_stamp_mismatch"] + report.caught_after_success
    assert caught > 0, report.line()
    assert_no_leak(prefill, decode, slots=4)
    faults = injected(prefill)
    assert faults["ghost"] > 100 and faults["delay"] > 100, faults


def test_completion_before_visibility_never_reports_success_early(daemons):
    """F3: the transport reports every write complete before its bytes land. With
    no grace, rooms fail their stamp or digest check rather than succeed; with a
    grace longer than the lag, they succeed once the bytes verify. Either way no
    wrong byte is ever delivered."""
    for grace, expect_success in (("0", False), ("0.2", True)):
        prefill = daemons("prefill", *FAST, "--aux-path", "transfer_engine", "--inject-faults", "early=1.0:20,seed=5", name=f"prefill-{grace}")
        decode = daemons("decode", *FAST, "--aux-path", "transfer_engine", "--verify-kv", "--visibility-grace", grace, name=f"decode-{grace}")
        report = chaos(prefill, decode, ChaosSpec(rooms=200, in_flight=8, slots=16, abort_rate=0.0, seed=9))
        print(grace, report.line())
        assert report.corruptions == 0 and report.caught_after_success == 0
        if expect_success:
            assert report.verified >= 190, report.line()
        else:
            early_failures = report.decode["failed:aux_stamp_mismatch"] + report.decode["failed:kv_digest_mismatch"]
            assert early_failures > 100, report.line()
            assert report.verified == report.decode["success"]
        assert injected(prefill)["early"] > 0


def test_window_stays_under_the_engines_per_peer_queue(daemons):
    """The engine refuses writes past its per-peer queue (after waiting
    MC_TCP_ADMISSION_TIMEOUT_MS for space; 1 ms here). pdxfer reads the same limit
    and keeps its window at half of it, so a tiny queue costs no room."""
    engine_limits = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16", "MC_TCP_ADMISSION_TIMEOUT_MS": "1"}
    prefill = daemons("prefill", *FAST, "--peer-window", "512", env=engine_limits)
    decode = daemons("decode", *FAST)
    layout = KVLayout(layout=Layout.MHA, num_layers=8, num_pages=1024, page_size=4, token_bytes=1280, dtype="uint8")
    report = chaos(prefill, decode, ChaosSpec(rooms=60, in_flight=8, slots=16, abort_rate=0, max_tokens=128, layout=layout, seed=2))
    print(report.line())
    assert report.decode == {"success": 60} and report.verified == 60, report.line()
    log = open(prefill.log_path).read()
    assert "using 8" in log and "window down to" not in log


LAYOUT_4 = KVLayout(layout=Layout.MHA, num_layers=4, num_pages=1024, page_size=4, token_bytes=1280, dtype="uint8")


def test_over_limit_batch_through_the_real_engine_is_survived(daemons):
    """Provoked for real: a batch far over the engine's per-peer queue, pushed through
    its batch API mid-run and left queued. The engine rejects most of it; then, from
    run to run, pdxfer's next writes fail, or stay pending for good (a wedged
    session), or go through. pdxfer writes failed blocks again, and re-creates the
    engine when a probe fails or the session stalls. No byte is wrong, every room
    ends, and later rooms all go through."""
    prefill = daemons("prefill", *FAST, "--stall-timeout", "1", "--inject-faults", "break_after=300")
    decode = daemons("decode", *FAST)
    first = chaos(prefill, decode, ChaosSpec(rooms=80, in_flight=4, slots=16, abort_rate=0, max_tokens=64, layout=LAYOUT_4, seed=4))
    print(first.line())
    assert first.corruptions == 0
    assert first.decode.get("success", 0) + first.decode.get("failed:transfer_failed", 0) == 80, first.line()
    then = chaos(prefill, decode, ChaosSpec(rooms=40, in_flight=4, slots=16, abort_rate=0, max_tokens=64, layout=LAYOUT_4, seed=5))
    print(then.line())
    assert then.decode == {"success": 40}, then.line()
    log = open(prefill.log_path).read()
    assert "pushed an over-limit batch" in log and "queue-full rejection" in log, log[-3000:]
    if "probe of the transfer session" in log or "stalled" in log:  # the session broke or wedged this time
        assert "works again after the reset" in log, log[-3000:]


def test_a_reset_ends_the_replaced_engines_and_writes_go_on():
    """A reset ends the engines it replaces (nothing sent to them can land any more):
    however many resets a long-lived daemon sees, it holds one set of engines."""
    from pdxfer.transport import Status
    from pdxfer.transport.mooncake import MooncakeTransport

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    writer, target = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, np.uint8)
    try:
        target.start()
        target.register(int(dst.ctypes.data), dst.nbytes)
        writer.start()
        writer.register(int(src.ctypes.data), src.nbytes)
        writer.reset()
        after_one = threads()
        for _ in range(4):
            writer.reset()
        assert threads() <= after_one, "replaced engines were kept"
        (handle,) = writer.submit(target.sessions, [int(src.ctypes.data)], [int(dst.ctypes.data)], [src.nbytes])
        assert settle(writer, handle, 10) is Status.DONE and (dst == src).all()
    finally:
        writer.close()
        target.close()


def test_broken_session_is_probed_and_the_engine_recreated(daemons):
    """A session that stays broken (every write and probe fails until the engine is
    re-created): the pump probes, resets the transport, and writes the failed
    blocks again through the new engine."""
    prefill = daemons("prefill", *FAST, "--inject-faults", "broken_after=200")
    decode = daemons("decode", *FAST)
    report = chaos(prefill, decode, ChaosSpec(rooms=60, in_flight=4, slots=16, abort_rate=0, max_tokens=64, layout=LAYOUT_4, seed=4))
    print(report.line())
    assert report.corruptions == 0 and report.decode == {"success": 60}, report.line()
    log = open(prefill.log_path).read()
    assert "probe of the transfer session" in log and re.search(r"transfer engine process \d+ started \(restart \d+\)", log)
    assert "works again after the reset" in log
    assert injected(prefill)["broken"] > 0


def test_an_error_inside_the_pump_fails_its_rooms_and_the_daemon_goes_on(daemons):
    """H1: a bug in a background thread fails the rooms it held, is counted, and
    does not take the daemon down."""
    prefill = daemons("prefill", *FAST, "--inject-faults", "raise=0.01,seed=2", "--transfer-engine-process", "inline")
    decode = daemons("decode", *FAST)
    report = chaos(prefill, decode, ChaosSpec(rooms=150, in_flight=4, slots=16, abort_rate=0, seed=6))
    print(report.line())
    assert report.corruptions == 0
    assert report.decode["failed:transfer_failed"] + report.decode["failed:peer_dead"] > 0 or report.prefill["failed:transfer_failed"] > 0
    assert report.verified > 0
    assert prefill.alive() and decode.alive()
    log = open(prefill.log_path).read()
    assert "transfer pump round failed" in log


def test_an_error_polling_the_engine_in_its_own_process_ends_that_process_and_the_daemon_goes_on(daemons):
    """H1 with --transfer-engine-process child (the default here): the binding's error
    ends the engine's process, so that none of its writes can land; the daemon starts
    another, writes the lost blocks again through it, and no byte lands wrong."""
    prefill = daemons("prefill", *FAST, "--inject-faults", "raise=0.01,seed=2")
    decode = daemons("decode", *FAST)
    report = chaos(prefill, decode, ChaosSpec(rooms=150, in_flight=4, slots=16, abort_rate=0, seed=6))
    print(report.line())
    assert report.corruptions == 0
    assert report.verified > 0
    assert prefill.alive() and decode.alive()
    log = open(prefill.log_path).read()
    assert "polling the transfer engine failed; ending this process" in log
    assert re.search(r"transfer engine process \d+ started \(restart \d+\)", log)


def test_backpressure_is_an_explicit_busy_with_a_retry_hint(daemons):
    prefill = daemons("prefill", "--max-rooms", "2")
    client = Client(prefill.engine, timeout=10)
    client.connect()
    try:
        client.create_kv_pool(small_layout())
        client.create_aux_buffer(2, 64)
        slots = [client.alloc_slot(), client.alloc_slot()]
        with pytest.raises(errors.Busy) as exc:
            client.alloc_slot()
        assert exc.value.retry_after_ms > 0 and "no free aux slot" in str(exc.value)
        client.send(1, np.array([1]), 4, slots[0], aux_bytes=0)
        client.send(2, np.array([2]), 4, slots[1], aux_bytes=0)
        with pytest.raises(errors.Busy, match="room table full"):
            client.abort(3)
        stats = client.stats()
        assert stats.rooms["bootstrapping"] == 2 and stats.slots["armed"] == 2
    finally:
        client.close()
