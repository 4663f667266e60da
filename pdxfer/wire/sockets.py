"""ZMQ sockets (the engine and admin channels); no business logic. Batching is
batch.py's, signed envelopes seal.py's: the bootstrap channel between daemons, plain
TCP (bootstrap.py), uses both without ZMQ.

Every frame of MessagePack is one message. A ZMQ message carries one or more of
them: engine messages are just those frames; peer and admin messages start with an
envelope (the sender's incarnation and, with a cluster secret, an HMAC over all of them).
Routers receive ``[identity, *frames]``. Sizes are bounded twice: ZMQ drops a
connection whose frame exceeds twice the limit before it is buffered, and anything
over the limit itself is refused with an error reply by the caller.

Messages posted to one destination during one turn of the event loop leave together,
as one ZMQ message (``batch.Outbox``).

Sockets are plain (not zmq.asyncio) and driven by the event loop: the loop watches
each socket's file descriptor and hands every waiting message to a callback, and
sends never block. That costs no future or task per message, which cut a request's
round trip on loopback from ~130 us to ~45 us here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from .batch import COPY_BELOW, Dropped, Head, Outbox, no_head

log = logging.getLogger("pdxfer.wire")


def _tune(sock: zmq.Socket, max_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)


def prepare_ipc(endpoint: str) -> None:
    """Create an ipc endpoint's directory owner-only when it is missing, and clear a
    stale socket file (the daemon's preflight refused a shared directory and a live socket)."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)


def restrict_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)


BATCH = 256  # ZMQ messages handled per wake-up before other callbacks get a turn
# Plain ints: zmq's flag enums cost a Python-level __or__ on every frame.
_LAST = int(zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# pyzmq's compiled socket methods, without its Python-level wrappers (argument
# handling): 0.5-1 us less per frame sent here, on every message.
_send_frame, _recv_frame, _option = zmq.backend.Socket.send, zmq.backend.Socket.recv, zmq.backend.Socket.get
CLOSE_LINGER = 100  # ms


class LoopSocket:
    """A plain ZMQ socket whose incoming messages the event loop hands to
    ``on_message`` as they arrive, and whose posted messages leave in batches (one
    ZMQ message per destination per turn of the loop, or per SEND_AT messages). A
    callback's exception is logged, ``on_error`` hears of it, and the socket goes on (H1)."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[bytes]], None], name: str, head: Head = no_head) -> None:
        self.sock = sock
        self.on_message = on_message
        self.name = name
        self.head = head
        self.on_dropped: Dropped = lambda to, payloads: None
        self.on_error: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False  # inside _readable, which reads again anyway
        self._look_pending = False  # a _readable call is already scheduled
        self.outbox = Outbox(self._send_batch)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.outbox.loop = loop
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._readable)
        loop.call_soon(self._readable)  # anything that arrived before we watched

    def _readable(self) -> None:
        self._look_pending = False
        sock = self.sock
        if sock is None or sock.closed:
            return
        self._reading = True
        try:
            for _ in range(BATCH):
                try:
                    # Asking first is cheaper than the Again exception a read of nothing raises.
                    if not _option(sock, _EVENTS) & _POLLIN:
                        return
                    # As zmq.Frame, whose ``more`` is a field: the RCVMORE option costs an enum lookup per frame.
                    frame = _recv_frame(sock, _LAST, False)
                    frames = [frame.bytes]
                    while frame.more:
                        frame = _recv_frame(sock, _LAST, False)
                        frames.append(frame.bytes)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    log.warning("%s: receive failed: %s", self.name, exc)
                    return
                try:
                    self.on_message(frames)
                except Exception:
                    self.on_error()
                    log.exception("%s: handling a message failed", self.name)
            self._look_soon()  # more may be waiting
        finally:
            self._reading = False

    def _look_soon(self) -> None:
        if not self._look_pending and self._loop is not None:
            self._look_pending = True
            self._loop.call_soon(self._readable)

    def _send_batch(self, to: bytes | None, payloads: list[bytes]) -> None:
        frames = payloads if self.head is no_head else self.head(payloads) + payloads
        if not self._send(frames if to is None else [to, *frames], to):
            self.on_dropped(to, payloads)

    def _send(self, frames, to=None) -> bool:
        """Queue one ZMQ message now, without blocking; False if it could not be
        (peer gone, queue full)."""
        sock = self.sock
        if sock is None or sock.closed:
            return False
        try:
            for frame in frames[:-1]:
                _send_frame(sock, frame, _MORE, len(frame) < COPY_BELOW)
            _send_frame(sock, frames[-1], _LAST, len(frames[-1]) < COPY_BELOW)
            return True
        except zmq.ZMQError as exc:
            log.debug("%s: dropped a message to %r: %s", self.name, to, exc)
            return False
        finally:
            # The descriptor signals edges: a send may have taken the wake-up for a
            # message already waiting. Inside _readable the next read finds it;
            # elsewhere, look once on the next turn of the loop.
            if not self._reading:
                self._look_soon()

    def close(self) -> None:
        """Send what was posted, then close; what it just sent gets CLOSE_LINGER to
        leave (a context's term() waits that long at most), anything else is dropped."""
        posted = self.outbox.flush()
        sock, self.sock = self.sock, None
        if sock is None or sock.closed:
            return
        if self._loop is not None:
            self._loop.remove_reader(sock.getsockopt(zmq.FD))
        sock.close(CLOSE_LINGER if posted else 0)


def _close_watched(io: LoopSocket, monitor: LoopSocket | None) -> None:
    """Stop a socket's monitor, if it has one, then close the socket."""
    if monitor is not None:
        io.sock.disable_monitor()
        monitor.close()
    io.close()


def _monitor(sock: zmq.Socket, events: int, on_event: Callable[[int], None], name: str) -> LoopSocket:
    """A loop-driven monitor of ``sock``: on_event(zmq event number)."""
    return LoopSocket(sock.get_monitor_socket(events), lambda frames: on_event(parse_monitor_message(frames)["event"]), name)


class Router:
    """A bound ROUTER: the daemon's engine or admin endpoint. ``on_message(frames)``
    gets each message, its sender's identity first; ``on_error()`` hears of each one
    whose handler raised."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_bytes: int, hwm: int, on_error: Callable[[], None] = lambda: None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.bound = ""
        self.connections = 0  # peers connected now (ROUTER sockets do not say who left, only that someone did)
        self.on_error = on_error
        self._io: LoopSocket | None = None
        self._monitor: LoopSocket | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[list[bytes]], None], head: Head = no_head) -> str:
        prepare_ipc(self.endpoint)
        sock = self.ctx.socket(zmq.ROUTER)
        _tune(sock, self.max_bytes, self.hwm)
        # No ROUTER_MANDATORY: it would report a departed identity, but it cost ~35 us
        # on every round trip here; a message to a peer that left is dropped silently.
        self._monitor = _monitor(sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED, self._connection, f"{self.endpoint} monitor")
        if self.endpoint.startswith("tcp://") and self.endpoint.endswith(":0"):
            sock.bind(self.endpoint[: -len(":0")] + ":*")
        else:
            sock.bind(self.endpoint)
        restrict_ipc(self.endpoint)
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._io = LoopSocket(sock, on_message, self.bound, head)
        self._io.on_error = lambda: self.on_error()
        self._io.attach(loop)
        self._monitor.attach(loop)
        return self.bound

    def _connection(self, event: int) -> None:
        self.connections += 1 if event == zmq.EVENT_ACCEPTED else -1

    def post(self, identity: bytes, payload: bytes) -> None:
        """Queue a message for the peer ``identity`` (see Outbox); one to a
        departed identity, or past a full queue, is dropped."""
        if self._io is not None:
            self._io.outbox.post(payload, identity)

    def close(self) -> None:
        if self._io is not None:
            _close_watched(self._io, self._monitor)
            self._io = None
        if self.bound.startswith("ipc://"):
            try:
                os.unlink(self.bound[len("ipc://") :])
            except FileNotFoundError:
                pass


class Dealer:
    """A DEALER connected to a remote ROUTER (a decode daemon's link to a prefill, an
    engine's to its daemon). ``on_message(frames)`` gets each message and
    ``on_connection('connected' | 'disconnected')`` each change of its TCP connection."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, max_bytes: int, hwm: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.identity = identity
        self.max_bytes = max_bytes
        self.hwm = hwm
        self._io: LoopSocket | None = None
        self._monitor: LoopSocket | None = None

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[list[bytes]], None],
        on_connection: Callable[[str], None] | None = None,
        head: Head = no_head,
        on_dropped: Dropped | None = None,
    ) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        _tune(sock, self.max_bytes, self.hwm)
        if self.identity:
            sock.setsockopt(zmq.IDENTITY, self.identity)
        if on_connection is not None:
            tell = lambda event: on_connection("connected" if event == zmq.EVENT_CONNECTED else "disconnected")  # noqa: E731
            self._monitor = _monitor(sock, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED, tell, f"{self.endpoint} monitor")
            self._monitor.attach(loop)
        sock.connect(self.endpoint)
        self._io = LoopSocket(sock, on_message, self.endpoint, head)
        if on_dropped is not None:
            self._io.on_dropped = on_dropped
        self._io.attach(loop)

    def post(self, payload: bytes) -> None:
        """Queue a message (see Outbox); past a full queue it is dropped,
        and ``on_dropped`` hears of it."""
        if self._io is not None:
            self._io.outbox.post(payload)

    def close(self) -> None:
        if self._io is not None:
            _close_watched(self._io, self._monitor)
            self._io = None
