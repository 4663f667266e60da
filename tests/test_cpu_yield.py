"""The daemon's own threads yield the cores to the transfer engine's (cpu_yield.py):
when to yield and take them back (pure), the policies real threads get, a process
that could not take the cores back not yielding at all, and a real daemon starved by
another process on its core taking them back."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from pdxfer.client import Client
from pdxfer.host import cpu_yield
from pdxfer.host.cpu_yield import CALM_FIRST, CALM_MAX, Yielding
from pdxfer.transport.pump import TransferPump

from .conftest import needs_mooncake
from .roomkit import free_port, wait_until
from .test_pump import FakeTransport
from .test_metrics import scrape, value

UNAVAILABLE = cpu_yield.unavailable()
needs_sched_idle = pytest.mark.skipif(bool(UNAVAILABLE), reason=f"this process cannot yield: {UNAVAILABLE or '-'}")


# --- when (pure)


def test_heartbeats_tighter_than_the_minimum_rule_yielding_out():
    assert cpu_yield.too_tight(cpu_yield.MIN_SILENCE_BOUND) == ""
    assert cpu_yield.too_tight(5.0) == ""
    assert "0.3s of silence" in cpu_yield.too_tight(0.3)


def test_the_cores_are_taken_back_only_when_the_loop_waits_while_the_process_is_not_busy():
    y = Yielding(now=0.0)
    assert y.active
    for now in (1.0, 2.0):
        assert y.window(1.0, loop_wait=0.5, own_cpu=0.0, now=now, working=True) is None  # half the window: not yet
    for now in (3.0, 4.0):
        assert y.window(1.0, loop_wait=0.9, own_cpu=0.5, now=now, working=True) is None  # behind its own engine's threads: the point
    assert y.window(2.0, loop_wait=1.5, own_cpu=1.0, now=6.0, working=True) is None
    assert y.active and y.returns == 0
    assert y.window(2.0, loop_wait=1.1, own_cpu=0.9, now=8.0, working=True) is None  # one starved window is not enough
    assert y.window(2.0, loop_wait=1.1, own_cpu=0.9, now=10.0, working=True) is False
    assert not y.active and y.returns == 1


def test_an_idle_daemon_keeps_yielding_however_long_it_waits_for_a_core():
    """An engine filling its pools on every core right after registering them: one
    window with its calls, then many starved ones with nothing for the daemon to do."""
    y = Yielding(now=0.0)
    assert _starve(y, 1.0) is None  # the registration's window
    for now in range(2, 30):
        assert _starve(y, float(now), working=False) is None
    assert _starve(y, 30.0) is None  # work again: the count started over
    assert y.active and y.returns == 0
    assert _starve(y, 31.0) is False


def test_starved_windows_must_come_in_a_row():
    y = Yielding(now=0.0)
    for now in range(1, 20, 2):
        assert _starve(y, float(now)) is None
        assert _calm(y, now + 1.0) is None
    assert y.active


def _starve(y: Yielding, now: float, working: bool = True) -> bool | None:
    return y.window(1.0, loop_wait=0.9, own_cpu=0.0, now=now, working=working)


def _calm(y: Yielding, now: float) -> bool | None:
    return y.window(1.0, loop_wait=0.0, own_cpu=0.0, now=now, working=True)


def _take_back(y: Yielding, now: float) -> bool | None:
    _starve(y, now - 1.0)
    return _starve(y, now)


def test_after_taking_the_cores_back_it_yields_again_only_after_a_calm_that_doubles_each_time():
    y = Yielding(now=0.0)
    assert _take_back(y, 10.0) is False
    assert y.calm_needed == CALM_FIRST
    assert _calm(y, 10.0 + CALM_FIRST - 0.1) is None
    assert _calm(y, 10.0 + CALM_FIRST) is True and y.active
    t = 10.0 + CALM_FIRST + 2
    assert _take_back(y, t) is False
    assert y.calm_needed == 2 * CALM_FIRST
    assert _calm(y, t + CALM_FIRST) is None
    assert _calm(y, t + 2 * CALM_FIRST) is True
    for _ in range(20):
        _take_back(y, t)
        _calm(y, t + CALM_MAX)
    assert y.calm_needed == CALM_MAX


def test_waiting_for_a_core_at_the_normal_policy_restarts_the_calm():
    y = Yielding(now=0.0)
    _take_back(y, 0.0)
    assert y.window(1.0, loop_wait=0.1, own_cpu=0.0, now=59.0, working=False) is None  # a tenth of the window: not calm; it starts again
    assert _calm(y, 61.0) is None
    assert y.window(1.0, loop_wait=0.09, own_cpu=0.0, now=59.0 + CALM_FIRST - 0.5, working=True) is None  # under a tenth: calm
    assert _calm(y, 59.0 + CALM_FIRST) is True


# --- how (real threads)


def _policy_of_thread_started(inside) -> tuple[int, int, threading.Event, threading.Thread]:
    """A thread that ``inside(target)`` starts: its policy, its id, the event that ends
    it, and the thread."""
    seen: dict[str, int] = {}
    stop = threading.Event()

    def child() -> None:
        seen["tid"] = threading.get_native_id()
        seen["policy"] = os.sched_getscheduler(0)
        stop.wait()

    started = inside(child)
    wait_until(lambda: "policy" in seen, 5, "the child thread did not start")
    return seen["policy"], seen["tid"], stop, started


@needs_sched_idle
def test_threads_started_by_a_yielding_thread_yield_unless_started_under_normal_policy():
    done = threading.Event()
    results: dict[str, tuple] = {}

    def yielding_parent() -> None:
        cpu_yield.yield_this_thread()

        def start(target):
            t = threading.Thread(target=target)
            t.start()
            return t

        results["inherited"] = _policy_of_thread_started(start)

        def start_normal(target):
            with cpu_yield.normal_policy():
                return start(target)

        results["normal"] = _policy_of_thread_started(start_normal)
        results["parent after"] = (os.sched_getscheduler(0),)
        done.wait()

    parent = threading.Thread(target=yielding_parent)
    parent.start()
    try:
        wait_until(lambda: "parent after" in results, 5, "the parent thread did not finish")
        inherited_policy, inherited_tid, _, _ = results["inherited"]
        assert inherited_policy == os.SCHED_IDLE
        assert results["normal"][0] == os.SCHED_OTHER
        assert results["parent after"] == (os.SCHED_IDLE,)

        taken = cpu_yield.take_back()
        assert inherited_tid in taken and parent.native_id in taken
        assert os.sched_getscheduler(inherited_tid) == os.SCHED_OTHER
        assert results["normal"][1] not in taken  # it never yielded
        assert cpu_yield.yield_again(taken) == taken
        assert os.sched_getscheduler(inherited_tid) == os.SCHED_IDLE
    finally:
        cpu_yield.take_back()
        for key in ("inherited", "normal"):
            results[key][2].set()
            results[key][3].join()
        done.set()
        parent.join()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the test process is left as it was


@needs_sched_idle
def test_the_pump_started_by_a_yielding_daemon_keeps_the_normal_policy():
    """The pump takes the transfer engine's locks; under SCHED_IDLE a preempted pump
    would stall the engine's sending thread behind it (priority inversion)."""
    seen: dict[str, int] = {}

    def yielding_daemon() -> None:
        cpu_yield.yield_this_thread()
        pump = TransferPump(FakeTransport(window=4), window=4, loop=asyncio.new_event_loop(), on_write_failed=[].append)
        pump.start()
        try:
            seen["pump"] = os.sched_getscheduler(pump._thread.native_id)
            seen["daemon"] = os.sched_getscheduler(0)
        finally:
            pump.stop()

    daemon = threading.Thread(target=yielding_daemon)
    daemon.start()
    daemon.join()
    assert seen == {"pump": os.SCHED_OTHER, "daemon": os.SCHED_IDLE}


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_a_process_that_could_not_leave_sched_idle_does_not_yield_and_says_why():
    code = "from pdxfer.host import cpu_yield; print(cpu_yield.unavailable())"
    out = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert "cannot leave SCHED_IDLE" in out.stdout and "CAP_SYS_NICE" in out.stdout


# --- a real daemon


def _policies(pid: int) -> dict[int, int]:
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@needs_mooncake
@needs_sched_idle
@pytest.mark.integration
def test_a_daemon_yields_its_own_threads_and_leaves_the_transfer_engines_alone(daemons):
    port = free_port()
    d = daemons("decode", "--http-port", str(port), "--yield-cpu")
    pid = d.ready["pid"]
    policies = _policies(pid)
    assert policies[pid] == os.SCHED_IDLE  # the event loop
    assert os.SCHED_OTHER in {p for tid, p in policies.items() if tid != pid}  # the engine's threads, started before
    assert value(scrape(port), "pdxfer_cpu_yielding") == 1

    port = free_port()
    d = daemons("decode", "--http-port", str(port), name="normal")  # the default: no yield
    assert set(_policies(d.ready["pid"]).values()) == {os.SCHED_OTHER}
    assert value(scrape(port), "pdxfer_cpu_yielding") == 0


@needs_mooncake
@needs_sched_idle
@pytest.mark.integration
def test_a_daemon_starved_by_another_process_on_its_core_takes_the_cores_back(daemons):
    """A busy process at the normal policy on the daemon's only core, and an engine
    asking for the daemon's stats without pause: its SCHED_IDLE loop waits for the
    core while the daemon process runs next to nothing, so its threads return to the
    normal policy; it says why in its log and counts it. (An idle daemon there waited
    3-36% of each second: too little to tell the rule for idle daemons apart, which
    the pure tests cover.)"""
    port = free_port()
    d = daemons("decode", "--http-port", str(port), "--yield-cpu")
    pid = d.ready["pid"]
    core = min(os.sched_getaffinity(pid))
    for tid in _policies(pid):
        os.sched_setaffinity(tid, {core})
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    asking = threading.Event()
    asking.set()

    def ask() -> None:
        with Client(d.engine, timeout=60) as client:
            while asking.is_set():
                client.stats()

    engine = threading.Thread(target=ask)
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while value(scrape(port), "pdxfer_cpu_takebacks_total") < 1:
            assert time.monotonic() < deadline, "a starved daemon never took the cores back"
            time.sleep(0.2)
        metrics = scrape(port)
        assert value(metrics, "pdxfer_cpu_takebacks_total") == 1
        assert value(metrics, "pdxfer_cpu_yielding") == 0
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.SCHED_IDLE not in _policies(pid).values()
    finally:
        asking.clear()
        hog.kill()
        hog.wait()
        engine.join()
    with open(d.log_path) as fh:
        said = [line for line in fh if "leave SCHED_IDLE" in line]
    assert len(said) == 1 and "for a core while this process ran" in said[0] and "other processes hold the cores" in said[0]


def test_doctor_says_whether_daemons_here_yield_and_why_not():
    from pdxfer.ops import hostchecks

    s = hostchecks.Settings(role="decode", protocol="tcp", device="cpu", host="127.0.0.1", bootstrap_port=0, http_port=0,
                            runtime_dir="/tmp", name="", rdma_devices="", pool_bytes=0)
    assert hostchecks.check_cpu_yield(s).status == "SKIP"  # off by default
    s = hostchecks.Settings(**{**s.__dict__, "yield_cpu": True})
    tight = hostchecks.check_cpu_yield(hostchecks.Settings(**{**s.__dict__, "silence_bound": 0.5}))
    assert tight.status == "OK" and "keep the normal policy" in tight.detail and "0.5s of silence" in tight.detail
    here = hostchecks.check_cpu_yield(s)
    assert here.status == "OK"
    if UNAVAILABLE:
        assert UNAVAILABLE in here.detail and "CAP_SYS_NICE" in here.detail
    else:
        assert "under SCHED_IDLE" in here.detail and "keep the normal policy" not in here.detail
