"""PdxferConnector: vLLM's KV connector interface over pdxfer (docs/engines.md §C1-C5), a thin
facade over the scheduler half (scheduler.py) and the worker half (worker.py).

    --kv-transfer-config '{"kv_connector": "PdxferConnector",
                           "kv_connector_module_path": "pdxfer.adapters.vllm",
                           "kv_role": "kv_producer",            # or kv_consumer
                           "kv_connector_extra_config": {"daemon": "ipc://...", "bootstrap": "host:port"}}'

``daemon``: the local pdxfer daemon's engine endpoint (default: the one a daemon of the
engine's role started with the same environment listens on). ``bootstrap``: on a
prefill, its daemon's bootstrap address, returned to sequential proxies with each
request (a parallel proxy knows it already). ``aux_slots``: rooms in flight at once
(default 1024). ``timeout``: seconds a call to the daemon may take (default 30).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...core.errors import Unsupported
from .metadata import PdxferMetadata
from .scheduler import SchedulerHalf
from .settings import settings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .worker import WorkerHalf


class PdxferConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise Unsupported("models with several KV cache groups (sliding window, hybrid): PdxferConnector moves one full-attention group so far")
        self.settings = settings(vllm_config)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(vllm_config.cache_config.block_size, self.settings.engine_id, self.settings.bootstrap,
                                            self.settings.sizes)
        else:
            from .worker import WorkerHalf  # the worker's process alone talks to a daemon

            self._worker = WorkerHalf(self.settings, vllm_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major blocks (A3): one contiguous run per (layer, block), and per head later.
        None for an MLA model: its latent rows have no heads to order."""
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # --- scheduler side

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdxferMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # --- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdxferMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Receives land whole before vLLM schedules the request: nothing to wait for here."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Sends start once the request finished (start_load_kv), not layer by layer."""

    def wait_for_save(self) -> None:
        """Sends read blocks vLLM holds for them until get_finished reports them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
