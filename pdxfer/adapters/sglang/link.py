"""One SGLang rank's connection to its pdxfer daemon, shaped for a scheduler that polls.

SGLang calls its transfer backend from the scheduler thread (and, for the retraction
path's aborts, from a helper thread): every call to the client is made under one lock,
and none waits for the daemon except registration, slot grants and aborts. Statuses are
those the daemon pushed (B6: a poll sends nothing). A daemon that goes away fails, fenced,
every room this rank had on it (its transfer engine went with it, so nothing more lands),
and the next call after ``RECONNECT_SECONDS`` connects again and registers the same
memory, so new rooms work once the daemon is back (A10).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Sequence

from ...client import Client, Slot
from ...core import config, errors
from ...core.protocol import ErrorCode, Rank, Role, RoomState, RoomStatus
from .layout import Registration

log = logging.getLogger("pdxfer.sglang")

RECONNECT_SECONDS = 1.0
SLOT_BATCH = 16  # aux slots asked for at once: one round trip per 16 rooms, not one per room


def daemon_endpoint(role: str, env=os.environ) -> str:
    """Where this rank's daemon listens: $PDXFER_ENDPOINT, else where a daemon of this
    role beside it listens, read from the same PDXFER_* settings ``pdxfer serve`` reads."""
    if env.get(config.ENDPOINT_ENV):
        return env[config.ENDPOINT_ENV]
    return config.load({"role": role}, env=env).engine_address


def unsupported_ranks(sizes: Rank) -> list[str]:
    """The parallel sizes of a server this backend cannot carry yet, as a user would
    name them. Attention TP it can: the daemon serves every rank of the server and
    slices heads between prefill and decode ranks (core/topology.py)."""
    found = []
    if sizes.cp > 1:
        found.append(f"attention context parallelism (CP {sizes.cp}): the daemon refuses it")
    if sizes.dp > 1:
        found.append(f"attention data parallelism (DP {sizes.dp}): the daemons match a room's legs to prefill ranks by TP and PP rank only")
    if sizes.pp > 1:
        found.append(f"pipeline parallelism (PP {sizes.pp}): the backend does not yet number a stage's layers within the whole model")
    return found


def release_timeout_refusal(release_timeout: float, fence_bound: float) -> str:
    """Why a decode server cannot run with SGLang's deferred release giving up after
    ``release_timeout`` seconds beside a decode daemon that fences a failed room within
    ``fence_bound``: SGLang would hand the pages of a request whose writes may still land
    to another request. "" when it can."""
    if release_timeout > fence_bound:
        return ""
    return (f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT is {release_timeout:g}s, but the pdxfer decode daemon "
            f"fences a failed request's pages only within {fence_bound:g}s (its --fence-bound): SGLang would give them to another "
            "request while a write for the failed one may still land. Raise the timeout above the bound, or lower --fence-bound")


def prefill_daemon(rows: Sequence[tuple[str, int]]) -> str:
    """The prefill daemon a decode rank's room comes from: every prefill rank it reads
    (SGLang's /route rows, ``(rank_ip, rank_port)``) must name the same one, which
    serves them all."""
    daemons = sorted(set(rows))
    if len(daemons) != 1:
        raise errors.Unsupported(
            f"the prefill ranks this decode rank reads register {len(daemons)} pdxfer daemons "
            f"({', '.join(f'{h}:{p}' for h, p in daemons)}); one daemon must serve every rank of a prefill server"
        )
    host, port = daemons[0]
    return f"{host}:{port}"


class Rows(NamedTuple):
    """SGLang's metadata buffers: row ``i`` of buffer ``b`` is ``sizes[b]`` bytes at
    ``ptrs[b] + i * sizes[b]`` (host memory). An aux record is a room's row of every
    buffer, end to end."""

    ptrs: Sequence[int]
    sizes: Sequence[int]

    @property
    def record_bytes(self) -> int:
        return sum(self.sizes)

    def gather(self, row: int, into: int) -> None:
        """Copy row ``row`` of every buffer to the address ``into``."""
        for ptr, size in zip(self.ptrs, self.sizes):
            ctypes.memmove(into, ptr + row * size, size)
            into += size

    def scatter(self, row: int, record: bytes) -> None:
        """Copy an aux record (``gather``'s layout) into row ``row`` of every buffer."""
        if len(record) != self.record_bytes:
            raise ValueError(f"an aux record of {len(record)} bytes for metadata rows of {self.record_bytes}")
        at = 0
        for ptr, size in zip(self.ptrs, self.sizes):
            ctypes.memmove(ptr + row * size, record[at : at + size], size)
            at += size


class Link:
    def __init__(self, endpoint: str, *, engine_id: str, role: Role, rank: Rank, sizes: Rank, device: str,
                 kv: Registration, rows: Rows, aux_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.role = role
        self._hello = dict(engine_id=engine_id, role=role, rank=rank, sizes=sizes, device=device)
        self._kv = kv
        self.rows = rows
        self._aux_slots = aux_slots
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._retry_at = 0.0
        self._rooms: dict[int, Slot | None] = {}  # rooms posted on this connection -> their aux slot
        self._lost: dict[int, RoomStatus] = {}  # rooms of a connection that went away
        self._dropping: set[int] = set()  # rooms to release once they settle
        self.bootstrap = ("", 0)  # the prefill daemon's bootstrap endpoint (host, port)
        self.fence_bound = 0.0  # decode: within how long the daemon fences a failed room (Welcome.fence_bound)

    # --- connection

    def open(self) -> None:
        """Connect and register, or raise naming the daemon SGLang could not use."""
        with self._lock:
            try:
                self._connect()
            except errors.PdxferError as exc:
                raise RuntimeError(
                    f"pdxfer: no usable {self.role.value} daemon at {self.endpoint} ({exc}); start one beside this "
                    f"server (pdxfer serve --role {self.role.value}) or point {config.ENDPOINT_ENV} at it"
                ) from exc

    def _connect(self) -> None:
        client = Client(self.endpoint, slot_batch=SLOT_BATCH, **self._hello)
        try:
            welcome = client.connect()
            client.register_kv(self._kv.buffers, self._kv.spec, self._kv.regions)
            client.create_aux_buffer(num_slots=self._aux_slots, payload_bytes=self.rows.record_bytes)
        except BaseException:
            client.close()
            raise
        self.fence_bound = welcome.fence_bound
        if welcome.bootstrap:
            host, _, port = welcome.bootstrap.rpartition("//")[2].rpartition(":")
            if self.bootstrap[1] and self.bootstrap != (host, int(port)):
                log.error("pdxfer prefill daemon at %s came back with bootstrap %s:%s, not %s:%d as SGLang's /route row says: "
                          "decode servers cannot reach it; restart it with --bootstrap-port %d", self.endpoint, host, port, *self.bootstrap, self.bootstrap[1])
            self.bootstrap = (host, int(port))
        self._client = client
        log.info("pdxfer %s daemon at %s: connected, KV and aux registered", self.role.value, self.endpoint)

    def _usable(self) -> Client:
        """The connected client, connecting again when it is time to; DaemonGone while
        there is none."""
        if self._client is None:
            if self._clock() < self._retry_at:
                raise errors.DaemonGone(f"the daemon at {self.endpoint} went away; connecting again every {RECONNECT_SECONDS:g}s")
            self._retry_at = self._clock() + RECONNECT_SECONDS
            self._connect()
        return self._client

    def _gone(self, exc: errors.PdxferError) -> None:
        """The connection broke: its rooms failed, and nothing of theirs can land now."""
        if self._client is not None:
            self._client.close()
            self._client = None
            self._retry_at = self._clock() + RECONNECT_SECONDS
        reason = exc.message
        for room in self._rooms:
            self._lost[room] = RoomStatus(req=0, room=room, state=RoomState.FAILED, code=ErrorCode.PEER_UNREACHABLE, reason=reason, fenced=True)
        self._rooms.clear()
        log.error("%s; %d room(s) failed", reason, len(self._lost))

    def _do(self, action: Callable[[Client], object]):
        """``action(client)`` under the lock; a broken connection fails its rooms and raises."""
        with self._lock:
            client = self._usable()
            try:
                return action(client)
            except errors.DaemonGone as exc:
                self._gone(exc)
                raise

    # --- rooms

    def announce(self, room: int) -> None:
        def post(client: Client) -> None:
            client.announce(room)
            self._rooms[room] = None

        self._do(post)

    def send(self, room: int, pages, first_page: int, *, last: bool, num_tokens: int = 0, row: int = -1, cuda_event: bytes = b"") -> None:
        """A chunk of ``room``; the last one carries metadata row ``row`` as the aux record.
        ``cuda_event``: the IPC handle of an event the daemon waits on before reading it."""

        def post(client: Client) -> None:
            if not last:
                client.send(room, pages, first_page=first_page, last=False, wait=False, cuda_event=cuda_event)
                return
            slot = client.alloc_slot()
            self._rooms[room] = slot
            self.rows.gather(row, client.aux.payload(slot).ctypes.data)
            client.send(room, pages, first_page=first_page, last=True, num_tokens=num_tokens, slot=slot,
                        aux_bytes=self.rows.record_bytes, wait=False, cuda_event=cuda_event)

        self._do(post)

    def expect(self, room: int, bootstrap: str, pages, skip_pages: int, prefill_sizes: Rank | None = None) -> None:
        """A decode room from the prefill daemon at ``bootstrap``, whose server runs
        ``prefill_sizes`` (TP, PP; one rank if None)."""

        def post(client: Client) -> None:
            slot = client.alloc_slot()
            client.expect(room, bootstrap, pages, slot, skip_pages=skip_pages, prefill_sizes=prefill_sizes, wait=False)
            self._rooms[room] = slot

        self._do(post)

    def status(self, room: int) -> RoomStatus | None:
        """The room's last status, as pushed (None: nothing heard of it yet)."""
        with self._lock:
            lost = self._lost.get(room)
            if lost is not None or room not in self._rooms or self._client is None:
                return lost
            try:
                return self._client.poll(room)
            except errors.DaemonGone as exc:
                self._gone(exc)
                return self._lost.get(room)
            except errors.PdxferError as exc:  # the daemon refused what was posted for it: nothing of it can land
                self._rooms.pop(room)
                self._lost[room] = RoomStatus(req=0, room=room, state=RoomState.FAILED, code=exc.code, reason=exc.message, fenced=True)
                return self._lost[room]

    def record(self, room: int) -> bytes:
        """The aux record a room that succeeded delivered, checked against its stamp."""
        with self._lock:
            if self._client is None:
                raise errors.DaemonGone(f"the daemon at {self.endpoint} went away before room {room}'s record was read")
            return self._client.aux.read(self._rooms[room], room)

    def quiet(self, room: int) -> bool:
        """Whether no write for ``room`` can land any more: never posted, released, settled, or lost."""
        status = self.status(room)
        if status is None:
            with self._lock:
                return room not in self._rooms
        return status.state is RoomState.SUCCESS or (status.state is RoomState.FAILED and status.fenced)

    def drop(self, room: int) -> None:
        """The engine wants nothing more of ``room``: released once no write for it can land."""
        with self._lock:
            if room in self._rooms:
                self._dropping.add(room)

    def tidy(self) -> None:
        """Release the dropped rooms that settled (called as the engine polls)."""
        for room in [r for r in self._dropping if self.quiet(r)]:
            self.release(room)

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            if room not in self._rooms or self._client is None:
                return
            try:
                self._client.abort(room, reason)
            except errors.DaemonGone as exc:
                self._gone(exc)
            except errors.PdxferError as exc:  # settled meanwhile, or never taken: nothing to stop
                log.debug("abort of room %d: %s", room, exc)

    def release(self, room: int) -> None:
        """Recycle ``room`` once no write for it can land: now if none can, else when it
        settles (`tidy`). Until then `quiet` says no: SGLang clears a failed decode room
        (failure_exception) before its deferred release asks whether the pages are safe."""
        if not self.quiet(room):
            self.drop(room)
            return
        with self._lock:
            self._lost.pop(room, None)
            self._dropping.discard(room)
            if room not in self._rooms:
                return
            del self._rooms[room]
            if self._client is None:
                return
            try:
                self._client.release(room, wait=False)
            except errors.PdxferError as exc:
                log.debug("release of room %d: %s", room, exc)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
