"""``pdxfer bench`` results as text tables, and the targets they are checked against."""

from __future__ import annotations

import statistics

SYSTEM_ORDER = ("wire", "baseline", "pdxfer")
BUSY_SHARE = 0.05  # other processes' share of the box above which the figures are flagged
PROBE_DRIFT = 1.25  # CPU probe slower or faster by this factor at the end than at the start: flagged
# figure key, label, format
FIGURES = (
    ("gbps", "GB/s", "{:.2f}"),
    ("rooms_per_s", "rooms/s", "{:.0f}"),
    ("p50_ms", "p50 ms to Success", "{:.2f}"),
    ("p90_ms", "p90 ms to Success", "{:.2f}"),
    ("p99_ms", "p99 ms to Success", "{:.2f}"),
    ("blocks_per_room", "blocks submitted per room", "{:.1f}"),
    ("inline_share", "rooms with KV in aux record", "{:.0%}"),
    ("control_per_room", "control msgs per room", "{:.2f}"),
    ("cpu_s_per_gb", "CPU s per GB moved", "{:.2f}"),
    ("cpu_ms_per_room", "CPU ms per room", "{:.2f}"),
    ("engine_cpu_ms_per_room", "engine CPU ms per room", "{:.2f}"),
    ("rss_idle_mib", "RSS idle MiB", "{:.0f}"),
    ("rss_anon_mib", "RSS anon MiB after", "{:.0f}"),
    ("rss_peak_mib", "RSS peak MiB (pools incl.)", "{:.0f}"),
)


def _fmt(value, spec: str = "{:.2f}", width: int = 10) -> str:
    return f"{'-' if value is None else spec.format(value):>{width}}"


def _x(value) -> str:
    return f"{'-' if value is None else f'{value:.2f}x':>10}"


def _workload_table(name: str, wl: dict) -> list[str]:
    systems = [s for s in SYSTEM_ORDER if s in wl["systems"]]
    blocks = wl["planned_blocks_per_room"]
    lines = [
        f"{name}: {wl['shape']}",
        f"  {wl['kv_bytes'] / 1e9:.2f} GB of KV per run; planned blocks per room {blocks['mean']:.1f} "
        f"(min {blocks['min']}, max {blocks['max']}); baseline API {wl['baseline_api']}",
    ]
    ratios = wl["ratios"]
    with_wire = "wire" in systems
    head = f"  {'':28}" + "".join(f"{s:>10}" for s in systems) + f"{'pdxfer/base':>12}" + (f"{'pdxfer/wire':>12}" if with_wire else "")
    lines.append(head)
    for key, label, spec in FIGURES:
        row = f"  {label:28}" + "".join(_fmt(wl["systems"][s]["median"][key], spec) for s in systems)
        row += f"  {_x(ratios['pdxfer/baseline'].get(key))}"
        if with_wire:
            row += f"  {_x(ratios['pdxfer/wire'].get(key))}" if key in ratios["pdxfer/wire"] else ""
        lines.append(row)
    lines.append(f"  {'mismatched rooms (all runs)':28}" + "".join(f"{wl['systems'][s]['mismatches']:>10}" for s in systems))
    if per_room := _per_daemon_medians(wl, "peer_messages_per_room"):
        lines.append("  pdxfer room messages in per room (medians): " + "; ".join(
            f"{role} daemon " + ", ".join(f"{kind} {n:.2f}" for kind, n in kinds.items()) for role, kinds in per_room.items()))
    if states := _per_daemon_medians(wl, "state_ms"):
        lines.append("  pdxfer ms a rank's room spent in each state it left, and a write job queued and writing (medians): " + "; ".join(
            f"{role} daemon " + ", ".join(f"{state} {ms:.2f}" for state, ms in by_state.items()) for role, by_state in states.items()))
    if staging := _per_daemon_medians(wl, "staging_per_room"):
        lines.append("  pdxfer staging per room, legs (decode) or chunks (prefill) (medians): " + "; ".join(
            f"{role} daemon " + ", ".join(f"{what} {n:.2f}" for what, n in figures.items()) for role, figures in staging.items()))
    if equal := wl.get("equal_tp"):
        for system in ("pdxfer", "baseline"):
            if equal[system]:
                lines.append(f"  {system} GB/s at TP {wl['workload']['prefill_tp']}:{wl['workload']['decode_tp']} over the same rooms "
                             f"at {equal['topology']} ({equal['workload']}): {_x(equal[system]['gbps']).strip()}; in each repeat: "
                             + " ".join(_x(r).strip() for r in equal[system]["by_repeat"]))
    paired = wl.get("gbps_by_repeat", {}).get("pdxfer/baseline", [])
    if len(paired) > 1:
        lines.append("  GB/s pdxfer/baseline in each repeat: " + " ".join(_x(r).strip() for r in paired))
    if len(wl.get("baseline_apis", {})) > 1:
        lines.append("  baseline by API (GB/s, rooms/s, p50 ms, p99 ms, CPU ms/room): " + "; ".join(
            f"{api} {_fmt(m['gbps'], '{:.2f}', 0)}, {_fmt(m['rooms_per_s'], '{:.0f}', 0)}, {_fmt(m['p50_ms'], '{:.2f}', 0)}, "
            f"{_fmt(m['p99_ms'], '{:.2f}', 0)}, {_fmt(m['cpu_ms_per_room'], '{:.2f}', 0)}"
            for api, m in wl["baseline_apis"].items()))
    takebacks = [r["extra"].get("cpu_takebacks", 0) for r in wl["systems"].get("pdxfer", {}).get("runs", [])]
    if any(takebacks):
        lines.append(f"  ! pdxfer daemons left SCHED_IDLE (other processes starved them) in {sum(map(bool, takebacks))} of "
                     f"{len(takebacks)} runs: those runs' rooms moved partly without the yield (--yield-cpu)")
    for s in systems:
        for error in wl["systems"][s]["errors"]:
            lines.append(f"  ! {s}: {error}")
    return lines


def _per_daemon_medians(wl: dict, key: str) -> dict[str, dict[str, float]]:
    """The medians over pdxfer's good runs of what each run's ``extra[key]`` holds per
    daemon role and name (peer messages per room, ms per state, staging per room)."""
    runs = [r["extra"].get(key) for r in wl["systems"].get("pdxfer", {}).get("runs", []) if not r["error"]]
    runs = [r for r in runs if r]
    if not runs:
        return {}
    return {role: {name: statistics.median(r.get(role, {}).get(name, 0.0) for r in runs) for name in names}
            for role, names in runs[0].items()}


def _sweep_table(report: dict) -> list[str]:
    points = [(p["in_flight"], report["workloads"].get(p["workload"])) for p in report["sweep"]]
    points = [(n, wl) for n, wl in points if wl is not None]
    if not points:
        return []
    lines = ["concurrency sweep (small rooms): baseline | pdxfer | pdxfer/baseline",
             f"  {'in flight':>9}  {'rooms/s':>26}  {'p50 ms':>26}  {'p99 ms':>26}  {'GB/s':>20}"]
    for n, wl in points:
        med = {s: v["median"] for s, v in wl["systems"].items()}
        ratio = wl["ratios"]["pdxfer/baseline"]
        cells = []
        for key, spec in (("rooms_per_s", "{:.0f}"), ("p50_ms", "{:.2f}"), ("p99_ms", "{:.2f}")):
            cells.append(_fmt(med.get("baseline", {}).get(key), spec, 8) + _fmt(med.get("pdxfer", {}).get(key), spec, 9) + _x(ratio.get(key))[1:])
        cells.append(_fmt(med.get("baseline", {}).get("gbps"), "{:.3f}", 10) + _fmt(med.get("pdxfer", {}).get("gbps"), "{:.3f}", 10))
        lines.append(f"  {n:>9}  " + "  ".join(cells))
    return lines


def _planning(report: dict) -> list[str]:
    planning = report.get("planning")
    if not planning:
        return []
    rate = planning["at_gbps"]
    timings = next(iter(planning["layouts"].values()), {}).get("timings", 1)
    lines = [f"planning (page lists -> checked, coalesced blocks -> the lists the engine is called with, {planning['window']} at a time; "
             f"medians of {timings} timings), vs moving the same bytes at {'-' if rate is None else f'{rate:.2f}'} GB/s (best pdxfer "
             "large or medium rate above)"]
    for label, t in planning["layouts"].items():
        share = "-" if t["plan_share"] is None else f"{t['plan_share']:.2%}"
        transfer = "-" if t["transfer_s"] is None else f"{t['transfer_s']:.1f} s"
        lines.append(
            f"  {label:20} {t['page_indices']:,} page indices -> {t['blocks']:,} blocks: plan {t['plan_s'] * 1e3:.0f} ms"
            f" + to lists {t['to_lists_s'] * 1e3:.0f} ms; transfer {transfer}; share {share}"
        )
    return lines


def _one_in_flight(report: dict, n: int) -> dict | None:
    for p in report["sweep"]:
        if p["in_flight"] == n:
            return report["workloads"].get(p["workload"])
    wl = report["workloads"].get("small")
    return wl if wl and wl["workload"]["in_flight"] == n else None


def _get(wl: dict | None, system: str, key: str):
    return None if wl is None else wl["systems"].get(system, {}).get("median", {}).get(key)


def _spread(wl: dict | None) -> str:
    """The range of a workload's per-repeat GB/s ratios, when it has several."""
    paired = [r for r in (wl or {}).get("gbps_by_repeat", {}).get("pdxfer/baseline", []) if r is not None]
    return f"repeats {min(paired):.2f}x-{max(paired):.2f}x" if len(paired) > 1 else ""


def targets(report: dict) -> list[dict]:
    wls = report["workloads"]

    def ratio(name: str, which: str, key: str = "gbps"):
        wl = wls.get(name)
        return None if wl is None else wl["ratios"][which].get(key)

    one, sixty_four = _one_in_flight(report, 1), _one_in_flight(report, 64)
    idle = [_get(wl, "pdxfer", "rss_idle_mib") for wl in wls.values()]
    idle = [v for v in idle if v is not None]
    layouts = report.get("planning", {}).get("layouts", {}).values()
    control = [_get(wl, "pdxfer", "control_per_room") for wl in wls.values()]
    control = [v for v in control if v is not None]
    shares = [t["plan_share"] for t in layouts if t["plan_share"] is not None]
    indices = next((f"{t['page_indices']:,}" for t in layouts), "page")
    rows = [
        ("large GB/s >= 0.95x baseline", ratio("large", "pdxfer/baseline"), lambda v: v >= 0.95, "{:.2f}x", _spread(wls.get("large"))),
        ("large GB/s >= 0.6x wire", ratio("large", "pdxfer/wire"), lambda v: v >= 0.6, "{:.2f}x", ""),
        ("medium GB/s >= 0.90x baseline", ratio("medium", "pdxfer/baseline"), lambda v: v >= 0.90, "{:.2f}x", _spread(wls.get("medium"))),
        ("small rooms/s >= 5000, 64 in flight", _get(sixty_four, "pdxfer", "rooms_per_s"), lambda v: v >= 5000, "{:.0f}", ""),
        ("p50 < 1 ms, one room in flight", _get(one, "pdxfer", "p50_ms"), lambda v: v < 1.0, "{:.2f} ms", ""),
        ("p99 < 5 ms, one room in flight", _get(one, "pdxfer", "p99_ms"), lambda v: v < 5.0, "{:.2f} ms", ""),
        (f"planning {indices} indices <= 5% of transfer", max(shares) if shares else None, lambda v: v <= 0.05, "{:.2%}", ""),
        ("idle daemon RSS < 150 MiB", max(idle) if idle else None, lambda v: v < 150, "{:.0f} MiB", ""),
        # A5: one room_request and one room_accepted per room per node pair, however many ranks
        ("control msgs per room per node pair <= 2", max(control) if control else None, lambda v: v <= 2.0, "{:.2f}", ""),
    ]
    for name in ("large", "medium"):
        if equal := (wls.get(name) or {}).get("equal_tp"):
            w = wls[name]["workload"]
            rows.append((f"{name} GB/s TP {w['prefill_tp']}:{w['decode_tp']} >= 0.9x {equal['topology']} ({w['page_order'].replace('_', '-')})",
                         equal["pdxfer"].get("gbps"), lambda v: v >= 0.9, "{:.2f}x",
                         f"baseline {_x(equal['baseline'].get('gbps')).strip()}" if equal["baseline"] else ""))
    return [
        {"target": text, "value": value, "shown": "-" if value is None else spec.format(value),
         "met": None if value is None else bool(test(value)), "spread": spread}
        for text, value, test, spec, spread in rows
    ]


def _lanes(n: int) -> str:
    return f"{n} engine lanes" if n else "the engine's default lanes"


def format_report(report: dict) -> str:
    cfg, box = report["config"], report["box"]
    topology = cfg.get("topology", (1, 1))
    lines = [
        f"pdxfer bench: medians of {cfg['repeat']} run(s) per workload and system; TCP over loopback, "
        f"{_lanes(cfg.get('tcp_lanes', 0))} per peer for pdxfer and baseline; seed {cfg['seed']}; "
        f"pages {cfg.get('placement', 'scattered')}; TP {':'.join(map(str, topology))} "
        f"({cfg.get('heads', 1)} KV heads, {cfg.get('page_order', 'token_major').replace('_', '-')}); "
        f"{box['cpus']} CPUs, {box['seconds']:.0f} s",
        f"  transfer engines per process: baseline {cfg.get('baseline_engines', 1)}, pdxfer daemons "
        f"{cfg.get('tcp_engines', 1)} (--baseline-engines, --tcp-engines), writes spread over them in turn",
    ]
    if cfg.get("staging_at_start"):
        lines.append("  pdxfer daemons' staging buffers: backed and mapped before the first room (--staging-at-start)")
    elif len(set(topology)) > 1 and cfg.get("staging_mib") != 0:
        lines.append("  pdxfer daemons' staging buffers: backed as staged legs first reach them, so a fresh daemon's first "
                     "legs take page faults in the engine's threads (--staging-at-start: before the first room)")
    if box["foreign_share"] > BUSY_SHARE:
        lines.append(f"  WARNING: other processes used {box['foreign_cpu_s']:.0f} CPU-seconds ({box['foreign_share']:.0%} of the box) "
                     "while this ran; the figures are unreliable")
    why = box.get("pdxfer_normal_policy_why")
    if why is not None:
        lines.append("  pdxfer daemons: their own threads " + (f"keep the normal CPU policy ({why})" if why else
                     "yield the cores to the transfer engine's (SCHED_IDLE, --yield-cpu)"))
    before, after = box.get("cpu_probe_ms", (None, None))
    if before and after:
        lines.append(f"  CPU probe (fixed pure-Python loop): {before:.1f} ms before, {after:.1f} ms after")
        if max(before, after) > PROBE_DRIFT * min(before, after):
            lines.append("  WARNING: this VM's CPU speed changed during the run (host contention); compare ratios within "
                         "this run only, and absolute figures with care")
    lines.append("")
    for name, wl in report["workloads"].items():
        lines += _workload_table(name, wl) + [""]
    for block in (_sweep_table(report), _planning(report)):
        if block:
            lines += block + [""]
    lines.append("targets")
    for t in report["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        spread = f"   ({t['spread']})" if t.get("spread") else ""
        lines.append(f"  {t['target']:46} {t['shown']:>10}   {verdict:6}{spread}".rstrip())
    return "\n".join(lines)
