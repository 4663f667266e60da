"""The vllm.general_plugins entry point (docs/engines.md §C1): vLLM loads it from
pyproject.toml's entry points, and then the connector's name alone selects
PdxferConnector. The entry point is installed as a distribution's would be: a
.dist-info on the path of a fresh interpreter (docs/engines.md §E1's way)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.engines.procs import REPO_ROOT

PROBE = """
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

load_general_plugins()
config = type("KVTransferConfig", (), {"kv_connector": "PdxferConnector", "kv_connector_module_path": None})()
cls = KVConnectorFactory.get_connector_class(config)
from pdxfer.adapters.vllm import plugin

plugin.register()  # vLLM may call it again in the same process
print(cls.__module__, cls.__name__)
"""


def test_c1_the_connector_name_alone_selects_pdxfer_once_the_plugin_is_installed(needs_vllm, tmp_path):
    entry_points = tomllib.loads(Path(REPO_ROOT, "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    dist = tmp_path / "pdxfer_plugin_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pdxfer-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO_ROOT])}
    env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["pdxfer.adapters.vllm.connector", "PdxferConnector"]

    # the plugin is what makes the name known: allowed no plugin, vLLM does not know it
    without = subprocess.run([sys.executable, "-c", PROBE], env={**env, "VLLM_PLUGINS": "none-such"}, capture_output=True, text=True, timeout=300)
    assert without.returncode != 0 and "Unsupported connector type: PdxferConnector" in without.stderr
