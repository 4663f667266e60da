"""SGLang's entry into pdxfer: ``register`` runs in every SGLang process, through the
``sglang.srt.plugins`` entry point, before SGLang reads its arguments (docs/engines.md §G1, B1).

It does nothing but register hooks with SGLang's own plugin registry, which applies them
once every plugin has run and re-points every module that imported a hooked name:

- the choice ``pdxfer`` for ``--disaggregation-transfer-backend``;
- REPLACE ``TransferBackend`` with a copy of the enum that has ``PDXFER`` too;
- AROUND ``get_kv_class``: pdxfer's classes for that backend, SGLang's for the others;
- AFTER ``MHATokenToKVPool._create_buffers_normal`` and ``MLATokenToKVPool._create_buffers``:
  on a PD server with this backend, the new KV tensors are made reachable by the daemon
  before SGLang takes their pointers (``places``): on CPU they move into shared memory,
  on GPU they are exported by CUDA IPC.
"""

from __future__ import annotations

import enum

BACKEND = "pdxfer"
_UTILS = "sglang.srt.disaggregation.utils"
_POOLS = "sglang.srt.mem_cache.memory_pool"


def register() -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(f"{_UTILS}.TransferBackend", with_pdxfer(TransferBackend), HookType.REPLACE)
    HookRegistry.register(f"{_UTILS}.get_kv_class", kv_class, HookType.AROUND)
    HookRegistry.register(f"{_POOLS}.MHATokenToKVPool._create_buffers_normal", share_mha_kv, HookType.AFTER)
    HookRegistry.register(f"{_POOLS}.MLATokenToKVPool._create_buffers", share_mla_kv, HookType.AFTER)


def with_pdxfer(backends: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's backend enum with PDXFER added (an enum cannot be extended in place)."""
    members = {member.name: member.value for member in backends}
    if "PDXFER" not in members:
        members["PDXFER"] = BACKEND
    return enum.Enum(backends.__name__, members, module=backends.__module__, qualname=backends.__qualname__)


def kv_class(original, transfer_backend, class_type):
    """get_kv_class for pdxfer: KVArgs stays SGLang's own (every backend shares it)."""
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND and class_type.value != "kvargs":
        from . import conn

        return conn.CLASSES[class_type.value]
    return original(transfer_backend, class_type)


def share_mha_kv(result, pool) -> None:
    """An MHA pool's K and V tensors, every layer's, as SGLang just allocated them."""
    _share(pool, [*pool.k_buffer, *pool.v_buffer])


def share_mla_kv(result, pool) -> None:
    """An MLA pool's latent tensors, one per layer, as SGLang just allocated them."""
    _share(pool, pool.kv_buffer)


def _share(pool, tensors) -> None:
    """The KV pool of a PD server on this backend becomes reachable by the daemon as soon
    as its tensors exist, before SGLang takes their pointers (for the KV transfer and its
    own kernels alike)."""
    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    if disagg.disaggregation_mode == "null" or disagg.disaggregation_transfer_backend != BACKEND:
        return
    from .places import share

    share(tensors, memory_saver=pool.memory_saver_adapter.enabled, custom_pool=pool.custom_mem_pool is not None)
