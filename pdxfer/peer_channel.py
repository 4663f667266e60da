"""The bootstrap channel between daemons: length-prefixed frames over plain TCP,
driven by the event loop. Engines still reach their daemon over ZMQ (wire.py).

The daemons own both ends of this channel, so it needs nothing ZMQ adds, and ZMQ
costs here: each of its messages wakes an I/O thread on each side besides the two
loops. A round trip between two processes on this project's 2-core VM took 106-144 us
and 56-74 us of the caller's CPU over ZMQ, 14 us and ~20 us over a plain socket.

A connection starts with PREAMBLE from the connecting side, then one message holding
its identity; every message after that is a batch as on ZMQ (an envelope frame and
1 to MAX_BATCH payload frames, see wire.Seal), laid out as ``u32 frame count``, one
``u32 length`` per frame, then the frames (little-endian). A frame over twice the
size limit, a stream that does not start with PREAMBLE, or one that has not named
itself within HANDSHAKE_SECONDS closes the connection; everything else is the
caller's to judge, as before. proto/PROTOCOL.md says the same.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import Callable

from .errors import BadMessage
from .wire import MAX_BATCH, Dropped, Head, Outbox, _no_head

log = logging.getLogger("pdxfer.peer_channel")

PREAMBLE = b"PDXF\x00\x01"  # magic and this framing's version
MAX_FRAMES = 4 * MAX_BATCH  # more than a batch may hold, so the receiver can say so in a reply
MAX_IDENTITY = 255
# Between a lost or refused connection and the next try (ZMQ's default). Not backed
# off: a connection reset by a flaky network looks like one refused by a peer, and a
# link that waited seconds after the network healed would miss its heartbeats.
RECONNECT_SECONDS = 0.1
REFUSAL_LOG_SECONDS = 10.0  # refused connections are logged once per this, with a count
CONNECT_TIMEOUT = 2.0  # a connect whose SYN is lost tries again after this, not the kernel's ~2 min
HANDSHAKE_SECONDS = 10.0  # an accepted connection that has not named itself by then is closed (ZMQ: 30 s)
_COUNT = struct.Struct("<I")


def encode(frames: list[bytes]) -> bytes:
    """One message's bytes on the stream."""
    return b"".join([_COUNT.pack(len(frames)), struct.pack(f"<{len(frames)}I", *map(len, frames)), *frames])


class Deframer:
    """Cuts a byte stream into messages (lists of frames). Pure; raises BadMessage
    as soon as a count or length is out of bounds, before waiting for its bytes."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[list[bytes]]:
        # Whole messages are cut straight from ``data``, one copy per frame; only a
        # message still incomplete waits in the buffer (most reads end on a message's end).
        buf = self._buf
        if buf:
            buf += data
            src = buf
        else:
            src = data
        messages = []
        pos, size = 0, len(src)
        with memoryview(src) as view:
            while size - pos >= 4:
                (count,) = _COUNT.unpack_from(src, pos)
                if not 1 <= count <= MAX_FRAMES:
                    raise BadMessage(f"a message has 1 to {MAX_FRAMES} frames, not {count}")
                start = pos + 4 + 4 * count
                if size < start:
                    break
                lengths = struct.unpack_from(f"<{count}I", src, pos + 4)
                if max(lengths) > self.max_frame_bytes:
                    raise BadMessage(f"a frame of {max(lengths)} bytes is over the {self.max_frame_bytes}-byte limit")
                if size < start + sum(lengths):
                    break
                frames = []
                for length in lengths:
                    frames.append(bytes(view[start : start + length]))
                    start += length
                messages.append(frames)
                pos = start
        if src is buf:
            del buf[:pos]
        elif pos < size:
            buf += memoryview(data)[pos:]
        return messages


class _RefusalLog:
    """Warnings about refused connections, at most one per REFUSAL_LOG_SECONDS with a
    count of the rest: an incompatible daemon reconnects ten times a second."""

    def __init__(self) -> None:
        self.logged_at = 0.0
        self.unlogged = 0

    def refused(self, name: str, peer, why: str) -> None:
        now = time.monotonic()
        if now - self.logged_at < REFUSAL_LOG_SECONDS:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more refused since the last report)" if self.unlogged else ""
        log.warning("%s: closing a connection from %s: %s%s", name, peer, why, more)
        self.logged_at, self.unlogged = now, 0


class _Connection(asyncio.Protocol):
    """One TCP connection of either side (``owner``: its PeerServer or PeerLink, which
    gets each message as ``received(connection, frames)``): deframes what arrives and
    writes batches, refusing one that would put its send buffer past ``queue_bytes``."""

    def __init__(self, name: str, max_bytes: int, owner, lost: asyncio.Future, preamble: bool) -> None:
        self.name = name
        self.deframer = Deframer(2 * max_bytes)
        self.queue_bytes = 2 * max_bytes
        self.owner = owner
        self.lost = lost
        self.identity: bytes | None = None
        self.transport: asyncio.Transport | None = None
        self._preamble = bytearray() if preamble else None  # accepted side: still to check it

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._preamble is not None:
            self._preamble += data
            if len(self._preamble) < len(PREAMBLE):
                return
            if self._preamble[: len(PREAMBLE)] != PREAMBLE:
                self.refuse(f"it did not open with pdxfer's preamble (got {bytes(self._preamble[:10])!r}; an older daemon speaking ZMQ?)")
                return
            data, self._preamble = bytes(self._preamble[len(PREAMBLE) :]), None
        try:
            messages = self.deframer.feed(data)
        except BadMessage as exc:
            self.refuse(exc.message)
            return
        for frames in messages:
            if self.transport.is_closing():
                return
            try:
                self.owner.received(self, frames)
            except Exception:
                self.owner.on_error()
                log.exception("%s: handling a message failed", self.name)

    def refuse(self, why: str) -> None:
        self.owner.refusals.refused(self.name, self.transport.get_extra_info("peername"), why)
        self.transport.abort()

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def send(self, frames: list[bytes]) -> bool:
        """Queue one message without blocking; False if the connection is closing or
        its send buffer is full."""
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > self.queue_bytes:
            return False
        transport.write(encode(frames))
        return True


class PeerServer:
    """A prefill daemon's bootstrap endpoint. ``on_message(identity, frames)`` gets
    each message of each identified connection; ``post(identity, payload)`` queues a
    reply (see wire.Outbox); one to an identity not connected, or past a full send
    buffer, is dropped and ``on_dropped`` hears of it. A connection with an identity
    already connected replaces it (a decode daemon that reconnected)."""

    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        self.host = host
        self.port = port
        self.max_bytes = max_bytes
        self.bound = ""
        self.on_error: Callable[[], None] = lambda: None  # a message handler raised (logged too)
        self.on_dropped: Dropped = lambda to, payloads: None
        self.refusals = _RefusalLog()
        self._server: asyncio.AbstractServer | None = None
        self._open: set[_Connection] = set()
        self._by_identity: dict[bytes, _Connection] = {}
        self._outbox = Outbox(self._send_batch)
        self._head: Head = _no_head
        self._on_message: Callable[[bytes, list[bytes]], None] = lambda identity, frames: None

    async def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[bytes, list[bytes]], None], head: Head = _no_head) -> str:
        """Bind (port 0: any free port) and return the bound ``tcp://host:port``;
        connections are accepted only from ``serve()`` on."""
        self._on_message, self._head, self._outbox.loop = on_message, head, loop
        self._server = await loop.create_server(self._accept, self.host, self.port, start_serving=False)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.bound = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        return self.bound

    async def serve(self) -> None:
        await self._server.start_serving()

    def _accept(self) -> _Connection:
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        conn = _Connection(self.bound, self.max_bytes, self, lost, preamble=True)
        self._open.add(conn)
        loop.call_later(HANDSHAKE_SECONDS, self._check_named, conn)
        lost.add_done_callback(lambda _: self._gone(conn))
        return conn

    def received(self, conn: _Connection, frames: list[bytes]) -> None:
        if conn.identity is not None:
            self._on_message(conn.identity, frames)
            return
        if len(frames) != 1 or not 1 <= len(frames[0]) <= MAX_IDENTITY:
            conn.refuse(f"its first message must be its identity (1 to {MAX_IDENTITY} bytes), not {len(frames)} frames")
            return
        conn.identity = frames[0]
        older = self._by_identity.get(conn.identity)
        self._by_identity[conn.identity] = conn
        if older is not None:
            older.transport.abort()

    def _check_named(self, conn: _Connection) -> None:
        if conn.identity is None and conn in self._open:
            conn.refuse(f"it did not name itself within {HANDSHAKE_SECONDS:g}s")

    def _gone(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.identity is not None and self._by_identity.get(conn.identity) is conn:
            del self._by_identity[conn.identity]

    def post(self, identity: bytes, payload: bytes) -> None:
        self._outbox.post(payload, identity)

    def _send_batch(self, identity: bytes | None, payloads: list[bytes]) -> None:
        conn = self._by_identity.get(identity)
        if conn is not None and conn.send(self._head(payloads) + payloads):
            return
        if conn is None:  # the peer left: common, and its rooms fail by its absence
            log.debug("%s: dropped %d messages to %r, which is not connected", self.bound, len(payloads), identity)
        else:
            log.warning("%s: dropped %d messages to %r: its connection is closing or %d bytes are queued for it",
                        self.bound, len(payloads), identity, conn.queue_bytes)
        self.on_dropped(identity, payloads)

    def close(self) -> None:
        """Send what was posted, stop listening, and close every connection once
        what it has buffered is written."""
        self._outbox.flush()
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._open):
            conn.transport.close()


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``; ``[v6]:port``) -> (host, port)."""
    address = endpoint.removeprefix("tcp://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port endpoint: {endpoint!r}")
    return host.strip("[]"), int(port)


class PeerLink:
    """A decode daemon's link to one prefill daemon's bootstrap endpoint. It connects,
    and reconnects RECONNECT_SECONDS after losing the connection, for as long as it is
    open; ``on_connection('connected' | 'disconnected')`` hears of each change.
    Messages posted while it is not connected wait for the next connection, up to a
    bound; past it, or past a full send buffer, they are dropped and ``on_dropped``
    hears of them. What was buffered on a connection that dropped is lost."""

    def __init__(self, endpoint: str, identity: bytes, max_bytes: int) -> None:
        self.endpoint = endpoint
        self.host, self.port = split_endpoint(endpoint)
        self.identity = identity
        self.max_bytes = max_bytes
        self.on_error: Callable[[], None] = lambda: None  # a handler raised (logged too)
        self.refusals = _RefusalLog()
        self._outbox = Outbox(self._send_batch)
        self._head: Head = _no_head
        self._conn: _Connection | None = None
        self._waiting: list[list[bytes]] = []  # batches of payloads posted while not connected
        self._waiting_bytes = 0
        self._task: asyncio.Task | None = None
        self._on_message: Callable[[list[bytes]], None] = lambda frames: None
        self._on_connection: Callable[[str], None] = lambda event: None
        self.on_dropped: Dropped = lambda to, payloads: None
        self.keep: Callable[[bytes], bool] = lambda payload: True  # on connecting: whether one posted meanwhile still goes

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[list[bytes]], None],
        on_connection: Callable[[str], None] | None = None,
        head: Head = _no_head,
    ) -> None:
        self._on_message, self._head, self._outbox.loop = on_message, head, loop
        if on_connection is not None:
            self._on_connection = on_connection
        self._task = loop.create_task(self._stay_connected(loop), name=f"pdxfer-link-{self.endpoint}")

    async def _stay_connected(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            lost = loop.create_future()
            make = lambda: _Connection(self.endpoint, self.max_bytes, self, lost, preamble=False)  # noqa: E731
            try:
                _, conn = await asyncio.wait_for(loop.create_connection(make, self.host, self.port), CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                log.debug("%s: cannot connect: %s", self.endpoint, exc)
                await asyncio.sleep(RECONNECT_SECONDS)
                continue
            try:
                conn.transport.write(PREAMBLE + encode([self.identity]))
                self._conn = conn
                waiting, self._waiting, self._waiting_bytes = self._waiting, [], 0
                for payloads in waiting:
                    if payloads := [p for p in payloads if self.keep(p)]:
                        self._send_batch(None, payloads)
                self._tell("connected")
                await lost
            finally:  # also when close() cancels this task: the connection goes with it
                conn.transport.close()
                self._conn = None
            self._tell("disconnected")
            await asyncio.sleep(RECONNECT_SECONDS)

    def _tell(self, event: str) -> None:
        try:
            self._on_connection(event)
        except Exception:
            self.on_error()
            log.exception("%s: handling a connection change failed", self.endpoint)

    def received(self, conn: _Connection, frames: list[bytes]) -> None:
        self._on_message(frames)

    def post(self, payload: bytes) -> None:
        self._outbox.post(payload)

    def _send_batch(self, to: bytes | None, payloads: list[bytes]) -> None:
        if self._conn is not None:
            sent = self._conn.send(self._head(payloads) + payloads)
        else:
            size = sum(map(len, payloads))
            sent = self._waiting_bytes + size <= 2 * self.max_bytes
            if sent:
                self._waiting.append(payloads)
                self._waiting_bytes += size
        if not sent:
            log.warning("%s: dropped %d messages: the connection is closing, or %d bytes already wait for it",
                        self.endpoint, len(payloads), 2 * self.max_bytes)
            self.on_dropped(None, payloads)

    def close(self) -> None:
        """Send what was posted, stop reconnecting, and close the connection once what
        it has buffered is written."""
        self._outbox.flush()
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._conn is not None:
            self._conn.transport.close()
            self._conn = None
