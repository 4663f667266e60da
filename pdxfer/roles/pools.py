"""What the local engine registered: its KV pool and its aux buffer, mapped into the
daemon, with the layout arithmetic and slot allocator that go with them."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..core.errors import Unsupported
from ..core.plan import Region, compat_of, layout_regions, pool_bytes, region_bases, region_views
from ..core.protocol import Compat, KVLayout, MemoryHandle
from ..core.slots import SlotAllocator
from ..core.stamp import HEADER_BYTES, Stamp, pack_header, unpack_header


@dataclass(eq=False)
class MappedKV:
    """The engine's KV pool (client.KVPool on the engine's side) as this daemon mapped it."""

    memory: object  # memory.SharedMemory / CudaIpcMemory / NpuIpcMemory
    layout: KVLayout
    version: int
    kind: str
    handle: MemoryHandle

    def __post_init__(self) -> None:
        self.regions: tuple[Region, ...] = layout_regions(self.layout)
        self.bases = region_bases(self.memory.address, self.regions)
        self.page_bytes = sum(r.page_bytes for r in self.regions)  # one page index over every region

    @property
    def address(self) -> int:
        return self.memory.address

    def _require_host(self, what: str) -> None:
        if self.kind != "shm":
            raise Unsupported(f"{what} needs a host-memory pool (this one is {self.kind})")

    def _region_pages(self, what: str) -> list[np.ndarray]:
        """Each region as a (pages, page_bytes) array, in layout order."""
        self._require_host(what)
        return region_views(self.memory.array, self.regions, self.layout.num_pages)

    def digest(self, pages: np.ndarray) -> int:
        """CRC-32 of the given pages, region by region in layout order: of the
        bytes gather() returns for them."""
        crc = 0
        for region in self._region_pages("a KV digest (--verify-kv)"):
            crc = zlib.crc32(np.take(region, pages, axis=0), crc)
        return crc

    def _page_spans(self, pages: np.ndarray) -> list[tuple[int, int]]:
        """(offset in the pool, bytes) of each page in each region, region by region in
        layout order. Inline KV is at most 1 MiB, so the list stays short; slicing the
        mapping by it costs a room a third of what fancy indexing did (4 KiB pages)."""
        self._require_host("inline KV")
        indices = pages.tolist()
        return [(r.offset + p * r.page_bytes, r.page_bytes) for r in self.regions for p in indices]

    def gather(self, pages: np.ndarray) -> bytes:
        """The given pages' bytes, region by region in layout order (a room's inline KV)."""
        pool = memoryview(self.memory.array)
        return b"".join([pool[at : at + size] for at, size in self._page_spans(pages)])

    def scatter(self, pages: np.ndarray, data: bytes) -> None:
        """Write what gather() made into the given pages."""
        pool, source, taken = memoryview(self.memory.array), memoryview(data), 0
        for at, size in self._page_spans(pages):
            pool[at : at + size] = source[taken : taken + size]
            taken += size

    @staticmethod
    def required_bytes(layout: KVLayout) -> int:
        return pool_bytes(layout)


@dataclass(eq=False)
class MappedAux:
    """The engine's aux buffer (client.AuxBuffer on its side) as this daemon mapped it:
    num_slots slots of slot_bytes, each a stamp header, then the payload."""

    memory: object  # memory.SharedMemory: aux always lives in host memory
    num_slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        self.slots = SlotAllocator(self.num_slots)

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    def slot_address(self, index: int) -> int:
        return self.memory.address + index * self.slot_bytes

    def _at(self, index: int) -> int:
        return index * self.slot_bytes

    def payload(self, index: int, length: int) -> bytes:
        start = self._at(index) + HEADER_BYTES
        return self.memory.array[start : start + length].tobytes()

    def header(self, index: int) -> Stamp | None:
        start = self._at(index)
        return unpack_header(self.memory.array[start : start + HEADER_BYTES])

    def write_header(self, index: int, stamp: Stamp) -> None:
        start = self._at(index)
        self.memory.array[start : start + HEADER_BYTES] = np.frombuffer(pack_header(stamp), np.uint8)

    def write(self, index: int, stamp: Stamp, payload: bytes) -> None:
        self.write_header(index, stamp)
        start = self._at(index) + HEADER_BYTES
        self.memory.array[start : start + len(payload)] = np.frombuffer(payload, np.uint8)

    def clear_header(self, index: int) -> None:
        start = self._at(index)
        self.memory.array[start : start + HEADER_BYTES] = 0


def compat(kv: MappedKV, aux: MappedAux) -> Compat:
    return compat_of(kv.layout, aux.slot_bytes)
