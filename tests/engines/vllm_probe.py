"""A vLLM KV connector that moves nothing and records what the worker hands it,
loaded the way an out-of-tree connector is (``kv_connector_module_path``,
docs/engines.md §V1, C1): ``register_kv_caches``'s tensors as plain values
(`kv_cache_record`). Engines run in-process here (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so the worker reads `RECORD` after start-up."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

RECORD: dict[str, Any] = {"roles": [], "kv_caches": None}


class ProbeMetadata(KVConnectorMetadata):
    pass


def kv_cache_record(kv_caches: dict) -> dict:
    """Per layer: shape, dtype, strides, storage offset (elements), and where its
    storage lives, so the layers sharing one storage show."""
    layers = {}
    for name, t in kv_caches.items():
        storage = t.untyped_storage()
        layers[name] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype),
            "stride": list(t.stride()),
            "storage_offset": t.storage_offset(),
            "element_size": t.element_size(),
            "data_ptr": t.data_ptr(),
            "storage_ptr": storage.data_ptr(),
            "storage_nbytes": storage.nbytes(),
            "device": str(t.device),
        }
    return layers


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        RECORD["roles"].append(role.name)

    # worker side
    def register_kv_caches(self, kv_caches) -> None:
        RECORD["kv_caches"] = kv_cache_record(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return ProbeMetadata()
