"""PdxferConnector's scheduler half driven by vLLM's real Scheduler, no model (docs/engines.md
§E2 as tests, §C5): what each request loads or sends, which blocks
a room may write, how long vLLM holds them, and what a failed room costs under both
``kv_load_failure_policy`` values. The worker half is played by the test, reporting what
the daemon would."""

from __future__ import annotations

import pytest

from pdxfer.adapters.vllm import params
from tests.engines.vllm_engines import BLOCK_SIZE as BS

PREFILL_BOOTSTRAP = "10.0.0.1:18998"


@pytest.fixture(scope="module")
def kit(needs_vllm):
    from tests.engines import vllm_kit

    return vllm_kit


@pytest.fixture(scope="module")
def configs(kit, model_dir):
    """VllmConfig by (role, failure policy): building one takes seconds, a Scheduler none."""
    made = {}

    def get(role: str, policy: str = "fail"):
        if (role, policy) not in made:
            made[role, policy] = kit.vllm_config(model_dir, role, policy, extra={"bootstrap": PREFILL_BOOTSTRAP} if role == "kv_producer" else None)
        return made[role, policy]

    return get


def from_prefill(room: int) -> dict:
    return params.for_decode(room, PREFILL_BOOTSTRAP, "prefill-engine")


def blocks_of(s, req) -> list[int]:
    (ids,) = s.kv_cache_manager.get_block_ids(req.request_id)
    return ids


def ref_counts(s, block_ids) -> list[int]:
    return [s.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in block_ids]


def step(s, **report):
    """One engine step: schedule, then the model runner's output with the worker's ``report``."""
    from tests.engines.vllm_kit import runner_output

    out = s.schedule()
    return out, s.update_from_output(out, runner_output(out, **report))


def received(s, req) -> None:
    """Schedule ``req``'s receive, then report it landed."""
    step(s)
    step(s, finished_recving={req.request_id})


def test_c3_remote_prefill_receives_the_prompt_then_computes_only_its_last_token(kit, configs):
    s = kit.scheduler(configs("kv_consumer"))
    a = kit.request(range(100, 140), from_prefill(7))
    s.add_request(a)
    assert s.connector.get_num_new_matched_tokens(a, 0) == (40, True)
    assert s.connector.get_num_new_matched_tokens(a, 0) == (40, True)  # side-effect free: asked again, same answer

    out = s.schedule()
    assert a.status is kit.RequestStatus.WAITING_FOR_REMOTE_KVS and out.total_num_scheduled_tokens == 0
    meta = out.kv_connector_metadata
    assert meta.receives == [kit.Receive(req_id=a.request_id, room=7, bootstrap=PREFILL_BOOTSTRAP, engine="prefill-engine",
                                     pages=tuple(blocks_of(s, a)[:2]), skip_pages=0)]
    assert meta.idle and meta.sends == meta.aborts == meta.cancels == []
    s.update_from_output(out, kit.runner_output(out))

    out, _ = step(s)  # the worker has not reported the room: nothing runs, nothing new is asked
    assert out.total_num_scheduled_tokens == 0 and out.kv_connector_metadata.receives == []
    step(s, finished_recving={a.request_id})
    out = s.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 1}  # E2: vLLM recomputes the last prompt token, so no aux record
    assert not out.kv_connector_metadata.idle and out.kv_connector_metadata.receives == []


def test_c3_a_local_prefix_hit_shortens_the_transfer_to_the_blocks_after_it(kit, configs):
    s = kit.scheduler(configs("kv_consumer"))
    prefix = list(range(500, 500 + BS))
    a = kit.request(prefix + list(range(600, 608)), from_prefill(7))
    s.add_request(a)
    received(s, a)
    step(s)  # a computes its last prompt token; its first block is now in the prefix cache

    b = kit.request(prefix + list(range(700, 740)), from_prefill(8))  # 72 tokens: one cached block, two to receive
    s.add_request(b)
    assert s.connector.get_num_new_matched_tokens(b, BS) == (72 - BS, True)
    out = s.schedule()
    assert b.status is kit.RequestStatus.WAITING_FOR_REMOTE_KVS
    shared = blocks_of(s, a)[0]
    assert blocks_of(s, b)[0] == shared  # the hit is a's block
    (receive,) = out.kv_connector_metadata.receives
    assert receive.skip_pages == 1 and receive.pages == tuple(blocks_of(s, b)[1:3])
    assert shared not in receive.pages  # a room never writes a block another request reads


def test_c3_prefill_holds_its_blocks_until_the_send_settled(kit, configs):
    s = kit.scheduler(configs("kv_producer"))
    c = kit.request(range(100, 140), params.for_prefill(9), max_tokens=1)
    s.add_request(c)
    out, outputs = step(s)
    assert out.num_scheduled_tokens == {c.request_id: 40}
    (done,) = outputs[0].outputs
    assert done.finish_reason is kit.FinishReason.LENGTH
    # what a sequential proxy forwards to the decode (vLLM adds remote_prefill_cached_tokens)
    assert done.kv_transfer_params.items() >= params.for_decode(9, PREFILL_BOOTSTRAP, "kv_producer-engine").items()
    held = blocks_of(s, c)[:2]
    assert ref_counts(s, held) == [1, 1] and s.connector.has_pending_push_work() and s.has_requests()

    out, _ = step(s)  # idle, yet the engine steps: the send goes out
    assert out.kv_connector_metadata.sends == [kit.Transmit(req_id=c.request_id, room=9, pages=tuple(held), num_tokens=40)]
    assert out.kv_connector_metadata.idle
    step(s)  # not settled yet
    assert ref_counts(s, held) == [1, 1] and s.connector.has_pending_push_work()

    step(s, finished_sending={c.request_id})
    assert ref_counts(s, held) == [0, 0]
    assert not s.connector.has_pending_push_work() and not s.has_requests()


def test_c2_a_sequential_proxy_names_no_room_and_a_first_token_eos_still_sends(kit, configs):
    """NIXL-style: the prefill gets only do_remote_decode; the connector picks the room
    and answers with it. Stopping on EOS at once ends the prompt as surely as max_tokens."""
    s = kit.scheduler(configs("kv_producer"))
    d = kit.request(range(100, 170), {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}, max_tokens=1)
    s.add_request(d)
    _, outputs = step(s, token=kit.EOS)
    (done,) = outputs[0].outputs
    assert done.finish_reason is kit.FinishReason.STOP
    room = done.kv_transfer_params["room"]
    assert 1 <= room < params.PICKED_ROOMS
    assert done.kv_transfer_params.items() >= params.for_decode(room, PREFILL_BOOTSTRAP, "kv_producer-engine").items()
    assert params.read(done.kv_transfer_params) == params.FromPrefill(room=room, bootstrap=PREFILL_BOOTSTRAP, engine="kv_producer-engine")
    out, _ = step(s)
    assert out.kv_connector_metadata.sends == [kit.Transmit(req_id=d.request_id, room=room, pages=tuple(blocks_of(s, d)[:3]), num_tokens=70)]


def test_c2_a_tp2_prefill_answers_with_its_sizes_and_the_decode_hands_them_to_every_rank(kit, configs, model_dir):
    """One scheduler half whatever the ranks: a TP2 prefill's answer names TP 2, and the
    decode's receive carries it, so that each decode rank's daemon knows which prefill
    ranks write its heads."""
    prefill = kit.scheduler(kit.vllm_config(model_dir, "kv_producer", extra={"bootstrap": PREFILL_BOOTSTRAP}, tp=2))
    c = kit.request(range(100, 140), params.for_prefill(12), max_tokens=1)
    prefill.add_request(c)
    _, outputs = step(prefill)
    (done,) = outputs[0].outputs
    answer = done.kv_transfer_params
    assert (answer["prefill_tp_size"], answer["prefill_pp_size"]) == (2, 1)
    out, _ = step(prefill)  # the one send every prefill rank posts for its heads
    assert out.kv_connector_metadata.sends == [kit.Transmit(req_id=c.request_id, room=12, pages=tuple(blocks_of(prefill, c)[:2]), num_tokens=40)]

    decode = kit.scheduler(configs("kv_consumer"))  # TP1 here: its one rank reads both prefill ranks
    a = kit.request(range(100, 140), {key: value for key, value in answer.items() if key != "remote_prefill_cached_tokens"})
    decode.add_request(a)
    out = decode.schedule()
    (receive,) = out.kv_connector_metadata.receives
    assert receive.room == 12 and receive.prefill_sizes == params.Sizes(tp=2, pp=1)
    assert receive.pages == tuple(blocks_of(decode, a)[:2])


def test_c2_pipeline_parallel_engines_are_refused_naming_the_way_out(kit, model_dir):
    from pdxfer.core.errors import Unsupported

    with pytest.raises(Unsupported, match="pipeline_parallel_size 2: .* run the engine with pipeline_parallel_size 1"):
        kit.scheduler(kit.vllm_config(model_dir, "kv_consumer", tp=2, pp=2))


def test_c3_aborts_before_scheduling_ask_nothing_of_the_worker_but_tell_the_decode(kit, configs):
    decode = kit.scheduler(configs("kv_consumer"))
    e = kit.request(range(100, 140), from_prefill(10))
    decode.add_request(e)
    decode.finish_requests(e.request_id, kit.RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    assert out.kv_connector_metadata.receives == out.kv_connector_metadata.cancels == []
    assert not decode.has_requests()

    prefill = kit.scheduler(configs("kv_producer"))
    f = kit.request(range(100, 140), params.for_prefill(11), max_tokens=1)
    prefill.add_request(f)
    prefill.finish_requests(f.request_id, kit.RequestStatus.FINISHED_ABORTED)
    out, _ = step(prefill)
    assert out.kv_connector_metadata.aborts == [11]  # the decode's room fails now, not at its timeout
    assert out.kv_connector_metadata.sends == [] and not prefill.connector.has_pending_push_work()


def test_c3_a_decode_aborted_while_receiving_keeps_its_blocks_until_the_room_settled(kit, configs):
    s = kit.scheduler(configs("kv_consumer"))
    g = kit.request(range(100, 140), from_prefill(12))
    s.add_request(g)
    step(s)
    held = blocks_of(s, g)[:2]
    s.finish_requests(g.request_id, kit.RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert out.kv_connector_metadata.cancels == [g.request_id]
    assert ref_counts(s, held) == [1, 1]  # a write may still land in them
    step(s, finished_recving={g.request_id})  # the worker saw the room fenced
    assert ref_counts(s, held) == [0, 0] and not s.has_requests()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_c4_a_failed_room_reports_only_its_own_blocks(kit, configs, policy):
    """Three requests share a cached prefix block; b's room fails. Reporting b's own
    blocks costs b alone (E2: reporting the shared one would fail all three)."""
    s = kit.scheduler(configs("kv_consumer", policy))
    prefix = list(range(500, 500 + BS))
    a = kit.request(prefix + list(range(600, 608)), from_prefill(20))
    s.add_request(a)
    received(s, a)
    step(s)

    b = kit.request(prefix + list(range(700, 740)), from_prefill(21))
    c = kit.request(prefix + list(range(800, 808)), from_prefill(22))
    s.add_request(b)
    s.add_request(c)
    out, _ = step(s)
    by_req = {r.req_id: r for r in out.kv_connector_metadata.receives}
    own = set(by_req[b.request_id].pages)
    assert blocks_of(s, a)[0] not in own and by_req[b.request_id].skip_pages == by_req[c.request_id].skip_pages == 1

    # the worker half: b's room failed and is fenced, c's landed, both settled this step
    _, outputs = step(s, finished_recving={b.request_id, c.request_id}, invalid_block_ids=own)
    errored = {o.request_id for o in outputs[0].outputs if o.finish_reason is kit.FinishReason.ERROR} if outputs else set()
    out = s.schedule()
    if policy == "fail":
        assert errored == {b.request_id}
        assert out.num_scheduled_tokens == {a.request_id: 1, c.request_id: 1}
    else:
        assert errored == set()
        # b recomputes what its room was to write, and keeps its prefix hit
        assert out.num_scheduled_tokens == {a.request_id: 1, c.request_id: 1, b.request_id: 72 - BS}
