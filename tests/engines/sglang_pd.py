"""SGLang engines for tests: one plain engine, or a prefill engine and a decode engine
moving KV through a transfer backend, each ``sgl.Engine`` in its own process.

A backend test compares `generate_pd`'s tokens with `generate_single`'s for the same
`Request` waves; ``backend="mooncake"`` is SGLang's own path and the baseline
(test_sglang_baseline.py), a pdxfer test passes ``backend="pdxfer"`` and its plugin.

Settings are docs/engines.md §E4's: CPU, ``torch_native`` attention, float32, pages of
16 tokens, seed 0, no tokenizer (requests carry ids), except the weights: every
engine loads the same random safetensors file (`model.py` says why not dummy
weights). The KV pool is held to 16,384 tokens: left to itself SGLang sizes it from
free host memory (14 GB here, per engine). Every address is on loopback."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pdxfer.ops.inspection import daemon_counters
from pdxfer.tools.launch import start_daemon, stop_all
from tests.listen_ports import free_port  # the tests take it from here
from tests.engines.procs import REPO_ROOT, Worker, plugin_dist
from tests.engines.prompts import Request
from tests.engines.sglang_plugins import KVARGS_DIR_ENV, TRANSFER_LOG_DIR_ENV
from tests.engines.sglang_worker import ENGINE_ARGS_ENV

PAGE_SIZE = 16
CHUNKED_PREFILL_SIZE = 64
HOST = "127.0.0.1"
# An engine starts in 10-30 s and a wave takes seconds on an idle 2-core machine; the
# margins are for a machine shared with other work (seen: 240 s to start).
START_TIMEOUT = 420.0
GENERATE_TIMEOUT = 300.0

ENGINE_ARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "page_size": PAGE_SIZE,
    "random_seed": 0,
    "max_total_tokens": 16384,
    "max_running_requests": 32,
    "chunked_prefill_size": CHUNKED_PREFILL_SIZE,
    "host": HOST,
    "log_level": "info",
    # The overlap scheduler records torch.cuda.Event()s (early send of a cached
    # prefix); on CPU the forward it would wait for has finished anyway.
    "disable_overlap_schedule": True,
    # An idle scheduler polls its sockets flat out; on 2 cores, one engine waiting
    # for the next request starves the next one starting up (50 s instead of 10 s).
    "sleep_on_idle": True,
}

# The test plugins (sglang_plugins.py) as an installed distribution would declare them.
PLUGIN_ENTRY_POINTS = {
    "mooncake_cpu": "tests.engines.sglang_plugins:mooncake_cpu",
    "kvargs_dump": "tests.engines.sglang_plugins:kvargs_dump",
    "transfer_log": "tests.engines.sglang_plugins:transfer_log",
    "decode_log": "tests.engines.sglang_plugins:decode_log",
    "mla_torch_native": "tests.engines.sglang_plugins:mla_torch_native",
}
BASELINE_PLUGINS = ("mooncake_cpu", "kvargs_dump", "transfer_log")


@dataclasses.dataclass
class PDRun:
    """What a prefill/decode pair returned: per wave, per request, the decode's
    generated ids; the prefill's answers; the KVArgs each role's manager was given
    (`sglang_plugins.kvargs_dump`), by file name; the sender and receiver calls
    (`sglang_plugins.transfer_log`); the rooms used, per wave; each wave's seconds,
    from sending it to both engines' answers."""

    tokens: list[list[list[int]]]
    prefill_outputs: list[list[dict]]
    decode_outputs: list[list[dict]]
    kvargs: dict[str, dict]
    calls: list[dict]
    rooms: list[list[int]]
    wave_seconds: list[float]

    def calls_for(self, room: int, call: str) -> list[dict]:
        return [c for c in self.calls if c["room"] == room and c["call"] == call]

    def handoff_seconds(self, room: int) -> float | None:
        """From the prefill handing the room's last chunk to the backend (its KV
        computed) to the decode streaming its first token (`sglang_plugins.decode_log`;
        both wall clocks of this host). None for a room that did not get that far."""
        sends, first = self.calls_for(room, "send"), self.calls_for(room, "first_token")
        if not sends or not first:
            return None
        return first[0]["t"] - max(s["t"] for s in sends)


def entry_point() -> str:
    """pdxfer's SGLang plugin, as pyproject.toml declares it."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]["pdxfer"]


def plugin_path(workdir: str, names: Iterable[str], extra: dict[str, str] | None = None) -> str:
    """A directory whose ``.dist-info`` declares the named test plugins (plus ``extra``,
    name → ``module:function``): on PYTHONPATH, SGLang loads them in every process."""
    entries = {name: PLUGIN_ENTRY_POINTS[name] for name in names}
    entries.update(extra or {})
    return plugin_dist(workdir, "sglang.srt.plugins", entries)


def engine_env(workdir: str, plugins: Sequence[str], extra_plugins: dict[str, str] | None = None,
               extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine worker: the repo and the test plugins importable,
    only those plugins loaded (SGLANG_PLUGINS), every address on loopback and
    Mooncake over TCP."""
    env = dict(os.environ)
    paths = [REPO_ROOT, plugin_path(workdir, plugins, extra_plugins)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_PLUGINS"] = ",".join([*plugins, *(extra_plugins or {})])
    env["SGLANG_HOST_IP"] = HOST
    env["HOST_IP"] = HOST
    env["MC_FORCE_TCP"] = "1"
    env["MOONCAKE_PROTOCOL"] = "tcp"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra_env or {})
    return env


def tensor_parallel(tp: int) -> tuple[dict, dict[str, str]]:
    """The engine arguments and environment of a server running ``tp`` TP ranks on this
    CPU: SGLang binds each rank's OpenMP threads to a NUMA node of its own and refuses
    more ranks than nodes (numa_utils.init_threads_binding) unless
    SGLANG_CPU_OMP_THREADS_BIND names each rank's cores; here ranks share the cores
    round robin. The ranks all-reduce over gloo."""
    cores = os.cpu_count() or 1
    return {"tp_size": tp}, {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp))}


def _worker(name: str, workdir: str, model_dir: str, engine_args: dict, env: dict[str, str]) -> Worker:
    args = {"model_path": model_dir, **ENGINE_ARGS, "port": free_port(), **engine_args}
    env = {**env, ENGINE_ARGS_ENV: json.dumps(args)}
    # SGLang kills its own subprocesses with SIGKILL and so leaves its load-snapshot
    # files behind (its stale_shm_cleanup says as much).
    return Worker(name, "tests.engines.sglang_worker", workdir, env, shm_leaks=("sglang_loads_",))


def _sampling(req: Request) -> dict:
    return {"temperature": 0.0, "max_new_tokens": req.max_new_tokens, "ignore_eos": True}


def _stop(workers: Sequence[Worker]) -> None:
    for w in workers:
        try:
            w.stop()
        except Exception as exc:  # keep stopping the others
            print(f"stopping {w.name}: {exc}", file=sys.stderr)


def generate_single(model_dir: str, workdir: str, waves: Sequence[Sequence[Request]],
                    engine_args: dict | None = None, plugins: Sequence[str] = ()) -> list[list[list[int]]]:
    """The reference: one engine, no disaggregation; per wave, per request, the
    generated ids. ``plugins``: test plugins the model needs (`PLUGIN_ENTRY_POINTS`)."""
    env = engine_env(workdir, plugins)
    worker = _worker("sglang-single", workdir, model_dir, engine_args or {}, env)
    try:
        worker.start()
        worker.ready(START_TIMEOUT)
        tokens = []
        for wave in waves:
            out = worker.call(
                "generate",
                GENERATE_TIMEOUT,
                input_ids=[list(r.input_ids) for r in wave],
                sampling_params=[_sampling(r) for r in wave],
            )
            tokens.append([o["output_ids"] for o in out])
        return tokens
    finally:
        _stop([worker])


def generate_pd(model_dir: str, workdir: str, waves: Sequence[Sequence[Request]], *,
                backend: str = "mooncake", plugins: Sequence[str] = BASELINE_PLUGINS,
                extra_plugins: dict[str, str] | None = None,
                prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None,
                engine_args: dict | None = None, prefill_args: dict | None = None, decode_args: dict | None = None,
                decode_radix_cache: bool = True,
                room_seed: int = 1, before_wave: Callable[[int], None] | None = None, op: str = "generate",
                wave_args: Callable[[int], tuple[dict, dict]] | None = None) -> PDRun:
    """A prefill and a decode engine, each in its own process, with
    ``disaggregation_transfer_backend=backend``; each wave's requests go to both at
    once, with the prefill's bootstrap address and a fresh room each. ``plugins``
    name test plugins (`PLUGIN_ENTRY_POINTS`), ``extra_plugins`` more entry points
    (name → ``module:function``), e.g. a backend's. ``prefill_args`` and ``decode_args``
    are one side's engine arguments beyond ``engine_args`` (e.g. `tensor_parallel`'s). ``decode_radix_cache`` turns on
    the decode's radix cache (off by default in SGLang, "experimental"): a request
    whose prefix the decode holds gets only the rest from the prefill.
    ``before_wave(i)`` runs before wave i is sent (a fault test kills or restarts a
    daemon there). ``op="generate_each"`` (`sglang_worker`) lets a request fail alone:
    its answer is then ``{"error": ...}`` and its tokens None. ``wave_args(i)`` gives
    more arguments of wave i's op for the prefill and for the decode (e.g. ``abort``)."""
    kvargs_dir = os.path.join(workdir, "kvargs")
    log_dir = os.path.join(workdir, "transfer-log")
    os.makedirs(kvargs_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    test_env = {KVARGS_DIR_ENV: kvargs_dir, TRANSFER_LOG_DIR_ENV: log_dir}
    bootstrap_port = free_port()
    common = {"disaggregation_transfer_backend": backend, **(engine_args or {})}
    prefill = _worker(
        "sglang-prefill", workdir, model_dir,
        {**common, **(prefill_args or {}), "disaggregation_mode": "prefill", "disaggregation_bootstrap_port": bootstrap_port},
        engine_env(workdir, plugins, extra_plugins, {**test_env, **(prefill_env or {})}),
    )
    decode = _worker(
        "sglang-decode", workdir, model_dir,
        # The default host pool for retraction calls cudaHostRegister (E4).
        {**common, **(decode_args or {}), "disaggregation_mode": "decode", "disaggregation_decode_retraction_backup": "cpu_tensor",
         "disaggregation_decode_enable_radix_cache": decode_radix_cache},
        engine_env(workdir, plugins, extra_plugins, {**test_env, **(decode_env or {})}),
    )
    rooms = random.Random(room_seed)
    try:
        prefill.start()
        decode.start()
        prefill.ready(START_TIMEOUT)
        decode.ready(START_TIMEOUT)
        tokens, prefill_outputs, decode_outputs, wave_rooms, seconds = [], [], [], [], []
        for i, wave in enumerate(waves):
            if before_wave is not None:
                before_wave(i)
            wave_rooms.append([rooms.randrange(1, 2**63) for _ in wave])
            batch = {
                "input_ids": [list(r.input_ids) for r in wave],
                "sampling_params": [_sampling(r) for r in wave],
                "bootstrap_host": [HOST] * len(wave),
                "bootstrap_port": [bootstrap_port] * len(wave),
                "bootstrap_room": wave_rooms[-1],
            }
            p_args, d_args = wave_args(i) if wave_args is not None else ({}, {})
            started = time.monotonic()
            prefill.submit(op, **batch, **p_args)
            decode.submit(op, **batch, **d_args)
            p_out = prefill.result(GENERATE_TIMEOUT, "prefilling a wave")
            d_out = decode.result(GENERATE_TIMEOUT, "decoding a wave")
            seconds.append(time.monotonic() - started)
            prefill_outputs.append(p_out)
            decode_outputs.append(d_out)
            tokens.append([o.get("output_ids") for o in d_out])
    finally:
        _stop([decode, prefill])
    kvargs, calls = {}, []
    for name in sorted(os.listdir(kvargs_dir)):
        with open(os.path.join(kvargs_dir, name)) as f:
            kvargs[name] = json.load(f)
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            calls.extend(json.loads(line) for line in f)
    return PDRun(tokens, prefill_outputs, decode_outputs, kvargs, calls, wave_rooms, seconds)


@dataclasses.dataclass
class PdxferRun:
    """`generate_pdxfer`'s result: the pair's run, each daemon's counters after the
    last wave (`pdxfer.ops.inspection.daemon_counters`) and exit codes."""

    run: PDRun
    sent: dict[str, float]
    received: dict[str, float]
    exit_codes: list[int]


def generate_pdxfer(model_dir: str, workdir: str, waves: Sequence[Sequence[Request]], *,
                    decode_flags: Sequence[str] = ("--verify-kv",), **kwargs) -> PdxferRun:
    """`generate_pd` over pdxfer: a prefill and a decode daemon (``pdxfer serve``, their
    logs and runtime directory in ``workdir``) beside the engines, each engine pointed
    at its own by PDXFER_ENDPOINT. ``kwargs`` go to `generate_pd`."""
    runtime = os.path.join(workdir, "pdxfer")
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    daemons = []
    try:
        for role, flags in (("prefill", ()), ("decode", decode_flags)):
            with open(os.path.join(workdir, f"{role}-daemon.log"), "w") as log:
                daemons.append(start_daemon(role, runtime, *flags, stderr=log))
        prefill, decode = daemons
        run = generate_pd(
            model_dir, os.path.join(workdir, "pd"), waves, backend="pdxfer",
            extra_plugins={"pdxfer": entry_point(), **kwargs.pop("extra_plugins", {})},
            prefill_env={**kwargs.pop("prefill_env", {}), "PDXFER_ENDPOINT": prefill.engine},
            decode_env={**kwargs.pop("decode_env", {}), "PDXFER_ENDPOINT": decode.engine}, **kwargs,
        )
        sent, received = daemon_counters(prefill.ready["admin"]), daemon_counters(decode.ready["admin"])
    finally:
        codes = stop_all(list(reversed(daemons)))
    return PdxferRun(run, sent, received, codes)
