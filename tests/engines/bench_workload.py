"""The workload both engine benchmarks run (`bench_sglang`, `bench_vllm`): the same
prompts in the same waves, on the test model widened so that each prompt token
carries enough KV for the transfer to matter."""

from __future__ import annotations

import argparse
import os
import random

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


def wide_model(workdir: str, args: argparse.Namespace) -> tuple[str, int]:
    """The test model with ``args``' layers and KV heads, written under ``workdir``:
    (its directory, its KV bytes per token)."""
    model_dir = model.write_model_dir(
        os.path.join(workdir, "model"), num_hidden_layers=args.layers, num_key_value_heads=args.kv_heads,
        num_attention_heads=max(args.kv_heads, model.CONFIG["num_attention_heads"]),
    )
    return model_dir, args.layers * 2 * args.kv_heads * model.HEAD_DIM * FLOAT32
