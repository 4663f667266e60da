"""SGLang's own prefill/decode path on CPU, the baseline of docs/engines.md §B7: a prefill
engine and a decode engine (separate processes) moving KV over SGLang's Mooncake
backend (TCP) must generate exactly the tokens of one plain engine. A pdxfer backend
test runs the same `sglang_pd.generate_pd` with ``backend="pdxfer"`` and compares
with the same `sglang_reference`."""

from __future__ import annotations

import pytest

from tests.engines import model, sglang_pd
from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.prompts import prompt_dependence

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

FLOAT32 = 4


def mismatches(waves, expected, got) -> list[str]:
    out = []
    for w, (wave, exp_wave, got_wave) in enumerate(zip(waves, expected, got)):
        for i, (req, exp, res) in enumerate(zip(wave, exp_wave, got_wave)):
            if exp != res:
                out.append(f"wave {w} request {i} ({len(req.input_ids)} prompt ids): expected {exp}, got {res}")
    return out


@pytest.fixture(scope="module")
def mooncake_run(needs_sglang, model_dir, waves, tmp_path_factory) -> sglang_pd.PDRun:
    workdir = str(tmp_path_factory.mktemp("sglang-mooncake"))
    return sglang_pd.generate_pd(model_dir, workdir, waves, backend="mooncake")


def test_b7_reference_depends_on_whole_prompt(sglang_reference, waves):
    """The comparison means something: every request generated its length, and prompts
    ending in the same id generated different ids (the model reads the prompt's KV,
    not just its last token)."""
    for wave, outs in zip(waves, sglang_reference):
        assert [len(t) for t in outs] == [r.max_new_tokens for r in wave]
    pairs = prompt_dependence(waves, sglang_reference)
    assert pairs, "the waves hold no two prompts ending in the same id"
    for a, ta, b, tb in pairs:
        assert ta != tb, f"prompts of {len(a.input_ids)} and {len(b.input_ids)} ids ending alike gave {ta}"


def test_b7_mooncake_pair_matches_single_engine(mooncake_run, sglang_reference, waves):
    """B7 baseline: decode tokens == the plain engine's, for ten requests of 5-287
    prompt ids sent concurrently, chunked sends (prompts past 64 ids), a shared
    prefix and a second wave whose prefixes both radix caches hold."""
    assert mismatches(waves, sglang_reference, mooncake_run.tokens) == []
    # The prefill answers with the first token, which it ships to the decode as aux.
    for wave_out, ref_wave in zip(mooncake_run.prefill_outputs, sglang_reference):
        assert [o["output_ids"] for o in wave_out] == [ref[:1] for ref in ref_wave]


def test_b7_sends_are_chunked_and_decode_skips_cached_prefix(mooncake_run, waves):
    """What the schedulers asked of the backend, per room (`sglang_plugins.
    transfer_log`): the prefill sends the pages after the decode's cached prefix, in
    chunks as chunked prefill computes them, the last one with the aux row and state;
    the decode asks for exactly those pages. A pdxfer backend sees the same calls."""
    chunked = 0
    for wave, rooms in zip(waves, mooncake_run.rooms):
        for req, room in zip(wave, rooms):
            (prefix,) = [c["prefix_len"] for c in mooncake_run.calls_for(room, "pop_decode_prefix_len")]
            (init,) = mooncake_run.calls_for(room, "init")
            (meta,) = mooncake_run.calls_for(room, "send_metadata")
            sends = mooncake_run.calls_for(room, "send")
            assert meta["decode_prefix_len"] == prefix
            assert meta["aux_index"] == init["aux_index"]
            pages = -(-(len(req.input_ids) - prefix) // sglang_pd.PAGE_SIZE)
            assert init["num_pages"] == meta["pages"] == sum(s["pages"] for s in sends) == pages, room
            assert sum(s["num_kv_tokens"] for s in sends) == len(req.input_ids) - prefix, room
            assert [s["with_state"] for s in sends] == [False] * (len(sends) - 1) + [True], room
            chunked += len(sends) > 1
    assert chunked >= 5
    # Wave 2: the decode holds the 257-id prompt it extends (its first 256 ids, whole
    # pages) and the 96-id shared prefix.
    assert [mooncake_run.calls_for(room, "send_metadata")[0]["decode_prefix_len"]
            for room in mooncake_run.rooms[1]] == [256, 96]


def test_b7_kvargs_on_cpu(mooncake_run):
    """What SGLang hands a transfer backend's manager on CPU for the tiny model: one
    buffer per layer for K, then one per layer for V, a page of one buffer being
    page_size x kv_heads x head_dim floats (token-major, NHD); aux is ten row-indexed
    host buffers with the same number of rows."""
    assert set(mooncake_run.kvargs) == {"prefill-0.json", "decode-0.json"}
    page_bytes = sglang_pd.PAGE_SIZE * model.NUM_KV_HEADS * model.HEAD_DIM * FLOAT32
    for name, kv in mooncake_run.kvargs.items():
        assert kv["manager"] == "MooncakeKVManager", name
        assert kv["page_size"] == sglang_pd.PAGE_SIZE, name
        assert not kv["is_mla_backend"], name
        assert kv["state_types"] == [], name
        assert kv["kv_item_lens"] == [page_bytes] * (2 * model.NUM_LAYERS), name
        assert len(kv["kv_data_ptrs"]) == len(kv["kv_data_lens"]) == 2 * model.NUM_LAYERS, name
        assert len(set(kv["kv_data_ptrs"])) == 2 * model.NUM_LAYERS, name
        # The pool's pages plus one: page 0 is SGLang's padding slot.
        assert kv["kv_data_lens"] == [
            (sglang_pd.ENGINE_ARGS["max_total_tokens"] + sglang_pd.PAGE_SIZE) * page_bytes // sglang_pd.PAGE_SIZE
        ] * (2 * model.NUM_LAYERS), name
        aux_rows = {length // item for length, item in zip(kv["aux_data_lens"], kv["aux_item_lens"])}
        assert len(kv["aux_data_ptrs"]) == len(kv["aux_item_lens"]) == 10, name
        assert all(length % item == 0 for length, item in zip(kv["aux_data_lens"], kv["aux_item_lens"])), name
        assert len(aux_rows) == 1, (name, aux_rows)
    prefill, decode = mooncake_run.kvargs["prefill-0.json"], mooncake_run.kvargs["decode-0.json"]
    assert prefill["aux_item_lens"] == decode["aux_item_lens"]
    assert (prefill["kv_head_num"], prefill["total_kv_head_num"]) == (model.NUM_KV_HEADS, model.NUM_KV_HEADS)
    assert (prefill["prefill_start_layer"], prefill["prefill_end_layer"]) == (0, model.NUM_LAYERS)
    # The decode sets kv_head_num only with the hetero-TP staging buffer: an adapter
    # reads head counts from the prefill's layout, not from its own KVArgs.
    assert "kv_head_num" not in decode
