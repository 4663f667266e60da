"""One benchmark run: one workload's plan on one system (wire, baseline or pdxfer),
its processes, /proc samples of the processes that move the bytes, and the run's
figures. pdxfer.tools.bench.main repeats runs and compares them.

Every run's clock is CLOCK_MONOTONIC, read in the processes themselves: a room starts
when the engine calls send() or expect(), whichever comes later (baseline: when the
writer admits it), and ends when the decode engine sees Success (baseline: when its
last write completed; wire: when its last byte arrived). A run's window is from its
first room's start to its last room's end.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...core.config import TCP_ENGINES, TCP_LANES
from ...core.paths import engine_env
from ...ops.inspection import daemon_counters
from ..launch import LaunchError, read_events, sim_argv, start_daemon, stop_all
from .plan import Plan, block_counts
from .raw import proc_sample

Progress = Callable[[int, int, int], None]  # rooms done, bytes moved, mismatches: within the run


@dataclass(frozen=True)
class RunOptions:
    workdir: str  # plan, timing and log files
    timeout: float = 300.0
    aux_path: str = "auto"
    api: str = "submit"  # baseline writer's transfer engine API
    window: int = 512  # baseline writes in flight
    corrupt: bool = False  # flip a destination byte before the check (testing aid)
    inline_kv_bytes: int | None = None  # the pdxfer daemons' --inline-kv-bytes (None: their default)
    expect_batch_ms: float | None = None  # the decode daemon's --expect-batch-ms (None: its default)
    staging_mib: int | None = None  # the decode daemon's --staging-mib (None: its default)
    stage_spans_below_kib: int | None = None  # both daemons' --stage-spans-below-kib (None: their default)
    staging_at_start: bool = False  # both daemons' --staging-at-start
    tcp_lanes: int = TCP_LANES  # pdxfer's --tcp-lanes and the baseline engines' MC_TCP_LANES_PER_PEER (0: the engine's default)
    tcp_engines: int = TCP_ENGINES  # pdxfer daemons' --tcp-engines
    baseline_engines: int = 1  # transfer engines in each baseline process


@dataclass
class RunResult:
    system: str
    workload: str
    rooms: int
    ok: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies_ms: np.ndarray | None = None
    blocks: int = 0
    inline_rooms: int | None = None  # rooms whose KV rode the aux record (pdxfer)
    control_messages: int | None = None  # pdxfer: room_request in at the prefill daemon + room_accepted in at the decode daemon
    mismatches: int = 0
    cpu_s: float | None = None  # of the two processes that move bytes (daemons, raw engines), over the window
    engine_cpu_s: float | None = None  # pdxfer: of the engine processes, every rank's (pdxfer.client and the sims' own work), over their rooms
    # Memory of the larger of those two processes, in bytes:
    rss_idle: int | None = None  # VmRSS before any pool is mapped (pdxfer: the daemon once ready)
    rss_anon: int | None = None  # RssAnon after the last room: memory of its own, without mapped pools
    rss_peak: int | None = None  # VmHWM after the last room, mapped pools included
    extra: dict = field(default_factory=dict)
    error: str = ""

    def figures(self) -> dict[str, float | None]:
        gb = self.bytes / 1e9
        lat = self.latencies_ms if self.latencies_ms is not None and self.latencies_ms.size else None
        pct = {f"p{q}_ms": (float(np.percentile(lat, q)) if lat is not None else None) for q in (50, 90, 99)}
        mib = lambda v: v / 2**20 if v is not None else None  # noqa: E731
        return {
            "gbps": gb / self.seconds if self.seconds else None,
            "rooms_per_s": self.ok / self.seconds if self.seconds else None,
            **pct,
            "blocks_per_room": self.blocks / self.rooms if self.rooms else None,
            "inline_share": self.inline_rooms / self.rooms if self.inline_rooms is not None and self.rooms else None,
            "control_per_room": self.control_messages / self.rooms if self.control_messages is not None and self.rooms else None,
            "cpu_s_per_gb": self.cpu_s / gb if self.cpu_s is not None and gb else None,
            "cpu_ms_per_room": self.cpu_s * 1000 / self.ok if self.cpu_s is not None and self.ok else None,
            "engine_cpu_ms_per_room": self.engine_cpu_s * 1000 / self.ok if self.engine_cpu_s is not None and self.ok else None,
            "rss_idle_mib": mib(self.rss_idle),
            "rss_anon_mib": mib(self.rss_anon),
            "rss_peak_mib": mib(self.rss_peak),
        }

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "latencies_ms"}
        out["figures"] = self.figures()
        return out


def _timed(result: RunResult, plan: Plan, rooms: np.ndarray, starts: np.ndarray, ends: np.ndarray, ok: np.ndarray) -> None:
    """Fill ok, bytes, seconds and latencies from per-room times."""
    sizes = dict(zip((r.room for r in plan.rooms), plan.room_bytes().tolist()))
    result.ok = int(ok.sum())
    result.bytes = int(sum(sizes[int(r)] for r in rooms[ok]))
    if result.ok:
        result.seconds = float(ends[ok].max() - starts[ok].min())
        result.latencies_ms = (ends[ok] - starts[ok]) * 1000.0


def _load_timings(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in ("room", "start", "end", "ok")}


def _await_event(proc: subprocess.Popen, name: str, timeout: float) -> dict:
    """The first JSON line of ``proc`` whose event is ``name``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(0.2):
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    event = json.loads(line)
                    if event.get("event") == name:
                        return event
            elif proc.poll() is not None:
                break
    finally:
        sel.close()
    raise LaunchError(f"{' '.join(proc.args[2:4])} exited or gave no {name!r} line within {timeout:g}s (code {proc.poll()})")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2"), **(extra or {})}


def raw_argv(role: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdxfer.tools.bench.raw", role, *flags]


def _spawn(argv: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a process that takes lines on stdin, prints JSON lines, logs to log_path
    (``env``: extra variables)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=_env(env), text=True)


def _say(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _reap(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _on_progress(progress: Progress, names: tuple[str, ...]):
    def on_event(name: str, event: dict) -> None:
        if name in names and event.get("event") == "progress":
            progress(event.get("done", 0), event.get("bytes", 0), event.get("mismatches", 0))

    return on_event


def _log(workdir: str, name: str) -> str:
    return os.path.join(workdir, f"{name}.log")


def run_wire(plan: Plan, plan_path: str, opts: RunOptions, progress: Progress) -> RunResult:
    result = RunResult("wire", plan.workload.name, len(plan.rooms))
    timings = os.path.join(opts.workdir, "wire-timings.npz")
    corrupt = ["--corrupt"] if opts.corrupt else []
    procs = {}
    try:
        procs["recv"] = _spawn(raw_argv("wire-recv", "--plan", plan_path, "--timings", timings, *corrupt), _log(opts.workdir, "wire-recv"))
        port = _await_event(procs["recv"], "ready", opts.timeout)["port"]
        procs["send"] = _spawn(raw_argv("wire-send", "--plan", plan_path, "--port", str(port)), _log(opts.workdir, "wire-send"))
        summaries = read_events(procs, _on_progress(progress, ("recv",)), timeout=opts.timeout)
    finally:
        _reap(procs.values())
    recv = summaries.get("recv")
    if recv is None or "send" not in summaries:
        result.error = "a wire process exited without a summary (see its log)"
        return result
    t = _load_timings(timings)
    _timed(result, plan, t["room"], t["start"], t["end"], t["ok"])
    result.latencies_ms = None  # one stream: rooms have no latency of their own
    result.blocks, result.mismatches = recv["blocks"], recv["mismatches"]
    return result


def run_baseline(plan: Plan, plan_path: str, opts: RunOptions, progress: Progress) -> RunResult:
    result = RunResult("baseline", plan.workload.name, len(plan.rooms), extra={"api": opts.api})
    timings = os.path.join(opts.workdir, "baseline-timings.npz")
    corrupt = ["--corrupt"] if opts.corrupt else []
    procs: dict[str, subprocess.Popen] = {}
    lanes = engine_env("tcp", opts.tcp_lanes, os.environ)  # the lanes pdxfer's engines get
    try:
        engines = ("--engines", str(opts.baseline_engines))
        procs["target"] = target = _spawn(raw_argv("te-target", "--plan", plan_path, *engines, *corrupt), _log(opts.workdir, "te-target"), lanes)
        ready = _await_event(target, "ready", opts.timeout)
        procs["writer"] = writer = _spawn(
            raw_argv("te-writer", "--plan", plan_path, *engines, "--peer", ",".join(ready["sessions"]),
                     "--dst-base", ",".join(map(str, ready["bases"])),
                     "--api", opts.api, "--in-flight", str(plan.workload.in_flight), "--window", str(opts.window),
                     "--timings", timings),
            _log(opts.workdir, "te-writer"), lanes,
        )
        writer_ready = _await_event(writer, "ready", opts.timeout)
        target_before = proc_sample(target.pid)
        _say(writer, "go")
        done = read_events({"writer": writer}, _on_progress(progress, ("writer",)), timeout=opts.timeout).get("writer")
        target_after = proc_sample(target.pid)
        _say(target, "verify")
        checked = read_events({"target": target}, timeout=opts.timeout).get("target")
    finally:
        _reap(procs.values())
    if done is None or checked is None:
        result.error = "a raw transfer engine process exited without a summary (see its log)"
        return result
    t = _load_timings(timings)
    _timed(result, plan, t["room"], t["start"], t["end"], t["ok"])
    result.blocks, result.mismatches = done["blocks"], checked["mismatches"]
    result.cpu_s = done["after"]["cpu_s"] - done["before"]["cpu_s"] + target_after["cpu_s"] - target_before["cpu_s"]
    result.rss_idle = max(writer_ready["idle"]["VmRSS"], ready["idle"]["VmRSS"])
    result.rss_anon = max(done["after"]["RssAnon"], target_after["RssAnon"])
    result.rss_peak = max(done["after"]["VmHWM"], target_after["VmHWM"])
    return result


def _start_daemons(runtime: str, opts: RunOptions) -> dict:
    flags = ["--log-level", "warning", "--aux-path", opts.aux_path, "--tcp-lanes", str(opts.tcp_lanes),
             "--tcp-engines", str(opts.tcp_engines)]
    if opts.inline_kv_bytes is not None:
        flags += ["--inline-kv-bytes", str(opts.inline_kv_bytes)]
    if opts.stage_spans_below_kib is not None:
        flags += ["--stage-spans-below-kib", str(opts.stage_spans_below_kib)]
    if opts.staging_at_start:
        flags += ["--staging-at-start"]
    decode = [] if opts.expect_batch_ms is None else ["--expect-batch-ms", str(opts.expect_batch_ms)]
    own = {"prefill": [], "decode": decode + ([] if opts.staging_mib is None else ["--staging-mib", str(opts.staging_mib)])}
    logs = {role: open(_log(opts.workdir, f"{role}-daemon"), "w") for role in ("prefill", "decode")}
    with ThreadPoolExecutor(2) as pool:
        futures = {role: pool.submit(start_daemon, role, runtime, *flags, *own[role], stderr=logs[role], timeout=60.0) for role in logs}
    for log in logs.values():  # the daemons have their own copies
        log.close()
    daemons, failure = {}, None
    for role, fut in futures.items():
        try:
            daemons[role] = fut.result()
        except LaunchError as exc:
            failure = exc
    if failure is not None:
        stop_all(daemons.values())
        for d in daemons.values():
            d.proc.stdout.close()
        raise failure
    return daemons


def _rank_names(w) -> dict[str, list[str]]:
    """The engine processes of a run: one per rank of each side."""
    return {side: [f"{side}-{r}" for r in range(w.tp(side))] for side in ("prefill", "decode")}


def _grew(before: dict, after: dict, key: str) -> float:
    """How much a daemon's counter ``key`` grew between two samples of its counters."""
    return after.get(key, 0.0) - before.get(key, 0.0)


def _control_messages(before: dict, after: dict, kind: str) -> float:
    return _grew(before, after, f"peer_messages_in:{kind}")


def _staging_per_room(before: dict, after: dict, rooms: int) -> dict[str, float]:
    """Per room, the legs (decode) or chunks (prefill) a daemon staged, and those that
    would have been but found its staging buffer full and wrote between the pages
    (slower: a block per span); empty where it staged nothing."""
    staged = _grew(before, after, "legs_staged") + _grew(before, after, "chunks_gathered")
    full = _grew(before, after, "staging_full")
    return {"staged": staged / rooms, "buffer full": full / rooms} if staged or full else {}


def _state_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean ms a room (of one rank) spent in each state it left during the run, from the
    daemon's pdxfer_room_state_seconds sums and counts; and, at a daemon that wrote, a
    write job's (a leg's chunk) ms queued before its first write and writing."""
    out = {}
    for key in after:  # in the order of a room's life
        if key.startswith("state_seconds:"):
            state = key.partition(":")[2]
            left = _grew(before, after, f"state_left:{state}")
            if left:
                out[state] = _grew(before, after, key) / left * 1000.0
    jobs = _grew(before, after, "jobs_written")
    for phase in ("queue", "write") if jobs else ():  # a write job's, at the daemon that writes
        out[f"job {phase}"] = _grew(before, after, f"job_{phase}_seconds") / jobs * 1000.0
    return out


def run_pdxfer(plan: Plan, plan_path: str, opts: RunOptions, progress: Progress) -> RunResult:
    w = plan.workload
    result = RunResult("pdxfer", w.name, len(plan.rooms), extra={"aux_path": opts.aux_path, "topology": w.topology})
    runtime = tempfile.mkdtemp(prefix="pdxb-")  # short: ipc socket paths are limited to ~107 bytes
    names = _rank_names(w)
    timing = {name: os.path.join(opts.workdir, f"pdxfer-{name}-timings.npz") for side in names.values() for name in side}
    flags = [
        "--plan", plan_path, "--rooms", str(len(plan.rooms)), "--in-flight", str(w.in_flight), "--layout", "mha",
        "--layers", str(w.layers), "--page-size", str(w.page_size), "--pages", str(plan.num_pages),
        "--slots", str(max(8, 2 * w.in_flight)), "--room-timeout", str(opts.timeout), "--heads", str(w.heads),
        "--page-order", w.page_order, "--start-on-stdin",
    ]
    daemons: dict = {}
    sims: dict[str, subprocess.Popen] = {}
    samples: dict[str, dict] = {}
    try:
        daemons = _start_daemons(runtime, opts)
        # A daemon is its process and its transfer engine's (--transfer-engine-process child).
        pids = {role: sorted({d.pid, d.ready.get("engine_pid") or d.pid}) for role, d in daemons.items()}
        samples["idle"] = {role: _sample(ps) for role, ps in pids.items()}
        for side, ranks in names.items():
            extra = ["--bootstrap", daemons["prefill"].bootstrap, "--prefill-tp", str(w.prefill_tp),
                     *(["--corrupt"] if opts.corrupt else [])] if side == "decode" else []
            if len(ranks) > 1:  # an engine's ranks take rooms together, as its scheduler would have them
                lockstep = os.path.join(runtime, f"{side}.lockstep")
                np.zeros(len(ranks), np.int64).tofile(lockstep)
                extra += ["--lockstep", lockstep]
            for rank, name in enumerate(ranks):
                sims[name] = _spawn(
                    sim_argv(side, daemons[side].engine, *flags, "--token-bytes", str(plan.rank_layout(side).token_bytes),
                             "--tp", str(w.tp(side)), "--rank", str(rank), "--timings", timing[name], *extra),
                    _log(opts.workdir, f"{name}-engine"))
        for sim in sims.values():  # pools registered, sources filled
            _await_event(sim, "ready", opts.timeout)
        samples["counters"] = {role: daemon_counters(d.ready["admin"]) for role, d in daemons.items()}
        samples["before"] = {role: _sample(ps) for role, ps in pids.items()}
        for sim in sims.values():
            _say(sim, "go")
        summaries = read_events(sims, _on_progress(progress, (names["decode"][0],)), timeout=opts.timeout,
                                watch={f"the {role} daemon": d.proc for role, d in daemons.items()})
        samples["after"] = {role: _sample(ps) for role, ps in pids.items() if daemons[role].alive()}
        samples["counters_after"] = {role: daemon_counters(d.ready["admin"]) for role, d in daemons.items() if d.alive()}
    finally:
        _reap(sims.values())
        codes = dict(zip(daemons, stop_all(daemons.values())))
        for d in daemons.values():
            d.proc.stdout.close()
        shutil.rmtree(runtime, ignore_errors=True)
    if set(summaries) != set(sims) or len(samples.get("after", {})) != 2 or len(samples.get("counters_after", {})) != 2:
        result.error = f"an engine or daemon died (daemon exit codes {codes}; see the logs)"
        return result
    # A room starts when the last of its ranks called send()/expect() and ends when the
    # last decode rank saw Success; it succeeded when every decode rank's part did.
    t = {name: _load_timings(path) for name, path in timing.items()}
    called = {}
    for name in timing:
        for room, start in zip(t[name]["room"].tolist(), t[name]["start"].tolist()):
            called[room] = max(called.get(room, -np.inf), start)
    rooms = np.array([r.room for r in plan.rooms], np.uint64)
    ends, ok = np.full(rooms.size, -np.inf), np.ones(rooms.size, bool)
    index = {room: i for i, room in enumerate(rooms.tolist())}
    for name in names["decode"]:
        seen = np.zeros(rooms.size, bool)
        for room, end, good in zip(t[name]["room"].tolist(), t[name]["end"].tolist(), t[name]["ok"].tolist()):
            i = index[room]
            seen[i] = True
            ends[i] = max(ends[i], end)
            ok[i] &= good
        ok &= seen
    starts = np.array([called.get(room, np.inf) for room in rooms.tolist()])
    ok &= np.isfinite(starts)
    _timed(result, plan, rooms, starts, ends, ok)
    planned = int(block_counts(plan).sum())  # the daemon plans with the same functions
    before, after = samples["counters"], samples["counters_after"]
    counters = after["prefill"]
    result.blocks = int(counters["blocks_submitted"] - before["prefill"]["blocks_submitted"])
    result.inline_rooms = int(counters["kv_inline_rooms"] - before["prefill"]["kv_inline_rooms"])
    # A5: one room_request per room per node pair, and one room_accepted back, whatever the ranks.
    result.control_messages = int(_control_messages(before["prefill"], counters, "room_request")
                                  + _control_messages(before["decode"], after["decode"], "room_accepted"))
    result.extra.update(blocks_planned=planned, prefill_counters={k: v - before["prefill"].get(k, 0.0) for k, v in counters.items()},
                        lanes={role: int(c.get("lanes", 0)) for role, c in after.items()},
                        peer_messages_per_room={  # every kind of room message each daemon took in, to see which grow with the ranks
                            role: {k.partition(":")[2]: _control_messages(before[role], c, k.partition(":")[2]) / len(plan.rooms)
                                   for k in sorted(c) if k.startswith("peer_messages_in:room")}
                            for role, c in after.items()})
    result.extra["state_ms"] = {role: _state_ms(before[role], c) for role, c in after.items()}
    staging = {role: _staging_per_room(before[role], c, len(plan.rooms)) for role, c in after.items()}
    result.extra["staging_per_room"] = {role: figures for role, figures in staging.items() if figures}
    # Daemons start afresh for each run: their count covers its set-up, window and check.
    result.extra["cpu_takebacks"] = int(counters["cpu_takebacks"] + after["decode"]["cpu_takebacks"])
    result.mismatches = sum(summaries[name]["mismatches"] for name in names["decode"])
    if result.ok != len(plan.rooms):
        outcomes = "; ".join(f"{name} {summaries[name]['outcome']}" for side in names.values() for name in side)
        result.error = f"{len(plan.rooms) - result.ok} rooms did not succeed: {outcomes}"
    result.cpu_s = sum(samples["after"][r]["cpu_s"] - samples["before"][r]["cpu_s"] for r in pids)
    result.engine_cpu_s = sum(summary["cpu_s"] for summary in summaries.values())
    result.rss_idle = max(samples["idle"][r]["VmRSS"] for r in pids)
    result.rss_anon = max(samples["after"][r]["RssAnon"] for r in pids)
    result.rss_peak = max(samples["after"][r]["VmHWM"] for r in pids)
    result.extra["per_daemon"] = {
        r: {"cpu_s": samples["after"][r]["cpu_s"] - samples["before"][r]["cpu_s"],
            "rss_idle": samples["idle"][r]["VmRSS"], "rss_anon": samples["after"][r]["RssAnon"],
            "rss_peak": samples["after"][r]["VmHWM"]}
        for r in pids
    }
    return result


def _sample(pids: list[int]) -> dict:
    """proc_sample of a daemon's processes added up: CPU, and memory (shared pages of
    the pools both map count twice in VmRSS; RssAnon is each one's own)."""
    samples = [proc_sample(pid) for pid in pids]
    return {key: sum(s[key] for s in samples) for key in samples[0]}


RUNNERS = {"wire": run_wire, "baseline": run_baseline, "pdxfer": run_pdxfer}
