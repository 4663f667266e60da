"""The workload both engine benchmarks run (`bench_sglang`, `bench_vllm`): the same
prompts in the same waves, on the test model widened so that each prompt token
carries enough KV for the transfer to matter."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from dataclasses import dataclass

from tests.engines import model
from tests.engines.prompts import Request

NEW_TOKENS = 4
FLOAT32 = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--wave", type=int, default=8, help="requests sent at once")
    parser.add_argument("--prompt", default="700-1000", help="prompt lengths in ids, MIN-MAX")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)


def waves(requests: int, wave: int, shortest: int, longest: int, seed: int = 0) -> list[list[Request]]:
    """A warm-up wave of two short prompts, then ``requests`` prompts of
    ``shortest``-``longest`` random ids in waves of ``wave``."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n))

    counted = [Request(ids(rng.randint(shortest, longest)), NEW_TOKENS) for _ in range(requests)]
    return [[Request(ids(40), NEW_TOKENS), Request(ids(70), NEW_TOKENS)]] + [counted[i:i + wave] for i in range(0, requests, wave)]


@dataclass(frozen=True)
class Workload:
    """What a bench run moves: the prompts (a warm-up wave, then the counted ones) on
    the widened model written under ``workdir``."""

    workdir: str
    model_dir: str
    kv_per_token: int
    prompts: list[list[Request]]
    shortest: int
    longest: int

    @property
    def counted(self) -> list[Request]:
        return [r for wave in self.prompts[1:] for r in wave]

    @property
    def mean_kv(self) -> float:
        """KV bytes per counted request, on average."""
        return sum(len(r.input_ids) for r in self.counted) / len(self.counted) * self.kv_per_token


def prepare(args: argparse.Namespace, prefix: str) -> Workload:
    """``add_arguments``' workload in a new work directory (``prefix``: its name's start)."""
    shortest, longest = map(int, args.prompt.split("-"))
    workdir = tempfile.mkdtemp(prefix=prefix)
    model_dir, kv_per_token = wide_model(workdir, args)
    return Workload(workdir, model_dir, kv_per_token, waves(args.requests, args.wave, shortest, longest), shortest, longest)


def handoff_figures(handoffs_ms: list[float], requests: int, seconds: float) -> dict:
    """Requests/s over ``seconds`` and the hand-offs' p50 and p99 (ms)."""
    handoffs_ms = sorted(handoffs_ms)
    cuts = statistics.quantiles(handoffs_ms, n=100, method="inclusive")
    return {"rps": requests / seconds, "p50": statistics.median(handoffs_ms), "p99": cuts[98], "timed": len(handoffs_ms), "requests": requests}


def print_figures(rows: dict[str, dict], ratio_label: str, note) -> None:
    """The table of ``rows`` (name -> handoff_figures), ``note(figures)`` after each,
    then the last row over the first."""
    print(f"  {'':22}{'requests/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for name, f in rows.items():
        print(f"  {name:22}{f['rps']:12.2f}{f['p50']:10.1f}{f['p99']:10.1f}   ({note(f)})")
    base, ours = list(rows.values())[0], list(rows.values())[-1]
    print(f"  {ratio_label:22}{ours['rps'] / base['rps']:11.2f}x{ours['p50'] / base['p50']:9.2f}x{ours['p99'] / base['p99']:9.2f}x")


def wide_model(workdir: str, args: argparse.Namespace) -> tuple[str, int]:
    """The test model with ``args``' layers and KV heads, written under ``workdir``:
    (its directory, its KV bytes per token)."""
    model_dir = model.write_model_dir(
        os.path.join(workdir, "model"), num_hidden_layers=args.layers, num_key_value_heads=args.kv_heads,
        num_attention_heads=max(args.kv_heads, model.CONFIG["num_attention_heads"]),
    )
    return model_dir, args.layers * 2 * args.kv_heads * model.HEAD_DIM * FLOAT32
