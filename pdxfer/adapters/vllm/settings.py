"""PdxferConnector's settings: its ``kv_connector_extra_config`` read once, after the
setups it does not support yet are refused, each refusal naming the way out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core import config as config_mod
from ...core.errors import Unsupported
from ...core.protocol import Role
from .params import Sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}
DEFAULT_AUX_SLOTS = 1024
DEFAULT_TIMEOUT = 30.0  # a daemon answers in milliseconds, but on a host whose cores are all taken it may take seconds


@dataclass(frozen=True)
class Settings:
    role: Role
    engine_id: str
    daemon: str  # the local daemon's engine endpoint
    bootstrap: str | None  # prefill: its daemon's bootstrap address, for sequential proxies
    sizes: Sizes  # the engine's TP and PP sizes (every rank's worker names its own rank to the daemon)
    aux_slots: int
    timeout: float  # seconds a call to the daemon may take, once registered


def settings(vllm_config: VllmConfig) -> Settings:
    kv = vllm_config.kv_transfer_config
    role = ROLES.get(kv.kv_role)
    if role is None:
        raise Unsupported(f"kv_role {kv.kv_role!r}: a pdxfer daemon serves one role; run the engine as kv_producer (prefill) or kv_consumer (decode)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise Unsupported(
            f"pipeline_parallel_size {parallel.pipeline_parallel_size}: PdxferConnector moves engines of one pipeline stage so far "
            "(any tensor_parallel_size); run the engine with pipeline_parallel_size 1"
        )
    extra = kv.kv_connector_extra_config
    daemon = extra.get("daemon") or config_mod.load({"role": role.value}).engine_address
    return Settings(role=role, engine_id=kv.engine_id, daemon=daemon, bootstrap=extra.get("bootstrap"),
                    sizes=Sizes(tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size),
                    aux_slots=int(extra.get("aux_slots", DEFAULT_AUX_SLOTS)), timeout=float(extra.get("timeout", DEFAULT_TIMEOUT)))
