"""The engine ranks a daemon serves (A1), each a *lane*: what it registered (its KV cache
and its aux buffer, mapped into the daemon, with the region arithmetic and slot
allocator that go with them), the engine connections that said hello, and the mappings
a new registration replaced, kept until no write aimed at them can land."""

from __future__ import annotations

import collections
import logging
import zlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from ..core import errors, paths
from ..core.config import Config
from ..core.errors import Unsupported
from ..core.plan import canonical, check_registration, compat_of, leg_region_pairs, region_addresses
from ..core.protocol import (ONE_RANK, Compat, EngineHello, KVRegion, KVSpec, MemoryHandle, PageOrder, Rank, RegisterAux, RegisterKV,
                             Role, ShmHandle, tag_of)
from ..core.slots import SlotAllocator
from ..core.staging import StagedLayout, slice_span, worth_staging
from ..core.stamp import HEADER_BYTES, Stamp, pack_header, unpack_header
from ..core.topology import rank_code
from .ports import Mapping, Port

log = logging.getLogger("pdxfer.lanes")


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


def rank_text(rank: Rank) -> str:
    return " ".join(f"{dim}={getattr(rank, dim)}" for dim in Rank.__struct_fields__)


class Replaced(NamedTuple):
    """What a registration replaced, for the rooms planned against it (C3): all of the
    lane's live rooms, or those at or below ``version`` (the same buffers registered again)."""

    reason: str
    version: int | None = None


class Lanes:
    """Every engine rank that said hello or registered, by index; the engine connection
    behind each; the replaced mappings, (release time, mapping), kept until writes
    aimed at them are over."""

    def __init__(self, config: Config, role: Role, port: Port) -> None:
        self.config = config
        self.role = role
        self.port = port
        self.items: list[Lane] = []
        self.of_engine: dict[bytes, Lane] = {}  # engine connection -> its lane
        self.engines: set[bytes] = set()  # engine connections that said hello
        self.retired: list[tuple[float, Mapping]] = []

    def __getitem__(self, index: int) -> Lane:
        return self.items[index]

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def hello(self, identity: bytes, hello: EngineHello) -> Lane:
        """A1: an engine rank of this daemon's role, without CP; its lane (made on first sight)."""
        who = f"engine {hello.engine_id!r}" if hello.engine_id else "the engine"
        if hello.role is not None and hello.role is not self.role:
            raise errors.Unsupported(f"{who} is a {hello.role.value} engine but this daemon is a {self.role.value} daemon: connect it to a {hello.role.value} daemon")
        if hello.sizes.cp > 1:
            raise errors.Unsupported(f"{who} runs context parallelism (CP size {hello.sizes.cp}), which pdxfer does not support yet: run it with CP 1")
        sizes = Rank(**{dim: getattr(hello.sizes, dim) or 1 for dim in Rank.__struct_fields__})  # a size left 0 is 1
        for dim in Rank.__struct_fields__:
            rank, size = getattr(hello.rank, dim), getattr(sizes, dim)
            if not rank < size:
                raise errors.BadMessage(f"{who}: rank {dim}={rank} is not below its size {dim}={size}")
        lane = self._lane(hello.engine_id, hello.rank)
        if lane.sizes != sizes and lane.ready:
            log.warning("%s now says sizes %s (was %s): it was redeployed", lane.name, rank_text(sizes), rank_text(lane.sizes))
        lane.sizes = sizes
        self.of_engine[identity] = lane
        self.engines.add(identity)
        return lane

    def _lane(self, engine_id: str, rank: Rank) -> Lane:
        for lane in self.items:
            if lane.engine_id == engine_id and (lane.rank.dp, lane.rank.pp, lane.rank.tp) == (rank.dp, rank.pp, rank.tp):
                return lane
        lane = Lane(len(self.items), engine_id, Rank(dp=rank.dp, pp=rank.pp, tp=rank.tp), ONE_RANK)
        self.items.append(lane)
        return lane

    def of(self, identity: bytes) -> Lane:
        """The lane of an engine connection: the one its hello named, else rank 0 of an
        unnamed engine (a client that never said hello)."""
        lane = self.of_engine.get(identity)
        return lane if lane is not None else self._lane("", Rank())

    def gone(self, identity: bytes) -> Lane | None:
        """The engine connection's process exited: its lane (and memory) stay for a successor."""
        self.engines.discard(identity)
        return self.of_engine.pop(identity, None)

    def slots_of(self, index: int) -> SlotAllocator | None:
        """A lane's slot allocator, or None before it registered an aux buffer."""
        aux = self.items[index].aux if index < len(self.items) else None
        return aux.slots if aux is not None else None

    def slot_counts(self) -> collections.Counter:
        """Slots by state, over every lane."""
        counts: collections.Counter = collections.Counter()
        for lane in self.items:
            if lane.aux is not None:
                counts.update(lane.aux.slots.counts())
        return counts

    def mappings(self) -> list[Mapping]:
        """Every engine buffer mapped now (KV and aux), each once."""
        out = []
        for lane in self.items:
            out += list(lane.kv.mappings.values()) if lane.kv is not None else []
            out += [lane.aux.memory] if lane.aux is not None else []
        return out

    def held_mappings(self) -> list[Mapping]:
        """Every engine buffer mapped now and every replaced one not let go yet (what the
        daemon unregisters from its transfer engines before it unmaps them)."""
        return self.mappings() + [mapping for _, mapping in self.retired]

    # --- registrations

    async def register_kv(self, lane: Lane, msg: RegisterKV, replaced: Callable[[Lane, Replaced], None]) -> None:
        """Map and register an engine rank's KV buffers; ``replaced`` hears of the
        registration this one replaced, once it is in place."""
        kinds = sorted({tag_of(handle) for handle in msg.buffers})
        if len(kinds) > 1:
            raise errors.Unsupported(f"the buffers of one KV registration must be of one kind, not {', '.join(kinds)}")
        paths.check_pool(self.config.protocol, self.config.device, kinds[0])
        check_registration([handle.size for handle in msg.buffers], msg.spec, msg.regions)
        old = lane.kv
        # A mapping is kept for a handle registered again only while it names the same memory.
        kept = {h: m for h, m in old.mappings.items() if self.port.same_memory(h, m)} if old is not None else {}
        same = old is not None and old.handles == msg.buffers and all(h in kept for h in msg.buffers)
        if same and msg.memory_version <= old.version:
            raise errors.StaleMemoryVersion(
                f"re-registering the same KV buffers needs a memory version above {old.version}, got {msg.memory_version} "
                f"(a new Client of a restarted rank registering its predecessor's memory: pass memory_version={old.version + 1} or above)"
            )
        mappings = await self._map_all(msg.buffers, kept)
        for handle, mapping in (old.mappings.items() if old is not None else ()):
            if mappings.get(handle) is not mapping:
                self._retire(mapping)  # never freed: a replaced buffer is unmapped once writes aimed at it are over
        lane.kv = MappedKV(mappings, msg.buffers, msg.spec, msg.regions, msg.memory_version, kinds[0])
        log.info("%s registered its KV cache: %d buffers, %d regions of %d pages (%d tokens each), layers %d-%d of %d, memory version %d",
                 lane.name, len(mappings), len(msg.regions), lane.kv.num_pages, msg.spec.page_size, *msg.spec.layers, msg.spec.num_layers_total, msg.memory_version)
        if same:
            replaced(lane, Replaced(f"the engine re-registered its KV cache (memory version {old.version} -> {msg.memory_version})", old.version))
        elif old is not None:
            replaced(lane, Replaced("the engine registered new KV memory (a restarted engine?)"))

    async def _map_all(self, handles, kept: dict) -> dict:
        """Each distinct handle mapped once: kept ones as they are, the others mapped and
        registered now. If one fails, those mapped here are let go again."""
        mappings: dict = {}
        try:
            for handle in dict.fromkeys(handles):
                mappings[handle] = kept[handle] if handle in kept else await self.port.map_memory(handle)
        except BaseException:
            for handle, mapping in mappings.items():
                if handle not in kept:
                    self.port.release_mapping(mapping)
            raise
        return mappings

    async def register_aux(self, lane: Lane, msg: RegisterAux, replaced: Callable[[Lane, Replaced], None]) -> None:
        """Map an engine rank's aux buffer; ``replaced`` hears of the one it replaces
        while that one's slots are still the lane's (its rooms' slots are quarantined there)."""
        if not isinstance(msg.memory, ShmHandle):
            raise errors.Unsupported("aux buffers live in host shared memory (shm handles only)")
        if msg.memory.size < msg.num_slots * msg.slot_bytes:
            raise errors.InsufficientCapacity(
                f"{msg.num_slots} slots of {msg.slot_bytes} bytes need {msg.num_slots * msg.slot_bytes} bytes, the buffer has {msg.memory.size}"
            )
        mapped = await self.port.map_memory(msg.memory)
        if lane.aux is not None:
            replaced(lane, Replaced("the engine registered a new aux buffer (a restarted engine?)"))
            self._retire(lane.aux.memory)  # the old slots' rooms cannot finish; late writes land in the retired mapping
        lane.aux = MappedAux(mapped, msg.num_slots, msg.slot_bytes)
        log.info("%s registered its aux buffer: %d slots of %d bytes", lane.name, msg.num_slots, msg.slot_bytes)

    def _retire(self, mapping: Mapping) -> None:
        grace = self.config.transfer_timeout + self.config.fence_timeout
        self.retired.append((self.port.clock() + grace, mapping))

    def release_retired(self, now: float) -> None:
        """Let go of replaced mappings whose grace ran out (the tick's)."""
        if self.retired and self.retired[0][0] <= now:
            due = [m for t, m in self.retired if t <= now]
            self.retired = [(t, m) for t, m in self.retired if t > now]
            for mapping in due:
                self.port.release_mapping(mapping)

    def reclaim_slots(self, now: float) -> list:
        """Slots granted and never used past retention go back; slots whose fence deadline
        passed are released: those, for their rooms to hear (the tick's)."""
        expired = []
        for lane in self.items:
            if lane.aux is None:
                continue
            reclaimed = lane.aux.slots.reclaim_granted(now - self.config.retention)
            if reclaimed:
                log.warning("reclaimed %d aux slots of %s granted over %gs ago and never used: %s", len(reclaimed), lane.name, self.config.retention, reclaimed[:8])
            expired += lane.aux.slots.expire_fences(now)
        return expired
