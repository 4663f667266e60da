"""The bootstrap channel as daemons use it: protocol messages, not frames. A prefill
daemon's ``MessageServer`` and a decode daemon's ``MessageLink`` seal every batch they
send in the daemon's envelope (seal.Seal: its incarnation and, with a cluster secret, a
MAC over the batch), open every batch they receive, and decode each payload; a batch
whose envelope does not check is handed over as refused, and a payload that does not
decode (or is over the size limit) is answered or logged here. What could not be
queued, what is kept for a connection to come and a link's greeting are messages too:
nothing above this module sees a frame.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..core.errors import BadMessage, Unauthenticated
from ..core.protocol import UNDECODABLE, Codec, ErrorCode, Message, PeerError
from .bootstrap import PeerLink, PeerServer, Refused
from .seal import Seal

log = logging.getLogger("pdxfer.peer_channel")


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
    """A prefill daemon's bootstrap endpoint (PeerServer), in messages.
    ``on_message(identity, incarnation, message, nbytes)`` gets each message of a batch
    whose envelope checked; ``on_unauthenticated(identity, messages, why)`` each batch
    whose did not (a signed one refused too when this side has no secret: its sender
    would refuse our unsigned answers); ``on_dropped(identity, messages)`` what could not
    be queued."""

    def __init__(self, host: str, port: int, max_bytes: int, seal: Seal, codec: Codec, *,
                 on_message: Callable[[bytes, str, Message, int], None], on_connection: Callable[[bytes, str], None],
                 on_unauthenticated: Callable[[bytes, list[Message], str], None], on_dropped: Callable[[bytes | None, list[Message]], None],
                 on_refused: Refused, on_error: Callable[[], None]) -> None:
        self.seal = seal
        self.codec = codec
        self.max_bytes = max_bytes
        self._on_message = on_message
        self._on_connection = on_connection
        self._on_unauthenticated = on_unauthenticated
        self.channel = PeerServer(host, port, max_bytes, seal if seal.secret else None, on_error=on_error, on_refused=on_refused,
                                  on_dropped=lambda to, payloads: on_dropped(to, _decoded(codec, payloads)))

    async def start(self, loop: asyncio.AbstractEventLoop) -> str:
        """Bind; the bound ``tcp://host:port``. Connections are taken from ``serve()`` on."""
        return await self.channel.start(loop, self._received, self._on_connection, lambda payloads: [self.seal.envelope(payloads)])

    async def serve(self) -> None:
        await self.channel.serve()

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
    ``on_message(incarnation, message)`` gets each message of a batch whose envelope
    checked; ``on_unauthenticated(why)`` hears of one whose did not, ``on_bad(why)`` of
    one that is no batch; ``keep(message)`` says whether one posted while the link was
    down still goes when it connects, after ``greeting()``; ``on_dropped(messages)`` gets
    what could not be queued."""

    def __init__(self, endpoint: str, identity: bytes, max_bytes: int, seal: Seal, codec: Codec, *,
                 on_message: Callable[[str, Message], None], on_connection: Callable[[str], None],
                 on_unauthenticated: Callable[[str], None], on_bad: Callable[[str], None],
                 on_dropped: Callable[[list[Message]], None], on_refused: Refused, on_error: Callable[[], None],
                 keep: Callable[[Message], bool], greeting: Callable[[], Message]) -> None:
        self.endpoint = endpoint
        self.seal = seal
        self.codec = codec
        self._on_message = on_message
        self._on_connection = on_connection
        self._on_unauthenticated = on_unauthenticated
        self._on_bad = on_bad
        self.channel = PeerLink(
            endpoint, identity, max_bytes, seal if seal.secret else None, on_error=on_error, on_refused=on_refused,
            on_dropped=lambda to, payloads: on_dropped(_decoded(codec, payloads)),
            keep=lambda payload: all(keep(msg) for msg in _decoded(codec, [payload])),
            greeting=lambda: [codec.encode(greeting())],
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.channel.start(loop, self._received, self._on_connection, lambda payloads: [self.seal.envelope(payloads)])

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
            self._on_message(incarnation, msg)

    def close(self) -> None:
        self.channel.close()
