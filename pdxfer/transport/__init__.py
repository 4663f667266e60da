"""Transports move bytes between registered memory of two daemons.

The daemon talks to one through this small interface, always from the transfer pump's
thread (see pump.py), so an implementation may block and need not be thread-safe
beyond that. ``mooncake.MooncakeTransport`` is the real one.
"""

from __future__ import annotations

import enum
from typing import Protocol


class Status(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = -1


class Transport(Protocol):
    def start(self) -> str:
        """Initialise; return the session id peers use to address this transport."""

    def register(self, address: int, length: int) -> None:
        """Make [address, address+length) a valid source or destination."""

    def unregister(self, address: int) -> None: ...

    def submit(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        """Start writing each block src[i] -> peer's dst[i]; one handle per block, 0
        for a block the transport refused at once."""

    def poll(self, handle: int) -> Status:
        """A handle's status. DONE and FAILED consume the handle: never poll it again."""

    def close(self) -> None: ...
