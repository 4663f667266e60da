"""Path decisions (A2, A3, D1) checked directly: the GPU, NVLink and Ascend paths cannot
run on a CPU-only host, so these pure functions are where they are tested."""

from __future__ import annotations

import typing

import pytest

from pdxfer.core import errors
from pdxfer.core.config import AuxPathChoice, Protocol
from pdxfer.core.paths import (
    ENGINE_PROTOCOL, MAX_TCP_LANES, POOL_KINDS, TCP_LANES_ENV, TCP_LEGACY_PROTO_ENV, AuxPath, check_engine_release, check_pool,
    choose_aux_path, engine_count, engine_env, release_numbers, startup_steps, stripes,
)

PROTOCOLS = typing.get_args(Protocol)


def test_every_configurable_protocol_is_known():
    assert set(ENGINE_PROTOCOL) == set(PROTOCOLS) == set(POOL_KINDS)


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        ("tcp", AuxPath.TCP),
        # NVLink completions do not prove the aux bytes are visible (F3): TCP by default.
        ("nvlink", AuxPath.TCP),
        ("intranode_nvlink", AuxPath.TCP),
        ("rdma", AuxPath.TRANSFER_ENGINE),
        ("ascend", AuxPath.TRANSFER_ENGINE),
        ("hixl", AuxPath.TRANSFER_ENGINE),
    ],
)
def test_auto_aux_path_follows_the_protocol(protocol, expected):
    assert choose_aux_path(protocol, "auto") is expected


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("choice", ["tcp", "transfer_engine"])
def test_explicit_aux_path_wins(protocol, choice):
    assert choose_aux_path(protocol, choice) is AuxPath(choice)


def test_aux_choices_match_the_config():
    assert set(typing.get_args(AuxPathChoice)) == {"auto"} | {a.value for a in AuxPath}


@pytest.mark.parametrize(
    ("protocol", "device", "pool"),
    [
        ("tcp", "cpu", "shm"),
        ("tcp", "cuda:0", "cuda_ipc"),
        ("rdma", "cpu", "shm"),
        ("rdma", "cuda:1", "cuda_ipc"),
        ("nvlink", "cuda:0", "cuda_ipc"),
        ("intranode_nvlink", "cuda:7", "cuda_ipc"),
        ("ascend", "npu:0", "npu_ipc"),
        ("hixl", "npu:2", "npu_ipc"),
        ("tcp", "cuda:0", "shm"),  # a CPU pool needs no particular device
    ],
)
def test_check_pool_accepts(protocol, device, pool):
    check_pool(protocol, device, pool)


@pytest.mark.parametrize(
    ("protocol", "device", "pool", "needed"),
    [
        ("nvlink", "cuda:0", "shm", "it moves: cuda_ipc"),
        ("intranode_nvlink", "cuda:0", "shm", "it moves: cuda_ipc"),
        ("nvlink", "npu:0", "npu_ipc", "it moves: cuda_ipc"),
        ("ascend", "npu:0", "shm", "it moves: npu_ipc"),
        ("hixl", "cpu", "cuda_ipc", "it moves: npu_ipc"),
        ("tcp", "cpu", "npu_ipc", "it moves: shm, cuda_ipc"),
        ("ascend", "cpu", "npu_ipc", "--device npu:N"),
        ("ascend", "cuda:0", "npu_ipc", "--device npu:N"),
        ("tcp", "cpu", "cuda_ipc", "--device cuda:N"),
        ("nvlink", "npu:1", "cuda_ipc", "--device cuda:N"),
    ],
)
def test_check_pool_refuses_saying_what_is_needed(protocol, device, pool, needed):
    with pytest.raises(errors.Unsupported) as info:
        check_pool(protocol, device, pool)
    message = str(info.value)
    assert needed in message
    assert pool in message


@pytest.mark.parametrize("device", ["cuda:0", "cuda:3", "npu:0", "npu:15"])
def test_device_is_bound_before_any_transport(device):
    steps = startup_steps(device)
    assert steps[0] == "bind_device"  # D1 (F6: aclrtGetDevice failed)
    assert steps.index("bind_device") < steps.index("init_transport")


def test_cpu_binds_no_device():
    assert "bind_device" not in startup_steps("cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "npu:0"])
def test_engine_endpoint_opens_after_the_transport(device):
    steps = startup_steps(device)
    assert steps.index("init_transport") < steps.index("open_engine_endpoint")
    assert steps[-1] == "open_engine_endpoint"
    assert len(steps) == len(set(steps))


def test_engine_protocol_names():
    assert ENGINE_PROTOCOL["intranode_nvlink"] == "nvlink_intra"
    assert ENGINE_PROTOCOL["hixl"] == "ascend"
    for same in ("tcp", "rdma", "nvlink", "ascend"):
        assert ENGINE_PROTOCOL[same] == same


def test_tcp_engine_gets_the_lanes_asked_for():
    assert engine_env("tcp", 8, {}) == {TCP_LANES_ENV: "8"}
    assert engine_env("tcp", MAX_TCP_LANES, {TCP_LANES_ENV: "2"}) == {TCP_LANES_ENV: str(MAX_TCP_LANES)}
    assert engine_env("tcp", 0, {TCP_LANES_ENV: "2"}) == {}  # 0: the environment's (or the engine's default)


@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if p != "tcp"])
def test_other_protocols_leave_the_tcp_settings_alone(protocol):
    assert engine_env(protocol, 8, {TCP_LEGACY_PROTO_ENV: "1"}) == {}


def test_unacknowledged_tcp_writes_are_refused():
    # A3: with MC_TCP_PROTO=1 a write is "done" once it left the socket buffer, so the
    # aux record could overtake its KV.
    with pytest.raises(errors.Unsupported, match=TCP_LEGACY_PROTO_ENV):
        engine_env("tcp", 8, {TCP_LEGACY_PROTO_ENV: "1"})
    for harmless in ("", "2", "0"):  # the engine takes exactly "1" as the legacy framing
        assert engine_env("tcp", 8, {TCP_LEGACY_PROTO_ENV: harmless}) == {TCP_LANES_ENV: "8"}


@pytest.mark.parametrize(("version", "numbers"), [
    ("0.3.13.post1", (0, 3, 13)), ("0.3.12rc1", (0, 3, 12)), ("0.3.11", (0, 3, 11)), ("1.0", (1, 0)), ("", None), ("unknown", None),
])
def test_release_numbers(version, numbers):
    assert release_numbers(version) == numbers


def test_engines_from_before_acknowledged_tcp_writes_are_refused_over_tcp():
    with pytest.raises(errors.Unsupported, match="0.3.11.post1.*overtake"):
        check_engine_release("tcp", "0.3.11.post1", "this daemon's")
    for fine in ("0.3.12", "0.3.13.post1", "1.0", ""):  # "": unknown, nothing to judge
        check_engine_release("tcp", fine, "this daemon's")
    for protocol in PROTOCOLS:
        if protocol != "tcp":
            check_engine_release(protocol, "0.3.5", "this daemon's")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_only_tcp_runs_several_engines(protocol):
    assert engine_count(protocol, 3) == (3 if protocol == "tcp" else 1)
    assert engine_count(protocol, 1) == 1


@pytest.mark.parametrize(
    ("engines", "sessions", "expected"),
    [
        (1, 1, [(0, 0)]),
        (2, 2, [(0, 0), (1, 1)]),  # pairs: one thread at each end
        (1, 3, [(0, 0), (0, 1), (0, 2)]),  # a one-engine writer still reaches every session
        (3, 1, [(0, 0), (1, 0), (2, 0)]),  # an old or one-engine peer still gets every engine's writes
        (2, 3, [(0, 0), (1, 1), (0, 2)]),
    ],
)
def test_stripes_use_every_engine_and_every_peer_session(engines, sessions, expected):
    got = stripes(engines, sessions)
    assert got == expected
    assert {e for e, _ in got} == set(range(engines)) and {s for _, s in got} == set(range(sessions))


@pytest.mark.parametrize(("engines", "sessions"), [(0, 1), (1, 0)])
def test_stripes_need_an_engine_and_a_session(engines, sessions):
    with pytest.raises(ValueError, match="stripes need"):
        stripes(engines, sessions)
