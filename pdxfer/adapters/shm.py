"""An engine's CPU tensors moved into shared memory in place, and found there again by
address: on CPU an engine's KV cache is plain process memory, which a daemon cannot map.

``rehome`` gives each distinct storage among the tensors a shared-memory file (named as
pdxfer's own pools are, so pdxfer's orphan sweep removes those of an engine that died),
copies it there and points the very tensor objects the engine holds at the file
(``Tensor.set_``), so nothing the engine holds goes stale (docs/engines.md §E3). Pointers
taken from the tensors afterwards lie in the files; ``locate`` turns such a pointer back
into a file name and offset by reading this process's memory map.
"""

from __future__ import annotations

import atexit
import os
from typing import NamedTuple

from ..host.memory import KV_POOL_PREFIX, SHM_DIR, new_file


class Place(NamedTuple):
    name: str  # the file's name under SHM_DIR
    offset: int  # of the address in the file
    size: int  # of the file


def rehome(tensors) -> list[str]:
    """Move the storages of ``tensors`` (CPU torch tensors) into shared-memory files,
    one per distinct storage, keeping every tensor's offset, shape and strides; returns
    the files' names. The files are removed when this process exits normally."""
    import torch

    names = []
    moved: dict[int, torch.UntypedStorage] = {}  # old storage address -> its file's storage
    for tensor in tensors:
        old = tensor.untyped_storage()
        new = moved.get(old.data_ptr())
        if new is None:
            name, fd = new_file(old.nbytes(), KV_POOL_PREFIX)
            os.close(fd)
            atexit.register(_unlink, name)
            new = torch.UntypedStorage.from_file(os.path.join(SHM_DIR, name), shared=True, nbytes=old.nbytes())
            new.copy_(old)
            moved[old.data_ptr()] = new
            names.append(name)
        tensor.set_(new, tensor.storage_offset(), tensor.size(), tensor.stride())
    return names


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def locate(address: int, maps: str = "/proc/self/maps") -> Place | None:
    """The shared-memory file mapped at ``address`` in this process, or None when that
    address is not in one."""
    with open(maps) as fh:
        for line in fh:
            fields = line.split(None, 5)
            if len(fields) < 6 or not fields[5].startswith(SHM_DIR + "/"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                path = fields[5].rstrip("\n")
                if path.endswith(" (deleted)"):
                    return None  # unlinked: no other process can open it by name
                return Place(os.path.basename(path), address - start + int(fields[2], 16), os.path.getsize(path))
    return None
