"""The ``vllm.general_plugins`` entry point (docs/engines.md §C1): with pdxfer installed,
``--kv-transfer-config '{"kv_connector": "PdxferConnector", ...}'`` works without
``kv_connector_module_path``. vLLM calls ``register`` in each of its processes, perhaps
more than once; it registers a name and imports nothing more (the connector loads when
an engine asks for it)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

NAME = "PdxferConnector"


def register() -> None:
    if NAME not in KVConnectorFactory._registry:  # the factory refuses a second registration of a name
        KVConnectorFactory.register_connector(NAME, "pdxfer.adapters.vllm.connector", NAME)
