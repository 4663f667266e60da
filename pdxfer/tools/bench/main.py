"""``pdxfer bench``: wire, raw transfer engines and pdxfer, on the same buffers and
block lists, workload by workload; medians over repeats, ratios, targets.

The pieces: pdxfer.tools.bench.args (flags), pdxfer.tools.bench.plan (workloads, page lists,
blocks), pdxfer.tools.bench.raw (the reference processes), pdxfer.tools.bench.run (one run of
one workload on one system). This module schedules the runs, draws the progress bar
and prints the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from ...core import config
from ...core.plan import pool_bytes
from ...host import cpu_yield
from ...host.memory import room_for_pools, sweep_orphans
from ...ops.tables import size
from ..demo import ProgressBar
from .plan import Plan, Workload, block_counts, make_plan, time_planning
from .raw import APIS as RAW_APIS
from .report import FIGURES, format_report, targets
from .run import RUNNERS, RunOptions, RunResult

WIRE_WORKLOADS = ("large", "medium", "small")
BANDWIDTH_WORKLOADS = ("large", "medium")  # bound by moving bytes, not by messages
# --baseline-api auto: what measured fastest on the 2-core box (pdxfer bench --baseline-api all):
# transfer_submit_write per block with sleeping status polls, 17-30% over the batch calls
# at 60-70% of their CPU; for one small room at a time, polling without sleeping
# (submit_spin: 0.19 ms p50 against 0.30), which costs large rooms a third of their rate.
SPIN_MAX_ROOM_BYTES = 2**20


def auto_api(workload: Workload) -> str:
    small = workload.max_pages * workload.page_index_bytes <= SPIN_MAX_ROOM_BYTES
    return "submit_spin" if workload.in_flight == 1 and small else "submit"


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
    busy = sum(fields[:3]) + fields[7]  # user nice system steal; not irq/softirq, which no process is charged for
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system


def cpu_probe_ms(rounds: int = 5) -> float:
    """Milliseconds a fixed piece of pure Python takes (best of ``rounds``). Run before
    and after the benchmark it shows whether the host gave this VM the same CPU speed
    throughout: on a shared host it can change by half within minutes."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i
        best = min(best, time.perf_counter() - start)
    return best * 1000


def _pages(mib_range: tuple[float, float], page_bytes: int) -> tuple[int, int]:
    low = max(1, math.ceil(mib_range[0] * 2**20 / page_bytes))
    high = max(low, math.floor(mib_range[1] * 2**20 / page_bytes))
    return low, high


EQUAL_TP = "-equal-tp"  # suffix of the workloads --compare-equal-tp adds: the same rooms at D:D


def topology_refusal(args: argparse.Namespace) -> str:
    """Why --topology, --heads and the token sizes do not split into ranks, or ""."""
    p, d = args.topology
    if args.heads % p or args.heads % d:
        return f"--heads {args.heads} must be divisible by both TP sizes of --topology {p}:{d}"
    for flag, nbytes in (("--token-bytes", args.token_bytes), ("--small-token-bytes", args.small_token_bytes)):
        if nbytes % args.heads:
            return f"{flag} {nbytes} is not a whole number of bytes per head for --heads {args.heads}"
    return ""


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    p, d = args.topology
    ranks = dict(prefill_tp=p, decode_tp=d, heads=args.heads, page_order=args.page_order)
    big = dict(layers=args.layers, page_size=args.page_size, token_bytes=args.token_bytes, **ranks)
    index_bytes = 2 * args.layers * args.page_size * args.token_bytes
    tiny = dict(layers=args.small_layers, page_size=args.small_page_size, token_bytes=args.small_token_bytes,
                min_pages=int(args.small_pages[0]), max_pages=int(args.small_pages[1]), **ranks)
    out = []
    if "large" in args.workloads:
        low, high = _pages(args.large_mib, index_bytes)
        out.append(Workload("large", args.large_rooms, args.large_in_flight, **big, min_pages=low, max_pages=high))
    if "medium" in args.workloads:
        low, high = _pages(args.medium_mib, index_bytes)
        out.append(Workload("medium", args.medium_rooms, args.medium_in_flight, **big, min_pages=low, max_pages=high))
    if "small" in args.workloads:
        out.append(Workload("small", args.small_rooms, args.small_in_flight, **tiny))
    if "sweep" in args.workloads:
        for level in args.sweep:
            if not ("small" in args.workloads and level == args.small_in_flight):
                out.append(Workload(f"sweep-{level}", max(args.sweep_rooms, 8 * level), level, **tiny))
    if args.compare_equal_tp and p != d:  # the same rooms (plans are seeded by their sizes), every rank pair equal
        out += [dataclasses.replace(w, name=w.name + EQUAL_TP, prefill_tp=d) for w in out]
    return out


def sweep_points(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(rooms in flight, workload whose runs stand for it)."""
    if "sweep" not in args.workloads:
        return []
    return [(n, "small" if "small" in args.workloads and n == args.small_in_flight else f"sweep-{n}") for n in args.sweep]


def systems_for(workload: Workload, systems: list[str]) -> list[str]:
    """The wire is one stream between one rank on each side, and an equal-TP twin is
    there for the GB/s of the others: the wire runs at 1:1 on its workloads only."""
    one_rank = (workload.prefill_tp, workload.decode_tp) == (1, 1) and not workload.name.endswith(EQUAL_TP)
    return [s for s in systems if s != "wire" or (workload.name in WIRE_WORKLOADS and one_rank)]


def apis_for(workload: Workload, choice: str) -> list[str]:
    """The baseline APIs to run: one, or with 'all' every one (the fastest is the baseline)."""
    if choice == "all":
        return list(RAW_APIS)
    return [auto_api(workload) if choice == "auto" else choice]


def schedule_runs(args: argparse.Namespace, workloads: list[Workload]) -> list[tuple[int, Workload, str, str]]:
    """(repeat, workload, system, baseline API or ''), repeats outermost so that a
    change in the box's load falls on every system alike."""
    out = []
    for rep in range(args.repeat):
        for w in workloads:
            for system in systems_for(w, args.systems):
                for api in apis_for(w, args.baseline_api) if system == "baseline" else [""]:
                    out.append((rep, w, system, api))
    return out


def pick_baseline(runs: dict[str, list[RunResult]]) -> str:
    """The baseline API with the highest median GB/s (for one plan, rooms/s alike)."""
    apis = [k for k in runs if k.startswith("baseline:")]
    return max(apis, key=lambda k: _median([r.figures()["gbps"] for r in runs[k] if not r.error]) or 0.0)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def by_repeat(runs: list[RunResult], against: list[RunResult], key: str) -> list[float | None]:
    """``runs``' figure over ``against``'s, repeat by repeat (runs of one repeat are
    neighbours in time, so this shows how far the box's load moved the ratio); None
    where either run failed."""
    return [None if a.error or b.error else _ratio(a.figures()[key], b.figures()[key]) for a, b in zip(runs, against)]


def summarize(runs: list[RunResult]) -> dict:
    good = [r for r in runs if not r.error]
    return {
        "median": {key: _median([r.figures()[key] for r in good]) for key, _, _ in FIGURES},
        "mismatches": sum(r.mismatches for r in runs),
        "errors": [r.error for r in runs if r.error],
        "runs": [r.to_json() for r in runs],
    }


def memory_shortfall(needs: dict[str, int], room: int) -> str:
    """Why the biggest run cannot map its pools here, or "". ``needs``: bytes of shared
    memory by workload; a run maps a source and a destination pool at once."""
    name, need = max(needs.items(), key=lambda item: item[1])
    if need <= room:
        return ""
    return (f"the {name} workload needs {size(need)} of shared memory (a source and a destination pool, each holding "
            f"every room's pages) but {size(room)} is left; give it fewer rooms (--{name.split('-')[0]}-rooms) or smaller rooms")


def run_bench(args: argparse.Namespace) -> int:
    if args.baseline_engines is None:  # the fair default: as many engines as a pdxfer daemon has
        args.baseline_engines = args.tcp_engines
    if refusal := topology_refusal(args):
        print(f"pdxfer bench: {refusal}", file=sys.stderr)
        return 2
    workloads = build_workloads(args)
    if not workloads:
        print("pdxfer bench: nothing to run", file=sys.stderr)
        return 2
    # Pools of engines killed before they could remove them (a bench interrupted with
    # SIGKILL) would otherwise hold the shared memory this run needs.
    if orphans := sweep_orphans():
        print(f"pdxfer bench: removed {len(orphans)} shared-memory pool(s) ({size(sum(orphans.values()))}) "
              "left by engine processes that had exited", file=sys.stderr)
    room = room_for_pools()
    # Checked once before planning, at every room's fewest pages, so that absurd sizes
    # are refused before their plans fill memory, and again with the plans' real sizes.
    if shortfall := memory_shortfall({w.name: 2 * pool_bytes(w.layout(w.rooms * w.min_pages)) for w in workloads}, room):
        print(f"pdxfer bench: {shortfall}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="pdxfer-bench-")
    os.makedirs(workdir, exist_ok=True)
    plans: dict[str, tuple[Plan, str]] = {}
    for w in workloads:
        plan, path = make_plan(w, args.seed, args.placement), os.path.join(workdir, f"plan-{w.name}.npz")
        plan.save(path)
        plans[w.name] = (plan, path)
    if shortfall := memory_shortfall({name: 2 * pool_bytes(plan.layout) for name, (plan, _) in plans.items()}, room):
        print(f"pdxfer bench: {shortfall}", file=sys.stderr)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return 2
    probe_before = cpu_probe_ms()
    box_before, wall_before = box_cpu(), time.monotonic()
    runs = run_all(args, workloads, plans, workdir)
    box_after, wall = box_cpu(), time.monotonic() - wall_before
    probe_after = cpu_probe_ms()
    foreign = max(0.0, (box_after[0] - box_before[0]) - (box_after[1] - box_before[1]))
    report = build_report(args, workloads, plans, runs)
    report["box"] = {"cpus": os.cpu_count(), "seconds": wall, "foreign_cpu_s": foreign,
                     "foreign_share": foreign / (wall * (os.cpu_count() or 1)) if wall else 0.0,
                     "cpu_probe_ms": [probe_before, probe_after], "pdxfer_normal_policy_why": daemon_cpu_policy()}
    # every run counts here, the baseline APIs that were not picked included
    failures = [(name, key, r.error) for name, by_key in runs.items() for key, rs in by_key.items() for r in rs if r.error]
    bad = [(name, key, n) for name, by_key in runs.items() for key, rs in by_key.items() if (n := sum(r.mismatches for r in rs))]
    report["ok"] = not failures and not bad
    print(json.dumps(report, default=_json_default) if args.json else format_report(report))
    for name, system, count in bad:
        print(f"pdxfer bench: VERIFICATION FAILED: {count} room(s) of {name} on {system} arrived with wrong bytes", file=sys.stderr)
    for name, system, error in failures:
        print(f"pdxfer bench: {name} on {system} failed: {error}", file=sys.stderr)
    if report["ok"] and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if report["ok"] else 1


def run_all(args: argparse.Namespace, workloads: list[Workload], plans: dict, workdir: str) -> dict[str, dict[str, list[RunResult]]]:
    """Every scheduled run, with the progress bar; results by workload, then by
    system ('baseline:API' for the baseline)."""
    schedule = schedule_runs(args, workloads)
    stream = LabelledStream(sys.stderr)
    bar = ProgressBar(sum(len(plans[w.name][0].rooms) for _, w, _, _ in schedule), stream=stream)
    runs: dict[str, dict[str, list[RunResult]]] = {w.name: {} for w in workloads}
    done_rooms = done_bytes = done_mismatches = 0
    for rep, w, system, api in schedule:
        plan, path = plans[w.name]
        key = f"{system}:{api}" if api else system
        shown_api = f" {api}" if api and len(apis_for(w, args.baseline_api)) > 1 else ""
        stream.label = f"{w.name} {system}{shown_api} {rep + 1}/{args.repeat}"
        run_dir = os.path.join(workdir, f"{w.name}-{key.replace(':', '-')}-{rep + 1}")
        os.makedirs(run_dir, exist_ok=True)
        opts = RunOptions(workdir=run_dir, timeout=args.timeout, aux_path=args.aux_path, api=api or "submit",
                          window=args.window, corrupt=system in args.corrupt, inline_kv_bytes=args.inline_kv_bytes,
                          expect_batch_ms=args.expect_batch_ms, staging_mib=args.staging_mib, stage_spans_below_kib=args.stage_spans_below_kib,
                          staging_at_start=args.staging_at_start,
                          tcp_lanes=args.tcp_lanes, tcp_engines=args.tcp_engines, baseline_engines=args.baseline_engines)

        def progress(done: int, nbytes: int, mismatches: int) -> None:
            bar.update(done_rooms + done, done_bytes + nbytes, done_mismatches + mismatches)

        try:
            result = RUNNERS[system](plan, path, opts, progress)
        except Exception as exc:  # reported with the run; the others go on
            result = RunResult(system, w.name, len(plan.rooms), error=f"{type(exc).__name__}: {exc}")
        if result.error:
            result.error += f" [logs in {run_dir}]"
        runs[w.name].setdefault(key, []).append(result)
        done_rooms, done_bytes, done_mismatches = done_rooms + len(plan.rooms), done_bytes + result.bytes, done_mismatches + result.mismatches
        bar.update(done_rooms, done_bytes, done_mismatches)
    bar.finish()
    stream.label = ""
    return runs


def daemon_cpu_policy() -> str:
    """Why the pdxfer daemons this bench starts (with its environment) keep the normal
    CPU policy for their own threads, or '' when they yield the cores (--yield-cpu)."""
    cfg = config.load({"role": "prefill"})
    return cpu_yield.why_not(cfg.yield_cpu, cfg.silence_bound)


def build_report(args: argparse.Namespace, workloads: list[Workload], plans: dict, runs: dict) -> dict:
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "workloads": {},
        "sweep": [{"in_flight": n, "workload": name} for n, name in sweep_points(args)],
    }
    for w in workloads:
        plan, by_key = plans[w.name][0], runs[w.name]
        counts = block_counts(plan)
        by_api = {k.partition(":")[2]: summarize(rs) for k, rs in by_key.items() if k.startswith("baseline:")}
        best = pick_baseline(by_key) if by_api else ""
        systems = {name: summarize(by_key[key]) for name, key in (("wire", "wire"), ("baseline", best), ("pdxfer", "pdxfer"))
                   if key in by_key}
        med = {s: v["median"] for s, v in systems.items()}

        def ratios(other: str, keys) -> dict:
            return {k: _ratio(med.get("pdxfer", {}).get(k), med.get(other, {}).get(k)) for k in keys}

        report["workloads"][w.name] = {
            "shape": w.describe(),
            "workload": w.__dict__,
            "kv_bytes": int(plan.room_bytes().sum()),
            "planned_blocks_per_room": {"mean": float(counts.mean()), "min": int(counts.min()), "max": int(counts.max())},
            "baseline_api": best.partition(":")[2],
            "baseline_apis": {api: v["median"] for api, v in by_api.items()},
            "systems": systems,
            "ratios": {"pdxfer/baseline": ratios("baseline", [k for k, _, _ in FIGURES]),
                       "pdxfer/wire": ratios("wire", ("gbps", "rooms_per_s"))},
            "gbps_by_repeat": {"pdxfer/baseline": by_repeat(by_key["pdxfer"], by_key[best], "gbps")
                               if best and "pdxfer" in by_key else []},
        }
    for w in workloads:  # GB/s at P:D over the same rooms at D:D, pdxfer's and the baseline's
        twin = runs.get(w.name + EQUAL_TP)
        if twin:
            report["workloads"][w.name]["equal_tp"] = {
                "workload": w.name + EQUAL_TP, "topology": f"{w.decode_tp}:{w.decode_tp}",
                **{system: equal_tp_ratio(runs[w.name], twin, system) for system in ("pdxfer", "baseline")},
            }
    if args.plan_indices:
        report["planning"] = planning_figures(args, report)
    report["targets"] = targets(report)
    return report


def equal_tp_ratio(runs: dict[str, list[RunResult]], twin: dict[str, list[RunResult]], system: str) -> dict:
    """A system's median GB/s over its median at equal TP (the baseline: each with its
    fastest API), and repeat by repeat; {} where either was not run."""
    key = {"pdxfer": "pdxfer", "baseline": pick_baseline(runs) if any(k.startswith("baseline:") for k in runs) else ""}[system]
    twin_key = pick_baseline(twin) if system == "baseline" and any(k.startswith("baseline:") for k in twin) else system
    if key not in runs or twin_key not in twin:
        return {}
    median = lambda rs: _median([r.figures()["gbps"] for r in rs if not r.error])  # noqa: E731
    return {"gbps": _ratio(median(runs[key]), median(twin[twin_key])), "by_repeat": by_repeat(runs[key], twin[twin_key], "gbps")}


def planning_figures(args: argparse.Namespace, report: dict) -> dict:
    """Planning time for --plan-indices page indices of each layout, against the time
    to move them at the best pdxfer rate measured on large or medium rooms (the
    strictest comparison; small rooms' rate is bound by the control plane, and
    would make planning look cheap). Without either, there is no share."""
    rates = [wl["systems"].get("pdxfer", {}).get("median", {}).get("gbps") for name, wl in report["workloads"].items()
             if name in BANDWIDTH_WORKLOADS]
    rates = [r for r in rates if r]
    best = max(rates) if rates else None
    shapes = {}
    window = config.load({"role": "prefill"}).peer_window  # the daemons run with their defaults
    for label, w in (("large/medium layout", Workload("plan", 1, 1, args.layers, args.page_size, args.token_bytes, 1, 1)),
                     ("small layout", Workload("plan", 1, 1, args.small_layers, args.small_page_size, args.small_token_bytes, 1, 1))):
        t = time_planning(w, args.plan_indices, window, args.seed)
        t["transfer_s"] = t["bytes"] / (best * 1e9) if best else None
        t["plan_share"] = _ratio(t["plan_s"] + t["to_lists_s"], t["transfer_s"])
        shapes[label] = t
    return {"at_gbps": best, "window": window, "layouts": shapes}


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
