"""``pdxfer bench`` flags. Standard library and pdxfer.core.config only (the CLI loads
both anyway), so ``pdxfer --help`` stays fast; the benchmark itself (pdxfer.tools.bench.main)
is imported when the command runs."""

from __future__ import annotations

import argparse

from ...core.config import INLINE_KV_BYTES, TCP_ENGINES, TCP_LANES
from ...core.paths import MAX_TCP_ENGINES, MAX_TCP_LANES
from ...ops.commands import int_between, positive_int
from .plan import DEFAULT_PLACEMENT, parse_placement

WORKLOADS = ("large", "medium", "small", "sweep")
SYSTEMS = ("wire", "baseline", "pdxfer")
BASELINE_APIS = ("auto", "all", "submit", "submit_spin", "batch_async", "batch_sync")

DESCRIPTION = """\
Measure, in one run and on the same buffers and block lists, three ways of moving
each room's KV pages from a prefill pool to a decode pool on loopback:

  wire      one plain TCP stream between two processes: the most this box's
            network path carries (no protocol, no transfer engine)
  baseline  raw Mooncake transfer engines in two processes, writing exactly the
            blocks pdxfer plans, with the engine API that is fastest for the case, as
            many engines per process as a pdxfer daemon has (--baseline-engines)
  pdxfer    the full path: two daemons and two simulated engines using
            pdxfer.client; a room runs from the engine's send()/expect() (the later
            of the two) until the decode engine sees Success

--topology P:D runs a prefill engine of TP P and a decode engine of TP D: a process
per rank, each rank's pool holding its share of --heads KV heads (--page-order), one
daemon per side serving all of its ranks; the baseline writes the same legs' blocks
between the same per-rank pools, and pdxfer's control messages per room (room_request
in at the prefill daemon, room_accepted in at the decode daemon) are reported, which
must not grow with the ranks. --compare-equal-tp also runs pdxfer at D:D on the same
rooms and gives the GB/s of P:D over it. The wire runs at 1:1 only.

Room page lists come from --seed; blocks from pdxfer.core.plan. Pools hold every room's
pages, so sources are filled (and pdxfer's aux records made) before and destinations
checked (every byte, every room, every system) after the timed window; any mismatch
or failed room is reported and the command exits 1. A run maps a source and a
destination pool at once: sizes whose pools would not fit in shared memory are
refused before anything starts (exit 2). Figures are medians over --repeat runs;
each workload prints GB/s, rooms/s, p50/p90/p99 time to Success, blocks per room,
CPU seconds per GB of the two byte-moving processes (pdxfer: the daemons, each with
its transfer engine's process), pdxfer's engine processes' CPU per room besides, the
byte-movers' resident memory, and the ratio pdxfer/baseline of each (and pdxfer/wire), then
pdxfer/baseline GB/s in each repeat (its runs are neighbours in time; the spread is
the box's noise), and how many runs' daemons left SCHED_IDLE when other processes
starved them (--yield-cpu on the daemons). A progress bar runs on stderr."""


def size_range(text: str) -> tuple[float, float]:
    """'64-96' or '8' -> (low, high)."""
    low, sep, high = text.partition("-")
    try:
        pair = (float(low), float(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN-MAX") from None
    if pair[0] <= 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < MIN <= MAX")
    return pair


def choices_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), not {text!r}")
        return items

    return parse


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need positive integers")
    return values


def topology(text: str) -> tuple[int, int]:
    """'P:D' -> (prefill TP, decode TP)."""
    p, sep, d = text.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not P:D (prefill TP : decode TP, e.g. 2:1)")
    return int(p), int(d)


def placement(text: str) -> str:
    try:
        parse_placement(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to run")
    g.add_argument("--workloads", type=choices_list(WORKLOADS), default=list(WORKLOADS), metavar="LIST",
                   help=f"comma-separated workloads to run, from {', '.join(WORKLOADS)} (default: all)")
    g.add_argument("--systems", type=choices_list(SYSTEMS), default=list(SYSTEMS), metavar="LIST",
                   help="comma-separated systems to measure, from wire, baseline, pdxfer (default: all; wire runs on "
                   "large, medium and small only: one stream has no concurrency to sweep)")
    g.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="runs of every workload on every system; figures are their medians (default: 3)")
    g.add_argument("--seed", type=int, default=1, help="seed of room ids, sizes and page choices (default: 1)")

    g = p.add_argument_group("large and medium: per-layer K/V pools")
    g.add_argument("--layers", type=int, default=8, metavar="N",
                   help="model layers; the pool has a K and a V buffer per layer (default: 8)")
    g.add_argument("--page-size", type=int, default=64, metavar="TOKENS", help="tokens per page (default: 64)")
    g.add_argument("--token-bytes", type=int, default=2048, metavar="BYTES",
                   help="bytes per token per layer in each of K and V; with --page-size 64 that makes 128 KiB pages, "
                   "8 KV heads x 128 x bf16 (default: 2048)")
    g.add_argument("--large-rooms", type=int, default=16, metavar="N", help="rooms in the large workload (default: 16)")
    g.add_argument("--large-in-flight", type=int, default=4, metavar="N", help="large rooms in flight (default: 4)")
    g.add_argument("--large-mib", type=size_range, default=(64, 96), metavar="MIN-MAX",
                   help="KV per large room in MiB, rounded to whole pages (default: 64-96)")
    g.add_argument("--medium-rooms", type=int, default=160, metavar="N", help="rooms in the medium workload (default: 160)")
    g.add_argument("--medium-in-flight", type=int, default=32, metavar="N", help="medium rooms in flight (default: 32)")
    g.add_argument("--medium-mib", type=size_range, default=(4, 16), metavar="MIN-MAX",
                   help="KV per medium room in MiB, rounded to whole pages (default: 4-16)")

    g = p.add_argument_group("small and the concurrency sweep: tiny rooms, bound by the control plane")
    g.add_argument("--small-rooms", type=int, default=4000, metavar="N", help="rooms in the small workload (default: 4000)")
    g.add_argument("--small-in-flight", type=int, default=64, metavar="N", help="small rooms in flight (default: 64)")
    g.add_argument("--small-pages", type=size_range, default=(1, 4), metavar="MIN-MAX",
                   help="page indices per small room (default: 1-4)")
    g.add_argument("--small-layers", type=int, default=1, metavar="N", help="layers of the small rooms' pool (default: 1)")
    g.add_argument("--small-page-size", type=int, default=16, metavar="TOKENS", help="tokens per page of the small rooms' pool (default: 16)")
    g.add_argument("--small-token-bytes", type=int, default=256, metavar="BYTES",
                   help="bytes per token per layer in each of K and V of the small rooms' pool: 4 KiB pages by default (default: 256)")
    g.add_argument("--sweep", type=int_list, default=[1, 8, 64, 256], metavar="LIST",
                   help="rooms in flight at each point of the concurrency sweep, on small rooms; a point equal to "
                   "--small-in-flight reuses the small workload's runs (default: 1,8,64,256)")
    g.add_argument("--sweep-rooms", type=int, default=1000, metavar="N",
                   help="rooms per sweep point, raised to 8x its rooms in flight (default: 1000)")

    g = p.add_argument_group("how")
    g.add_argument("--baseline-api", choices=BASELINE_APIS, default="auto",
                   help="transfer engine API of the baseline writer: submit (transfer_submit_write per block, "
                   "transfer_check_status on the oldest write, short sleeps while none completed), submit_spin (the same, "
                   "polling without sleeping), batch_async (batch_transfer_async_write per room, get_batch_transfer_status), "
                   "batch_sync (batch_transfer_sync_write, a thread per room in flight, at most 16); all runs every one "
                   "and takes the fastest per workload as the baseline (and lists the others); auto uses the one measured "
                   "fastest on a 2-core box: submit_spin for one room of at most 1 MiB at a time, submit otherwise (default: auto)")
    g.add_argument("--window", type=int, default=512, metavar="N",
                   help="baseline writes in flight to the peer, as pdxfer's --peer-window; under the engine's per-peer "
                   "queue of 1024 (default: 512)")
    g.add_argument("--inline-kv-bytes", type=int, default=None, metavar="N",
                   help="the pdxfer daemons' --inline-kv-bytes: rooms with at most N bytes of KV send them inside the aux "
                   "record instead of as transfer-engine writes; 0 sends every byte through the engine, as the baseline "
                   f"does (default: the daemons' default, {INLINE_KV_BYTES})")
    g.add_argument("--tcp-lanes", type=int_between(0, MAX_TCP_LANES), default=TCP_LANES, metavar="N",
                   help="connections to a peer the transfer engine writes over, for pdxfer (its daemons' --tcp-lanes) and the "
                   "baseline alike (its engines' MC_TCP_LANES_PER_PEER), so both move bytes the same way; 0 leaves the "
                   f"engine's default of 4 (default: {TCP_LANES}, the daemons' default)")
    g.add_argument("--tcp-engines", type=int_between(1, MAX_TCP_ENGINES), default=TCP_ENGINES, metavar="N",
                   help="the pdxfer daemons' --tcp-engines: transfer engines per daemon, writes spread over them "
                   f"(default: {TCP_ENGINES}, the daemons' default)")
    g.add_argument("--baseline-engines", type=positive_int, default=None, metavar="N",
                   help="transfer engines in each baseline process, writes spread over them as pdxfer's daemons spread "
                   "theirs (default: as many as --tcp-engines gives each pdxfer daemon, so both use the same engines; "
                   "1 is a raw engine as engine integrations run it)")
    g.add_argument("--placement", type=placement, default=DEFAULT_PLACEMENT, metavar="contiguous|scattered|runs:N",
                   help="how rooms' pages lie in the pools, on both sides, as an engine's allocator hands them out: "
                   "contiguous (each room one run of pages), scattered (page by page, so nothing coalesces) or in runs "
                   f"of N consecutive pages (default: {DEFAULT_PLACEMENT})")
    g.add_argument("--topology", type=topology, default=(1, 1), metavar="P:D",
                   help="TP size of the prefill engine and of the decode engine: a process per rank, each with its own pool "
                   "holding its share of --heads heads, one daemon per side for all its ranks; D above P is fan-out, a prefill rank writing to "
                   "several decode ranks (default: 1:1)")
    g.add_argument("--heads", type=positive_int, default=8, metavar="N",
                   help="KV heads of the model, split over each engine's ranks; must divide --token-bytes and "
                   "--small-token-bytes and be divisible by P and D (default: 8)")
    g.add_argument("--page-order", choices=("head_major", "token_major"), default="head_major",
                   help="how a rank's page holds its heads' tokens: head_major ([head][token], vLLM's; a leg's slice of "
                   "heads is one block per page and region) or token_major ([token][head], SGLang's; a block per token) "
                   "(default: head_major)")
    g.add_argument("--compare-equal-tp", action="store_true",
                   help="also run pdxfer at D:D on the same rooms (the same bytes per room) and report the GB/s of "
                   "--topology P:D over it, per workload")
    g.add_argument("--expect-batch-ms", type=float, default=None, metavar="MS",
                   help="the decode daemon's --expect-batch-ms: how long a room's request waits for the engine's other "
                   "ranks to expect it too, so that one request carries every rank's legs; it leaves at once when they all "
                   "have (default: the daemon's default)")
    g.add_argument("--staging-mib", type=int, default=None, metavar="MIB",
                   help="the decode daemon's --staging-mib: its buffer for legs from prefill ranks holding fewer KV heads, "
                   "which then write runs of whole pages instead of a slice per page; 0 writes into the pages "
                   "(default: the daemon's default)")
    g.add_argument("--staging-at-start", action="store_true",
                   help="both daemons' --staging-at-start: their staging buffers are backed and mapped before the first "
                   "room, as a daemon that has run a while has them, instead of page by page as the first staged legs "
                   "write them (default: off, as the daemons start)")
    g.add_argument("--stage-spans-below-kib", type=int, default=None, metavar="KIB",
                   help="both daemons' --stage-spans-below-kib: slices whose spans are shorter are staged (default: the "
                   "daemons' default, as measured for the protocol)")
    g.add_argument("--aux-path", choices=["auto", "tcp", "transfer_engine"], default="auto",
                   help="the pdxfer daemons' --aux-path (default: auto, which is tcp here)")
    g.add_argument("--plan-indices", type=int, default=1_000_000, metavar="N",
                   help="page indices to plan for the planning-time figure, once per layout, compared with moving them at "
                   "pdxfer's best large or medium rate (without those, no share is given); 0 skips it (default: 1000000)")
    g.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="limit for one run of one workload on one system (default: 300)")
    g.add_argument("--workdir", default="", metavar="DIR",
                   help="keep plans, per-room timings and every process's log in DIR (default: a temporary directory, "
                   "kept only when a run failed)")
    g.add_argument("--corrupt", type=choices_list(SYSTEMS), default=[], metavar="LIST",
                   help="testing aid: in every run of these systems (comma-separated, from wire, baseline, pdxfer) flip one "
                   "destination byte before the check, to show the check catches it; the command then reports the "
                   "mismatch and exits 1 (default: none)")
    g.add_argument("--json", action="store_true", help="print the results as one JSON document instead of tables")
