"""What the local engine registered: its KV cache and its aux buffer, mapped into the
daemon, with the region arithmetic and slot allocator that go with them."""

from __future__ import annotations

import logging
import zlib
from dataclasses import InitVar, dataclass, field

import numpy as np

from ..core.errors import Unsupported
from ..core import errors
from ..core.plan import canonical, compat_of, leg_region_pairs, region_addresses
from ..core.protocol import Compat, KVRegion, KVSpec, MemoryHandle, PageOrder, Rank
from ..core.staging import StagedLayout, StagingArena, slice_span, worth_staging
from ..core.topology import rank_code
from ..core.slots import SlotAllocator
from ..core.stamp import HEADER_BYTES, Stamp, pack_header, unpack_header

log = logging.getLogger("pdxfer.staging")

RESERVE_UNIT = 2 << 20  # bytes of the staging buffer backed at once (Staging._back)


@dataclass(eq=False)
class MappedKV:
    """The engine's KV cache as this daemon mapped it: its buffers (``mappings``, one
    per distinct handle, each a memory.SharedMemory / CudaIpcMemory / NpuIpcMemory)
    and its regions in canonical order (plan.canonical), the order blocks, digests and
    inline KV follow on both sides."""

    mappings: dict  # handle -> mapping
    handles: tuple[MemoryHandle, ...]  # as registered: regions name buffers by index into it
    spec: KVSpec
    regions: tuple[KVRegion, ...]
    version: int
    kind: str  # the handles' kind: shm, cuda_ipc, npu_ipc

    def __post_init__(self) -> None:
        self.regions = canonical(self.regions)
        self.buffers = [self.mappings[h] for h in self.handles]  # the mapping of each buffer index
        self.bases = region_addresses([mapping.address for mapping in self.buffers], self.regions)
        self.page_bytes = sum(r.page_bytes for r in self.regions)  # one page index over every region
        self.num_pages = self.regions[0].num_pages

    def _require_host(self, what: str) -> None:
        if self.kind != "shm":
            raise Unsupported(f"{what} needs a host-memory pool (this one is {self.kind})")

    def _region_pages(self, what: str) -> list[np.ndarray]:
        """Each region as a (pages, page_bytes) array, in canonical order."""
        self._require_host(what)
        return [
            self.buffers[r.buffer].array[r.offset : r.offset + r.num_pages * r.page_bytes].reshape(r.num_pages, r.page_bytes)
            for r in self.regions
        ]

    def digest(self, pages: np.ndarray) -> int:
        """CRC-32 of the given pages, region by region in canonical order: of the
        bytes gather() returns for them."""
        crc = 0
        for region in self._region_pages("a KV digest (--verify-kv)"):
            crc = zlib.crc32(np.take(region, pages, axis=0), crc)
        return crc

    def _page_spans(self, pages: np.ndarray) -> list[tuple[memoryview, int, int]]:
        """(buffer, offset in it, bytes) of each page in each region, region by region in
        canonical order. Inline KV is at most 1 MiB, so the list stays short; slicing the
        mapping by it costs a room a third of what fancy indexing did (4 KiB pages)."""
        self._require_host("inline KV")
        indices = pages.tolist()
        views = [memoryview(mapping.array) for mapping in self.buffers]
        return [(views[r.buffer], r.offset + p * r.page_bytes, r.page_bytes) for r in self.regions for p in indices]

    def worth_staging(self, head_count: int, whole_heads: int, below: int) -> bool:
        """Whether ``head_count`` of this rank's heads, every head of the other side's rank
        (``whole_heads``), are worth staging here (core/staging.worth_staging), given the
        shortest span such a slice has in any of its regions."""
        spec = self.spec
        span = min(slice_span(r.page_bytes, spec.heads.local, head_count, spec.page_size, spec.page_order is PageOrder.HEAD_MAJOR)
                   for r in self.regions)
        return worth_staging(head_count, whole_heads, spec.heads.local, self.kind == "shm", span, below)

    def copy_heads(self, staged: np.ndarray, layout: StagedLayout, layers: tuple[int, int], head_start: int,
                   head_count: int, pages: np.ndarray, into_pages: bool) -> None:
        """Between a staged leg or chunk (core/staging.py, position i for pages[i]) and
        heads [head_start, +head_count) of ``pages`` in the regions of ``layers``: into
        the pages (decode), or out of them into ``staged`` (prefill)."""
        heads, tokens = self.spec.heads.local, self.spec.page_size
        token_major = self.spec.page_order is PageOrder.TOKEN_MAJOR
        views = self._region_pages("staging")
        pairs = leg_region_pairs(self.regions, self.regions, layers)
        for (j, _), at, size in zip(pairs, layout.offsets, layout.slice_bytes):
            part = staged[at : at + pages.size * size]
            if token_major:  # [token][head][unit]
                view = views[j].reshape(self.num_pages, tokens, heads, -1)
                shape, index = (pages.size, tokens, head_count, -1), (pages, slice(None), slice(head_start, head_start + head_count))
            else:  # [head][token x unit]
                view = views[j].reshape(self.num_pages, heads, -1)
                shape, index = (pages.size, head_count, -1), (pages, slice(head_start, head_start + head_count))
            if into_pages:
                view[index] = part.reshape(shape)
            else:
                part.reshape(shape)[...] = view[index]

    def gather(self, pages: np.ndarray) -> bytes:
        """The given pages' bytes, region by region in canonical order (a room's inline KV)."""
        return b"".join([buffer[at : at + size] for buffer, at, size in self._page_spans(pages)])

    def scatter(self, pages: np.ndarray, data: bytes) -> None:
        """Write what gather() made into the given pages."""
        source, taken = memoryview(data), 0
        for buffer, at, size in self._page_spans(pages):
            buffer[at : at + size] = source[taken : taken + size]
            taken += size


@dataclass(eq=False)
class Staging:
    """A daemon's staging buffer (core/staging.py): shared memory registered with its
    transfer engines, and the extents taken in it."""

    memory: object  # memory.SharedMemory
    backed: InitVar[bool] = False  # every page backed already (--staging-at-start); _backed holds it from then on

    def __post_init__(self, backed: bool) -> None:
        self.arena = StagingArena(self.memory.size)
        self.full = 0  # legs or chunks that would have gained from an extent but found none free
        self.largest_refused = 0  # bytes of the largest one that could never fit, 0 if none
        self.unbacked = 0  # of those, the ones whose extent shared memory could not back
        # The buffer is created without pages (an idle daemon's takes no memory); each
        # RESERVE_UNIT is backed the first time an extent reaches into it, and stays so
        # (all of them at start with --staging-at-start).
        self._backed = np.full(-(-self.memory.size // RESERVE_UNIT), backed)

    def take(self, nbytes: int) -> int | None:
        """The offset of a free extent of ``nbytes``, backed by pages, or None (counted):
        the caller then writes between the pages. One larger than the whole buffer is
        logged, with the size that would hold it, each time one larger than any before
        comes; one that shared memory cannot back, at the 1st, 2nd, 4th, 8th... time."""
        offset = self.arena.take(nbytes)
        if offset is not None:
            why_not = self._back(offset, nbytes)
            if why_not:
                self.arena.give(offset)
                self.unbacked += 1
                if self.unbacked & (self.unbacked - 1) == 0:
                    log.warning("%s, so a leg or chunk of %.1f MiB writes between the pages, far slower for short slices (%d so far); "
                                "free some or make it larger", why_not, nbytes / 2**20, self.unbacked)
                offset = None
        if offset is None:
            self.full += 1
            if nbytes > self.arena.size and nbytes > self.largest_refused:
                self.largest_refused = nbytes
                log.warning("a leg of %.1f MiB cannot be staged in the %d MiB staging buffer, so it writes between the pages "
                            "(a block per page or per token, far slower for the short slices that are staged); start the daemon with "
                            "--staging-mib %d or more to stage legs this large", nbytes / 2**20, self.arena.size >> 20,
                            -(-nbytes // 2**20) * 2)
        return offset

    def _back(self, offset: int, nbytes: int) -> str:
        """Why [offset, +nbytes) cannot have pages, or "" once it has them, backing the
        units it reaches that had none (memory.SharedMemory.reserve): writing an
        unbacked page once /dev/shm is full kills the writer (SIGBUS), the daemon
        itself when a prefill gathers."""
        first, end = offset // RESERVE_UNIT, -(-(offset + nbytes) // RESERVE_UNIT)
        missing = np.flatnonzero(~self._backed[first:end])
        if missing.size == 0:
            return ""
        start, stop = first + int(missing[0]), first + int(missing[-1]) + 1
        try:
            self.memory.reserve(start * RESERVE_UNIT, min(stop * RESERVE_UNIT, self.memory.size) - start * RESERVE_UNIT)
        except errors.InsufficientCapacity as exc:
            return exc.message
        self._backed[start:stop] = True
        return ""

    @property
    def base(self) -> int:
        return self.memory.address

    def extent(self, offset: int, nbytes: int) -> np.ndarray:
        return self.memory.array[offset : offset + nbytes]


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


@dataclass(eq=False)
class Lane:
    """One rank of one engine on this daemon (A1): its KV cache, its aux buffer and its
    slots. A daemon keeps a lane per (engine, rank) for its life; an engine that
    connects again under the same name and rank (a restart) finds its lane and
    registers anew. Rooms of a rank are keyed by topology.room_key(room, code)."""

    index: int  # named by peers (protocol.LaneInfo, LegRequest.lane)
    engine_id: str
    rank: Rank
    sizes: Rank
    kv: MappedKV | None = None
    aux: MappedAux | None = None
    _compat: tuple = field(default=(None, None, None), repr=False)  # (kv, aux, their Compat): checked for every leg

    def __post_init__(self) -> None:
        self.code = rank_code(self.rank.pp, self.rank.tp)

    @property
    def name(self) -> str:
        who = self.engine_id or "engine"
        return f"{who} rank pp={self.rank.pp} tp={self.rank.tp}" if self.code else who

    @property
    def ready(self) -> bool:
        return self.kv is not None and self.aux is not None

    def registered_kv(self) -> MappedKV:
        if self.kv is None:
            raise errors.NotRegistered(f"{self.name} has not registered its KV pool")
        return self.kv

    def registered_aux(self) -> MappedAux:
        if self.aux is None:
            raise errors.NotRegistered(f"{self.name} has not registered its aux buffer")
        return self.aux

    def compat(self) -> Compat:
        """What a peer's rank must agree with to move KV to or from this one, made once
        per registration (a new registration replaces kv or aux)."""
        kv, aux = self.registered_kv(), self.registered_aux()
        if self._compat[0] is not kv or self._compat[1] is not aux:
            self._compat = (kv, aux, compat_of(kv.spec, kv.regions, aux.slot_bytes))
        return self._compat[2]
