"""An engine's pool and aux buffer arguments, checked before any shared memory is
made: zero pages or zero slots is a typed error naming the argument (it was
``ValueError: cannot mmap an empty file``)."""

from __future__ import annotations

import os

import pytest

from pdxfer.client import AuxBuffer, KVPool
from pdxfer.core import errors
from pdxfer.host import memory

from .conftest import small_layout


def pools_made() -> set[str]:
    return {n for n in os.listdir(memory.SHM_DIR) if n.startswith((f"{memory.KV_POOL_PREFIX}-{os.getpid()}-", f"{memory.AUX_BUFFER_PREFIX}-{os.getpid()}-"))}


@pytest.mark.parametrize("field", ["num_pages", "num_layers", "page_size", "token_bytes"])
def test_a_kv_pool_with_a_zero_dimension_is_refused_by_name(field):
    before = pools_made()
    with pytest.raises(errors.BadMessage, match=rf"create_kv_pool: layout\.{field} is 0; a KV pool needs at least 1"):
        KVPool.create(small_layout(**{field: 0}))
    assert pools_made() == before  # refused before a name was made in /dev/shm


def test_an_aux_buffer_with_no_slots_or_a_negative_payload_is_refused_by_name():
    with pytest.raises(errors.BadMessage, match=r"create_aux_buffer: num_slots is 0; an aux buffer needs at least 1 slot"):
        AuxBuffer.create(0, 64)
    with pytest.raises(errors.BadMessage, match=r"create_aux_buffer: payload_bytes is -1; it cannot be negative"):
        AuxBuffer.create(4, -1)
    aux = AuxBuffer.create(4, 0)  # stamps only: allowed
    try:
        assert aux.payload_bytes == 0 and aux.num_slots == 4
    finally:
        aux.memory.close()
