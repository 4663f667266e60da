"""What a role does to the world outside it: one typed port per role, handed to its
constructor (hypercorn's ``send``). The role decides; the port carries it out.

A role reaches its engine, its peers, the transfer pump, host memory, timers and the
clock through its port and nothing else, so a test drives it with a port that records
(tests/roles/) and a daemon with one that posts to sockets and the pump
(daemon/ports.py). There is no default: a role built without a port cannot run.
"""

from __future__ import annotations

from typing import Callable, Protocol

from ..core.protocol import MemoryHandle, Message, RoomState
from ..core.rooms import Room
from ..transport import Job


class Mapping(Protocol):
    """An engine buffer mapped into this process and registered with the transport."""

    address: int

    def close(self) -> None: ...


class Port(Protocol):
    """What both roles need."""

    def clock(self) -> float:
        """Monotonic seconds: what room deadlines, leases and heartbeats are measured in."""

    def wall(self) -> float:
        """Wall-clock seconds since the epoch, told to peers so they can estimate skew."""

    def send_engine(self, identity: bytes, message: Message) -> None:
        """A message to the engine connection ``identity`` (a room's status)."""

    async def map_memory(self, handle: MemoryHandle) -> Mapping:
        """Map an engine buffer and register it with the transport, or raise (and
        leave nothing mapped)."""

    def release_mapping(self, mapping: Mapping) -> None:
        """Unregister a replaced buffer from the transport and unmap it (no write of
        it can land any more)."""

    def same_memory(self, handle: MemoryHandle, mapping: Mapping) -> bool:
        """Whether ``mapping``, made for ``handle``, still maps the memory ``handle`` names
        (an engine that restarted may make its shared memory again under the same name)."""

    observe: Callable[[Room, RoomState | None, float], None] | None
    """Told that the room table moved ``room`` out of ``left`` (None: created) at
    ``now``, where something listens (debug logging); None: nothing does, and a
    transition costs no call. Metrics take the table's moves instead."""

    def watch_engine(self, identity: bytes, pid: int, pid_namespace: int) -> None:
        """Tell the role (engine_gone) when the process behind an engine connection
        exits, where this host can see it."""

    def back_staging(self, offset: int, nbytes: int) -> None:
        """Back [offset, +nbytes) of the staging buffer with pages, or raise
        InsufficientCapacity (a full /dev/shm: writing an unbacked page would end the
        writer with SIGBUS). What roles.staging.Staging reserves through."""


class PrefillPort(Port, Protocol):
    """A prefill daemon answers decode daemons and writes into them."""

    def send_peer(self, identity: bytes, message: Message) -> None:
        """A message to the decode daemon connected as ``identity``."""

    def submit(self, job: Job) -> None:
        """Write ``job``'s blocks; ``job.on_done`` runs once every one settled."""

    def cancel(self, job: Job) -> None:
        """Submit no more of ``job``; its ``on_done`` still waits for what is in flight."""

    def after_event(self, handle: bytes, done: Callable[[str], None]) -> None:
        """Call ``done("")`` once the CUDA event ``handle`` (an IPC handle from the engine)
        completed, or ``done(reason)`` when it cannot be opened or waited on."""


class DecodePort(Port, Protocol):
    """A decode daemon opens one link per prefill daemon, and may find them by name."""

    def open_link(self, endpoint: str) -> None:
        """Connect to the prefill daemon at ``endpoint`` (the link reconnects by itself)."""

    def close_link(self, endpoint: str) -> None: ...

    def send_link(self, endpoint: str, message: Message) -> None:
        """A message on the link to ``endpoint``; posted while it is down, it waits for it."""

    def later(self, delay: float, fn: Callable[[], None]) -> object:
        """Call ``fn`` after ``delay`` seconds."""

    def off_loop(self, work: Callable[[], None], done: Callable[[BaseException | None], None]) -> None:
        """Run ``work`` on a worker thread beside the event loop (a copy between buffers,
        which releases the GIL), then call ``done`` on the loop with what it raised, or None."""

    def resolve(self, name: str) -> str | None:
        """The bootstrap address of the prefill daemon registered as ``name`` (raises
        PdxferError, unknown_peer, when none is); None when this daemon has no registry."""

    def incarnation_of(self, name: str) -> str:
        """The incarnation the registry holds for the daemon ``name`` now ("" if none)."""

    def rotate_sessions(self) -> None:
        """Start new transfer engines beside the current ones (Transport.rotate), then call
        the role's sessions_rotated with their sessions, or rotation_failed with why not."""

    def end_sessions(self, sessions: tuple[str, ...]) -> None:
        """End the transfer engines at ``sessions`` (Transport.end: nothing sent to them
        lands afterwards), then call the role's sessions_ended with them."""
