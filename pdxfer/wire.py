"""ZMQ sockets and framing; no business logic.

Engine messages are one frame of MessagePack. Peer messages are two frames:
an envelope (the sender's incarnation and, with a cluster secret, an HMAC) and the
payload. Routers receive ``[identity, *frames]``. Sizes are bounded twice: ZMQ drops
a connection whose message exceeds twice the limit before it is buffered, and
anything over the limit itself is refused with an error reply by the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .errors import BadMessage, PdxferError
from .protocol import Envelope, ErrorCode

log = logging.getLogger("pdxfer.wire")


def _outcome(sent, to) -> bool:
    """Whether a non-blocking send on an asyncio socket went out. Its error (the
    identity is gone, the queue is full) is in the returned future, usually already
    settled; one that settles later is read too, so it is not reported as lost."""
    if not sent.done():
        sent.add_done_callback(lambda fut: fut.cancelled() or fut.exception())
        return True
    exc = sent.exception()
    if exc is not None:
        log.debug("dropped a message to %r: %s", to, exc)
        return False
    return True


def _tune(sock: zmq.Socket, max_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)


def prepare_ipc(endpoint: str) -> None:
    """Create an ipc endpoint's directory owner-only and clear a stale socket file."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if stat.S_IMODE(os.stat(directory).st_mode) & 0o077:
        os.chmod(directory, 0o700)
    if os.path.exists(path):
        os.unlink(path)


def restrict_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)


class Unauthenticated(PdxferError):
    code = ErrorCode.UNAUTHENTICATED


MAC_BYTES = 16


class Seal:
    """Signs and checks peer envelopes. Without a secret it only names the sender."""

    def __init__(self, incarnation: str, secret: bytes = b"") -> None:
        self.incarnation = incarnation
        self.secret = secret
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._encoder = msgspec.msgpack.Encoder()

    def _mac(self, incarnation: str, payload: bytes) -> bytes:
        return hmac.new(self.secret, incarnation.encode() + b"\0" + payload, hashlib.sha256).digest()[:MAC_BYTES]

    def seal(self, payload: bytes) -> list[bytes]:
        mac = self._mac(self.incarnation, payload) if self.secret else b""
        return [self._encoder.encode(Envelope(self.incarnation, mac)), payload]

    def open(self, frames: list[bytes]) -> tuple[str, bytes]:
        """(sender incarnation, payload), or BadMessage / Unauthenticated."""
        if len(frames) != 2:
            raise BadMessage(f"a peer message has 2 frames (envelope, payload), not {len(frames)}")
        try:
            env = self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadMessage(f"cannot decode the envelope: {exc}") from None
        if self.secret and not hmac.compare_digest(env.mac, self._mac(env.incarnation, frames[1])):
            raise Unauthenticated("message not signed with this cluster's secret")
        return env.incarnation, frames[1]


class Router:
    """A bound ROUTER socket: the daemon's engine endpoint or bootstrap endpoint."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, max_bytes: int, hwm: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.sock: zmq.asyncio.Socket | None = None
        self.bound = ""
        self.connections = 0  # peers connected now, kept by track_connections()
        self._monitor: zmq.asyncio.Socket | None = None

    def start(self) -> str:
        prepare_ipc(self.endpoint)
        sock = self.ctx.socket(zmq.ROUTER)
        _tune(sock, self.max_bytes, self.hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        if self.endpoint.startswith("tcp://") and self.endpoint.endswith(":0"):
            sock.bind(self.endpoint[: -len(":0")] + ":*")
        else:
            sock.bind(self.endpoint)
        restrict_ipc(self.endpoint)
        self.sock = sock
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound

    async def recv(self) -> tuple[bytes, list[bytes]]:
        frames = await self.sock.recv_multipart(copy=True)
        return frames[0], frames[1:]

    async def track_connections(self) -> None:
        """Keep ``connections`` current (ROUTER sockets do not say who left, only that someone did)."""
        while self._monitor is not None:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            self.connections += 1 if event["event"] == zmq.EVENT_ACCEPTED else -1

    def send(self, identity: bytes, *frames: bytes) -> bool:
        """Queue a message; False if that identity is gone or its queue is full."""
        sent = self.sock.send_multipart((identity, *frames), flags=zmq.NOBLOCK, copy=len(frames[-1]) < 65536)
        return _outcome(sent, identity)

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.bound.startswith("ipc://"):
            try:
                os.unlink(self.bound[len("ipc://") :])
            except FileNotFoundError:
                pass


class Dealer:
    """A DEALER connected to a remote ROUTER (a decode daemon's link to a prefill)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: bytes, max_bytes: int, hwm: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.identity = identity
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.sock: zmq.asyncio.Socket | None = None
        self.monitor: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        _tune(sock, self.max_bytes, self.hwm)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self.sock = sock

    async def recv(self) -> list[bytes]:
        return await self.sock.recv_multipart(copy=True)

    async def connection_event(self) -> str:
        """'connected' or 'disconnected', as TCP connections to the peer come and go."""
        event = parse_monitor_message(await self.monitor.recv_multipart())
        return "connected" if event["event"] == zmq.EVENT_CONNECTED else "disconnected"

    def send(self, *frames: bytes) -> bool:
        sent = self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames[-1]) < 65536)
        return _outcome(sent, self.endpoint)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
