"""CUDA IPC export of an engine's own tensors (docs/engines.md §A2), for register_kv, and of
events the daemon waits on before it reads them (A11).

torch's caching allocator carves tensors out of cudaMalloc blocks. Legacy CUDA IPC
exports a whole block, so a tensor travels as (the block's handle, the tensor's offset
inside it, its length), read from the storage's CUDA sharing info. Tensors that share a
block share one handle: vLLM's per-layer views of one storage, and SGLang's per-layer
tensors when the allocator packed several into one block.

torch counts each export as a consumer that never lets go (the daemon does not speak
its reference counting): a block freed after export is not reused while the process
lives (tests/gpu checks it), and at exit torch warns "Producer process has been
terminated before all shared CUDA tensors released". KV caches live as long as the
engine; memory the daemon may still write is better kept than handed to another tensor.

Duck-typed over torch tensors: pdxfer never imports torch for this, so CPU hosts and
the daemon import the package without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.errors import Unsupported
from ..core.protocol import CudaIpcHandle

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# torch's shared handle: a version byte, a type byte, then the type's payload (older
# torch gave the bare 64 bytes). The 'c' payload is the same in versions 2 and 3.
CUDA_MALLOC, EXPANDABLE_SEGMENT = ord("c"), ord("e")
EXPANDABLE_FIX = (
    "start the engine without expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or unset): "
    "legacy CUDA IPC exports only cudaMalloc blocks, and pdxfer cannot yet take expandable segments (cuda_vmm)"
)


@dataclass(frozen=True)
class Placement:
    """Where one exported tensor lies: ``buffer`` indexes the handles export_tensors
    returns; ``offset`` is from the block's start to the tensor's first byte."""

    buffer: int
    offset: int
    length: int


def ipc_handle(shared: bytes) -> bytes:
    """The cudaIpcMemHandle_t bytes in the handle torch's storage sharing gives."""
    if len(shared) == HANDLE_BYTES:
        return shared
    kind = shared[1] if len(shared) > 1 else None
    if kind == EXPANDABLE_SEGMENT:
        raise Unsupported(f"the tensor lives in an expandable segment: {EXPANDABLE_FIX}")
    if kind == CUDA_MALLOC and len(shared) == 2 + HANDLE_BYTES:
        return shared[2:]
    raise Unsupported(f"torch shared the storage in a form pdxfer does not know ({len(shared)} bytes, type byte {kind!r})")


def dense_elements(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """How many elements a tensor spans when it fills them without gaps or overlaps, in
    any order of its dimensions (a permuted view is still one span); else refused."""
    if 0 in sizes:
        raise Unsupported("an empty tensor has no memory to register")
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1):
        if stride != expected:
            raise Unsupported(f"a tensor of sizes {tuple(sizes)} and strides {tuple(strides)} has gaps or overlaps; register the tensor it views")
        expected *= size
    return expected


def export_tensors(tensors: Sequence) -> tuple[list[CudaIpcHandle], list[Placement]]:
    """One CudaIpcHandle per cudaMalloc block behind ``tensors`` (torch CUDA tensors)
    and one Placement per tensor, in order. A handle's size reaches the end of the
    furthest storage exported from its block: what the daemon may touch."""
    handles: list[CudaIpcHandle] = []
    blocks: dict[tuple[int, int], int] = {}  # (device, block start in this process) -> handle index
    shared: dict[tuple[int, int], tuple[bytes, int]] = {}  # one share per storage: views share theirs
    placements = []
    for i, tensor in enumerate(tensors):
        if not tensor.is_cuda:
            raise Unsupported(f"tensor {i} is on {tensor.device}, not a CUDA device; host memory travels as shared memory")
        elements = dense_elements(tuple(tensor.shape), tuple(tensor.stride()))
        storage, device = tensor.untyped_storage(), tensor.device.index
        key = (device, storage.data_ptr())
        if key not in shared:
            shared[key] = _share(storage, i)
        raw, storage_at = shared[key]
        index = blocks.setdefault((device, key[1] - storage_at), len(handles))
        end = storage_at + storage.nbytes()
        if index == len(handles):
            handles.append(CudaIpcHandle(handle=raw, size=end, device=device))
        elif end > handles[index].size:
            handles[index] = CudaIpcHandle(handle=raw, size=end, device=device)
        placements.append(Placement(index, storage_at + tensor.storage_offset() * tensor.element_size(), elements * tensor.element_size()))
    return handles, placements


def _share(storage, i: int) -> tuple[bytes, int]:
    """(the block's IPC handle, the storage's offset inside the block)."""
    try:
        info = storage._share_cuda_()
    except RuntimeError as exc:
        raise Unsupported(f"torch cannot share tensor {i}'s storage by CUDA IPC ({exc}); if the engine uses expandable segments, {EXPANDABLE_FIX}") from None
    # (device, handle, storage bytes, offset in the block, ref counter, its offset, event, event needed)
    return ipc_handle(info[1]), info[3]


def event_after(wait_event, stream) -> tuple[object, bytes]:
    """An interprocess CUDA event that completes once ``wait_event`` (a torch CUDA event,
    which torch cannot export itself) has, and its IPC handle for send()'s
    ``cuda_event``. ``stream`` is made to wait for ``wait_event`` and records the new
    event; the host does not wait. Keep the event alive while the daemon may wait on
    its handle: a destroyed event leaves the handle undefined."""
    import torch

    stream.wait_event(wait_event)
    event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    return event, bytes(event.ipc_handle())
