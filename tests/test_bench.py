"""pdxfer bench: block counts from coalescing (pure), and the benchmark itself at a
tiny size, once clean and once with a corrupted byte in every system. Nothing here
asserts on speed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from pdxfer.cli import build_parser
from pdxfer.core import config
from pdxfer.core.plan import layout_regions, pool_bytes
from pdxfer.host import cpu_yield
from pdxfer.host.memory import KV_POOL_PREFIX
from pdxfer.tools.bench.main import by_repeat, memory_shortfall, planning_figures
from pdxfer.tools.bench.plan import DEFAULT_PLACEMENT, PLANNING_TIMINGS, Plan, RoomPages, Workload, block_counts, make_plan, page_order, parse_placement, time_planning
from pdxfer.tools.bench.report import format_report, targets
from pdxfer.tools.bench.run import RunResult
from pdxfer.tools.launch import LaunchError, read_events
from pdxfer.tools.sim import Lockstep, RoomSpec, run_rooms

from .conftest import needs_mooncake, orphan_pool

# 2 layers: K0 V0 K1 V1, four regions of 4 tokens x 64 B = 256 B pages.
TINY = Workload("t", rooms=1, in_flight=1, layers=2, page_size=4, token_bytes=64, min_pages=1, max_pages=1)


def one_room(src, dst) -> Plan:
    src, dst = np.array(src, np.int32), np.array(dst, np.int32)
    return Plan(TINY, 64, [RoomPages(room=1, tokens=src.size * 4, src=src, dst=dst)])


def runs(src, dst) -> int:
    """Runs contiguous on both sides, counted the slow way."""
    count = 1
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            count += 1
    return count


@pytest.mark.parametrize(
    "src, dst, expected_runs",
    [
        ([0, 1, 2, 3], [10, 11, 12, 13], 1),  # contiguous on both sides: one block per region
        ([0, 1, 2, 3], [10, 5, 11, 12], 3),  # a scattered destination page splits the run
        ([4, 5, 0, 1], [8, 9, 10, 11], 2),  # the source jumps back
        ([7], [3], 1),
        ([0, 2, 4, 6], [0, 2, 4, 6], 4),  # strided: nothing coalesces
    ],
)
def test_coalescing_gives_one_block_per_run_and_region(src, dst, expected_runs):
    plan = one_room(src, dst)
    (blocks,) = plan.blocks()
    regions = layout_regions(plan.layout)
    assert len(regions) == 4
    assert len(blocks) == expected_runs * len(regions)
    assert block_counts(plan).tolist() == [expected_runs * len(regions)]
    assert blocks.nbytes == len(src) * 4 * 256  # every page of every region, once


def test_blocks_address_the_right_pages():
    plan = one_room([2, 3], [9, 10])
    (blocks,) = plan.blocks((1 << 20,), (1 << 30,))
    page, pool_pages = 256, plan.num_pages
    for r in range(4):  # region r starts at r * pool_pages * page
        assert blocks.src[r] == (1 << 20) + r * pool_pages * page + 2 * page
        assert blocks.dst[r] == (1 << 30) + r * pool_pages * page + 9 * page
        assert blocks.length[r] == 2 * page


def test_planned_rooms_coalesce_as_counted_by_hand(tmp_path):
    w = Workload("w", rooms=50, in_flight=4, layers=3, page_size=4, token_bytes=64, min_pages=1, max_pages=12)
    plan = make_plan(w, seed=5, placement="runs:4")
    expected = [runs(r.src.tolist(), r.dst.tolist()) * 2 * w.layers for r in plan.rooms]
    assert block_counts(plan).tolist() == expected
    # pages never repeat within a plan, on either side, and fit the pools
    src = np.concatenate([r.src for r in plan.rooms])
    dst = np.concatenate([r.dst for r in plan.rooms])
    assert len(set(src.tolist())) == src.size and len(set(dst.tolist())) == dst.size
    assert src.max() < plan.num_pages and dst.max() < plan.num_pages
    # both sides come in runs of 4 pages, so rooms of more than one page coalesce
    assert min(expected) >= 2 * w.layers
    assert sum(expected) < 2 * w.layers * src.size
    assert plan.num_pages % 4 == 0
    # the file every benchmark process reads gives back the same plan
    plan.save(tmp_path / "plan.npz")
    again = Plan.load(str(tmp_path / "plan.npz"))
    assert again.workload == plan.workload and again.num_pages == plan.num_pages
    assert [(r.room, r.tokens, r.src.tolist(), r.dst.tolist()) for r in again.rooms] == [
        (r.room, r.tokens, r.src.tolist(), r.dst.tolist()) for r in plan.rooms
    ]
    assert make_plan(w, seed=5, placement="runs:4").rooms[7].dst.tolist() == plan.rooms[7].dst.tolist()  # deterministic


@pytest.mark.parametrize("text, run", [("contiguous", 0), ("scattered", 1), ("runs:1", 1), ("runs:16", 16)])
def test_placement_names_a_run_length(text, run):
    assert parse_placement(text) == run


@pytest.mark.parametrize("text", ["runs", "runs:0", "runs:x", "blocks:4", ""])
def test_placement_refuses_what_it_cannot_lay_out(text):
    with pytest.raises(ValueError, match="contiguous, scattered or runs:N"):
        parse_placement(text)


@pytest.mark.parametrize("run", [0, 1, 2, 8])
def test_page_order_hands_out_every_page_once_in_runs(run):
    order = page_order(64, run, np.random.default_rng(3)).tolist()
    assert sorted(order) == list(range(64))
    starts = [order[i] for i in range(0, 64, max(run, 1))]
    if run == 0:
        assert order == list(range(64))
    else:  # each run is `run` consecutive pages starting at a multiple of `run`
        assert all(order[i : i + run] == list(range(s, s + run)) and s % run == 0 for i, s in zip(range(0, 64, run), starts))
    if run == 1:
        assert order != list(range(64))  # shuffled


def test_contiguous_rooms_are_one_block_per_region_and_scattered_ones_a_block_per_page():
    w = Workload("w", rooms=20, in_flight=4, layers=2, page_size=4, token_bytes=64, min_pages=2, max_pages=6)
    regions = 2 * w.layers
    contiguous = make_plan(w, seed=2, placement="contiguous")
    assert block_counts(contiguous).tolist() == [regions] * w.rooms
    scattered = make_plan(w, seed=2, placement="scattered")
    pages = [r.src.size for r in scattered.rooms]
    counts = block_counts(scattered).tolist()
    assert all(c <= regions * p for c, p in zip(counts, pages)) and sum(counts) > regions * sum(pages) * 0.8


def test_planning_measurement_counts_blocks():
    t = time_planning(TINY, 1000, window=7)
    assert t["page_indices"] == 1000
    assert t["blocks"] % 4 == 0 and 0.9 * 4000 <= t["blocks"] <= 4000  # scattered: (nearly) a block per page and region
    assert t["bytes"] == 1000 * 4 * 256
    assert t["plan_s"] >= 0 and t["to_lists_s"] >= 0
    assert t["timings"] == PLANNING_TIMINGS > 1


@pytest.mark.parametrize("measured, rate", [({"small": 0.1}, None), ({"small": 0.1, "medium": 1.5, "large": 2.0}, 2.0), ({"medium": 1.5}, 1.5)])
def test_planning_is_compared_with_large_or_medium_rates_only(measured, rate):
    """Small rooms' GB/s is bound by messages: against it planning would look cheap."""
    args = build_parser().parse_args(["bench", "--plan-indices", "1000", "--layers", "2"])
    report = {"workloads": {name: {"systems": {"pdxfer": {"median": {"gbps": gbps}}}} for name, gbps in measured.items()}}
    planning = planning_figures(args, report)
    assert planning["at_gbps"] == rate
    assert planning["window"] == config.load({"role": "prefill"}).peer_window  # converted as the pump submits them
    for t in planning["layouts"].values():
        assert (t["plan_share"] is None) is (rate is None)


@pytest.mark.parametrize("why, said", [("", "yield the cores to the transfer engine's"),
                                       ("--no-yield-cpu", "keep the normal CPU policy (--no-yield-cpu)")])
def test_report_says_whether_the_pdxfer_daemons_yielded_the_cores(why, said):
    report = {"config": {"repeat": 1, "seed": 1}, "workloads": {}, "sweep": [], "targets": [],
              "box": {"cpus": 2, "seconds": 9.0, "foreign_cpu_s": 0.0, "foreign_share": 0.0, "pdxfer_normal_policy_why": why}}
    assert f"pdxfer daemons: their own threads {said}" in format_report(report)


@pytest.mark.parametrize("topology, staging, said", [
    ((2, 1), {}, "backed as staged legs first reach them"),
    ((2, 1), {"staging_at_start": True}, "backed and mapped before the first room"),
    ((2, 1), {"staging_mib": 0}, None),  # no buffer to back
    ((1, 1), {}, None),  # nothing staged at equal TP
])
def test_report_says_how_the_staging_buffers_were_backed_where_there_are_any(topology, staging, said):
    report = {"config": {"repeat": 1, "seed": 1, "topology": topology, **staging}, "workloads": {}, "sweep": [], "targets": [],
              "box": {"cpus": 2, "seconds": 9.0, "foreign_cpu_s": 0.0, "foreign_share": 0.0}}
    lines = [line for line in format_report(report).splitlines() if "staging buffers" in line]
    assert [said in line for line in lines] == ([True] if said else [])


@pytest.mark.parametrize("probe, warned", [((10.0, 11.0), False), ((10.0, 14.0), True), ((14.0, 10.0), True)])
def test_report_flags_a_cpu_speed_change_during_the_run(probe, warned):
    report = {"config": {"repeat": 1, "seed": 1}, "workloads": {}, "sweep": [], "targets": [],
              "box": {"cpus": 2, "seconds": 9.0, "foreign_cpu_s": 0.0, "foreign_share": 0.0, "cpu_probe_ms": list(probe)}}
    text = format_report(report)
    assert f"{probe[0]:.1f} ms before, {probe[1]:.1f} ms after" in text
    assert ("CPU speed changed" in text) is warned


def test_ratios_repeat_by_repeat_pair_neighbouring_runs_and_show_the_spread():
    def run(system: str, seconds: float, error: str = "") -> RunResult:
        return RunResult(system, "medium", rooms=4, ok=4, bytes=2 * 10**9, seconds=seconds, error=error)

    pdxfer = [run("pdxfer", 1.0), run("pdxfer", 2.0), run("pdxfer", 1.0, error="died")]
    baseline = [run("baseline", 0.8), run("baseline", 1.0), run("baseline", 1.0)]
    paired = by_repeat(pdxfer, baseline, "gbps")
    assert paired[:2] == [pytest.approx(0.8), pytest.approx(0.5)] and paired[2] is None
    wl = {"systems": {}, "gbps_by_repeat": {"pdxfer/baseline": paired}, "ratios": {"pdxfer/baseline": {"gbps": 0.65}, "pdxfer/wire": {}}}
    medium = next(t for t in targets({"workloads": {"medium": wl}, "sweep": []}) if t["target"].startswith("medium"))
    assert medium["met"] is False and medium["spread"] == "repeats 0.50x-0.80x"
    report = {"config": {"repeat": 3, "seed": 1}, "workloads": {}, "sweep": [], "targets": [medium],
              "box": {"cpus": 2, "seconds": 9.0, "foreign_cpu_s": 0.0, "foreign_share": 0.0}}
    assert "0.65x   MISSED   (repeats 0.50x-0.80x)" in format_report(report)


def test_every_bench_flag_is_explained():
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")
    bench = sub.choices["bench"]
    for action in bench._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 15, f"{action.option_strings} has no help"


def test_a_bench_too_big_for_shared_memory_names_the_workload_and_the_flag_that_shrinks_it():
    small = Workload("medium", rooms=4, in_flight=2, layers=2, page_size=4, token_bytes=64, min_pages=1, max_pages=2)
    big = Workload("sweep-64", rooms=64, in_flight=64, layers=2, page_size=4, token_bytes=64, min_pages=1, max_pages=2)
    needs = {w.name: 2 * pool_bytes(make_plan(w, 1).layout) for w in (small, big)}  # a source and a destination pool
    assert needs["sweep-64"] > needs["medium"]
    assert memory_shortfall(needs, room=needs["sweep-64"]) == ""
    why = memory_shortfall(needs, room=needs["sweep-64"] - 1)
    assert "sweep-64 workload" in why and "--sweep-rooms" in why


@pytest.mark.parametrize("rooms", ["200000", "900000000"])  # the second would fill memory with its plan alone
def test_bench_refuses_sizes_that_do_not_fit_before_starting_anything(rooms):
    proc = subprocess.run([sys.executable, "-m", "pdxfer", "bench", "--workloads", "medium", "--medium-rooms", rooms],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "medium workload needs" in proc.stderr and "--medium-rooms" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # the refusal alone: no run, no progress bar


def test_bench_removes_the_pools_of_killed_engines_before_it_checks_for_room():
    """A bench killed with SIGKILL leaves its engines' pools behind; the next bench says
    it removed them instead of refusing for the room they hold."""
    orphan = orphan_pool(KV_POOL_PREFIX, 1 << 20)
    try:
        proc = subprocess.run([sys.executable, "-m", "pdxfer", "bench", "--workloads", "medium", "--medium-rooms", "200000"],
                              capture_output=True, text=True, timeout=120)
        assert not os.path.exists(orphan)
        assert "pdxfer bench: removed" in proc.stderr and "left by engine processes that had exited" in proc.stderr
        assert proc.returncode == 2 and "medium workload needs" in proc.stderr  # the refusal still follows
    finally:
        if os.path.exists(orphan):
            os.unlink(orphan)


TINY_FLAGS = [
    "--repeat", "1", "--large-rooms", "2", "--large-in-flight", "2", "--large-mib", "2-4",
    "--medium-rooms", "6", "--medium-in-flight", "3", "--medium-mib", "1-2",
    "--small-rooms", "30", "--small-in-flight", "8", "--sweep", "1,8", "--sweep-rooms", "10",
    "--layers", "2", "--plan-indices", "2000", "--timeout", "60", "--json",
]


def bench(*flags: str) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "pdxfer", "bench", *TINY_FLAGS, *flags],
                          capture_output=True, text=True, timeout=240)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@needs_mooncake
@pytest.mark.integration
def test_bench_runs_every_workload_and_system_at_a_tiny_size():
    code, report, err = bench()
    assert code == 0, err
    assert report["ok"]
    assert set(report["workloads"]) == {"large", "medium", "small", "sweep-1"}  # sweep-8 is small's runs
    # by default the baseline gets as many transfer engines as each pdxfer daemon, and pages lie in runs
    assert report["config"]["baseline_engines"] == report["config"]["tcp_engines"] >= 2
    assert f"pages {DEFAULT_PLACEMENT};" in format_report(report)
    assert report["sweep"] == [{"in_flight": 1, "workload": "sweep-1"}, {"in_flight": 8, "workload": "small"}]
    for name, wl in report["workloads"].items():
        expected = {"baseline", "pdxfer"} | ({"wire"} if name != "sweep-1" else set())
        assert set(wl["systems"]) == expected, name
        for system, result in wl["systems"].items():
            assert result["mismatches"] == 0 and not result["errors"], (name, system, result["errors"])
            (run,) = result["runs"]
            assert run["ok"] == wl["workload"]["rooms"], (name, system)
            assert run["bytes"] == wl["kv_bytes"], (name, system)
            assert result["median"]["gbps"] > 0
        # same block lists: the baseline submitted exactly what pdxfer plans
        assert wl["systems"]["baseline"]["median"]["blocks_per_room"] == pytest.approx(wl["planned_blocks_per_room"]["mean"])
        pdx = wl["systems"]["pdxfer"]["median"]
        if name in ("large", "medium"):  # over --inline-kv-bytes: pdxfer wrote those blocks too
            assert pdx["inline_share"] == 0
            assert wl["ratios"]["pdxfer/baseline"]["blocks_per_room"] == pytest.approx(1.0)
        else:  # a few pages: the KV rode the aux record, no engine write
            assert pdx["inline_share"] == 1.0 and pdx["blocks_per_room"] == 0
        assert wl["systems"]["pdxfer"]["median"]["p99_ms"] is not None
        assert wl["systems"]["pdxfer"]["median"]["cpu_s_per_gb"] is not None
        assert pdx["engine_cpu_ms_per_room"] > 0  # the engine processes' own count over their rooms
        assert wl["systems"]["baseline"]["median"]["engine_cpu_ms_per_room"] is None  # its engines are the byte movers
        assert wl["systems"]["pdxfer"]["median"]["rss_idle_mib"] > 0
    unmeasured = {t["target"] for t in report["targets"] if t["met"] is None}
    assert unmeasured == {"small rooms/s >= 5000, 64 in flight"}  # no point of this tiny run has 64 in flight
    assert report["box"]["pdxfer_normal_policy_why"] == cpu_yield.why_not(False, 60.0)  # the daemons it started: the default, no yield
    assert "rooms" in err and "GB/s" in err  # the progress bar, on stderr
    # What the daemons did, not only what they were set to do: a run whose daemons left
    # SCHED_IDLE is named under its workload.
    runs = report["workloads"]["medium"]["systems"]["pdxfer"]["runs"]
    assert all(isinstance(r["extra"]["cpu_takebacks"], int) for r in runs)
    # Where a room's time went, side by side, from the daemons' state histograms.
    for role in ("prefill", "decode"):
        states = runs[0]["extra"]["state_ms"][role]
        assert list(states)[0] == "bootstrapping" and states["transferring"] > 0, (role, states)
    prefill = runs[0]["extra"]["state_ms"]["prefill"]
    assert 0 < prefill["job write"] < prefill["transferring"] and prefill["job queue"] >= 0  # the writes are part of its transfer
    assert "job write" not in runs[0]["extra"]["state_ms"]["decode"]  # it writes nothing
    assert "ms a rank's room spent in each state it left, and a write job queued and writing" in format_report(report)
    starved = "left SCHED_IDLE (other processes starved them) in 1 of 1 runs"
    assert (starved in format_report(report)) is (runs[0]["extra"]["cpu_takebacks"] > 0)
    runs[0]["extra"]["cpu_takebacks"] = 2
    assert starved in format_report(report)


@needs_mooncake
@pytest.mark.integration
def test_bench_with_inline_kv_off_writes_the_baselines_blocks():
    code, report, err = bench("--workloads", "small", "--systems", "baseline,pdxfer", "--inline-kv-bytes", "0")
    assert code == 0, err
    wl = report["workloads"]["small"]
    assert wl["systems"]["pdxfer"]["median"]["inline_share"] == 0
    assert wl["ratios"]["pdxfer/baseline"]["blocks_per_room"] == pytest.approx(1.0)


@needs_mooncake
@pytest.mark.integration
def test_a_baseline_with_several_engines_moves_every_block_with_every_api():
    """--baseline-engines: raw engines spreading their writes as pdxfer's daemons do,
    to compare pdxfer with that; every API, every byte checked."""
    code, report, err = bench("--workloads", "medium", "--systems", "baseline,pdxfer", "--baseline-api", "all",
                              "--baseline-engines", "2", "--tcp-engines", "3")
    assert code == 0, err
    wl = report["workloads"]["medium"]
    assert set(wl["baseline_apis"]) == {"submit", "submit_spin", "batch_async", "batch_sync"}
    assert all(median["blocks_per_room"] == pytest.approx(wl["planned_blocks_per_room"]["mean"]) for median in wl["baseline_apis"].values())
    assert wl["systems"]["baseline"]["mismatches"] == 0 and wl["systems"]["pdxfer"]["mismatches"] == 0
    assert "transfer engines per process: baseline 2, pdxfer daemons 3" in format_report(report)


@needs_mooncake
@pytest.mark.integration
def test_bench_catches_a_corrupted_byte_in_every_system():
    code, report, err = bench("--workloads", "small", "--corrupt", "wire,baseline,pdxfer")
    assert code == 1
    assert not report["ok"]
    for system, result in report["workloads"]["small"]["systems"].items():
        assert result["mismatches"] == 1, (system, result)
        assert f"VERIFICATION FAILED: 1 room(s) of small on {system}" in err


@needs_mooncake
@pytest.mark.integration
def test_bench_runs_prefill_tp2_into_decode_tp1_with_the_fields_of_ranks():
    """--topology 2:1: two prefill rank processes, one decode rank, one daemon per side
    serving all of its ranks; the baseline writes the same legs' blocks between the same
    per-rank pools; every byte of every decode rank checked against the heads it holds.
    The daemons' staging buffers are backed before the first room (--staging-at-start)."""
    code, report, err = bench("--workloads", "medium,small", "--systems", "wire,baseline,pdxfer", "--topology", "2:1",
                              "--heads", "8", "--compare-equal-tp", "--inline-kv-bytes", "0", "--staging-at-start")
    assert code == 0, err
    assert set(report["workloads"]) == {"medium", "small", "medium-equal-tp", "small-equal-tp"}
    for name in ("medium", "small"):
        wl = report["workloads"][name]
        assert set(wl["systems"]) == {"baseline", "pdxfer"}, name  # the wire is one stream: 1:1 only
        base, pdx = wl["systems"]["baseline"], wl["systems"]["pdxfer"]
        for result in (base, pdx):
            assert result["mismatches"] == 0 and not result["errors"], (name, result["errors"])
            assert result["runs"][0]["bytes"] == wl["kv_bytes"]
        # head slices: two legs per room, each a block per page and region; the baseline wrote exactly those. pdxfer's
        # decode daemon staged both workloads' slices over TCP (medium's 64 KiB spans, small's 2 KiB; core/staging.py),
        # so it wrote runs of whole source pages
        assert base["median"]["blocks_per_room"] == pytest.approx(wl["planned_blocks_per_room"]["mean"])
        assert pdx["median"]["blocks_per_room"] < wl["planned_blocks_per_room"]["mean"]
        (run,) = pdx["runs"]
        assert run["extra"]["lanes"] == {"prefill": 2, "decode": 1}
        assert pdx["median"]["control_per_room"] == pytest.approx(2.0)  # one room_request, one room_accepted
        equal = wl["equal_tp"]
        assert equal["topology"] == "1:1" and equal["pdxfer"]["gbps"] > 0 and equal["baseline"]["gbps"] > 0
        twin = report["workloads"][equal["workload"]]
        assert set(twin["systems"]) == {"baseline", "pdxfer"} and twin["kv_bytes"] == wl["kv_bytes"]
        assert twin["systems"]["pdxfer"]["runs"][0]["extra"]["lanes"] == {"prefill": 1, "decode": 1}
        # both legs of every room went through the decode's buffer, none found it full; equal TP stages nothing
        assert run["extra"]["staging_per_room"] == {"decode": {"staged": 2.0, "buffer full": 0.0}}, name
        assert twin["systems"]["pdxfer"]["runs"][0]["extra"]["staging_per_room"] == {}
    assert "medium GB/s TP 2:1 >= 0.9x 1:1 (head-major)" in {t["target"] for t in report["targets"]}
    assert "TP 2:1 (8 KV heads, head-major)" in format_report(report)
    assert "staging buffers: backed and mapped before the first room (--staging-at-start)" in format_report(report)
    assert "pdxfer staging per room, legs (decode) or chunks (prefill) (medians): decode daemon staged 2.00, buffer full 0.00" in format_report(report)


def test_ranks_in_lockstep_start_a_room_only_once_every_rank_has_one_free(tmp_path, monkeypatch):
    """Two ranks of one engine, two rooms in flight: rank 1 holds its first two rooms
    while rank 0 finishes its own at once. Rank 0 waits for rank 1 before its third,
    as one scheduler gating on both ranks would; once rank 1 finishes one, both go on,
    woken by rank 1's message (the periodic recheck is pushed out of the test's reach)."""
    monkeypatch.setattr(Lockstep, "RECHECK_S", 60.0)
    path = str(tmp_path / "lockstep")
    np.zeros(2, np.int64).tofile(path)
    specs = [RoomSpec(i, 100 + i, 16) for i in range(4)]
    started: dict[int, list[int]] = {0: [], 1: []}

    async def scenario() -> None:
        holds = {0: asyncio.Event(), 1: asyncio.Event()}

        def ranks_room(rank: int):
            async def one(spec: RoomSpec) -> None:
                started[rank].append(spec.index)
                if rank == 1 and spec.index in holds:
                    await holds[spec.index].wait()
            return one

        ranks = [asyncio.create_task(run_rooms(specs, 2, ranks_room(r), Lockstep(path, 2, r))) for r in (0, 1)]
        await asyncio.sleep(0.05)
        assert started == {0: [0, 1], 1: [0, 1]}
        holds[0].set()
        await asyncio.sleep(0.05)
        assert started[0] == [0, 1, 2, 3] and started[1] == [0, 1, 2, 3]
        holds[1].set()
        await asyncio.wait_for(asyncio.gather(*ranks), 5)

    asyncio.run(scenario())
    assert np.fromfile(path, np.int64).tolist() == [4, 4]


def test_a_daemon_that_dies_ends_the_wait_for_its_engines_at_once_saying_how():
    # The bench and the demo wait on the simulated engines; an engine whose daemon died
    # waits out its room timeout, so the wait watches the daemons too.
    sim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    daemon = subprocess.Popen(["sh", "-c", "kill -BUS $$"])
    try:
        with pytest.raises(LaunchError, match=r"^the prefill daemon ended \(killed by signal SIGBUS\) while the simulated engines ran$"):
            read_events({"sim": sim}, timeout=90, watch={"the prefill daemon": daemon})
        assert sim.wait(10) == -signal.SIGKILL  # its engines are not left running
    finally:
        sim.kill()
        sim.stdout.close()


def test_bench_refuses_a_topology_pdxfer_cannot_split():
    for flags, why in ((["--topology", "0:1"], "not P:D"), (["--topology", "3:1"], "divisible"),
                       (["--heads", "3"], "bytes per head"),
                       # what the daemons would refuse only after the bench started them (exit 2, a LaunchError)
                       (["--tcp-lanes", "32"], "'32': need 0 to 16"), (["--tcp-engines", "9"], "'9': need 1 to 8")):
        proc = subprocess.run([sys.executable, "-m", "pdxfer", "bench", *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr, (flags, proc.stderr)
