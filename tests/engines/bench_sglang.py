"""pdxfer against SGLang's own Mooncake backend on the same real engine pair: a
benchmark, not a test (`make bench-sglang`; nothing asserts speed).

    python -m tests.engines.bench_sglang [--requests N] [--wave W] [--prompt MIN-MAX] [--layers L] [--kv-heads H] [--rounds R]

The same prompts, sent in the same waves (W requests at once), over
``--disaggregation-transfer-backend mooncake`` (SGLang's, TCP) and over ``pdxfer``
(two daemons beside the engines, no --verify-kv), R times each in the order mooncake,
pdxfer, pdxfer, mooncake, ...; each time a fresh prefill and decode ``sgl.Engine`` on
CPU (`sglang_pd`'s settings). The model is the test model
(`model.py`) with more layers and KV heads, so each prompt token carries more KV
(32 KiB with the defaults) and the transfer has something to move. A warm-up wave
goes first and is not counted.

Per backend: requests/s (the counted requests over the seconds their waves took, from
sending a wave to both engines' answers) and p50/p99 of the hand-off, from the
prefill handing a request's last chunk to its backend (its KV computed) to the
decode streaming its first token (`sglang_plugins.decode_log`; both on this host's
wall clock). The decode tokens of the two backends must agree, or the figures are
void; the script says which."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from tests.engines import bench_workload, model, sglang_pd
from tests.engines.bench_workload import NEW_TOKENS


def figures(*runs: sglang_pd.PDRun) -> dict:
    """Requests/s and hand-off percentiles (ms) over the counted waves (all but the
    first) of ``runs`` together."""
    rooms = [(run, room) for run in runs for wave in run.rooms[1:] for room in wave]
    handoffs = [1000 * h for h in (run.handoff_seconds(room) for run, room in rooms) if h is not None]
    return bench_workload.handoff_figures(handoffs, len(rooms), sum(sum(run.wave_seconds[1:]) for run in runs))


def backend_order(rounds: int) -> list[str]:
    """Mooncake then pdxfer, then the other way round, ``rounds`` times in all (ABBA):
    a box growing busier or quieter over the runs favours neither."""
    pair = ["mooncake", "pdxfer"]
    return [name for i in range(rounds) for name in (pair if i % 2 == 0 else pair[::-1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.bench_sglang", description=__doc__.split("\n\n")[0])
    bench_workload.add_arguments(parser)
    parser.add_argument("--chunked-prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2,
                        help="engine pairs per backend, run in the order mooncake, pdxfer, pdxfer, mooncake, ... (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (engine and daemon logs)")
    args = parser.parse_args(argv)
    work = bench_workload.prepare(args, "pdxfer-bench-sglang-")
    workdir, model_dir, prompts = work.workdir, work.model_dir, work.prompts
    common = {"engine_args": {"chunked_prefill_size": args.chunked_prefill},
              "plugins": (*sglang_pd.BASELINE_PLUGINS, "decode_log")}
    runs: dict[str, list[sglang_pd.PDRun]] = {"mooncake": [], "pdxfer": []}
    received = 0
    try:
        for i, name in enumerate(backend_order(args.rounds)):
            where = os.path.join(workdir, f"{name}-{i}")
            if name == "mooncake":
                runs[name].append(sglang_pd.generate_pd(model_dir, where, prompts, backend="mooncake", **common))
            else:
                pair = sglang_pd.generate_pdxfer(model_dir, where, prompts, decode_flags=(), **common)
                runs[name].append(pair.run)
                received = pair.received["bytes_received"]
            print(f"  run {i + 1}: {name:9}" + "  ".join(f"{k} {v:.2f}" for k, v in figures(runs[name][-1]).items()
                                                          if k in ("rps", "p50", "p99")), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    counted = work.counted
    print(f"bench-sglang: {len(counted)} requests in waves of {args.wave} at once (after a warm-up wave), prompts of "
          f"{work.shortest}-{work.longest} ids, {NEW_TOKENS} new tokens each; {args.rounds} engine pairs per backend, "
          f"in the order {', '.join(backend_order(args.rounds))}; {os.cpu_count()} CPUs")
    print(f"  model: {args.layers} layers, {args.kv_heads} KV heads of {model.HEAD_DIM}, float32: {work.kv_per_token // 1024} KiB of KV "
          f"per token, {work.mean_kv / 2**20:.1f} MiB per request on average; chunked prefill {args.chunked_prefill}")
    print(f"  pdxfer's decode daemon received {received / 2**20:.1f} MiB in its last run (warm-up included)")
    print("  hand-off: from the prefill's last chunk handed to the backend to the decode's first token; "
          "figures over every counted request of a backend's runs")
    bench_workload.print_figures({"mooncake (SGLang's)": figures(*runs["mooncake"]), "pdxfer": figures(*runs["pdxfer"])},
                                 "pdxfer/mooncake", lambda f: f"{f['timed']}/{f['requests']} hand-offs timed")
    tokens = [run.tokens for side in runs.values() for run in side]
    same = all(t == tokens[0] for t in tokens)
    print(f"  decode tokens: {'the same in every run' if same else 'DIFFER between runs: the figures are void'}"
          f" ({len(counted) + len(prompts[0])} requests)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
