"""Configuration: one frozen object; defaults < TOML file < PDXFER_ env < flags. The
environment is always passed in explicitly so the host's variables cannot leak in."""

from __future__ import annotations

import os

import msgspec
import pytest

from pdxfer.core import config
from pdxfer.core.protocol import Role


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "pdxfer.toml"
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = config.load(flags={"role": "prefill"}, env={})
    assert cfg.role is Role.PREFILL
    assert (cfg.bootstrap_port, cfg.protocol, cfg.device, cfg.aux_path) == (18998, "tcp", "cpu", "auto")
    assert (cfg.max_rooms, cfg.peer_window, cfg.fence_timeout) == (4096, 512, 10.0)


def test_precedence_defaults_file_env_flags(tmp_path):
    path = write_toml(
        tmp_path,
        'role = "decode"\nbootstrap_port = 9000\nmax_rooms = 10\npeer_window = 7\nhost = "10.0.0.5"\n',
    )
    env = {"PDXFER_MAX_ROOMS": "20", "PDXFER_PEER_WINDOW": "8"}
    flags = {"peer_window": 9, "host": None}  # None: flag not given
    cfg = config.load(flags=flags, env=env, file=path)
    assert cfg.role is Role.DECODE  # file over default
    assert cfg.bootstrap_port == 9000  # file over default
    assert cfg.max_rooms == 20  # env over file
    assert cfg.peer_window == 9  # flag over env over file
    assert cfg.host == "10.0.0.5"  # a flag left unset does not hide the file
    assert cfg.transfer_timeout == 30.0  # untouched default


def test_config_file_named_by_the_environment(tmp_path):
    path = write_toml(tmp_path, 'role = "prefill"\nprotocol = "rdma"\n')
    cfg = config.load(env={"PDXFER_CONFIG": path})
    assert cfg.protocol == "rdma"
    # An explicit --config wins over PDXFER_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text('role = "prefill"\nprotocol = "hixl"\n')
    assert config.load(env={"PDXFER_CONFIG": path}, file=str(other)).protocol == "hixl"


def test_env_strings_are_converted():
    env = {
        "PDXFER_ROLE": "decode",
        "PDXFER_BOOTSTRAP_PORT": "0",
        "PDXFER_WAITING_TIMEOUT": "2.5",
        "PDXFER_DEVICE": "npu:3",
    }
    cfg = config.load(env=env)
    assert (cfg.role, cfg.bootstrap_port, cfg.waiting_timeout, cfg.device) == (Role.DECODE, 0, 2.5, "npu:3")


def test_env_without_prefix_is_ignored():
    with pytest.raises(ValueError, match="role"):
        config.load(env={"ROLE": "prefill", "pdxfer_role": "prefill"})


def test_config_is_frozen():
    cfg = config.load(flags={"role": "prefill"}, env={})
    with pytest.raises(AttributeError):
        cfg.max_rooms = 1


@pytest.mark.parametrize(
    ("source", "field", "value"),
    [
        ("env", "max_rooms", "0"),
        ("env", "bootstrap_port", "70000"),
        ("env", "peer_window", "many"),
        ("flags", "device", "gpu0"),
        ("flags", "protocol", "udp"),
        ("flags", "aux_path", "carrier_pigeon"),
        ("flags", "transfer_timeout", 0),
        ("flags", "fence_timeout", -1.0),
        ("flags", "max_message_bytes", 100),
        ("flags", "staging_mib", "-1"),
        ("file", "log_level", '"loud"'),
        ("file", "role", '"router"'),
    ],
)
def test_invalid_values_name_the_field(tmp_path, source, field, value):
    flags: dict = {"role": "prefill"} if field != "role" else {}
    env: dict = {}
    file = None
    if source == "env":
        env[f"PDXFER_{field.upper()}"] = value
    elif source == "flags":
        flags[field] = value
    else:
        file = write_toml(tmp_path, f"{field} = {value}\n")
    with pytest.raises(ValueError) as info:
        config.load(flags=flags, env=env, file=file)
    where = {"env": f"environment variable PDXFER_{field.upper()}", "flags": "--" + field.replace("_", "-"),
             "file": f"{file} line 1 ({field})"}[source]
    given = value.strip('"') if source == "file" else value  # the file holds TOML strings
    assert f"{where} is {given!r}" in str(info.value)  # where it was given, and the value
    assert not isinstance(info.value, msgspec.ValidationError)  # callers catch ValueError only


@pytest.mark.parametrize(("field", "value", "valid"), [
    ("protocol", "udp", "ascend, hixl, intranode_nvlink, nvlink, rdma, tcp"),
    ("role", "router", "prefill, decode"),
    ("log_format", "yaml", "json, text"),
])
def test_an_invalid_choice_lists_the_valid_ones(field, value, valid):
    with pytest.raises(ValueError, match=f"choose one of: {valid}$"):
        config.load({"role": "decode", field: value}, env={})


def test_an_invalid_value_names_its_source_not_a_json_path(tmp_path):
    with pytest.raises(ValueError) as info:
        config.load({"role": "decode"}, env={"PDXFER_BOOTSTRAP_PORT": "abc"})
    assert str(info.value) == "invalid configuration: environment variable PDXFER_BOOTSTRAP_PORT is 'abc': expected int, got str"
    path = write_toml(tmp_path, 'role = "decode"\n\n# the port\nbootstrap-port = "x"\n')
    with pytest.raises(ValueError, match=rf"^invalid configuration: {path} line 4 \(bootstrap-port\) is 'x': expected int"):
        config.load(env={}, file=path)


def test_an_empty_environment_variable_is_unset():
    """A ConfigMap key left blank sets the variable to "": the option keeps its default
    (or the file's value) instead of failing to parse."""
    cfg = config.load(env={"PDXFER_ROLE": "decode", "PDXFER_HTTP_PORT": "", "PDXFER_PROTOCOL": ""})
    assert (cfg.http_port, cfg.protocol) == (0, "tcp")


def test_toml_keys_take_the_flags_spelling_too(tmp_path):
    path = write_toml(tmp_path, 'role = "prefill"\nbootstrap-port = 9001\nmax_rooms = 7\n')
    cfg = config.load(env={}, file=path)
    assert (cfg.bootstrap_port, cfg.max_rooms) == (9001, 7)
    twice = write_toml(tmp_path, 'role = "prefill"\nbootstrap-port = 9001\nbootstrap_port = 9002\n')
    with pytest.raises(ValueError, match="line 3: 'bootstrap_port' sets bootstrap_port again"):
        config.load(env={}, file=twice)


def test_the_readme_toml_example_loads(tmp_path):
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = config.load(env={}, file=write_toml(tmp_path, example))
    assert cfg.role is Role.PREFILL and cfg.http_port != 0


def test_unknown_key_in_file_is_refused(tmp_path):
    path = write_toml(tmp_path, 'role = "prefill"\nbootstrap_prot = 1\n')
    with pytest.raises(ValueError, match="line 2: 'bootstrap_prot' is not an option"):
        config.load(env={}, file=path)


def test_the_engines_endpoint_variable_is_not_the_daemons_and_a_misspelt_one_is_refused():
    """PDXFER_ENDPOINT names an engine's daemon (pdxfer.adapters): a daemon started in
    the same environment passes over it, and still refuses what it does not know."""
    env = {"PDXFER_ROLE": "decode", "PDXFER_ENDPOINT": "ipc:///run/p/decode.engine.sock"}
    assert config.load(env=env).role is Role.DECODE
    with pytest.raises(ValueError, match="unknown environment variable PDXFER_ENDPIONT"):
        config.load(env={**env, "PDXFER_ENDPIONT": "x"})


def test_missing_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        config.load(env={})


def test_the_staging_defaults_follow_the_protocol_and_side_and_an_operators_size_stands():
    decode, prefill = config.load({"role": "decode"}, env={}), config.load({"role": "prefill"}, env={})
    assert decode.staging_bytes == prefill.staging_bytes == 512 << 20  # tcp, the default protocol
    assert (decode.stage_spans_below, prefill.stage_spans_below) == (128 << 10, 16 << 10)
    rdma = config.load({"role": "decode", "protocol": "rdma"}, env={})
    assert rdma.staging_bytes == 64 << 20 and rdma.stage_spans_below == 8 << 10
    assert config.load({"role": "decode", "staging_mib": "0"}, env={}).staging_bytes == 0
    assert config.load({"role": "decode"}, env={"PDXFER_STAGING_MIB": "32"}).staging_bytes == 32 << 20


def test_every_field_is_documented():
    fields = config.fields()
    assert [name for name, _, _ in fields] == list(config.Config.__struct_fields__)
    for name, _default, description in fields:
        assert description.strip(), f"config field {name} has no description (it is its --help text)"
    defaults = {name: default for name, default, _ in fields}
    assert defaults["role"] is msgspec.NODEFAULT
    assert defaults["bootstrap_port"] == 18998


def test_engine_address_uses_runtime_dir_and_instance_name():
    cfg = config.Config(role=Role.PREFILL, runtime_dir="/run/x")
    assert cfg.instance == "prefill"
    assert cfg.engine_address == "ipc:///run/x/prefill.engine.sock"
    named = config.Config(role=Role.DECODE, runtime_dir="/run/x", name="d7")
    assert named.engine_address == "ipc:///run/x/d7.engine.sock"
    explicit = config.Config(role=Role.DECODE, engine_endpoint="tcp://127.0.0.1:5555")
    assert explicit.engine_address == "tcp://127.0.0.1:5555"


def test_default_runtime_dir_is_resolved_once_from_the_given_environment():
    cfg = config.load({"role": "decode"}, env={"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert cfg.runtime_dir == "/run/user/1000/pdxfer"
    assert cfg.engine_address == "ipc:///run/user/1000/pdxfer/decode.engine.sock"
    bare = config.load({"role": "decode"}, env={})
    assert bare.engine_address == f"ipc:///tmp/pdxfer-{os.getuid()}/decode.engine.sock"


def test_misspelt_environment_variable_is_refused():
    with pytest.raises(ValueError, match="PDXFER_PEER_WINDOWS"):
        config.load({"role": "decode"}, env={"PDXFER_PEER_WINDOWS": "8"})


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, 5.0),  # heartbeats alone: interval 1 s x 5 misses
    ({"registry": "etcd://127.0.0.1:2379"}, 5.0 * 2 / 3),  # a stall just before a renewal leaves the lease 2/3 of its TTL
    ({"registry": "etcd://127.0.0.1:2379", "registry_ttl": 2}, 2 * 2 / 3),
    ({"registry": "etcd://127.0.0.1:2379", "registry_ttl": 60, "heartbeat_misses": 2}, 2.0),
])
def test_silence_bound_is_the_tightest_deadline_on_this_daemon(flags, expected):
    cfg = config.load({"role": "decode", **flags}, env={})
    assert cfg.silence_bound == pytest.approx(expected)
