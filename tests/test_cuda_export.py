"""CUDA IPC export of engine tensors (A2, adapters/cuda.py): the arithmetic, on torch's
sharing info as the caching allocator gives it, checked without a GPU. Fake storages
stand in for torch's here; tests/gpu/test_cuda_ipc.py exports real tensors between two
processes on a GPU host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdxfer.adapters.cuda import HANDLE_BYTES, Placement, dense_elements, export_tensors, ipc_handle
from pdxfer.core.errors import BadMessage, Unsupported
from pdxfer.core.protocol import CudaIpcHandle
from pdxfer.host.memory import CudaIpcMemory

RAW = bytes(range(HANDLE_BYTES))


@pytest.mark.parametrize("version", [2, 3])
def test_the_handle_comes_out_of_torchs_versioned_bytes(version):
    assert ipc_handle(bytes([version]) + b"c" + RAW) == RAW


def test_older_torchs_bare_handle_is_taken_as_it_is():
    assert ipc_handle(RAW) == RAW


def test_an_expandable_segment_is_refused_naming_the_fix():
    with pytest.raises(Unsupported, match="expandable_segments:False"):
        ipc_handle(b"\x02e" + b"\x00" * 40)


@pytest.mark.parametrize("shared", [b"\x02c" + RAW[:10], b"\x02x" + RAW, b"", b"\x02"])
def test_an_unknown_handle_form_is_refused(shared):
    with pytest.raises(Unsupported, match="does not know"):
        ipc_handle(shared)


@pytest.mark.parametrize(
    ("sizes", "strides", "elements"),
    [
        ((4, 8, 16), (128, 16, 1), 512),  # contiguous (SGLang's [tokens, heads, head_dim])
        ((4, 16, 8), (128, 1, 16), 512),  # a permuted view of the same span
        ((4, 1, 8), (8, 99, 1), 32),  # a dimension of size 1 may have any stride
        ((7,), (1,), 7),
    ],
)
def test_a_dense_tensor_spans_its_elements(sizes, strides, elements):
    assert dense_elements(sizes, strides) == elements


@pytest.mark.parametrize(
    ("sizes", "strides", "why"),
    [
        ((4, 8), (16, 1), "gaps"),  # every other row: a slice of the head dimension
        ((4, 8), (0, 1), "gaps"),  # broadcast: rows overlap
        ((4, 8), (8, 2), "gaps"),
        ((0, 8), (8, 1), "empty"),
    ],
)
def test_a_tensor_that_is_not_one_span_is_refused(sizes, strides, why):
    with pytest.raises(Unsupported, match=why):
        dense_elements(sizes, strides)


class FakeStorage:
    """What export_tensors reads of a torch UntypedStorage: its address, size and
    CUDA sharing info (device, handle, bytes, offset in its block, ...)."""

    def __init__(self, block: bytes, block_start: int, at: int, nbytes: int, error: Exception | None = None) -> None:
        self.block, self.block_start, self.at, self.size, self.error = block, block_start, at, nbytes, error
        self.shares = 0

    def data_ptr(self) -> int:
        return self.block_start + self.at

    def nbytes(self) -> int:
        return self.size

    def _share_cuda_(self):
        self.shares += 1
        if self.error:
            raise self.error
        return (0, b"\x03c" + self.block, self.size, self.at, b"ref", 0, b"event", True)


def tensor(storage: FakeStorage, shape: tuple, offset: int = 0, itemsize: int = 2, cuda: bool = True, device: int = 0, stride=None):
    if stride is None:
        stride, step = [], 1
        for size in reversed(shape):
            stride.insert(0, step)
            step *= size
    return SimpleNamespace(
        is_cuda=cuda, device=SimpleNamespace(index=device, type="cuda" if cuda else "cpu"), shape=shape, stride=lambda: tuple(stride),
        untyped_storage=lambda: storage, storage_offset=lambda: offset, element_size=lambda: itemsize,
        data_ptr=lambda: storage.data_ptr() + offset * itemsize,
    )


def test_views_of_one_storage_share_one_handle_at_per_layer_offsets():
    """vLLM: every layer is a view of one storage, which starts 4096 bytes into its block."""
    layer = 2 * 4 * 16 * 2 * 8  # [blocks, heads, block_size, 2*head_dim] elements
    storage = FakeStorage(RAW, block_start=1 << 30, at=4096, nbytes=3 * layer * 2)
    handles, places = export_tensors([tensor(storage, (2, 4, 16, 16), offset=i * layer) for i in range(3)])
    assert handles == [CudaIpcHandle(handle=RAW, size=4096 + 3 * layer * 2, device=0)]
    assert places == [Placement(0, 4096 + i * layer * 2, layer * 2) for i in range(3)]
    assert storage.shares == 1


def test_storages_in_one_block_share_its_handle_and_the_furthest_end_sizes_it():
    """SGLang: per-layer K and V tensors that the allocator carved from one block, and
    one from a block of its own."""
    a = FakeStorage(RAW, block_start=1 << 30, at=512, nbytes=1024)
    b = FakeStorage(RAW, block_start=1 << 30, at=8192, nbytes=2048)
    c = FakeStorage(RAW[::-1], block_start=2 << 30, at=0, nbytes=4096)
    handles, places = export_tensors([tensor(a, (512,)), tensor(c, (2048,)), tensor(b, (1024,))])
    assert handles == [CudaIpcHandle(handle=RAW, size=8192 + 2048, device=0), CudaIpcHandle(handle=RAW[::-1], size=4096, device=0)]
    assert places == [Placement(0, 512, 1024), Placement(1, 0, 4096), Placement(0, 8192, 2048)]


def test_blocks_at_the_same_address_on_two_devices_are_two_handles():
    a, b = FakeStorage(RAW, 1 << 30, 0, 64), FakeStorage(RAW[::-1], 1 << 30, 0, 64)
    handles, places = export_tensors([tensor(a, (32,), device=0), tensor(b, (32,), device=1)])
    assert [h.device for h in handles] == [0, 1]
    assert [p.buffer for p in places] == [0, 1]


def test_a_permuted_view_is_placed_at_its_first_byte():
    storage = FakeStorage(RAW, 1 << 30, at=256, nbytes=4 * 16 * 8 * 4)
    handles, places = export_tensors([tensor(storage, (4, 16, 8), offset=0, itemsize=4, stride=(128, 1, 16))])
    assert places == [Placement(0, 256, 4 * 16 * 8 * 4)]


def test_a_host_tensor_is_refused():
    with pytest.raises(Unsupported, match="not a CUDA device"):
        export_tensors([tensor(FakeStorage(RAW, 0, 0, 8), (4,), cuda=False)])


def test_a_storage_torch_cannot_share_is_refused_naming_the_fix():
    storage = FakeStorage(RAW, 0, 0, 8, error=RuntimeError("cuMemExportToShareableHandle failed"))
    with pytest.raises(Unsupported, match="cuMemExportToShareableHandle failed.*expandable_segments:False"):
        export_tensors([tensor(storage, (4,))])


def test_the_daemon_refuses_torchs_sharing_bytes_passed_unparsed():
    """The version and type bytes left on would open some other 64 bytes as a handle."""
    with pytest.raises(BadMessage, match="64 bytes of a cudaIpcMemHandle_t, not 66"):
        CudaIpcMemory(CudaIpcHandle(handle=b"\x03c" + RAW, size=4096, device=0))
