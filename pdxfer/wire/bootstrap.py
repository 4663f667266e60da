"""The bootstrap channel between daemons: length-prefixed frames over plain TCP,
driven by the event loop, and the messages daemons send on it (MessageServer and
MessageLink, at the end). Engines still reach their daemon over ZMQ (sockets.py).

The daemons own both ends of this channel, so it needs nothing ZMQ adds, and ZMQ
costs here: each of its messages wakes an I/O thread on each side besides the two
loops. A round trip between two processes on this project's 2-core VM took 106-144 us
and 56-74 us of the caller's CPU over ZMQ, 14 us and ~20 us over a plain socket.

A connection starts with PREAMBLE from the connecting side (a decode daemon). The
accepting side (a prefill daemon) answers with a challenge (one message of one frame:
NONCE_BYTES random bytes, new for every connection); the connecting side with one
message of three frames: its identity, a proof, and a challenge of its own (NONCE_BYTES,
new for every connection); the accepting side with one message of one frame, its own
proof, or with a refusal (a batch saying why, then the close). With a cluster secret
the connecting side's proof is seal.Seal.prove of the first challenge and the identity,
and the accepting side's is seal.Seal.prove_reply of both challenges and the identity;
without one both are empty. Every message after that is a batch as on ZMQ (an envelope
frame and 1 to MAX_BATCH payload frames, see seal.Seal). A message is laid out as
``u32 frame count``, one ``u32 length`` per frame, then the frames (little-endian).

Both sides prove the secret. An identity is proven, not claimed: the accepting side
hears nothing a connection says before its proof verifies, and only then may that
connection replace an older one under the same identity. Identities are incarnations,
which every envelope carries in plain text; were a claim enough, anyone who can reach
the port could disconnect a decode daemon and fail its rooms. And the connecting side
sends nothing, not even what was posted before it connected, until the accepting
side's proof verifies: its first message (peer_hello) names the memory a prefill may
write and the transfer-engine sessions to write it through, which a process that took
the prefill's address (a wrong address, a spoofed name, a stranger on the port) must
not learn. Each proof covers a challenge the other side chose, so an answer or a reply
recorded on another connection is worth nothing there; the reply's own tag keeps a
connecting side's proof, sent back to it, from passing for one. A process that relays
a connection to the real prefill still reads what crosses it: the channel is signed,
not encrypted (README, Security).

Without a secret there is nothing to prove with: identities are only claimed, and
either side believes whoever answers, as before this handshake. A secret on one side
only is refused by the side that has it and, where it can tell, by the other: an
accepting side without one refuses an answer that carries a proof (after its empty
reply, which tells the other side that it has none).

A frame over twice the size limit, a stream that does not start with PREAMBLE, a
handshake message of another shape, a proof that does not verify or cannot be checked,
or no handshake within HANDSHAKE_SECONDS closes the connection, logged (RefusalLog) and
told to the owner's ``on_refused``; everything else is the caller's to judge, as before.
proto/PROTOCOL.md says the same.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import secrets
import socket
import struct
import time
from typing import Callable, Protocol

from ..core.errors import BadMessage, Unauthenticated
from ..core.protocol import UNDECODABLE, Codec, ErrorCode, Message, PeerError
from .batch import MAX_BATCH, Dropped, Head, Outbox, no_head
from .seal import Seal

log = logging.getLogger("pdxfer.peer_channel")

PREAMBLE = b"PDXF\x00\x03"  # magic and this framing's version (2: the challenge and proof; 3: both sides prove)
MAX_FRAMES = 4 * MAX_BATCH  # more than a batch may hold, so the receiver can say so in a reply
MAX_IDENTITY = 255
NONCE_BYTES = 16  # of a challenge: never repeated in practice, so no answer or reply can be replayed
# Between a lost or refused connection and the next try (ZMQ's default). Not backed
# off: a connection reset by a flaky network looks like one refused by a peer, and a
# link that waited seconds after the network healed would miss its heartbeats.
RECONNECT_SECONDS = 0.1
REFUSAL_LOG_SECONDS = 10.0  # refusals of one kind are logged once per this, with a count
CONNECT_TIMEOUT = 2.0  # a connect whose SYN is lost tries again after this, not the kernel's ~2 min
HANDSHAKE_SECONDS = 10.0  # a connection whose handshake is not done by then is closed (ZMQ: 30 s)
_COUNT = struct.Struct("<I")



class Prover(Protocol):
    """What proves a cluster secret in the handshake: seal.Seal, given a secret."""

    def prove(self, nonce: bytes, identity: bytes) -> bytes: ...

    def prove_reply(self, nonce: bytes, counter: bytes, identity: bytes) -> bytes: ...


Refused = Callable[[ErrorCode, str], list[bytes]]  # (code, why) -> a last message for the refused connection, or []


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


class RefusalLog:
    """Warnings about refusals, at most one of each kind (an error code) per
    REFUSAL_LOG_SECONDS with a count of the rest: an incompatible daemon reconnects ten
    times a second, and a flood of one kind (junk on a port) must not hide another
    (someone without the secret)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._kinds: dict[ErrorCode, tuple[float, int]] = {}  # -> (when last logged, refusals since)

    def refused(self, code: ErrorCode, message: str) -> None:
        now = time.monotonic()
        logged_at, unlogged = self._kinds.get(code, (-math.inf, 0))
        if now - logged_at < REFUSAL_LOG_SECONDS:
            self._kinds[code] = (logged_at, unlogged + 1)
            return
        more = f" ({unlogged} more refused since the last report)" if unlogged else ""
        self.logger.warning("%s%s", message, more)
        self._kinds[code] = (now, 0)


class _Connection(asyncio.Protocol):
    """One TCP connection of either side (``owner``: its PeerServer or PeerLink, which
    gets each message as ``received(connection, frames)``): deframes what arrives and
    writes batches, refusing one that would put its send buffer past ``queue_bytes``.
    The accepted side checks the preamble, then sends the challenge (``nonce``); the
    owners carry out the rest of the handshake."""

    def __init__(self, name: str, max_bytes: int, owner, lost: asyncio.Future, preamble: bool) -> None:
        self.name = name
        self.deframer = Deframer(2 * max_bytes)
        self.queue_bytes = 2 * max_bytes
        self.owner = owner
        self.lost = lost
        self.identity: bytes | None = None  # accepted side: once proven (or, without a secret, claimed)
        self.nonce = b""  # accepted side: the challenge it sent
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
            # Only now: a stranger to the framing (a ZMQ peer, a port scan) gets nothing but the close.
            self.nonce = secrets.token_bytes(NONCE_BYTES)
            self.transport.write(encode([self.nonce]))
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

    def refuse(self, why: str, code: ErrorCode = ErrorCode.BAD_MESSAGE) -> None:
        """Close the connection, logged with the peer's address; the owner's
        ``on_refused`` hears of it and may give a last message to write first."""
        self.owner.refusals.refused(code, f"{self.name}: closing a connection from {self.transport.get_extra_info('peername')}: {why}")
        last = self.owner.on_refused(code, why)
        if last:
            self.transport.write(encode(last))
            self.transport.close()  # once that is written
        else:
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
    each message of each identified connection, and ``on_connection(identity,
    'connected' | 'disconnected')`` hears when a connection takes an identity and when
    the one holding it is lost (not when another takes it over: the identity is still
    connected). ``post(identity, payload)`` queues a
    reply (see batch.Outbox); one to an identity not connected, or past a full send
    buffer, is dropped and ``on_dropped`` hears of it. With ``prover`` (a cluster
    secret), a connection takes an identity only with its proof, and is then sent
    this side's; without, on its claim. A connection that took an identity already
    connected replaces that connection (a decode daemon that reconnected).
    ``on_refused(code, why)`` hears of each connection refused (also logged) and
    returns a last message to write to it before it closes, or []."""

    def __init__(self, host: str, port: int, max_bytes: int, prover: Prover | None = None, *,
                 on_error: Callable[[], None] = lambda: None, on_dropped: Dropped = lambda to, payloads: None,
                 on_refused: Refused = lambda code, why: []) -> None:
        self.host = host
        self.port = port
        self.max_bytes = max_bytes
        self.prover = prover
        self.bound = ""
        self.on_error = on_error  # a message handler raised (logged too)
        self.on_dropped = on_dropped
        self.on_refused = on_refused
        self.refusals = RefusalLog(log)
        self._server: asyncio.AbstractServer | None = None
        self._open: set[_Connection] = set()
        self._by_identity: dict[bytes, _Connection] = {}
        self._outbox = Outbox(self._send_batch)
        self._head: Head = no_head
        self._on_message: Callable[[bytes, list[bytes]], None] = lambda identity, frames: None
        self._on_connection: Callable[[bytes, str], None] | None = None

    async def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[bytes, list[bytes]], None],
        on_connection: Callable[[bytes, str], None],
        head: Head = no_head,
    ) -> str:
        """Bind (port 0: any free port) and return the bound ``tcp://host:port``;
        connections are accepted only from ``serve()`` on."""
        self._on_message, self._on_connection, self._head, self._outbox.loop = on_message, on_connection, head, loop
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
        if len(frames) != 3 or not 1 <= len(frames[0]) <= MAX_IDENTITY or len(frames[2]) != NONCE_BYTES:
            sizes = ", ".join(str(len(f)) for f in frames[:4])
            conn.refuse(f"its first message must be its identity (1 to {MAX_IDENTITY} bytes), a proof and a challenge of "
                        f"{NONCE_BYTES} bytes, not {len(frames)} frames ({sizes} bytes)")
            return
        identity, proof, counter = frames
        # The reasons name the roles: the last message the owner sends a refused
        # connection may quote them to the decode daemon at the other end.
        who = f"decode daemon {identity[:64]!r}"
        if self.prover is None:
            if proof:
                # Our empty reply goes first, as to anyone: it tells that daemon which
                # side lacks the secret. It would refuse us; we refuse it too, so that
                # this side logs and counts it.
                conn.transport.write(encode([b""]))
                conn.refuse(f"{who} answered with a proof of a cluster secret (--cluster-secret-file), and the prefill has none",
                            ErrorCode.UNAUTHENTICATED)
                return
            reply = b""
        elif not proof:
            conn.refuse(f"{who} gave no proof: the prefill has a cluster secret (--cluster-secret-file), the decode has none", ErrorCode.UNAUTHENTICATED)
            return
        elif not hmac.compare_digest(proof, self.prover.prove(conn.nonce, identity)):
            conn.refuse(f"{who} gave no proof of the prefill's cluster secret (--cluster-secret-file): it has another one, "
                        "or it is no daemon of this cluster", ErrorCode.UNAUTHENTICATED)
            return
        else:
            reply = self.prover.prove_reply(conn.nonce, counter, identity)
        conn.transport.write(encode([reply]))  # before anything posted to the identity it now holds
        conn.identity = identity
        older = self._by_identity.get(conn.identity)
        self._by_identity[conn.identity] = conn
        if older is not None:
            older.transport.abort()
        self._tell(identity, "connected")

    def _check_named(self, conn: _Connection) -> None:
        if conn.identity is None and conn in self._open:
            conn.refuse(f"it did not answer its challenge within {HANDSHAKE_SECONDS:g}s")

    def _gone(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.identity is not None and self._by_identity.get(conn.identity) is conn:
            del self._by_identity[conn.identity]
            self._tell(conn.identity, "disconnected")

    def _tell(self, identity: bytes, event: str) -> None:
        try:
            self._on_connection(identity, event)
        except Exception:
            self.on_error()
            log.exception("%s: handling a connection change of %r failed", self.bound, identity)

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
    answers the challenge (with ``prover``'s proof of a cluster secret, or an empty
    one) with a challenge of its own, checks the reply (with ``prover``: that it proves
    the secret too), and reconnects RECONNECT_SECONDS after losing the connection, for
    as long as it is open; ``on_connection('connected' | 'disconnected')`` hears of each
    change: a connection counts once the reply checked out, and nothing is sent on it
    before. A refusal that comes in the reply's place is handed to ``on_message``
    when there is no secret to check it by (it says why); with one, it is refused like
    a reply that does not verify. Messages posted while it is not connected wait for
    the next connection, up to a bound; past it, or past a full send buffer, they are
    dropped and ``on_dropped`` hears of them. ``on_unreachable(why)`` hears of each
    connect that failed (refused, unanswered). What was buffered on a connection that
    dropped is lost. ``on_refused`` is as on PeerServer."""

    def __init__(self, endpoint: str, identity: bytes, max_bytes: int, prover: Prover | None = None, *,
                 on_error: Callable[[], None] = lambda: None, on_refused: Refused = lambda code, why: [],
                 on_dropped: Dropped = lambda to, payloads: None, keep: Callable[[bytes], bool] = lambda payload: True,
                 greeting: Callable[[], list[bytes]] = lambda: [], on_unreachable: Callable[[str], None] = lambda why: None) -> None:
        self.endpoint = endpoint
        self.host, self.port = split_endpoint(endpoint)
        self.identity = identity
        self.max_bytes = max_bytes
        self.prover = prover
        self.on_error = on_error  # a handler raised (logged too)
        self.on_refused = on_refused
        self.refusals = RefusalLog(log)
        # The connection in its handshake, and what it learnt so far.
        self._setup: _Connection | None = None
        self._outcome: asyncio.Future | None = None  # True once taken, False once refused
        self._challenge = b""  # the prefill's
        self._counter = b""  # ours
        self._outbox = Outbox(self._send_batch)
        self._head: Head = no_head
        self._conn: _Connection | None = None
        self._waiting: list[list[bytes]] = []  # batches of payloads posted while not connected
        self._waiting_bytes = 0
        self._task: asyncio.Task | None = None
        self._on_message: Callable[[list[bytes]], None] = lambda frames: None
        self._on_connection: Callable[[str], None] = lambda event: None
        self.on_dropped = on_dropped
        self.keep = keep  # on connecting: whether one posted meanwhile still goes
        # On connecting again: what goes before everything posted meanwhile (the decode's
        # peer_hello: a prefill that restarted meanwhile must hear it before any request).
        self.greeting = greeting
        self.on_unreachable = on_unreachable  # each connect that failed: why, as a person would say it
        self._taken = 0  # connections taken so far

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[list[bytes]], None],
        on_connection: Callable[[str], None] | None = None,
        head: Head = no_head,
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
                self._unreachable(self._why_not(exc))
                await asyncio.sleep(RECONNECT_SECONDS)
                continue
            taken = False
            try:
                taken = await self._handshake(conn, lost)
                if taken:
                    await lost
            finally:  # also when close() cancels this task: the connection goes with it
                conn.transport.close()
                self._conn = self._setup = self._outcome = None
            if taken:
                self._tell("disconnected")
            await asyncio.sleep(RECONNECT_SECONDS)

    def _why_not(self, exc: BaseException) -> str:
        """A failed connect, as the room waiting for it should say it."""
        where = f"{self.host}:{self.port}"
        if isinstance(exc, ConnectionRefusedError):
            return f"connection refused by {where} (nothing listens there)"
        if isinstance(exc, asyncio.TimeoutError):
            return f"no answer from {where} within {CONNECT_TIMEOUT:g}s"
        return f"cannot connect to {where}: {getattr(exc, 'strerror', None) or exc}"

    def _unreachable(self, why: str) -> None:
        try:
            self.on_unreachable(why)
        except Exception:
            self.on_error()
            log.exception("%s: handling a failed connect failed", self.endpoint)

    async def _handshake(self, conn: _Connection, lost: asyncio.Future) -> bool:
        """Open with the preamble; ``received`` answers the challenge and checks the
        reply. Whether the connection was taken (one closed, refused or silent first
        is given up)."""
        self._outcome = outcome = asyncio.get_running_loop().create_future()
        self._setup = conn
        self._challenge = self._counter = b""
        conn.transport.write(PREAMBLE)
        await asyncio.wait([outcome, lost], timeout=HANDSHAKE_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        if outcome.done():
            return outcome.result()
        if not lost.done():
            step = "a reply to its answer" if self._challenge else "a challenge"
            conn.refuse(f"it sent no {step} within {HANDSHAKE_SECONDS:g}s (a daemon of an older framing?)")
        return False

    def _tell(self, event: str) -> None:
        try:
            self._on_connection(event)
        except Exception:
            self.on_error()
            log.exception("%s: handling a connection change failed", self.endpoint)

    def received(self, conn: _Connection, frames: list[bytes]) -> None:
        if conn is self._conn:
            self._on_message(frames)
            return
        outcome = self._outcome
        if conn is not self._setup or outcome is None or outcome.done():
            conn.refuse("it sent a message on a connection this side has given up")
            return
        if not self._challenge:
            if len(frames) != 1 or len(frames[0]) != NONCE_BYTES:
                conn.refuse(f"its first message must be a challenge of {NONCE_BYTES} bytes, and nothing may come before it is answered")
                return
            self._challenge, self._counter = frames[0], secrets.token_bytes(NONCE_BYTES)
            proof = self.prover.prove(self._challenge, self.identity) if self.prover is not None else b""
            conn.transport.write(encode([self.identity, proof, self._counter]))
            return
        why = self._check_reply(frames)
        if why:
            outcome.set_result(False)
            conn.refuse(why, ErrorCode.UNAUTHENTICATED)
        elif len(frames) != 1:  # a refusal, and no secret to check it by: its reason is the owner's to read
            outcome.set_result(False)
            conn.transport.abort()
            self._on_message(frames)
        else:
            outcome.set_result(True)
            self._take(conn)

    def _check_reply(self, frames: list[bytes]) -> str:
        """Why the prefill's reply to our answer does not prove our secret; "" when it
        does, or when there is no secret to prove."""
        if self.prover is None:
            return ""
        if len(frames) != 1:
            return (f"it refused this daemon's proof and gave none of its own ({len(frames)} frames where its proof should be): "
                    "the two have different cluster secrets (--cluster-secret-file), or it is not the prefill daemon")
        if not frames[0]:
            return "it gave no proof: the prefill has no cluster secret (--cluster-secret-file), the decode has one"
        if not hmac.compare_digest(frames[0], self.prover.prove_reply(self._challenge, self._counter, self.identity)):
            return ("it gave no proof of this cluster's secret (--cluster-secret-file): it has another one, or it is not "
                    "the prefill daemon (a wrong address, or another process on its port)")
        return ""

    def _take(self, conn: _Connection) -> None:
        """The reply checked out (without a secret: it came): what waited goes first,
        then everything else. Done while the reply is read, so that a message right
        behind it finds the connection taken."""
        self._conn = conn
        self._taken += 1
        waiting, self._waiting, self._waiting_bytes = self._waiting, [], 0
        if self._taken > 1 and (greeting := self.greeting()):
            self._send_batch(None, greeting)
        for payloads in waiting:
            if payloads := [p for p in payloads if self.keep(p)]:
                self._send_batch(None, payloads)
        self._tell("connected")

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


# --- the channel in messages
#
# What daemons use: a prefill daemon's MessageServer and a decode daemon's MessageLink
# seal every batch they send in the daemon's envelope (seal.Seal: its incarnation and,
# with a cluster secret, a MAC over the batch), open every batch they receive, and
# decode each payload; a batch whose envelope does not check is handed over as refused,
# and a payload that does not decode (or is over the size limit) is answered or logged
# here. What could not be queued, what is kept for a connection to come and a link's
# greeting are messages too: nothing above this module sees a frame.

def _decoded(codec: Codec, payloads: list[bytes]) -> list[Message]:
    """The payloads that decode, as messages (what this side posted, or a batch only to be looked at)."""
    out = []
    for payload in payloads:
        try:
            out.append(codec.peer_messages.decode(payload))
        except UNDECODABLE:
            continue
    return out


class MessageServer:
    """A prefill daemon's bootstrap endpoint (PeerServer), in messages. It binds at
    ``start``, before the role that answers exists (the role is told the address), and
    takes connections from ``serve`` on, which names the role's handlers:
    ``on_message(identity, incarnation, message, nbytes)`` gets each message of a batch
    whose envelope checked; ``on_unauthenticated(identity, messages, why)`` each batch
    whose did not (a signed one refused too when this side has no secret: its sender
    would refuse our unsigned answers); ``on_connection(identity, event)`` each
    connection that came or went. ``on_dropped(identity, messages)`` gets what could not
    be queued."""

    def __init__(self, host: str, port: int, max_bytes: int, seal: Seal, codec: Codec, *,
                 on_dropped: Callable[[bytes | None, list[Message]], None], on_refused: Refused, on_error: Callable[[], None]) -> None:
        self.seal = seal
        self.codec = codec
        self.max_bytes = max_bytes
        self._on_message: Callable[[bytes, str, Message, int], None] = lambda identity, incarnation, msg, nbytes: None
        self._on_connection: Callable[[bytes, str], None] = lambda identity, event: None
        self._on_unauthenticated: Callable[[bytes, list[Message], str], None] = lambda identity, messages, why: None
        self.channel = PeerServer(host, port, max_bytes, seal if seal.secret else None, on_error=on_error, on_refused=on_refused,
                                  on_dropped=lambda to, payloads: on_dropped(to, _decoded(codec, payloads)))

    async def start(self, loop: asyncio.AbstractEventLoop) -> str:
        """Bind; the bound ``tcp://host:port``."""
        return await self.channel.start(loop, self._received, self._connection, self.seal.head)

    async def serve(self, on_message: Callable[[bytes, str, Message, int], None], on_connection: Callable[[bytes, str], None],
                    on_unauthenticated: Callable[[bytes, list[Message], str], None]) -> None:
        self._on_message, self._on_connection, self._on_unauthenticated = on_message, on_connection, on_unauthenticated
        await self.channel.serve()

    def _connection(self, identity: bytes, event: str) -> None:
        self._on_connection(identity, event)

    def post(self, identity: bytes, message: Message) -> None:
        self.channel.post(identity, self.codec.encode(message))

    def _received(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            incarnation, payloads = self.seal.open(frames, refuse_signed=True)
        except Unauthenticated as exc:
            self._on_unauthenticated(identity, _decoded(self.codec, frames[1:]), exc.message)
            return
        except BadMessage as exc:
            self.post(identity, PeerError(code=ErrorCode.BAD_MESSAGE, message=str(exc)))
            return
        for payload in payloads:
            if len(payload) > self.max_bytes:
                self.post(identity, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"message of {len(payload)} bytes exceeds the {self.max_bytes}-byte limit"))
                continue
            try:
                msg = self.codec.peer_messages.decode(payload)
            except UNDECODABLE as exc:
                self.post(identity, PeerError(code=ErrorCode.BAD_MESSAGE, message=f"cannot decode peer message: {exc}"))
                continue
            self._on_message(identity, incarnation, msg, len(payload))

    def close(self) -> None:
        self.channel.close()


class MessageLink:
    """A decode daemon's link to one prefill daemon (PeerLink), in messages.
    ``on_message(endpoint, incarnation, message)`` gets each message of a batch whose
    envelope checked, ``on_connection(endpoint, event)`` each change of its connection; ``on_unauthenticated(why)`` hears of one whose did not, ``on_bad(why)`` of
    one that is no batch; ``keep(message)`` says whether one posted while the link was
    down still goes when it connects, after ``greeting()``; ``on_dropped(messages)`` gets
    what could not be queued; ``on_unreachable(endpoint, why)`` each connect that failed."""

    def __init__(self, endpoint: str, identity: bytes, max_bytes: int, seal: Seal, codec: Codec, *,
                 on_message: Callable[[str, str, Message], None], on_connection: Callable[[str, str], None],
                 on_unauthenticated: Callable[[str], None], on_bad: Callable[[str], None],
                 on_dropped: Callable[[list[Message]], None], on_refused: Refused, on_error: Callable[[], None],
                 keep: Callable[[Message], bool], greeting: Callable[[], Message], on_unreachable: Callable[[str, str], None]) -> None:
        self.endpoint = endpoint
        self.seal = seal
        self.codec = codec
        self._on_message = on_message
        self._on_connection = functools.partial(on_connection, endpoint)
        self._on_unauthenticated = on_unauthenticated
        self._on_bad = on_bad
        self.channel = PeerLink(
            endpoint, identity, max_bytes, seal if seal.secret else None, on_error=on_error, on_refused=on_refused,
            on_dropped=lambda to, payloads: on_dropped(_decoded(codec, payloads)),
            keep=lambda payload: all(keep(msg) for msg in _decoded(codec, [payload])),
            greeting=lambda: [codec.encode(greeting())], on_unreachable=functools.partial(on_unreachable, endpoint),
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.channel.start(loop, self._received, self._on_connection, self.seal.head)

    def post(self, message: Message) -> None:
        self.channel.post(self.codec.encode(message))

    def _received(self, frames: list[bytes]) -> None:
        try:
            incarnation, payloads = self.seal.open(frames)
        except Unauthenticated as exc:
            self._on_unauthenticated(exc.message)
            return
        except BadMessage as exc:
            self._on_bad(str(exc))
            return
        for payload in payloads:
            try:
                msg = self.codec.peer_messages.decode(payload)
            except UNDECODABLE as exc:
                log.warning("undecodable message from prefill %s: %s", self.endpoint, exc, extra={"peer": self.endpoint})
                continue
            self._on_message(self.endpoint, incarnation, msg)

    def close(self) -> None:
        self.channel.close()
