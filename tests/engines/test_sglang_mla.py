"""MLA through pdxfer on real SGLang engines (issue 48): a tiny DeepSeek-V2
(`model.MLA_CONFIG`), whose KV is one 576-wide latent row per token and layer, the
same on every TP rank. SGLang's CPU attention runs it with the test plugin
``mla_torch_native`` (sglang_plugins.py), given to every engine here, the plain one
included; SGLang's own Mooncake backend on the same prompts is the baseline that must
pass too, so a failure of the pdxfer pair is pdxfer's.

Pass means token for token against one plain engine, with prompts whose tokens depend on
the whole prompt (`prompt_dependence`), the decode daemon's ``--verify-kv`` on, and the
bytes the decode daemon received equal to one latent copy of every page sent, whatever
the prefill's TP size."""

from __future__ import annotations

import pytest

from tests.engines import sglang_pd
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.model import MLA_LATENT, NUM_LAYERS
from tests.engines.prompts import prompt_dependence
from tests.engines.test_sglang_baseline import mismatches

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

PLUGINS = (*sglang_pd.BASELINE_PLUGINS, "mla_torch_native")
LATENT_PAGE_BYTES = sglang_pd.PAGE_SIZE * MLA_LATENT * 4  # float32 latent rows of one page of one layer


@pytest.fixture(scope="module")
def mla_reference(needs_sglang, mla_model_dir, waves, tmp_path_factory) -> list[list[list[int]]]:
    return sglang_pd.generate_single(mla_model_dir, str(tmp_path_factory.mktemp("mla-single")), waves, plugins=("mla_torch_native",))


def test_the_mla_models_tokens_depend_on_the_whole_prompt(waves, mla_reference):
    pairs = prompt_dependence(waves, mla_reference)
    assert pairs and all(ta != tb for _, ta, _, tb in pairs), pairs


def test_mla_mooncake_baseline_on_the_same_waves(needs_sglang, mla_model_dir, waves, mla_reference, tmp_path):
    run = sglang_pd.generate_pd(mla_model_dir, str(tmp_path), waves, plugins=PLUGINS)
    assert mismatches(waves, mla_reference, run.tokens) == []


def pages_sent(run, waves) -> int:
    """The pages the prefill scheduler handed its sender for every room (one TP rank's
    sends: every rank sends the same)."""
    total = 0
    for wave, rooms in zip(waves, run.rooms):
        for req, room in zip(wave, rooms):
            sends = run.calls_for(room, "send")
            first_rank = sends[0]["pid"]
            (prefix,) = {c["prefix_len"] for c in run.calls_for(room, "pop_decode_prefix_len")}
            mine = [s for s in sends if s["pid"] == first_rank]
            assert sum(s["num_kv_tokens"] for s in mine) == len(req.input_ids) - prefix, room
            total += sum(s["pages"] for s in mine)
    return total


@pytest.mark.parametrize("prefill_tp", [1, 2], ids=["tp1-to-tp1", "tp2-to-tp1"])
def test_mla_pdxfer_pair_matches_single_engine_moving_one_latent_copy(prefill_tp, needs_sglang, mla_model_dir, waves, mla_reference, tmp_path):
    """TP1 -> TP1, and a TP2 prefill (each rank holding the whole latent) -> TP1: the
    decode daemon reads each room from one prefill rank (the other's leg is a dummy),
    so it receives one latent copy of every page, and every room succeeds on both."""
    kwargs = {}
    if prefill_tp > 1:
        kwargs["prefill_args"], kwargs["prefill_env"] = sglang_pd.tensor_parallel(prefill_tp)
    pair = sglang_pd.generate_pdxfer(mla_model_dir, str(tmp_path), waves, plugins=PLUGINS, **kwargs)
    run, sent, received = pair.run, pair.sent, pair.received
    assert pair.exit_codes == [0, 0]

    assert mismatches(waves, mla_reference, run.tokens) == []
    requests = sum(len(wave) for wave in waves)
    assert sorted(run.kvargs) == [*(f"decode-{r}.json" for r in range(1)), *(f"prefill-{r}.json" for r in range(prefill_tp))]
    for name, kv in run.kvargs.items():  # the latent pool: one buffer per layer, a page of latent rows each, on every rank
        assert kv["kv_item_lens"] == [LATENT_PAGE_BYTES] * NUM_LAYERS, (name, kv["kv_item_lens"])
    assert (received["rooms_succeeded"], received["rooms_failed"]) == (requests, 0)
    assert (sent["rooms_succeeded"], sent["rooms_failed"]) == (prefill_tp * requests, 0)
    decode_kv = run.kvargs["decode-0.json"]
    assert received["bytes_received"] == pages_sent(run, waves) * sum(decode_kv["kv_item_lens"]) + requests * (32 + sum(decode_kv["aux_item_lens"]))
