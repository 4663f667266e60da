"""ZMQ sockets and framing; no business logic.

Every message is a single ZMQ frame of MessagePack. Routers receive
``[identity, payload]``. Sizes are bounded twice: ZMQ drops a connection whose
message exceeds twice the limit before it is buffered, and anything over the
limit itself is refused with an error reply by the caller.
"""

from __future__ import annotations

import logging
import os
import stat

import zmq
import zmq.asyncio

log = logging.getLogger("pdxfer.wire")


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


class Router:
    """A bound ROUTER socket: the daemon's engine endpoint or bootstrap endpoint."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, max_bytes: int, hwm: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.sock: zmq.asyncio.Socket | None = None
        self.bound = ""

    def start(self) -> str:
        prepare_ipc(self.endpoint)
        sock = self.ctx.socket(zmq.ROUTER)
        _tune(sock, self.max_bytes, self.hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
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

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Queue a message; False if that identity is gone or its queue is full."""
        try:
            self.sock.send_multipart((identity, payload), flags=zmq.NOBLOCK, copy=len(payload) < 65536)
            return True
        except zmq.ZMQError as exc:
            log.debug("dropped a message to %r: %s", identity, exc)
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None


class Dealer:
    """A DEALER connected to a remote ROUTER (a decode daemon's link to a prefill)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: bytes, max_bytes: int, hwm: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.identity = identity
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.sock: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        _tune(sock, self.max_bytes, self.hwm)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.connect(self.endpoint)
        self.sock = sock

    async def recv(self) -> list[bytes]:
        return await self.sock.recv_multipart(copy=True)

    def send(self, payload: bytes) -> bool:
        try:
            self.sock.send(payload, flags=zmq.NOBLOCK, copy=len(payload) < 65536)
            return True
        except zmq.ZMQError as exc:
            log.debug("dropped a message to %s: %s", self.endpoint, exc)
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
