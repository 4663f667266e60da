"""kv_transfer_params of disaggregated vLLM requests (pdxfer.adapters.vllm.params, docs/engines.md
§C2): what each side reads, what the prefill answers, what is refused. No vLLM needed."""

from __future__ import annotations

import pytest

from pdxfer.adapters.vllm import params
from pdxfer.adapters.vllm.params import FromPrefill, Sizes, ToDecode


def test_c2_each_side_reads_what_the_proxy_sends_it():
    assert params.read(params.for_prefill(5)) == ToDecode(room=5)
    assert params.read(params.for_decode(5, "10.0.0.1:18998", "p0")) == FromPrefill(room=5, bootstrap="10.0.0.1:18998", engine="p0")
    assert params.read({"do_remote_decode": True}) == ToDecode(room=None)  # a sequential proxy: the prefill picks
    assert params.read(None) is None and params.read({}) is None
    assert params.read({"do_remote_decode": False, "do_remote_prefill": False, "remote_block_ids": [1]}) is None


def test_c2_the_prefills_answer_is_the_decodes_request_with_the_prefills_sizes():
    answer = params.answer(2**64 - 1, "[::1]:18998", "p0", Sizes(tp=4, pp=2))
    assert params.read(answer) == FromPrefill(room=2**64 - 1, bootstrap="[::1]:18998", engine="p0", sizes=Sizes(tp=4, pp=2))
    assert params.sizes_of(answer) == Sizes(tp=4, pp=2)  # what a parallel proxy learns from it
    # without a bootstrap address configured, the answer still names the room and the
    # sizes, and a decode given only that says what is missing
    short = params.answer(3, None, "p0", Sizes(tp=2))
    assert "prefill_bootstrap" not in short and params.sizes_of(short) == Sizes(tp=2)
    with pytest.raises(ValueError, match="prefill_bootstrap must be 'host:port'"):
        params.read(short)


def test_c2_sizes_left_out_are_one_and_bad_ones_are_refused_naming_them():
    # a decode request from a proxy or prefill that names no sizes: a TP1, PP1 prefill
    assert params.read({"do_remote_prefill": True, "room": 1, "prefill_bootstrap": "h:1"}).sizes == Sizes(tp=1, pp=1)
    assert params.read(params.for_decode(1, "h:1", "p", Sizes(tp=8))).sizes == Sizes(tp=8, pp=1)
    for key, bad in [("prefill_tp_size", 0), ("prefill_pp_size", -1), ("prefill_tp_size", "2"), ("prefill_tp_size", True), ("prefill_pp_size", 1.0)]:
        with pytest.raises(ValueError, match=f"{key} must be a positive integer .*not {bad!r}"):
            params.read({"do_remote_prefill": True, "room": 1, "prefill_bootstrap": "h:1", key: bad})


@pytest.mark.parametrize("room", [0, -1, 2**64, True, "12", 1.5, None])
def test_c2_a_room_outside_u64_is_refused_naming_it(room):
    with pytest.raises(ValueError, match=r"room must be an integer in 1\.\.2\*\*64-1, not " + repr(room).replace("(", r"\(").replace(".", r"\.")):
        params.read({"do_remote_prefill": True, "room": room, "prefill_bootstrap": "h:1"})


@pytest.mark.parametrize("bootstrap", [None, "", "host", "host:", "host:port", 18998])
def test_c2_a_bootstrap_without_a_port_is_refused(bootstrap):
    with pytest.raises(ValueError, match="prefill_bootstrap"):
        params.read({"do_remote_prefill": True, "room": 1, "prefill_bootstrap": bootstrap})


def test_c2_picked_rooms_survive_a_json_double():
    rooms = {params.new_room() for _ in range(1000)}
    assert len(rooms) == 1000
    assert all(1 <= r < params.PICKED_ROOMS and int(float(r)) == r for r in rooms)
