"""The heartbeat rule, for both roles: when a peer is owed a heartbeat, when its
silence makes it dead, and when the silence is this daemon's own. Pure: every verdict
takes the times it judges (monotonic seconds) and ``now``.

A decode daemon sends a heartbeat on every link each ``interval``; the prefill answers
it, and either side takes any message from the other as a sign of life. A peer heard
nothing from for longer than ``misses`` intervals (the bound; at exactly the bound it
still lives) is declared dead, and exactly its rooms fail. A daemon that itself stood
still (SIGSTOP, swap) for over half the bound since it last looked cannot tell its
peers' silence from its own: it starts their clocks again (``resumed``) instead. A link
with no rooms not heard from for ten bounds, or IDLE_SECONDS if longer, is closed.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_SECONDS = 60.0  # an idle link not heard from for this long (or 10 bounds) is closed


@dataclass(frozen=True)
class Heartbeats:
    interval: float  # seconds between heartbeats on a link
    misses: int  # heartbeats a peer may miss before it is dead

    @property
    def bound(self) -> float:
        """Seconds of silence after which a peer is dead."""
        return self.interval * self.misses

    def due(self, last_beat: float, now: float) -> bool:
        """A heartbeat is owed on a link whose last one left at ``last_beat`` (0: none yet)."""
        return now - last_beat >= self.interval

    @staticmethod
    def missed(beats: int, last_beat: float, last_heard: float) -> bool:
        """The last of ``beats`` heartbeats, sent at ``last_beat``, went unanswered:
        not a word from the peer since it left."""
        return beats > 0 and last_heard < last_beat

    def dead(self, last_heard: float, now: float) -> bool:
        """A peer last heard from at ``last_heard`` has been silent past the bound."""
        return now - last_heard > self.bound

    def stood_still(self, last_look: float, now: float) -> bool:
        """This daemon did not look at its peers from ``last_look`` (0: never) until
        ``now`` for over half the bound: their silence meanwhile is its own."""
        return bool(last_look) and now - last_look > self.bound / 2

    def idle(self, last_heard: float, now: float) -> bool:
        """A link with no rooms, last heard from at ``last_heard``, may be closed."""
        return now - last_heard > max(IDLE_SECONDS, 10 * self.bound)


def resumed(last_heard: float, now: float) -> float:
    """When a peer counts as last heard from once this daemon stood still: now, unless later."""
    return max(last_heard, now)


@dataclass
class TickGaps:
    """A daemon's own ticks: whether it stood still since the last one, for long enough
    that its peers' silence meanwhile is its own (Heartbeats.stood_still)."""

    heartbeats: Heartbeats
    last: float = 0.0

    def stood_still(self, now: float) -> bool:
        last, self.last = self.last, now
        return self.heartbeats.stood_still(last, now)
