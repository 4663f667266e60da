"""One engine rank's session with its pdxfer daemon, as an engine adapter holds it: the
SGLang link (sglang/link.py) and the vLLM worker half (vllm/worker.py) post rooms
through it and read their statuses from it.

- **Connect and register.** ``open()`` connects, registers the engine's KV memory and
  an aux buffer, and hands the daemon's welcome to ``on_welcome``; a registration may
  take ``Timeouts.register`` (the daemon maps the whole KV cache), one when connecting
  again ``Timeouts.reconnect``, any call after it ``Timeouts.call``.
- **A daemon that goes away** fails, fenced, every room posted on its connection: its
  transfer engine went with it, so nothing more of them lands. The first post (or
  ``keep_connected()``) at least ``RECONNECT_SECONDS`` after the last try connects
  again and registers the same memory, so that new rooms work once a daemon is back
  (A10); until then posts raise DaemonGone at once.
- **A refusal** of what was posted for a room without waiting (the daemon answers it
  later) settles the room: failed, fenced, as the daemon never took it; its slot goes
  back, and a prefill's room is aborted so that its decode learns now rather than at
  its timeout. A send the engine could not hand over is given back the same way.
- **Abort and release never raise**: a daemon that went away holds nothing to stop or
  recycle.

Statuses are those the daemon pushed (B6: a status read sends nothing). Every call to
the client is made under one lock: SGLang calls from its scheduler thread and, for the
retraction path's aborts, from a helper thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple, Protocol, Sequence

from ..client import Client, Slot
from ..core import errors
from ..core.protocol import ErrorCode, KVRegion, KVSpec, MemoryHandle, Rank, Role, RoomState, RoomStatus, Welcome

log = logging.getLogger("pdxfer.session")

RECONNECT_SECONDS = 1.0  # between tries to reach a daemon that went away
SLOT_BATCH = 16  # aux slots asked for at once: one round trip per 16 rooms, not one per room


class KVMemory(Protocol):
    """The engine's KV memory as the daemon maps it."""

    buffers: Sequence[MemoryHandle]
    spec: KVSpec
    regions: Sequence[KVRegion]


class Timeouts(NamedTuple):
    """Seconds the daemon may take to answer: registering at start-up, registering when
    connecting again (the engine waits for it), any call once registered."""

    register: float = 30.0
    reconnect: float = 30.0
    call: float = 30.0


class Posted(NamedTuple):
    """A room posted on the connection: its aux slot (None before its last chunk), and
    whether the daemon releases it itself once it settled."""

    slot: Slot | None = None
    self_released: bool = False


def _failed(room: int, code: ErrorCode, reason: str) -> RoomStatus:
    """A room that failed without the daemon saying so: nothing of it can land."""
    return RoomStatus(req=0, room=room, state=RoomState.FAILED, code=code, reason=reason, fenced=True)


class Session:
    def __init__(self, endpoint: str, *, engine_id: str, role: Role, rank: Rank, sizes: Rank, device: str, kv: KVMemory,
                 aux_slots: int, aux_bytes: int, timeouts: Timeouts = Timeouts(),
                 on_welcome: Callable[[Welcome], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``aux_bytes``: the payload of each of the ``aux_slots`` aux slots, the longest
        aux record the engine sends (0: stamps only). ``on_welcome`` hears each
        connection's welcome, before any room is posted on it."""
        self.endpoint = endpoint
        self.role = role
        self._hello = dict(engine_id=engine_id, role=role, rank=rank, sizes=sizes, device=device)
        self._kv = kv
        self._aux_slots = aux_slots
        self._aux_bytes = aux_bytes
        self.timeouts = timeouts
        self._on_welcome = on_welcome
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._retry_at = 0.0
        self._rooms: dict[int, Posted] = {}  # rooms posted on this connection
        self._lost: dict[int, RoomStatus] = {}  # rooms failed without the daemon: its connection went, or it refused them

    # --- connection

    def open(self) -> None:
        """Connect and register, or raise why not."""
        with self._lock:
            self._client = self._connect(self.timeouts.register)

    def _connect(self, timeout: float) -> Client:
        client = Client(self.endpoint, timeout=timeout, slot_batch=SLOT_BATCH, **self._hello)
        try:
            welcome = client.connect()
            client.register_kv(self._kv.buffers, self._kv.spec, self._kv.regions)
            client.create_aux_buffer(self._aux_slots, payload_bytes=self._aux_bytes)
        except BaseException:
            client.close()
            raise
        client.timeout = self.timeouts.call
        if self._on_welcome is not None:
            self._on_welcome(welcome)
        log.info("pdxfer %s: %s daemon at %s: connected, KV and aux registered", self._hello["engine_id"], self.role.value, self.endpoint)
        return client

    def _usable(self) -> Client:
        """The connection, made again when it is time to; DaemonGone while there is none."""
        if self._client is None:
            if self._clock() < self._retry_at:
                raise errors.DaemonGone(f"the daemon at {self.endpoint} went away; connecting again every {RECONNECT_SECONDS:g}s")
            self._retry_at = self._clock() + RECONNECT_SECONDS
            try:
                self._client = self._connect(self.timeouts.reconnect)
            except errors.PdxferError as exc:
                log.warning("pdxfer: could not connect to the daemon at %s again: %s", self.endpoint, exc)
                raise
        return self._client

    def keep_connected(self) -> None:
        """Connect again now if the connection went away and it is time to try, so that
        the daemon knows this rank before its next room (a failure is logged)."""
        with self._lock:
            try:
                self._usable()
            except errors.PdxferError:
                pass

    def _gone(self, exc: errors.PdxferError) -> None:
        """The connection broke: its rooms failed, and nothing of theirs can land now."""
        if self._client is not None:
            self._client.close()
            self._client = None
            self._retry_at = self._clock() + RECONNECT_SECONDS
        for room in self._rooms:
            self._lost[room] = _failed(room, ErrorCode.PEER_UNREACHABLE, exc.message)
        log.error("pdxfer: %s; %d room(s) in flight failed", exc.message, len(self._rooms))
        self._rooms.clear()

    def _do(self, action: Callable[[Client], object]):
        """``action(client)`` under the lock; a broken connection fails its rooms and raises."""
        with self._lock:
            client = self._usable()
            try:
                return action(client)
            except errors.DaemonGone as exc:
                self._gone(exc)
                raise

    def _quietly(self, what: str, action: Callable[[Client], object]) -> None:
        """``action(client)`` whose failure changes nothing for the engine: nothing without
        a connection, and a daemon that went away fails the rooms in flight."""
        if self._client is None:
            return
        try:
            action(self._client)
        except errors.DaemonGone as exc:
            self._gone(exc)
        except errors.PdxferError as exc:
            log.warning("pdxfer: %s: %s", what, exc)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # --- rooms

    def posted(self, room: int) -> bool:
        """Whether ``room`` is posted on the connection and not yet released or lost."""
        return room in self._rooms

    def announce(self, room: int) -> None:
        """Prefill: this rank will send ``room``."""

        def post(client: Client) -> None:
            client.announce(room)
            self._rooms[room] = Posted()

        self._do(post)

    def send(self, room: int, pages, *, first_page: int = 0, last: bool = True, num_tokens: int = 0,
             write_record: Callable[[int], None] | None = None, release_when_settled: bool = False, cuda_event: bytes = b"") -> None:
        """A chunk of ``room`` (the whole room by default). The last one takes an aux
        slot, into whose payload ``write_record(address)`` writes the room's aux record.
        ``cuda_event``: the IPC handle of an event the daemon waits on before reading it."""

        def post(client: Client) -> None:
            slot = None
            try:
                if not last:
                    client.send(room, pages, first_page=first_page, last=False, wait=False, cuda_event=cuda_event)
                    return
                slot = client.alloc_slot()
                if write_record is not None:
                    write_record(client.aux.payload(slot).ctypes.data)
                client.send(room, pages, num_tokens, slot, first_page=first_page, wait=False,
                            release_when_settled=release_when_settled, cuda_event=cuda_event)
            except errors.DaemonGone:
                raise
            except errors.PdxferError as exc:
                self._give_back(room, slot, f"the engine could not hand over a chunk: {exc.message}")
                raise
            self._rooms[room] = Posted(slot, release_when_settled)

        self._do(post)

    def expect(self, room: int, bootstrap: str, pages, *, skip_pages: int = 0, prefill_sizes: Rank | None = None) -> None:
        """Decode: ``room`` from the prefill daemon at ``bootstrap``, whose engine runs
        ``prefill_sizes`` (TP, PP; one rank if None), into ``pages`` and an aux slot."""

        def post(client: Client) -> None:
            slot = client.alloc_slot()
            try:
                client.expect(room, bootstrap, pages, slot, skip_pages=skip_pages, prefill_sizes=prefill_sizes, wait=False)
            except errors.DaemonGone:
                raise
            except errors.PdxferError as exc:
                self._give_back(room, slot, f"not expected: {exc.message}")
                raise
            self._rooms[room] = Posted(slot)

        self._do(post)

    def status(self, room: int) -> RoomStatus | None:
        """The room's last status, as pushed (None: nothing heard of it yet)."""
        with self._lock:
            return self._heard(room, lambda client: client.poll(room))

    def wait(self, room: int, timeout: float) -> RoomStatus | None:
        """Wait up to ``timeout`` for ``room`` to settle, taking the statuses of the
        other rooms meanwhile; its status once settled, else None."""
        with self._lock:
            return self._heard(room, lambda client: client.wait(room, timeout=timeout))

    def _heard(self, room: int, ask: Callable[[Client], RoomStatus]) -> RoomStatus | None:
        if room in self._lost or room not in self._rooms or self._client is None:
            return self._lost.get(room)
        try:
            return ask(self._client)
        except errors.Timeout:  # not settled in time (wait), or no answer in time (poll): nothing heard, nothing refused
            return None
        except errors.DaemonGone as exc:
            self._gone(exc)
        except errors.PdxferError as exc:  # the daemon refused what was posted for it
            posted = self._rooms.pop(room)
            self._lost[room] = _failed(room, exc.code, exc.message)
            self._give_back(room, posted.slot, f"the daemon refused it: {exc.message}")
        return self._lost.get(room)

    def _give_back(self, room: int, slot: Slot | None, why: str) -> None:
        """What the daemon never took of ``room``: its slot, and a prefill's room aborted
        so that its decode learns now."""
        if slot is not None:
            self._quietly(f"room {room}'s slot not given back (bound after all: it goes with the room)", lambda client: client.free_slot(slot))
        if self.role is Role.PREFILL:
            self._quietly(f"room {room} not aborted", lambda client: client.abort(room, why))

    def record(self, room: int) -> bytes:
        """The aux record a room that succeeded delivered, checked against its stamp."""
        with self._lock:
            if self._client is None:
                raise errors.DaemonGone(f"the daemon at {self.endpoint} went away before room {room}'s record was read")
            return self._client.aux.read(self._rooms[room].slot, room)

    def abort(self, room: int, reason: str) -> None:
        """Stop ``room``, failing it on both daemons; nothing to stop on a daemon that went away."""
        with self._lock:
            self._quietly(f"room {room} not aborted", lambda client: client.abort(room, reason))

    def release(self, room: int) -> None:
        """Forget ``room``, and let the daemon recycle it (once no write for it can land:
        the caller's to know) unless it does so itself or went away."""
        with self._lock:
            self._lost.pop(room, None)
            posted = self._rooms.pop(room, None)
            if posted is not None and not posted.self_released:
                self._quietly(f"release of room {room}", lambda client: client.release(room, wait=False))
