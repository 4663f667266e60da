"""The engine-side library: register the engine's KV memory (or create shared-memory
KV pools) and aux buffers with the local daemon, and run rooms.

    endpoint = pdxfer.core.config.load({"role": "decode"}).engine_address  # the daemon beside us
    with Client(endpoint, engine_id="decode-0", rank=Rank(tp=0)) as client:
        client.register_kv(buffers, spec, regions)   # memory the engine owns (protocol.KVSpec, KVRegion)
        aux = client.create_aux_buffer(num_slots=256, payload_bytes=4096)
        slot = client.alloc_slot()
        client.expect(room, "10.0.0.5:18998", pages, slot, skip_pages=prefix_pages, num_draft_tokens=4)
        status = client.wait(room)          # Success, or Failed once fenced
        record = aux.read(slot, room)       # the aux record, checked against its stamp
        ...read the prompt's KV from the engine's pages...
        client.release(room)

A prefill announces a room, learns the decode's pages from its status
(waiting_for_input), and sends it in chunks as they are computed:
``send(room, pages, first_page=0, last=False)``, then the last chunk with its token
count and aux slot. ``create_kv_pool(KVLayout)`` makes a shared-memory pool and
registers it the same way.

examples/engine.py runs both sides in full. ``Client`` is synchronous (one call at a
time, no threads); ``AsyncClient`` has the same methods as coroutines. Both raise
pdxfer.errors types for error replies. The daemon pushes every change of a room's
state to the connection that owns the room, so ``poll()`` answers from what was
pushed, without a round trip.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from typing import NamedTuple

import numpy as np
import zmq

from .core import errors
from .core.plan import layout_registration, layout_regions, pages_to_bytes, pool_bytes, region_views
from .core.protocol import (
    ONE_RANK,
    PROTOCOL_VERSION,
    Abort,
    AllocSlot,
    Announce,
    Busy,
    Codec,
    EngineHello,
    Error,
    Expect,
    FreeSlot,
    GetStats,
    KVLayout,
    KVRegion,
    KVSpec,
    MemoryHandle,
    Message,
    Poll,
    Rank,
    RegisterAux,
    RegisterKV,
    Release,
    Role,
    RoomState,
    RoomStatus,
    Send,
    SlotGrant,
    Stats,
)
from .core.stamp import HEADER_BYTES, unpack_header, verify
from .host.memory import AUX_BUFFER_PREFIX, KV_POOL_PREFIX, SharedMemory
from .host.processes import pid_namespace
from .wire.sockets import CLOSE_LINGER, Dealer

MAX_SLOTS_PER_REQUEST = 64  # what one alloc_slot request may ask for (protocol.AllocSlot)
WAIT_POLL_SECONDS = 1.0  # wait() asks the daemon this often when no status was pushed
MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_SELF_RELEASED = 65536  # rooms sent with release_when_settled whose status a client keeps until it is claimed
_ERRORS = {cls.code: cls for cls in errors.PdxferError.__subclasses__() if cls is not errors.Busy}


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def raise_for(reply: Message) -> Message:
    """Return a successful reply; raise the typed error an error reply stands for."""
    if isinstance(reply, Error):
        raise _ERRORS.get(reply.code, errors.PdxferError)(reply.message, room=reply.room, code=reply.code)
    if isinstance(reply, Busy):
        raise errors.Busy(reply.reason, retry_after_ms=reply.retry_after_ms, room=reply.room)
    return reply


def settled(status: RoomStatus) -> bool:
    """Success, or Failed with no write still able to land."""
    return status.state is RoomState.SUCCESS or (status.state is RoomState.FAILED and status.fenced)


class Slot(NamedTuple):
    index: int
    generation: int


class KVPool:
    """An engine's KV pool in shared memory; views per layout region."""

    def __init__(self, memory: SharedMemory, layout: KVLayout, version: int = 1) -> None:
        self.memory = memory
        self.layout = layout
        self.version = version
        self.regions = layout_regions(layout)

    @classmethod
    def create(cls, layout: KVLayout) -> "KVPool":
        for field in ("num_layers", "num_pages", "page_size", "token_bytes"):  # a struct built in Python is not validated
            if getattr(layout, field) < 1:
                raise errors.BadMessage(f"create_kv_pool: layout.{field} is {getattr(layout, field)}; a KV pool needs at least 1")
        return cls(SharedMemory.create(pool_bytes(layout), prefix=KV_POOL_PREFIX), layout)

    def arrays(self) -> list[np.ndarray]:
        """One uint8 array per region, shaped [num_pages, page_bytes]."""
        return region_views(self.memory.array, self.regions, self.layout.num_pages)

    def tensors(self):
        """One torch tensor per region, [num_pages, tokens per page, elements per token],
        in the layout's dtype (torch is imported here only)."""
        import torch

        dtype = getattr(torch, self.layout.dtype)
        flat = torch.frombuffer(self.memory.array, dtype=torch.uint8)
        n = self.layout.num_pages
        out = []
        for r in self.regions:
            region = flat[r.offset : r.offset + n * r.page_bytes].view(dtype)
            out.append(region.view(n, -1, self.layout.token_bytes // region.element_size()))
        return out

    def close(self) -> None:
        self.memory.close()


class AuxBuffer:
    """num_slots slots; each a 32-byte stamp header (the daemon's) then the payload."""

    def __init__(self, memory: SharedMemory, num_slots: int, slot_bytes: int) -> None:
        self.memory = memory
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    @classmethod
    def create(cls, num_slots: int, payload_bytes: int) -> "AuxBuffer":
        if num_slots < 1:
            raise errors.BadMessage(f"create_aux_buffer: num_slots is {num_slots}; an aux buffer needs at least 1 slot")
        if payload_bytes < 0:
            raise errors.BadMessage(f"create_aux_buffer: payload_bytes is {payload_bytes}; it cannot be negative")
        slot_bytes = HEADER_BYTES + payload_bytes
        return cls(SharedMemory.create(num_slots * slot_bytes, prefix=AUX_BUFFER_PREFIX), num_slots, slot_bytes)

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    def payload(self, slot: Slot | int) -> np.ndarray:
        """The writable payload area of a slot (uint8)."""
        index = slot[0] if isinstance(slot, tuple) else slot
        start = index * self.slot_bytes + HEADER_BYTES
        return self.memory.array[start : start + self.payload_bytes]

    def read(self, slot: Slot, room: int) -> bytes:
        """The aux record a finished room delivered into ``slot``, checked once more
        against its stamp as it is read, so a write landing after Success can never
        be taken for the room's record (S3)."""
        start = slot.index * self.slot_bytes
        stamp = unpack_header(self.memory.array[start : start + HEADER_BYTES].tobytes())
        length = min(stamp.length, self.payload_bytes) if stamp else 0
        payload = self.memory.array[start + HEADER_BYTES : start + HEADER_BYTES + length].tobytes()
        verify(stamp, slot=slot.index, expected_room=room, expected_generation=slot.generation, payload=payload)
        return payload

    def tensor(self):
        import torch

        return torch.frombuffer(self.memory.array, dtype=torch.uint8).view(self.num_slots, self.slot_bytes)[:, HEADER_BYTES:]

    def close(self) -> None:
        self.memory.close()


class _Requests:
    """Message builders shared by both clients."""

    def __init__(self, endpoint: str, timeout: float = 30.0, engine_id: str = "", slot_batch: int = 1, *,
                 role: Role | None = None, rank: Rank = Rank(), sizes: Rank = ONE_RANK, device: str = "") -> None:
        """``engine_id`` names the engine instance (stable across its restarts), ``rank``
        and ``sizes`` its rank and parallel sizes, ``device`` where its KV lives ("cpu",
        "cuda:0"); the daemon refuses a ``role`` other than its own. ``slot_batch`` > 1
        keeps up to that many granted slots at hand, asking the daemon once per batch:
        one round trip less per room for busy engines."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.engine_id = engine_id
        self.role, self.rank, self.sizes, self.device = role, rank, sizes, device
        self.slot_batch = slot_batch
        self._spare: collections.deque[Slot] = collections.deque()
        self.codec = Codec()
        self.kv: KVPool | None = None
        self.aux: AuxBuffer | None = None
        self.registration: RegisterKV | None = None  # the KV registration the daemon holds, if any
        self.welcome = None
        self._req = itertools.count(1)
        self._forget_rooms()

    def _forget_rooms(self) -> None:
        """What this client heard about rooms: nothing yet (a new connection)."""
        self._lost = False  # the daemon went away: what it pushed is no longer news
        self._status: dict[int, RoomStatus] = {}  # pushed statuses (and bootstrapping, for a room just handed over)
        self._unanswered: set[int] = set()  # rooms with a send()/expect()/announce() that did not wait
        self._refused: dict[int, Error | Busy] = {}  # what the daemon answered such a request with instead of taking it
        # Rooms sent with release_when_settled, oldest first: no release() forgets them,
        # so their status is forgotten once wait() or poll() returned it settled.
        self._self_released: dict[int, None] = {}

    def _gone(self) -> str:
        return f"the daemon at {self.endpoint} went away: rooms in flight on it are lost; connect and register again"

    def _queue_full(self) -> str:
        return f"the queue to the daemon at {self.endpoint} is full"

    def _incoming(self, raw: bytes) -> Message | None:
        """Decode one message from the daemon: a pushed room status (req 0), or the
        refusal of a send()/expect() that did not wait, is recorded and handed to
        _pushed; anything else is a reply, returned."""
        msg = self.codec.engine_replies.decode(raw)
        if msg.req == 0:
            if isinstance(msg, RoomStatus):
                self._status[msg.room] = msg
                self._pushed(msg)
                return None
            if isinstance(msg, (Error, Busy)) and msg.room in self._unanswered:
                self._refuse(msg)
                return None
        return msg

    def _refuse(self, refusal: Error | Busy) -> None:
        self._unanswered.discard(refusal.room)
        self._status.pop(refusal.room, None)  # perhaps never the daemon's: poll() asks it
        self._self_released.pop(refusal.room, None)
        self._refused[refusal.room] = refusal
        self._pushed(refusal)

    def _pushed(self, msg: RoomStatus | Error | Busy) -> None:
        """A room status the daemon pushed, or a refusal (nothing to do unless someone waits on the room)."""

    def _posting(self, msg: Send | Expect | Announce) -> None:
        """``msg`` leaves without waiting for an answer: listen for its refusal."""
        self._refused.pop(msg.room, None)
        self._unanswered.add(msg.room)
        self._taken(msg)

    def _taken(self, msg: Send | Expect | Announce) -> None:
        """The daemon has (or, not waiting, will have) the room: its status is
        bootstrapping until a change is pushed (one pushed already stands). One it
        releases itself is remembered until its settled status is claimed; at most
        MAX_SELF_RELEASED of them, the oldest forgotten first (an engine that never
        waits for them)."""
        self._status.setdefault(msg.room, RoomStatus(req=0, room=msg.room, state=RoomState.BOOTSTRAPPING))
        if isinstance(msg, Send) and msg.release_when_settled:
            self._self_released[msg.room] = None
            if len(self._self_released) > MAX_SELF_RELEASED:
                self._forget(next(iter(self._self_released)))

    def _claimed(self, room: int, status: RoomStatus) -> RoomStatus:
        """``status`` goes to the engine: a settled room the daemon released itself is forgotten."""
        if room in self._self_released and settled(status):
            self._forget(room)
        return status

    def _known_settled(self, room: int) -> RoomStatus | None:
        """The settled status already heard for ``room`` (claimed), or None; first
        raises the refusal of its send()/expect() that did not wait, if there was one."""
        self._raise_refusal(room)
        known = self._status.get(room)
        return self._claimed(room, known) if known is not None and settled(known) else None

    def _known(self, room: int) -> RoomStatus | None:
        """What poll() answers without asking the daemon (B6): the room's latest pushed
        status, claimed; None for a room this connection has no status of. Raises first
        DaemonGone if the daemon went away, and the refusal of a request for the room
        that did not wait."""
        if self._lost:
            raise errors.DaemonGone(self._gone())
        self._raise_refusal(room)
        known = self._status.get(room)
        return None if known is None else self._claimed(room, known)

    def _raise_refusal(self, room: int) -> None:
        """Raise what the daemon answered a send()/expect() for ``room`` that did not wait with, if it refused it."""
        refusal = self._refused.pop(room, None)
        if refusal is not None:
            raise_for(refusal)

    def _forget(self, room: int) -> None:
        self._status.pop(room, None)
        self._unanswered.discard(room)
        self._refused.pop(room, None)
        self._self_released.pop(room, None)

    def _kv_version(self, memory_version: int | None) -> int:
        if memory_version is not None:
            return memory_version
        if self.registration is None:
            raise errors.NotRegistered("register_kv() or create_kv_pool() first")
        return self.registration.memory_version

    def _hello(self) -> EngineHello:
        return EngineHello(req=next(self._req), version=PROTOCOL_VERSION, engine_id=self.engine_id, role=self.role,
                           rank=self.rank, sizes=self.sizes, device=self.device, pid=os.getpid(), pid_namespace=pid_namespace())

    def _register_kv(self, buffers, spec: KVSpec, regions, memory_version: int | None) -> RegisterKV:
        """A registration replacing the current one: under a higher memory version unless one is given."""
        if memory_version is None:
            memory_version = self.registration.memory_version + 1 if self.registration is not None else 1
        return RegisterKV(req=next(self._req), buffers=tuple(buffers), spec=spec, regions=tuple(regions), memory_version=memory_version)

    def _pool_registration(self, pool: KVPool) -> RegisterKV:
        spec, regions = layout_registration(pool.layout)
        return self._register_kv([pool.memory.handle], spec, regions, None)

    def _registered(self, msg: RegisterKV, pool: KVPool | None = None) -> int:
        """The daemon took ``msg``: it is the registration rooms are computed against."""
        self.registration = msg
        if pool is not None:
            self.kv = pool
        if self.kv is not None and self.kv.memory.handle in msg.buffers:
            self.kv.version = msg.memory_version
        return msg.memory_version

    def _reregistration(self) -> RegisterKV:
        """The current registration again, under a higher memory version (the engine relocated pages)."""
        if self.registration is None:
            raise errors.NotRegistered("register_kv() or create_kv_pool() first")
        r = self.registration
        return self._register_kv(r.buffers, r.spec, r.regions, None)

    def _register_aux(self, aux: AuxBuffer) -> RegisterAux:
        return RegisterAux(req=next(self._req), memory=aux.memory.handle, num_slots=aux.num_slots, slot_bytes=aux.slot_bytes)

    def _send(self, room, pages, num_tokens, slot, aux_bytes, memory_version, wait, release_when_settled, first_page, last, cuda_event) -> Send:
        if not last:
            slot, aux_bytes = (0, 0), 0
        elif slot is None:
            raise errors.BadMessage(f"the last chunk of room {room} carries its aux slot: send(..., slot=)", room=room)
        if aux_bytes is None:
            aux_bytes = self.aux.payload_bytes if self.aux else 0
        return Send(
            req=next(self._req) if wait else 0, room=room, pages=pages_to_bytes(pages), num_tokens=num_tokens,
            slot=slot[0], generation=slot[1], aux_bytes=aux_bytes, memory_version=self._kv_version(memory_version),
            release_when_settled=release_when_settled, first_page=first_page, last=last, cuda_event=cuda_event,
        )

    def _expect(self, room, bootstrap, pages, slot, num_draft_tokens, memory_version, wait, skip_pages, prefill_sizes) -> Expect:
        return Expect(
            req=next(self._req) if wait else 0, room=room, bootstrap=bootstrap, pages=pages_to_bytes(pages), slot=slot[0],
            generation=slot[1], memory_version=self._kv_version(memory_version), num_draft_tokens=num_draft_tokens,
            skip_pages=skip_pages, prefill_sizes=prefill_sizes or ONE_RANK,
        )

    def _announce(self, room: int, wait: bool) -> Announce:
        return Announce(req=next(self._req) if wait else 0, room=room)

    def _poll(self, room: int) -> Poll:
        return Poll(req=next(self._req), room=room)

    def _abort(self, room: int, reason: str) -> Abort:
        return Abort(req=next(self._req), room=room, reason=reason)

    def _release(self, room: int, wait: bool) -> Release:
        return Release(req=next(self._req) if wait else 0, room=room)

    def _alloc(self, count: int = 0) -> AllocSlot:
        return AllocSlot(req=next(self._req), count=count or self.slot_batch)

    def _granted(self, grant: SlotGrant) -> Slot:
        self._spare.extend(Slot(*pair) for pair in grant.more)
        return Slot(grant.slot, grant.generation)

    def _spares_back(self) -> list[bytes]:
        """FreeSlot messages (no reply wanted) for the slots still at hand."""
        out = [self.codec.encode(FreeSlot(req=0, slot=s.index, generation=s.generation)) for s in self._spare]
        self._spare.clear()
        return out

    def _free(self, slot: Slot) -> FreeSlot:
        return FreeSlot(req=next(self._req), slot=slot[0], generation=slot[1])

    def _stats(self) -> GetStats:
        return GetStats(req=next(self._req))

    def _close_pools(self) -> None:
        for pool in (self.kv, self.aux):
            if pool is not None:
                pool.close()
        self.kv = self.aux = None


class Client(_Requests):
    """Synchronous engine client."""

    _sock: zmq.Socket | None = None

    def connect(self):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Watched while waiting, so a daemon that dies fails the wait at once (DaemonGone).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(self.endpoint)
        self._forget_rooms()
        self.welcome = self._call(self._hello())
        return self.welcome

    def close(self) -> None:
        if self._sock is not None:
            spares = self._spares_back()
            for raw in spares:
                self._sock.send(raw, zmq.NOBLOCK)
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(CLOSE_LINGER if spares else 0)  # time for the spare slots to go back
            self._sock = None
        self._close_pools()

    def _receive(self, timeout_ms: int) -> list[bytes] | None:
        """The next incoming ZMQ message, or None after ``timeout_ms``; DaemonGone when
        the connection to the daemon dropped meanwhile."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._monitor in ready:
            self._monitor.recv_multipart()
            self._lost = True
            raise errors.DaemonGone(self._gone())
        return self._sock.recv_multipart() if self._sock in ready else None

    def __enter__(self) -> "Client":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take(self, frames: list[bytes]) -> list[Message]:
        """The replies in one incoming ZMQ message (pushed statuses are recorded)."""
        return [msg for raw in frames if (msg := self._incoming(raw)) is not None]

    def _call(self, msg: Message):
        self._still_connected()
        self._sock.send(self.codec.encode(msg))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            frames = self._receive(int(left * 1000) + 1) if left > 0 else None
            if frames is None:
                raise errors.Timeout(f"daemon at {self.endpoint} did not answer {type(msg).__name__} within {self.timeout:g}s")
            mine = [reply for reply in self._take(frames) if getattr(reply, "req", None) == msg.req]
            if mine:
                return raise_for(mine[0])

    def _drain(self, timeout_ms: int = 0) -> None:
        self._still_connected()
        while (frames := self._receive(timeout_ms)) is not None:
            self._take(frames)
            timeout_ms = 0

    def _still_connected(self) -> None:
        """Once the daemon went away, every call says so until connect(): the socket
        would otherwise reach a restarted daemon, which knows nothing of this engine."""
        if self._lost:
            raise errors.DaemonGone(self._gone())

    def register_kv(self, buffers: list[MemoryHandle], spec: KVSpec, regions: list[KVRegion], memory_version: int | None = None) -> int:
        """Register the KV cache the engine owns: its buffers and what their pages mean
        (A2, A3). Again, it replaces the registration under a higher memory version.
        Returns the memory version rooms are computed against."""
        msg = self._register_kv(buffers, spec, regions, memory_version)
        self._call(msg)
        return self._registered(msg)

    def create_kv_pool(self, layout: KVLayout) -> KVPool:
        """A shared-memory pool made here, registered as register_kv() does."""
        pool = KVPool.create(layout)
        msg = self._pool_registration(pool)
        self._call(msg)
        self._registered(msg, pool)
        return pool

    def reregister_kv(self) -> int:
        msg = self._reregistration()
        self._call(msg)
        return self._registered(msg)

    def create_aux_buffer(self, num_slots: int, payload_bytes: int) -> AuxBuffer:
        aux = AuxBuffer.create(num_slots, payload_bytes)
        self._call(self._register_aux(aux))
        self.aux = aux
        return aux

    def alloc_slot(self) -> Slot:
        if self._spare:
            return self._spare.popleft()
        return self._granted(self._call(self._alloc()))

    def free_slot(self, slot: Slot) -> None:
        self._call(self._free(slot))

    def stats(self) -> Stats:
        """Rooms and slots by state, failures by reason, peers: what the daemon holds now."""
        return self._call(self._stats())

    def announce(self, room: int, *, wait: bool = False) -> None:
        """Prefill: this engine will send ``room``. Its status turns waiting_for_input,
        with the decode's ``pages`` and ``skip_pages``, once the decode's request is in."""
        self._request(self._announce(room, wait))

    def send(self, room: int, pages, num_tokens: int = 0, slot: Slot | None = None, aux_bytes: int | None = None,
             memory_version: int | None = None, *, first_page: int = 0, last: bool = True, wait: bool = True,
             release_when_settled: bool = False, cuda_event: bytes = b"") -> None:
        """Hand the daemon a chunk of a room's KV: source ``pages`` for positions
        [first_page, first_page + len(pages)), written at once if the decode's request is
        in. The ``last`` chunk (the default: the whole room) carries the token count and
        the aux record (``slot``). Positions below the decode's skip_pages are not written.
        ``wait=False`` returns at once: the daemon then sends no ok, and wait() or poll()
        for the room raise its refusal, if it refused. ``release_when_settled``: the
        daemon releases the room itself once it settled; no release() for it.
        ``cuda_event``: the IPC handle of a CUDA event recorded after the work that wrote
        these pages (torch: ``torch.cuda.Event(interprocess=True)``, then
        ``event.ipc_handle()``): the daemon writes them once it completed, so the engine
        need not synchronize before send()."""
        self._request(self._send(room, pages, num_tokens, slot, aux_bytes, memory_version, wait, release_when_settled, first_page, last, cuda_event))

    def expect(self, room: int, bootstrap: str, pages, slot: Slot, num_draft_tokens: int = 0, memory_version: int | None = None,
               *, skip_pages: int = 0, prefill_sizes: Rank | None = None, wait: bool = True) -> None:
        """Receive a room into ``pages`` (positions skip_pages.. of it: the first
        ``skip_pages`` this side holds already) and ``slot`` from the prefill daemon at
        ``bootstrap``, whose engine runs ``prefill_sizes`` (TP, PP; default one rank);
        ``wait`` as for send()."""
        self._request(self._expect(room, bootstrap, pages, slot, num_draft_tokens, memory_version, wait, skip_pages, prefill_sizes))

    def _request(self, msg: Send | Expect | Announce) -> None:
        if msg.req:
            self._call(msg)
            self._taken(msg)
            return
        self._posting(msg)
        try:
            self._sock.send(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._forget(msg.room)
            raise errors.Busy(self._queue_full(), retry_after_ms=10, room=msg.room) from None

    def _ask(self, room: int) -> RoomStatus:
        """The daemon's answer to a poll. A refusal of a request for this room that
        did not wait arrives before it (one connection, in order): it is raised first."""
        try:
            return self._call(self._poll(room))
        except errors.PdxferError:
            self._raise_refusal(room)
            raise

    def poll(self, room: int) -> RoomStatus:
        """The room's status as the daemon last pushed it (no round trip); asks the
        daemon only about a room this connection holds no status of."""
        self._drain()
        known = self._known(room)
        return known if known is not None else self._claimed(room, self._ask(room))

    def wait(self, room: int, timeout: float | None = None) -> RoomStatus:
        """Block until the room succeeded, or failed and is fenced. Waits for the
        daemon's pushed status; asks (poll) only now and then, in case one was lost."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._drain()
        self._raise_refusal(room)
        status = self._status.get(room)
        ask_at = time.monotonic() + WAIT_POLL_SECONDS
        while status is None or not settled(status):
            now = time.monotonic()
            if now >= deadline:
                state = status.state.value if status else "unsettled"
                raise errors.Timeout(f"room {room} still {state} after waiting", room=room)
            if now >= ask_at:
                status = self._ask(room)  # raises for a room the daemon never had
                ask_at = now + WAIT_POLL_SECONDS
                continue
            self._drain(int(min(deadline, ask_at) * 1000 - now * 1000) + 1)
            self._raise_refusal(room)
            status = self._status.get(room) or status
        return self._claimed(room, status)

    def abort(self, room: int, reason: str = "aborted by engine") -> None:
        self._call(self._abort(room, reason))

    def release(self, room: int, wait: bool = True) -> None:
        """Recycle a finished room. ``wait=False`` sends it without waiting for the
        daemon's answer (an error is then only in the daemon's log)."""
        msg = self._release(room, wait)
        if wait:
            self._call(msg)
        else:
            self._sock.send(self.codec.encode(msg), zmq.NOBLOCK)
        self._forget(room)


class AsyncClient(_Requests):
    """asyncio engine client; many calls may be in flight at once. Its socket is
    driven by the event loop (see wire.sockets.Dealer): no task or future per message."""

    _sock: Dealer | None = None

    async def connect(self):
        self._pending: dict[int, asyncio.Future] = {}
        self._asking: asyncio.Future | None = None  # the request for slots out now
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()  # alloc_slot() calls waiting for it
        self._forget_rooms()
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._sock = Dealer(zmq.Context.instance(), self.endpoint, b"", MAX_REPLY_BYTES, 100_000)
        self._sock.start(asyncio.get_running_loop(), self._read, self._connection, on_dropped=self._dropped)
        self.welcome = await self._call(self._hello())
        return self.welcome

    def _connection(self, event: str) -> None:
        """A daemon that went away forgets this engine: fail what waits on it now
        rather than at each call's timeout."""
        if event == "disconnected":
            self._lost = True
            self._fail_waiting(errors.DaemonGone, self._gone())

    def _fail_waiting(self, error: type[errors.PdxferError], message: str) -> None:
        """Every call awaiting a reply and every wait() raise ``error(message)``."""
        waiting = [*self._pending.values(), *(f for fs in self._waiters.values() for f in fs)]
        self._pending.clear()
        self._waiters.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error(message))

    async def close(self) -> None:
        if self._sock is not None:
            for raw in self._spares_back():
                self._sock.post(raw)
            self._sock.close()
            self._sock = None
            self._fail_waiting(errors.PdxferError, "engine client closed")
        self._close_pools()

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _read(self, frames: list[bytes]) -> None:
        for raw in frames:
            msg = self._incoming(raw)
            fut = None if msg is None else self._pending.pop(getattr(msg, "req", 0), None)
            if fut is not None:
                _resolve(fut, msg)

    def _pushed(self, msg: RoomStatus | Error | Busy) -> None:
        if not isinstance(msg, RoomStatus) or settled(msg):
            for fut in self._waiters.pop(msg.room, ()):
                _resolve(fut, msg)

    def _dropped(self, to, payloads: list[bytes]) -> None:
        """Requests the socket could not queue (its queue to the daemon is full)."""
        full = self._queue_full()
        for raw in payloads:
            msg = self.codec.engine_requests.decode(raw)
            if msg.req == 0 and isinstance(msg, (Send, Expect, Announce)) and msg.room in self._unanswered:
                self._refuse(Busy(req=0, reason=full, retry_after_ms=10, room=msg.room))
                continue
            fut = self._pending.pop(msg.req, None)
            if fut is not None and not fut.done():
                fut.set_exception(errors.Busy(full, retry_after_ms=10))

    async def _call(self, msg: Message):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[msg.req] = fut
        self._sock.post(self.codec.encode(msg))
        # A timer, not asyncio.wait_for: that costs a second future and a task switch per call.
        timer = loop.call_later(self.timeout, _resolve, fut, None)
        try:
            reply = await fut
        finally:
            timer.cancel()
            self._pending.pop(msg.req, None)
        if reply is None:
            raise errors.Timeout(f"daemon at {self.endpoint} did not answer {type(msg).__name__} within {self.timeout:g}s")
        return raise_for(reply)

    async def register_kv(self, buffers: list[MemoryHandle], spec: KVSpec, regions: list[KVRegion], memory_version: int | None = None) -> int:
        """As Client.register_kv()."""
        msg = self._register_kv(buffers, spec, regions, memory_version)
        await self._call(msg)
        return self._registered(msg)

    async def create_kv_pool(self, layout: KVLayout) -> KVPool:
        pool = KVPool.create(layout)
        msg = self._pool_registration(pool)
        await self._call(msg)
        self._registered(msg, pool)
        return pool

    async def reregister_kv(self) -> int:
        msg = self._reregistration()
        await self._call(msg)
        return self._registered(msg)

    async def create_aux_buffer(self, num_slots: int, payload_bytes: int) -> AuxBuffer:
        aux = AuxBuffer.create(num_slots, payload_bytes)
        await self._call(self._register_aux(aux))
        self.aux = aux
        return aux

    async def alloc_slot(self) -> Slot:
        """A slot at hand, or one from the daemon. One request for slots is out at a
        time, for as many as are waiting (slot_batch at least): when only a few are
        free, callers that each asked for a batch would be granted one or two each,
        a round trip per room."""
        if self._spare:
            return self._spare.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        if self._asking is None:
            self._ask_slots()
        return await waiter

    def _ask_slots(self) -> None:
        count = min(MAX_SLOTS_PER_REQUEST, max(self.slot_batch, len(self._slot_waiters)))
        self._asking = asyncio.ensure_future(self._call(self._alloc(count)))  # held here: the loop keeps only a weak reference
        self._asking.add_done_callback(self._slots_granted)

    def _slots_granted(self, asked: asyncio.Future) -> None:
        self._asking = None
        waiters = self._slot_waiters
        if asked.cancelled():
            refusal: BaseException | None = errors.PdxferError("engine client closed")
        else:
            refusal = asked.exception()
        if refusal is None:
            self._spare.appendleft(self._granted(asked.result()))
        while waiters and (self._spare or refusal is not None):
            waiter = waiters.popleft()
            if waiter.done():  # cancelled: nothing to give it
                continue
            if refusal is None:
                waiter.set_result(self._spare.popleft())
            elif isinstance(refusal, errors.Busy):  # each caller gets its own
                waiter.set_exception(errors.Busy(refusal.message, retry_after_ms=refusal.retry_after_ms))
            else:
                waiter.set_exception(refusal)
        if waiters:  # more callers came than this grant served
            self._ask_slots()

    async def free_slot(self, slot: Slot) -> None:
        await self._call(self._free(slot))

    async def stats(self) -> Stats:
        return await self._call(self._stats())

    async def announce(self, room: int, *, wait: bool = False) -> None:
        """As Client.announce()."""
        await self._request(self._announce(room, wait))

    async def send(self, room: int, pages, num_tokens: int = 0, slot: Slot | None = None, aux_bytes: int | None = None,
                   memory_version: int | None = None, *, first_page: int = 0, last: bool = True, wait: bool = True,
                   release_when_settled: bool = False, cuda_event: bytes = b"") -> None:
        """As Client.send(): ``wait=False`` spares the daemon's ok and a wake-up per room."""
        await self._request(self._send(room, pages, num_tokens, slot, aux_bytes, memory_version, wait, release_when_settled, first_page, last, cuda_event))

    async def expect(self, room: int, bootstrap: str, pages, slot: Slot, num_draft_tokens: int = 0, memory_version: int | None = None,
                     *, skip_pages: int = 0, prefill_sizes: Rank | None = None, wait: bool = True) -> None:
        await self._request(self._expect(room, bootstrap, pages, slot, num_draft_tokens, memory_version, wait, skip_pages, prefill_sizes))

    async def _request(self, msg: Send | Expect | Announce) -> None:
        if msg.req:
            await self._call(msg)
            self._taken(msg)
            return
        self._posting(msg)
        self._sock.post(self.codec.encode(msg))

    async def _ask(self, room: int) -> RoomStatus:
        try:
            return await self._call(self._poll(room))
        except errors.PdxferError:
            self._raise_refusal(room)
            raise

    async def poll(self, room: int) -> RoomStatus:
        """As Client.poll(): from pushed statuses, without a round trip."""
        known = self._known(room)
        return known if known is not None else self._claimed(room, await self._ask(room))

    async def wait(self, room: int, timeout: float | None = None) -> RoomStatus:
        """Until the room succeeded, or failed and is fenced. Waits for the daemon's
        pushed status; asks (poll) only now and then, in case one was lost."""
        known = self._known_settled(room)
        if known is not None:
            return known
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise errors.Timeout(f"room {room} did not settle in time", room=room)
            fut = loop.create_future()  # the settled status, or None when it is time to ask
            self._waiters.setdefault(room, []).append(fut)
            timer = loop.call_later(min(left, WAIT_POLL_SECONDS), _resolve, fut, None)
            try:
                status = await fut
            finally:
                timer.cancel()
                waiters = self._waiters.get(room)
                if waiters and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self._waiters[room]
            if isinstance(status, RoomStatus):
                return self._claimed(room, status)
            if status is not None:  # the daemon refused the send()/expect() that did not wait
                self._refused.pop(room, None)
                raise_for(status)
            status = await self._ask(room)  # raises for a room the daemon never had
            if settled(status):
                return self._claimed(room, status)

    async def abort(self, room: int, reason: str = "aborted by engine") -> None:
        await self._call(self._abort(room, reason))

    async def release(self, room: int, wait: bool = True) -> None:
        msg = self._release(room, wait)
        if wait:
            await self._call(msg)
        else:
            self._sock.post(self.codec.encode(msg))
        self._forget(room)
