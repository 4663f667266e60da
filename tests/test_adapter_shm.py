"""pdxfer.adapters.shm: an engine's CPU tensors moved into shared memory in place, and
found there again from a raw pointer, as the SGLang adapter does with SGLang's KV pool
(docs/engines.md §E3, B7)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdxfer.adapters.shm import locate, rehome
from pdxfer.host.memory import KV_POOL_PREFIX, SHM_DIR, find_orphans

torch = pytest.importorskip("torch")


@pytest.fixture
def files():
    made: list[str] = []
    yield made
    for name in made:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def test_views_of_one_storage_stay_views_of_one_file(files):
    """SGLang allocates a layer's K and V as the halves of one tensor: they move into
    one file, each at its own offset, and keep their values, shapes and strides."""
    rows, heads, dim = 40, 2, 8
    fused = torch.arange(2 * rows * heads * dim, dtype=torch.float32).view(2, rows, heads, dim)
    k, v = fused[0, :36], fused[1, :36]
    other = torch.full((5, 3), 7.0)
    before = [t.clone() for t in (k, v, other)]
    files += rehome([k, v, other])

    assert len(files) == 2 and all(name.startswith(f"{KV_POOL_PREFIX}-{os.getpid()}-") for name in files)
    for tensor, old in zip((k, v, other), before):
        assert torch.equal(tensor, old)
    assert (k.shape, k.stride(), v.storage_offset()) == ((36, heads, dim), (heads * dim, dim, 1), rows * heads * dim)
    kp, vp, op = (locate(t.data_ptr()) for t in (k, v, other))
    assert kp.name == vp.name != op.name
    assert (kp.offset, vp.offset, kp.size) == (0, rows * heads * dim * 4, 2 * rows * heads * dim * 4)
    assert (op.offset, op.size) == (0, 5 * 3 * 4)


def test_another_mapping_of_the_file_sees_the_engines_writes(files):
    """What a daemon maps by name is the memory the engine's tensor writes."""
    tensor = torch.zeros(64, dtype=torch.float32)
    files += rehome([tensor])
    place = locate(tensor[16:].data_ptr())
    other = np.memmap(os.path.join(SHM_DIR, place.name), dtype=np.float32, mode="r+", shape=(64,))
    tensor[16:20] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert place.offset == 64 and list(other[16:20]) == [1.0, 2.0, 3.0, 4.0]
    other[0] = 9.0
    assert tensor[0].item() == 9.0


def test_an_engine_that_died_leaves_files_the_sweep_finds(files):
    """The files carry the pid of their engine, as pdxfer's own pools do."""
    files += rehome([torch.zeros(8)])
    dead = files[0].replace(f"-{os.getpid()}-", "-999999999-")
    os.rename(os.path.join(SHM_DIR, files[0]), os.path.join(SHM_DIR, dead))
    files[0] = dead
    assert dead in find_orphans((KV_POOL_PREFIX,))


def test_plain_memory_is_not_in_a_file():
    assert locate(torch.zeros(1024).data_ptr()) is None
    assert locate(0) is None
