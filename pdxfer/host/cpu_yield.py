"""The daemon's own threads give the cores to the transfer engine's threads
(``--yield-cpu``, off by default).

Off by default because beside real engines, which keep the cores busy, a yielding
daemon waits for a core at every hand-off: SGLang's CPU engines on a 2-core box saw
22-32 ms from a request's last chunk to its first decode token at the median with the
daemons yielding, 13-15 ms without; and with the transfer engine in a process of its
own (transport/isolated.py), the simulated engines' bench moved no more GB/s yielding
in two interleaved pairs of runs. What follows is why it helped once, and how it works when asked for.

Why: over TCP, each of the engine's lanes carries one write at a time and waits for
the destination's acknowledgement. An engine thread that wakes to find its core busy
with the daemon's Python (event loop, ZMQ) waits in the run queue, and its lanes
sit idle meanwhile. Moving medium rooms on a 2-core VM, the engine's sending and
receiving threads waited there 16-24% and 25-33% of the time while the box sat 15-20%
idle. With the daemon's threads under SCHED_IDLE they waited 3-7% and 6-11%, and pdxfer
moved 14-44% more GB/s over six interleaved pairs of runs (pdxfer/tools/bench/HISTORY.md).

How: once the transfer engine has started (its threads keep the normal policy), the
daemon's main thread switches to SCHED_IDLE, and every thread it starts afterwards
(ZMQ I/O, workers) inherits it; not the pump, which takes a lock the engine's sending
thread needs (pump.py). The kernel lets a waking normal thread preempt a
SCHED_IDLE one at once; SCHED_IDLE threads run whenever no normal thread wants the core.

The risk is starvation: while other processes fill every core, SCHED_IDLE threads get
next to no CPU. A daemon with little to do still gets a core within a few hundred
milliseconds (measured: 16-230 ms per half second behind a busy process on its only
core), but a busy one crawls. So the daemon yields only where it can take the cores
back (leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE of 20) and only when its
its peers and the registry allow it MIN_SILENCE_BOUND seconds of silence
(Config.silence_bound); and ``Yielding`` judges each
WINDOW: if the event loop's thread waited for a core (runnable, not running) over half
of it while the whole process, the engine's threads included, ran less than half a
core, other processes hold the cores. (Its own engine threads are what the loop waits
behind when the transfer keeps the process busy: that is the point of yielding.)
After STARVED_WINDOWS such windows in a row, each with work for the daemon (a live
room, an engine call), its threads return to the normal policy. An idle daemon
loses nothing by waiting (its heartbeats allow for it), and an engine busy filling
its pools on every core right after registering them (a model loading, the bench's
set-up) would otherwise cost the transfers after it their yield. The threads yield
again after a calm spell that doubles with each return.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

WINDOW = 1.0  # seconds over which the daemon judges whether it is starved
STARVED_WAIT = 0.5  # the loop waited for a core over this share of the window...
STARVED_OWN_CPU = 0.5  # ...while the process ran less than this many cores' worth of it
STARVED_WINDOWS = 2  # such windows in a row, each with work, before taking the cores back
CALM_WAIT = 0.1  # at the normal policy, a window whose loop waited less than this share is calm
CALM_FIRST, CALM_MAX = 60.0, 3600.0  # seconds of calm before yielding again: the first time, and at most
MIN_SILENCE_BOUND = 2.0  # seconds of silence peers and registry must allow: ten times a yielding loop's wait behind a busy process
SCHEDSTAT = "/proc/thread-self/schedstat"  # run time, run-queue wait (ns), timeslices


def sample() -> tuple[float, float, float]:
    """(monotonic time, seconds the calling thread has spent runnable but not running
    since it started, this process's CPU seconds): two samples' difference is what
    ``Yielding.window`` judges."""
    with open(SCHEDSTAT, "rb") as fh:
        waited = int(fh.read().split()[1]) / 1e9
    return time.monotonic(), waited, time.process_time()


class Yielding:
    """Whether the daemon's threads should yield now, judged window by window (pure:
    the daemon applies what ``window`` returns)."""

    def __init__(self, now: float) -> None:
        self.active = True  # the daemon yields from the start
        self.returns = 0  # times the cores were taken back
        self._starved = 0  # starved windows with work in a row
        self._calm_since = now

    @property
    def calm_needed(self) -> float:
        """Seconds of calm after which a daemon that took the cores back yields again."""
        return min(CALM_MAX, CALM_FIRST * 2 ** max(0, self.returns - 1))

    def window(self, span: float, loop_wait: float, own_cpu: float, now: float, working: bool) -> bool | None:
        """Over the last ``span`` seconds the loop waited ``loop_wait`` seconds for a
        core and the process ran ``own_cpu`` CPU seconds, with work to do or not
        (``working``); it is ``now``. Returns False to take the cores back, True to
        yield them again, None to leave things as they are."""
        if self.active:
            starved = working and loop_wait > STARVED_WAIT * span and own_cpu < STARVED_OWN_CPU * span
            self._starved = self._starved + 1 if starved else 0
            if self._starved < STARVED_WINDOWS:
                return None
            self._starved = 0
            self.active = False
            self.returns += 1
            self._calm_since = now
            return False
        if loop_wait >= CALM_WAIT * span:  # still short of CPU, even at the normal policy
            self._calm_since = now
            return None
        if now - self._calm_since < self.calm_needed:
            return None
        self.active = True
        return True


def too_tight(silence_bound: float) -> str:
    """Why deadlines this tight (Config.silence_bound) rule yielding out, or ''."""
    if silence_bound >= MIN_SILENCE_BOUND:
        return ""
    return (f"peers or the registry declare this daemon gone after {silence_bound:g}s of silence, under the "
            f"{MIN_SILENCE_BOUND:g}s a yielding loop needs")


def why_not(enabled: bool, silence_bound: float) -> str:
    """Why a daemon with these settings, in this process's place, keeps the normal
    policy for its threads; '' if it yields."""
    if not enabled:
        return "off by default; --yield-cpu turns it on"
    return too_tight(silence_bound) or unavailable()


def unavailable() -> str:
    """Why this process cannot yield and take the cores back, or '' if it can. Tried on
    a throwaway thread, since the rule (CAP_SYS_NICE or RLIMIT_NICE) is the kernel's."""
    if not hasattr(os, "SCHED_IDLE"):
        return "this platform has no SCHED_IDLE"
    if not os.path.exists(SCHEDSTAT):
        return f"no {SCHEDSTAT} to watch the event loop for starvation"
    why: list[str] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            why.append(f"cannot switch a thread to SCHED_IDLE ({exc.strerror})")
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            reason = "it needs CAP_SYS_NICE or an RLIMIT_NICE of 20" if exc.errno == errno.EPERM else exc.strerror
            why.append(f"a thread cannot leave SCHED_IDLE ({reason})")

    thread = threading.Thread(target=attempt, name="pdxfer-sched-probe")
    thread.start()
    thread.join()
    return "; ".join(why)


def yield_this_thread() -> None:
    """SCHED_IDLE for the calling thread and every thread it starts from now on."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _set_policy(tids: list[int], policy: int) -> list[int]:
    changed = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        changed.append(tid)
    return changed


def take_back() -> list[int]:
    """Return every SCHED_IDLE thread of this process to the normal policy; their ids."""
    idle = []
    for name in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(name)) == os.SCHED_IDLE:
                idle.append(int(name))
        except ProcessLookupError:
            continue
    return _set_policy(idle, os.SCHED_OTHER)


def yield_again(tids: list[int]) -> list[int]:
    """SCHED_IDLE again for the threads ``take_back`` returned (those still running)."""
    return _set_policy(tids, os.SCHED_IDLE)


@contextlib.contextmanager
def normal_policy():
    """Run the block at the normal policy, so that threads it starts (a new transfer
    engine's) get the normal policy even when the caller yields."""
    idle = hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE
    if idle:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        yield
    finally:
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
