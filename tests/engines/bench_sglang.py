"""pdxfer against SGLang's own Mooncake backend on the same real engine pair: a
benchmark, not a test (`make bench-sglang`; nothing asserts speed).

    python -m tests.engines.bench_sglang [--requests N] [--wave W] [--prompt MIN-MAX] [--layers L] [--kv-heads H]

One run: the same prompts, sent in the same waves (W requests at once), first over
``--disaggregation-transfer-backend mooncake`` (SGLang's, TCP), then over ``pdxfer``
(two daemons beside the engines, no --verify-kv), each time a fresh prefill and decode
``sgl.Engine`` on CPU (`sglang_pd`'s settings). The model is the test model
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
import statistics
import sys
import tempfile

from tests.engines import bench_workload, model, sglang_pd
from tests.engines.bench_workload import NEW_TOKENS, waves


def figures(run: sglang_pd.PDRun) -> dict:
    """Requests/s and hand-off percentiles (ms) over the counted waves (all but the first)."""
    rooms = [room for wave in run.rooms[1:] for room in wave]
    handoffs = sorted(1000 * h for h in map(run.handoff_seconds, rooms) if h is not None)
    cuts = statistics.quantiles(handoffs, n=100, method="inclusive")
    return {"rps": len(rooms) / sum(run.wave_seconds[1:]), "p50": statistics.median(handoffs), "p99": cuts[98],
            "timed": len(handoffs), "requests": len(rooms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.bench_sglang", description=__doc__.split("\n\n")[0])
    bench_workload.add_arguments(parser)
    parser.add_argument("--chunked-prefill", type=int, default=512)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (engine and daemon logs)")
    args = parser.parse_args(argv)
    shortest, longest = map(int, args.prompt.split("-"))
    workdir = tempfile.mkdtemp(prefix="pdxfer-bench-sglang-")
    model_dir, kv_per_token = bench_workload.wide_model(workdir, args)
    prompts = waves(args.requests, args.wave, shortest, longest)
    common = {"engine_args": {"chunked_prefill_size": args.chunked_prefill},
              "plugins": (*sglang_pd.BASELINE_PLUGINS, "decode_log")}
    try:
        mooncake = sglang_pd.generate_pd(model_dir, os.path.join(workdir, "mooncake"), prompts, backend="mooncake", **common)
        pair = sglang_pd.generate_pdxfer(model_dir, os.path.join(workdir, "pdxfer"), prompts, decode_flags=(), **common)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    pdxfer = pair.run
    counted = [r for wave in prompts[1:] for r in wave]
    mean_kv = sum(len(r.input_ids) for r in counted) / len(counted) * kv_per_token
    rows = {"mooncake (SGLang's)": figures(mooncake), "pdxfer": figures(pdxfer)}
    print(f"bench-sglang: {len(counted)} requests in waves of {args.wave} at once (after a warm-up wave), prompts of "
          f"{shortest}-{longest} ids, {NEW_TOKENS} new tokens each; {os.cpu_count()} CPUs")
    print(f"  model: {args.layers} layers, {args.kv_heads} KV heads of {model.HEAD_DIM}, float32: {kv_per_token // 1024} KiB of KV "
          f"per token, {mean_kv / 2**20:.1f} MiB per request on average; chunked prefill {args.chunked_prefill}")
    print(f"  pdxfer's decode daemon received {pair.received['bytes_received'] / 2**20:.1f} MiB (warm-up included)")
    print("  hand-off: from the prefill's last chunk handed to the backend to the decode's first token")
    print(f"  {'':22}{'requests/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for name, f in rows.items():
        print(f"  {name:22}{f['rps']:12.2f}{f['p50']:10.1f}{f['p99']:10.1f}   ({f['timed']}/{f['requests']} hand-offs timed)")
    m, p = rows["mooncake (SGLang's)"], rows["pdxfer"]
    print(f"  {'pdxfer/mooncake':22}{p['rps'] / m['rps']:11.2f}x{p['p50'] / m['p50']:9.2f}x{p['p99'] / m['p99']:9.2f}x")
    same = mooncake.tokens == pdxfer.tokens
    print(f"  decode tokens: {'the same on both backends' if same else 'DIFFER between the backends: the figures are void'}"
          f" ({len(counted) + len(prompts[0])} requests)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
