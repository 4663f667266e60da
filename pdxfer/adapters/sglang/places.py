"""Where an SGLang server's KV tensors lie for the daemon, found again by pointer.

The plugin's pool hooks hand each new KV pool's tensors to ``share``: CPU ones move into
shared memory (``..shm``), CUDA ones are exported by CUDA IPC (``..cuda``: a handle per
cudaMalloc block and each tensor's offset in it). The KV manager, which SGLang gives only
pointers (``KVArgs.kv_data_ptrs``), turns each back into a buffer and an offset with
``locate``. The table is this process's: each SGLang rank is a process of its own.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ...core.errors import Unsupported
from ...core.protocol import CudaIpcHandle, MemoryHandle, ShmHandle
from .. import shm
from ..cuda import export_tensors


class Exported(NamedTuple):
    address: int  # of the tensor's first byte, in this process
    length: int
    handle: CudaIpcHandle  # of the block it lies in
    offset: int  # of the tensor's first byte in that block


_exported: list[Exported] = []


def share(tensors: Sequence, *, memory_saver: bool = False, custom_pool: bool = False) -> None:
    """Make one KV pool's ``tensors`` (torch tensors on one device) reachable by the
    daemon: CPU memory moves into shared memory in place, CUDA memory is exported.
    ``memory_saver``, ``custom_pool``: SGLang allocated the pool through
    torch_memory_saver or a custom CUDA memory pool, which CUDA IPC cannot export."""
    if not tensors:
        return
    kind = tensors[0].device.type
    if kind == "cpu":
        shm.rehome(tensors)
    elif kind == "cuda":
        if memory_saver:
            raise Unsupported("SGLang's --enable-memory-saver allocates the KV cache as CUDA virtual memory, which pdxfer cannot "
                              "export yet (legacy CUDA IPC only): start the server without it")
        if custom_pool:
            raise Unsupported("the KV cache is in a custom CUDA memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL), which pdxfer cannot "
                              "export by CUDA IPC: unset it")
        handles, placements = export_tensors(tensors)
        _exported.extend(Exported(t.data_ptr(), p.length, handles[p.buffer], p.offset) for t, p in zip(tensors, placements))
    # Other devices: their pointers are found nowhere, and the manager refuses them by name.


def locate(address: int) -> tuple[MemoryHandle, int] | None:
    """The buffer the daemon maps to reach ``address`` and the offset of the address in
    it, or None when the address is in no memory ``share`` made reachable."""
    for entry in _exported:
        if entry.address <= address < entry.address + entry.length:
            return entry.handle, entry.offset + address - entry.address
    place = shm.locate(address)
    return None if place is None else (ShmHandle(name=place.name, size=place.size), place.offset)
