"""``pdxfer bench``: wire, raw transfer engines and pdxfer, on the same buffers and
block lists, workload by workload; medians over repeats, ratios, targets.

The pieces: pdxfer.bench_args (flags), pdxfer.bench_plan (workloads, page lists,
blocks), pdxfer.bench_raw (the reference processes), pdxfer.bench_run (one run of
one workload on one system). This module schedules the runs, draws the progress bar
and prints the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from .bench_plan import Plan, Workload, block_counts, make_plan, time_planning
from .bench_report import FIGURES, format_report, targets
from .bench_run import RUNNERS, RunOptions, RunResult
from .demo import ProgressBar
from .launch import LaunchError

WIRE_WORKLOADS = ("large", "medium", "small")
# The baseline API per workload for --baseline-api auto: what measured fastest here (see README).
AUTO_API = {"large": "submit", "medium": "submit", "small": "submit", "sweep": "submit"}


class LabelledStream:
    """A stream that puts the current run's label in front of each progress line."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.label = ""

    def isatty(self) -> bool:
        return self.stream.isatty()

    def write(self, text: str) -> None:
        lead = "\r" if text.startswith("\r") else ""
        clear = "\x1b[K" if lead else ""
        self.stream.write(f"{lead}{clear}{self.label:<22} {text[len(lead):]}")

    def flush(self) -> None:
        self.stream.flush()


def box_cpu() -> tuple[float, float]:
    """(CPU seconds every process on the box used since boot, CPU seconds this
    process and its waited-for children used), to tell how much of the run's CPU
    went to processes outside the benchmark."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system . . irq softirq steal
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system


def _pages(mib_range: tuple[float, float], page_bytes: int) -> tuple[int, int]:
    low = max(1, math.ceil(mib_range[0] * 2**20 / page_bytes))
    high = max(low, math.floor(mib_range[1] * 2**20 / page_bytes))
    return low, high


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    big = dict(layers=args.layers, page_size=args.page_size, token_bytes=args.token_bytes)
    index_bytes = 2 * args.layers * args.page_size * args.token_bytes
    tiny = dict(layers=args.small_layers, page_size=args.small_page_size, token_bytes=args.small_token_bytes,
                min_pages=int(args.small_pages[0]), max_pages=int(args.small_pages[1]))
    out = []
    if "large" in args.workloads:
        out.append(Workload("large", args.large_rooms, args.large_in_flight, **big, **dict(zip(("min_pages", "max_pages"), _pages(args.large_mib, index_bytes)))))
    if "medium" in args.workloads:
        out.append(Workload("medium", args.medium_rooms, args.medium_in_flight, **big, **dict(zip(("min_pages", "max_pages"), _pages(args.medium_mib, index_bytes)))))
    if "small" in args.workloads:
        out.append(Workload("small", args.small_rooms, args.small_in_flight, **tiny))
    if "sweep" in args.workloads:
        for level in args.sweep:
            if not ("small" in args.workloads and level == args.small_in_flight):
                out.append(Workload(f"sweep-{level}", max(args.sweep_rooms, 8 * level), level, **tiny))
    return out


def sweep_points(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(rooms in flight, workload whose runs stand for it)."""
    if "sweep" not in args.workloads:
        return []
    return [(n, "small" if "small" in args.workloads and n == args.small_in_flight else f"sweep-{n}") for n in args.sweep]


def systems_for(workload: Workload, systems: list[str]) -> list[str]:
    return [s for s in systems if s != "wire" or workload.name in WIRE_WORKLOADS]


def api_for(workload: Workload, choice: str) -> str:
    return AUTO_API[workload.name.partition("-")[0]] if choice == "auto" else choice


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: list[RunResult]) -> dict:
    good = [r for r in runs if not r.error]
    return {
        "median": {key: _median([r.figures()[key] for r in good]) for key, _, _ in FIGURES},
        "mismatches": sum(r.mismatches for r in runs),
        "errors": [r.error for r in runs if r.error],
        "runs": [r.to_json() for r in runs],
    }


def run_bench(args: argparse.Namespace) -> int:
    workloads = build_workloads(args)
    if not workloads:
        print("pdxfer bench: nothing to run", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="pdxfer-bench-")
    os.makedirs(workdir, exist_ok=True)
    plans: dict[str, tuple[Plan, str]] = {}
    for w in workloads:
        plan = make_plan(w, args.seed)
        path = os.path.join(workdir, f"plan-{w.name}.npz")
        plan.save(path)
        plans[w.name] = (plan, path)
    schedule = [(rep, w, s) for rep in range(args.repeat) for w in workloads for s in systems_for(w, args.systems)]
    stream = LabelledStream(sys.stderr)
    bar = ProgressBar(sum(len(plans[w.name][0].rooms) for _, w, _ in schedule), stream=stream)
    runs: dict[str, dict[str, list[RunResult]]] = {w.name: {} for w in workloads}
    box_before, wall_before = box_cpu(), time.monotonic()
    rooms_before = bytes_before = mismatches_before = 0
    for rep, w, system in schedule:
        plan, path = plans[w.name]
        stream.label = f"{w.name} {system} {rep + 1}/{args.repeat}"
        run_dir = os.path.join(workdir, f"{w.name}-{system}-{rep + 1}")
        os.makedirs(run_dir, exist_ok=True)
        opts = RunOptions(workdir=run_dir, timeout=args.timeout, aux_path=args.aux_path, api=api_for(w, args.baseline_api),
                          window=args.window, corrupt=system in args.corrupt)

        def progress(done: int, nbytes: int, mismatches: int) -> None:
            bar.update(rooms_before + done, bytes_before + nbytes, mismatches_before + mismatches)

        try:
            result = RUNNERS[system](plan, path, opts, progress)
        except (LaunchError, OSError, ValueError, KeyError) as exc:
            result = RunResult(system, w.name, len(plan.rooms), error=f"{type(exc).__name__}: {exc}")
        if result.error:
            result.error += f" [logs in {run_dir}]"
        runs[w.name].setdefault(system, []).append(result)
        rooms_before += len(plan.rooms)
        bytes_before += result.bytes
        mismatches_before += result.mismatches
        bar.update(rooms_before, bytes_before, mismatches_before)
    bar.finish()
    stream.label = ""
    box_after, wall = box_cpu(), time.monotonic() - wall_before
    foreign = max(0.0, (box_after[0] - box_before[0]) - (box_after[1] - box_before[1]))

    report = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "workloads": {},
        "sweep": [{"in_flight": n, "workload": name} for n, name in sweep_points(args)],
        "box": {"cpus": os.cpu_count(), "seconds": wall, "foreign_cpu_s": foreign,
                "foreign_share": foreign / (wall * (os.cpu_count() or 1)) if wall else 0.0},
    }
    for w in workloads:
        plan = plans[w.name][0]
        counts = block_counts(plan)
        systems = {s: summarize(rs) for s, rs in runs[w.name].items()}
        med = {s: v["median"] for s, v in systems.items()}
        entry = {
            "shape": w.describe(),
            "workload": w.__dict__,
            "kv_bytes": int(plan.room_bytes().sum()),
            "planned_blocks_per_room": {"mean": float(counts.mean()), "min": int(counts.min()), "max": int(counts.max())},
            "baseline_api": api_for(w, args.baseline_api),
            "systems": systems,
            "ratios": {
                "pdxfer/baseline": {k: _ratio(med.get("pdxfer", {}).get(k), med.get("baseline", {}).get(k)) for k, _, _ in FIGURES},
                "pdxfer/wire": {k: _ratio(med.get("pdxfer", {}).get(k), med.get("wire", {}).get(k)) for k in ("gbps", "rooms_per_s")},
            },
        }
        report["workloads"][w.name] = entry
    if args.plan_indices:
        report["planning"] = planning_figures(args, report)
    report["targets"] = targets(report)
    failures = [(name, s, e) for name, wl in report["workloads"].items() for s, v in wl["systems"].items() for e in v["errors"]]
    bad = [(name, s, v["mismatches"]) for name, wl in report["workloads"].items() for s, v in wl["systems"].items() if v["mismatches"]]
    report["ok"] = not failures and not bad
    if args.json:
        print(json.dumps(report, default=_json_default))
    else:
        print(format_report(report))
    for name, system, count in bad:
        print(f"pdxfer bench: VERIFICATION FAILED: {count} room(s) of {name} on {system} arrived with wrong bytes", file=sys.stderr)
    for name, system, error in failures:
        print(f"pdxfer bench: {name} on {system} failed: {error}", file=sys.stderr)
    if report["ok"] and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if report["ok"] else 1


def planning_figures(args: argparse.Namespace, report: dict) -> dict:
    """Planning time for --plan-indices page indices of each layout, against the time
    to move them at the best pdxfer rate measured (the strictest comparison)."""
    rates = [wl["systems"].get("pdxfer", {}).get("median", {}).get("gbps") for wl in report["workloads"].values()]
    rates = [r for r in rates if r]
    best = max(rates) if rates else None
    shapes = {}
    for label, w in (("large/medium layout", Workload("plan", 1, 1, args.layers, args.page_size, args.token_bytes, 1, 1)),
                     ("small layout", Workload("plan", 1, 1, args.small_layers, args.small_page_size, args.small_token_bytes, 1, 1))):
        t = time_planning(w, args.plan_indices, args.seed)
        t["transfer_s"] = t["bytes"] / (best * 1e9) if best else None
        t["plan_share"] = _ratio(t["plan_s"] + t["to_lists_s"], t["transfer_s"])
        shapes[label] = t
    return {"at_gbps": best, "layouts": shapes}


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
