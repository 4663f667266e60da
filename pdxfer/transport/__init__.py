"""Transports move bytes between registered memory of two daemons.

The daemon talks to one through this small interface, always from the transfer pump's
thread (see pump.py), except ``register`` which start-up and registrations call from
a worker thread. ``mooncake.MooncakeTransport`` is the real one;
``faults.FaultInjectingTransport`` wraps it to inject faults the real one cannot be
made to produce on demand (tests only). ``isolated.IsolatedTransport`` runs either in
a process of its own (``engine_process.py``), so that the engine's death is not the daemon's;
``build.py`` chooses.

The roles hand the pump a ``Job`` per room and peer; it is defined here, so that they
need not import the pump's thread.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from ..core.plan import Blocks

PROBE_BYTES = 64

# A peer as the transports address it: the sessions of its transfer engines, the
# first of them the one it announces alone (protocol.PeerHello.session).
Peer = tuple[str, ...]


def label(sessions: Peer) -> str:
    """A peer's sessions as logs and errors name them."""
    return ",".join(sessions)


def primary(sessions: Peer) -> str:
    """The one session a peer is announced and named by: its first engine's ("" before it started)."""
    return sessions[0] if sessions else ""


class Status(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = -1


class Transport(Protocol):
    scratch: int  # address of a small registered buffer: probes are written from [0, 64) into a peer's [64, 128)

    def start(self) -> Peer:
        """Initialise; return the session ids peers address this transport by, one per engine."""

    def register(self, address: int, length: int, populate: bool = True) -> None:
        """Make [address, address+length) a valid source or destination. ``populate``
        false: where the transport maps it (another process), pages come in as used."""

    def unregister(self, address: int) -> None: ...

    def submit(self, peer: Peer, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        """Start writing each block src[i] -> peer's dst[i], spread over the peer's
        sessions; one handle per block, 0 for a block the transport refused at once."""

    def poll(self, handle: int) -> Status:
        """A handle's status. DONE and FAILED consume the handle: never poll it again."""

    def probe(self, peer: Peer, dst: int) -> bool:
        """Write PROBE_BYTES from our scratch to ``dst`` at ``peer`` over every route the
        writes take, and wait: are the sessions usable?"""

    def rotate(self) -> Peer:
        """Start new engines (every region registered with them) and return their sessions,
        where writes go from now on; the replaced ones keep receiving until ``end``.
        Called only with nothing of ours in flight."""

    def end(self, sessions: Peer) -> None:
        """End the engines that rotate replaced, named by their sessions: once this
        returns, nothing sent to those sessions can land any more (their sockets are
        closed, with whatever they held unread); no later engine takes their ports."""

    def reset(self) -> Peer:
        """rotate, then end the replaced sessions: return the new session ids. Called only
        with nothing in flight."""

    def close(self) -> None: ...


@dataclass(eq=False)
class Job:
    """One room's blocks to one peer: a role makes it, the pump writes it and calls
    ``on_done`` once every block it submitted has settled."""

    id: int
    peer: Peer  # the decode daemon's transfer sessions
    blocks: Blocks
    on_done: Callable[[Job], None]  # runs on the event loop
    deadline: float = 0.0  # monotonic time after which no block of it is submitted (its lease); 0: none
    probe: int = 0  # the peer's probe address, for checking a suspect session
    next: int = 0  # next block to submit
    retry: deque = field(default_factory=deque)  # failed blocks to write again, first
    retries: int = 0
    in_flight: int = 0
    error: str = ""
    cancelled: bool = False
    queued: bool = False  # still has blocks waiting in its peer's queue
    abandoned: bool = False  # the pump failed; writes of this job may still land
    settled: bool = False
    queued_at: float = 0.0  # monotonic: handed to the pump
    started_at: float = 0.0  # its first block submitted (0: none yet)

    @property
    def ok(self) -> bool:
        return not self.error and not self.cancelled

    def finished(self) -> bool:
        """Nothing of it in flight, and nothing more to submit (all done, failed or cancelled)."""
        done = self.next >= len(self.blocks) and not self.retry
        return self.in_flight == 0 and (done or bool(self.error) or self.cancelled)
