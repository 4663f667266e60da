"""A port that records (roles.ports): every message a role sends to its engine, its
peers and its links, every write it submits or cancels, every link it opens or closes,
every timer it sets, and every buffer it maps or releases; time is a fake clock, in
whole milliseconds, that moves only when a test moves it."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdxfer.core.errors import PdxferError
from pdxfer.core.protocol import ErrorCode, MemoryHandle, Message, RoomState
from pdxfer.core.rooms import Room
from pdxfer.transport import Job

START_MS = 1_000_000  # the fake monotonic clock starts here (a role reads 0 as "never")
WALL_OFFSET = 1_700_000_000.0  # the fake wall clock is the monotonic one plus this


def seconds(ms: int) -> float:
    """A time in milliseconds on the fake clock, as a role reads it."""
    return ms / 1000


@dataclass(eq=False)
class Buffer:
    """A mapped engine buffer: plain process memory of the handle's size."""

    handle: MemoryHandle
    array: np.ndarray = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.array = np.zeros(self.handle.size, np.uint8)

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def close(self) -> None:
        self.closed = True


class RecordingPort:
    """Both roles.ports.PrefillPort and roles.ports.DecodePort."""

    def __init__(self) -> None:
        self.ms = START_MS
        self.sent: list[tuple[str, bytes | str, Message]] = []  # ("engine" | "peer" | "link", to, message)
        self.submitted: list[Job] = []
        self.cancelled: list[Job] = []
        self.links: list[tuple[str, str]] = []  # ("open" | "close", endpoint)
        self.mapped: list[Buffer] = []
        self.released: list[Buffer] = []
        self.remade: set[MemoryHandle] = set()  # handles whose memory the test made anew under the same name
        self.transitions: list[tuple[int, RoomState | None, RoomState]] = []  # (room, from, to)
        self.registry: dict[str, tuple[str, str]] | None = None  # name -> (bootstrap, incarnation); None: no registry
        self.watched: dict[bytes, tuple[int, int]] = {}  # engine connection -> (pid, pid namespace) the role asked to watch
        self.events: list[tuple[bytes, Callable[[str], None]]] = []  # CUDA events a role waits for: (handle, call when done)
        self.event_error = ""  # set: every CUDA event fails at once with it, as on a daemon that cannot wait on one
        self.copies: list[tuple[Callable[[], None], Callable[[BaseException | None], None]]] = []  # work handed off the loop, not run yet
        self.backed: list[tuple[int, int]] = []  # staging buffer extents backed with pages (offset, bytes)
        self.rotations = 0  # new transfer sessions asked for (the test answers with the role's sessions_rotated)
        self.ended: list[tuple[str, ...]] = []  # transfer sessions asked to end (the test answers with sessions_ended)
        self._timers: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()

    # --- time

    def clock(self) -> float:
        return seconds(self.ms)

    def wall(self) -> float:
        return WALL_OFFSET + seconds(self.ms)

    def later(self, delay: float, fn: Callable[[], None]) -> object:
        due = self.ms + max(1, round(delay * 1000))  # whole milliseconds, at least the next one
        entry = (due, next(self._order), fn)
        heapq.heappush(self._timers, entry)
        return entry

    def off_loop(self, work: Callable[[], None], done: Callable[[BaseException | None], None]) -> None:
        self.copies.append((work, done))

    def run_copies(self) -> int:
        """Run the work handed off the loop so far, each then told done; how many ran."""
        ran, self.copies = self.copies, []
        for work, done in ran:
            try:
                work()
            except Exception as exc:  # the daemon's port hands it to done too
                done(exc)
            else:
                done(None)
        return len(ran)

    def timers(self) -> list[int]:
        """When the timers set and not yet run are due (ms), soonest first."""
        return sorted(due for due, _, _ in self._timers)

    def advance(self, ms: int) -> None:
        """Move the clock ``ms`` milliseconds on, running each timer at its due time."""
        end = self.ms + ms
        while self._timers and self._timers[0][0] <= end:
            due, _, fn = heapq.heappop(self._timers)
            self.ms = max(self.ms, due)
            fn()
        self.ms = end

    # --- effects

    def send_engine(self, identity: bytes, message: Message) -> None:
        self.sent.append(("engine", identity, message))

    def send_peer(self, identity: bytes, message: Message) -> None:
        self.sent.append(("peer", identity, message))

    def send_link(self, endpoint: str, message: Message) -> None:
        self.sent.append(("link", endpoint, message))

    def open_link(self, endpoint: str) -> None:
        self.links.append(("open", endpoint))

    def close_link(self, endpoint: str) -> None:
        self.links.append(("close", endpoint))

    def submit(self, job: Job) -> None:
        self.submitted.append(job)

    def cancel(self, job: Job) -> None:
        job.cancelled = True  # as the pump marks it
        self.cancelled.append(job)

    async def map_memory(self, handle: MemoryHandle) -> Buffer:
        buffer = Buffer(handle)
        self.mapped.append(buffer)
        return buffer

    def release_mapping(self, mapping: Buffer) -> None:
        self.released.append(mapping)

    def same_memory(self, handle: MemoryHandle, mapping: Buffer) -> bool:
        return handle not in self.remade

    def observe(self, room: Room, left: RoomState | None, now: float) -> None:
        self.transitions.append((room.id, left, room.state))

    def after_event(self, handle: bytes, done: Callable[[str], None]) -> None:
        if self.event_error:  # as a daemon that cannot wait on events answers: at once
            done(self.event_error)
            return
        self.events.append((handle, done))

    def watch_engine(self, identity: bytes, pid: int, pid_namespace: int) -> None:
        self.watched[identity] = (pid, pid_namespace)

    def back_staging(self, offset: int, nbytes: int) -> None:
        self.backed.append((offset, nbytes))

    def rotate_sessions(self) -> None:
        self.rotations += 1

    def end_sessions(self, sessions: tuple[str, ...]) -> None:
        self.ended.append(sessions)

    def resolve(self, name: str) -> str | None:
        if self.registry is None:
            return None
        if name not in self.registry:
            raise PdxferError(f"no daemon named {name!r} in the registry", code=ErrorCode.UNKNOWN_PEER)
        return self.registry[name][0]

    def incarnation_of(self, name: str) -> str:
        return self.registry[name][1] if self.registry and name in self.registry else ""

    # --- reading what happened

    def take(self) -> list[tuple[str, bytes | str, Message]]:
        """What was sent since the last take, in order; forgotten here."""
        sent, self.sent = self.sent, []
        return sent
