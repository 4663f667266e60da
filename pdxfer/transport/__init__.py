"""Transports move bytes between registered memory of two daemons.

The daemon talks to one through this small interface, always from the transfer pump's
thread (see pump.py), except ``register`` which start-up and registrations call from
a worker thread. ``mooncake.MooncakeTransport`` is the real one;
``faults.FaultInjectingTransport`` wraps it to inject faults the real one cannot be
made to produce on demand (tests only).
"""

from __future__ import annotations

import enum
from typing import Protocol

PROBE_BYTES = 64


class Status(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = -1


class Transport(Protocol):
    scratch: int  # address of a small registered buffer: probes are written from [0, 64) into a peer's [64, 128)

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

    def probe(self, peer: str, dst: int) -> bool:
        """Write PROBE_BYTES from our scratch to ``dst`` at ``peer`` and wait: is the session usable?"""

    def reset(self) -> str:
        """Replace every session (re-create the engine, re-register memory); return the new session id.
        Called only with nothing in flight."""

    def close(self) -> None: ...
