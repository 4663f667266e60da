"""pdxfer: ship KV cache and aux metadata from prefill to decode workers.

An engine needs only what this package exports: ``Client`` (or ``AsyncClient``) with
its ``Rank`` and ``Role``, the ``Slot`` it allocates, what it registers (its buffers:
``ShmHandle``, ``CudaIpcHandle``; what their pages mean: ``KVSpec``, ``KVRegion``,
``RegionKind``, ``Heads``, ``PageOrder``, ``KVPacking``; or a pool pdxfer makes:
``KVLayout``, ``Layout``), ``RoomState``, and ``errors`` (``PdxferError`` and its
kinds, each with the side at fault). The rest lives in
subpackages by layer: ``core`` (pure), ``roles``, ``daemon``, ``transport``, ``wire``,
``host``, ``ops`` (operator commands), ``tools`` (demo, simulators, benchmark).

A name is imported on first use, so that ``python -m pdxfer.<module>`` and
``import pdxfer.core`` do not load the client (ZMQ) with this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
_PROTOCOL = (
    "CudaIpcHandle", "Heads", "KVLayout", "KVPacking", "KVRegion", "KVSpec", "Layout", "PageOrder", "Rank", "RegionKind",
    "Role", "RoomState", "ShmHandle",
)
__all__ = [
    "AsyncClient", "Client", "CudaIpcHandle", "Heads", "KVLayout", "KVPacking", "KVRegion", "KVSpec", "Layout", "PageOrder",
    "PdxferError", "Rank", "RegionKind", "Role", "RoomState", "ShmHandle", "Slot", "errors",
]

if TYPE_CHECKING:
    from .client import AsyncClient, Client, Slot
    from .core import errors
    from .core.errors import PdxferError
    from .core.protocol import (
        CudaIpcHandle,
        Heads,
        KVLayout,
        KVPacking,
        KVRegion,
        KVSpec,
        Layout,
        PageOrder,
        Rank,
        RegionKind,
        Role,
        RoomState,
        ShmHandle,
    )


def __getattr__(name: str):
    if name in ("AsyncClient", "Client", "Slot"):
        from . import client as module
    elif name in _PROTOCOL:
        from .core import protocol as module
    elif name == "PdxferError":
        from .core import errors as module
    elif name == "errors":
        from .core import errors

        return errors
    else:
        raise AttributeError(f"module 'pdxfer' has no attribute {name!r}")
    return getattr(module, name)
