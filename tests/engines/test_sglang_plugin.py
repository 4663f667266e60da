"""E1 as a test (docs/engines.md §E1, B1): SGLang 0.5.23 loads pdxfer through the entry
point pyproject.toml declares, and then knows the backend everywhere it looks one up,
without a byte of SGLang patched. Each check runs in a fresh interpreter, as SGLang's
own processes do: plugins load once per process and hook modules for good."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.sglang_pd import engine_env, entry_point

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUP = "sglang.srt.plugins"


def run_in_sglang(tmp_path, script: str) -> str:
    """``script`` in a fresh interpreter whose SGLang finds pdxfer as an installed
    plugin would be found; its stdout."""
    env = engine_env(str(tmp_path), (), {"pdxfer": entry_point()})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_entry_point_names_the_register_function():
    assert entry_point() == "pdxfer.adapters.sglang.plugin:register"
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["optional-dependencies"]["sglang"] == []  # SGLang itself is the user's


def test_sglang_knows_the_backend_after_loading_plugins(needs_sglang, tmp_path):
    out = run_in_sglang(tmp_path, """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
        from sglang.srt.disaggregation import utils
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.common import conn as common
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.managers import disagg_service
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.server_args import prepare_server_args

        assert "pdxfer" in DISAGG_TRANSFER_BACKEND_CHOICES
        backend = utils.TransferBackend("pdxfer")
        # every module that imported the enum sees the copy (the registry re-points them)
        assert disagg_service.TransferBackend is utils.TransferBackend
        assert utils.TransferBackend("mooncake") is utils.TransferBackend.MOONCAKE
        kinds = {k: utils.get_kv_class(backend, k) for k in utils.KVClassType}
        assert kinds[utils.KVClassType.KVARGS] is KVArgs
        bases = {"MANAGER": common.CommonKVManager, "SENDER": common.CommonKVSender,
                 "RECEIVER": common.CommonKVReceiver, "BOOTSTRAP_SERVER": common.CommonKVBootstrapServer}
        for kind, base in bases.items():
            cls = kinds[utils.KVClassType[kind]]
            assert issubclass(cls, base) and cls.__module__ == "pdxfer.adapters.sglang.conn", (kind, cls)
        assert utils.get_kv_class(utils.TransferBackend.MOONCAKE, utils.KVClassType.MANAGER) is MooncakeKVManager
        assert disagg_service.rust_server_serves_kv_bootstrap("pdxfer")
        assert MHATokenToKVPool._create_buffers_normal.__wrapped__.__qualname__ == "MHATokenToKVPool._create_buffers_normal"
        args = prepare_server_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                                    "--disaggregation-transfer-backend", "pdxfer"])
        print(args.disaggregation_transfer_backend, ",".join(sorted(kinds[k].__name__ for k in kinds)))
    """)
    assert out.split() == ["pdxfer", "KVArgs,PdxferKVBootstrapServer,PdxferKVManager,PdxferKVReceiver,PdxferKVSender"]


def test_without_the_plugin_sglang_refuses_the_name(needs_sglang, tmp_path):
    """The control: the choice really comes from the plugin. make engines-env installs
    pdxfer, whose entry point SGLang would load, so another plugin alone is allowed."""
    env = engine_env(str(tmp_path), ("mooncake_cpu",))
    done = subprocess.run(
        [sys.executable, "-c", "from sglang.srt.plugins import load_plugins; load_plugins()\n"
         "from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as c; print('pdxfer' in c)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["False"]
