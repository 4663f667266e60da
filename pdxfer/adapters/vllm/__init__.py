"""pdxfer for vLLM: the KV connector (``PdxferConnector``, connector.py) and the proxy
that routes each request to a prefill and a decode engine (proxy.py, ``pdxfer proxy``).

vLLM loads the connector by module path (``kv_connector_module_path =
"pdxfer.adapters.vllm"``). It is imported on first use, so that the proxy and the
request params (params.py) need no vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["PdxferConnector"]

if TYPE_CHECKING:
    from .connector import PdxferConnector


def __getattr__(name: str):
    if name == "PdxferConnector":
        from .connector import PdxferConnector

        return PdxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
