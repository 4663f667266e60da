"""A decode daemon's transfer sessions over time, and the rotation that ends old ones
(proto/PROTOCOL.md, "Fencing"). Pure: times are passed in.

Each set of sessions the daemon's transfer engines had is a *generation*, numbered
from 1. A room may be written into the generations from the one current when it was
requested to the newest one that a ``peer_hello`` listed it live in (``Span``); once
none of those is live any more, nothing aimed at it can land (ending a generation
closes its sockets), so a failed room is fenced.

A rotation replaces the current generation: new engines start, every prefill hears of
them in a ``peer_hello`` (with the legs it may move there), and the old generation ends
once every prefill that was live when it began said ``sessions_drained`` for it, or at
its deadline, whichever comes first. One runs at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Sessions = tuple[str, ...]


@dataclass(frozen=True)
class Span:
    """The generations a room may be written into: [first, last]."""

    first: int
    last: int

    def moved(self, to: int) -> Span:
        return Span(self.first, max(self.last, to))


@dataclass
class Generations:
    """Which generations are live, and their sessions."""

    current: int = 1
    live: dict[int, Sessions] = field(default_factory=dict)  # generation -> its sessions, while its engines run

    @classmethod
    def starting(cls, sessions: Sessions) -> Generations:
        return cls(1, {1: sessions})

    @property
    def sessions(self) -> Sessions:
        """Where writes go now."""
        return self.live.get(self.current, ())

    def rotated(self, sessions: Sessions) -> int:
        """New engines took over at ``sessions``: their generation, now the current one."""
        self.current += 1
        self.live[self.current] = sessions
        return self.current

    def number(self, sessions: Sessions) -> int | None:
        """The live generation with these sessions, if any."""
        return next((g for g, s in self.live.items() if s == sessions), None)

    def ended(self, sessions: Sessions) -> int | None:
        """The engines at ``sessions`` ended: their generation, no longer live (None: none was)."""
        number = self.number(sessions)
        if number is not None:
            del self.live[number]
        return number

    def all_ended(self, span: Span) -> bool:
        """Nothing written into ``span``'s generations can land any more."""
        return not any(span.first <= g <= span.last for g in self.live)


@dataclass
class Rotation:
    """The retirement of generation ``old``: who still has to say it drained, and until when."""

    old: int
    sessions: Sessions
    reason: str
    started: float
    deadline: float  # the old generation ends then, drained or not
    waiting: set[str]  # prefill links whose sessions_drained for it has not come
    ending: bool = False  # its end was asked for

    def drained(self, link: str) -> bool:
        """``link`` said it drained (or is no longer waited for): whether none is left."""
        self.waiting.discard(link)
        return not self.waiting

    def due(self, now: float) -> bool:
        """Whether the old generation ends now: every prefill drained it, or time is up."""
        return not self.ending and (not self.waiting or now >= self.deadline)


def fence_due(failed_at: float, last_heard: float, bound: float) -> float:
    """When a failed room whose writer never confirmed must be fenced at the latest: the
    fence bound after its failure, or after its prefill's last word if that came first
    (a prefill that went silent before the room failed)."""
    return min(failed_at, last_heard) + bound
