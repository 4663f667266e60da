"""Test-only vLLM plugins, loaded in every vLLM process through the
``vllm.general_plugins`` entry point group (`vllm_servers.start_server` puts a
``.dist-info`` naming them on the server's PYTHONPATH, `procs.plugin_dist`). Nothing
in vLLM is patched on disk.

- ``mooncake_cpu``: vLLM's own MooncakeConnector, the baseline of `bench_vllm`, asks
  for the current accelerator's index when its worker half starts, to bind its
  sender threads to that device; with no accelerator torch raises ("Cannot access
  accelerator device when none is available"). On the CPU platform the worker half
  starts with that index read as 0 (``set_device`` is a no-op for the CPU there); the
  rest of the connector runs as shipped, over Mooncake's TCP transport."""

from __future__ import annotations

import functools
from unittest import mock

PLUGIN_ENTRY_POINTS = {"mooncake_cpu": "tests.engines.vllm_plugins:mooncake_cpu"}


def mooncake_cpu() -> None:
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector

    worker = mooncake_connector.MooncakeConnectorWorker
    if getattr(worker.__init__, "cpu_shim", False):  # vLLM loads plugins more than once per process
        return
    init = worker.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with mock.patch.object(torch.accelerator, "current_device_index", return_value=0):
            init(self, *args, **kwargs)

    __init__.cpu_shim = True
    worker.__init__ = __init__
