"""What a daemon asks of its role: the inbound side of a role, as ports.py is its
outbound side. ``RoleInbound`` is what both roles answer (the engine conversation,
ticks, draining, what operators read); ``PrefillInbound`` and ``DecodeInbound`` add
each role's bootstrap channel. The daemon holds its role as one of these and never asks
which class it is. Every message comes decoded.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol

from ..core.protocol import ErrorCode, Message, PeerInfo, Role
from ..core.rooms import Room, RoomTable
from .book import RoomBook
from .engine import EngineDesk
from .lanes import Lanes


class RoleInbound(Protocol):
    role: Role
    rooms: RoomTable  # what operators list (pdxfer rooms)
    book: RoomBook  # the rooms' outcomes and failure counts
    lanes: Lanes  # what engines registered (pdxfer slots, /readyz)
    desk: EngineDesk  # what both roles answer their engines: engines gone, draining, stats

    def on_engine(self, identity: bytes, msg: Message) -> Message | Awaitable[Message] | None:
        """An engine message: the reply, an awaitable of it (a registration), or None."""

    def tick(self) -> None: ...

    def fail(self, room: Room, code: ErrorCode, reason: str) -> bool:
        """An operator fails a room (pdxfer room ID --fail)."""

    def counters(self) -> dict[str, float]:
        """Everything the role counts, by name: the admin API's info and the metrics."""

    def peer_infos(self, now: float, wall: float) -> list[PeerInfo]: ...

    def peer_gone(self, record, reason: str) -> None:
        """The registry says a daemon of the other role is gone."""

    def drain(self, peer: str) -> None: ...

    def unsent(self, messages: list[Message]) -> None:
        """Peer messages that could not be queued: the live rooms they were about fail."""


class PrefillInbound(RoleInbound, Protocol):
    def on_peer(self, identity: bytes, incarnation: str, msg: Message, nbytes: int) -> None: ...

    def refuse_unauthenticated(self, identity: bytes, messages: list[Message], why: str) -> None: ...

    def on_connection(self, identity: bytes, event: str) -> None: ...

    def write_failed(self, sessions: tuple[str, ...]) -> None: ...

    def new_sessions(self, sessions: tuple[str, ...]) -> None: ...

    def transport_closed(self) -> int: ...


class DecodeInbound(RoleInbound, Protocol):
    def on_link(self, endpoint: str, incarnation: str, msg: Message) -> None: ...

    def on_connection(self, endpoint: str, event: str) -> None: ...

    def unreachable(self, endpoint: str, why: str) -> None: ...

    def hello(self, endpoint: str) -> Message: ...

    def still_wanted(self, msg: Message) -> bool: ...

    def link_unauthenticated(self, endpoint: str, why: str) -> None: ...

    def link_unproven(self, endpoint: str, why: str) -> None: ...

    def check_cut(self, peer: str) -> list: ...

    def cut(self, peer: str, answer: Callable[[int], None]) -> None: ...

    def sessions_rotated(self, sessions: tuple[str, ...]) -> None: ...

    def sessions_ended(self, sessions: tuple[str, ...]) -> None: ...

    def rotation_failed(self, reason: str) -> None: ...
