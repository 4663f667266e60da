"""What the decode role keeps: a link per prefill daemon (its clock offset, its
incarnation), each room part's work and legs, requests gathering their ranks' legs, and
the staging extents legs hold. Its parts (service, requester, verifier, rotations)
share one ``DecodeState``, handed to each at construction."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from ...core.generations import Span
from ...core.protocol import LegRequest, RoomRequest
from ...core.staging import StagedLayout


# Offset samples kept per link: the best (largest) of the recent ones is used; older
# ones go, since two hosts' monotonic clocks drift apart (tens of ppm).
OFFSET_SAMPLES = 8



@dataclass(eq=False)
class PrefillLink:
    endpoint: str
    last_heard: float  # when its silence counts from: its last message, or when it was last declared dead
    last_word: float = 0.0  # its last message (0: none yet); a room's fence is due at the latest fence_bound after it
    last_beat: float = 0.0
    beats: int = 0
    incarnation: str = ""
    session: str = ""
    ready: bool = False
    rooms: set[int] = field(default_factory=set)  # keys of its rooms in the table (failed ones waiting for their fence included)
    draining: bool = False
    beat_wall: float = 0.0  # wall clock when the last heartbeat left
    rtt: float = -1.0  # seconds, from the last answered heartbeat
    skew: float = 0.0  # the prefill's wall clock minus ours
    connected: bool = False  # its TCP connection is up; heartbeats go only then (one queued meanwhile would be stale)
    unreachable: str = ""  # why the last connect failed, until one succeeds
    stages: bool = False  # its welcome said it writes staged legs (LegRequest.staged_at)
    # The prefill's monotonic clock minus ours, lower bounds from its latest answers:
    # each was read there before the answer left and here after it arrived.
    offsets: collections.deque = field(default_factory=lambda: collections.deque(maxlen=OFFSET_SAMPLES))
    held: dict[int, RoomRequest] = field(default_factory=dict)  # room requests waiting for a first offset, by room id
    # Connections lost so far: a room's request leaves on the connection of its epoch, so
    # rooms asked for after the last loss reached whoever answers on the next one.
    epoch: int = 0

    def clock_sample(self, theirs: float, now: float) -> None:
        if theirs:
            self.offsets.append(theirs - now)

    def writes_until(self, now: float, span: float) -> float:
        """Leave to write for ``span`` seconds from ``now``, on the prefill's clock and
        never later than the truth; 0 before its clock was seen."""
        return now + max(self.offsets) + span if self.offsets else 0.0


@dataclass(eq=False)
class LegState:
    """One leg of a decode rank's room (docs/engines.md §A4): one prefill rank's part."""

    request: LegRequest
    landed: bool = False  # its KV (and, for the leg that carries it, the aux record) verified; a dummy leg at once
    peer_failed: bool = False  # the failure came from that prefill rank: it knows
    first_check: float = 0.0  # first verification attempt of what landed
    stage_layout: StagedLayout | None = None  # where it lies in the staging extent it gains from (core/staging.py), taken when its request leaves

    @property
    def whole(self) -> bool:
        """Whole pages of every layer: what --verify-kv's digest covers."""
        return self.request.head_count == 0 and self.request.layers == (0, 0)


@dataclass(eq=False)
class DecodeWork:
    engine: bytes
    link: str
    memory_version: int
    pages: np.ndarray
    legs: dict[int, LegState]  # by leg code
    epoch: int = 0  # its link's epoch when it was asked for
    span: Span = Span(1, 1)  # the generations of our sessions it may be written into (core/generations.py)
    started: float = 0.0  # when we learnt the prefill began writing


@dataclass(frozen=True)
class StagedExtent:
    """A staged leg's extent of the staging buffer (core/staging.py), held until proof
    that nothing of the leg can land any more, however long its room lives."""

    offset: int
    link: str  # the prefill's endpoint
    epoch: int  # its link's epoch when the room was asked for


@dataclass(eq=False)
class PendingRequest:
    """A room's legs from the local ranks that expected it so far, before its request
    leaves for the prefill daemon (A5)."""

    link: PrefillLink
    legs: list[LegRequest]


@dataclass(eq=False)
class DecodeState:
    """What the decode role's parts share."""

    links: dict[str, PrefillLink] = field(default_factory=dict)  # by the prefill's bootstrap endpoint
    work: dict[int, DecodeWork] = field(default_factory=dict)  # by room key
    pending: dict[tuple[str, int], PendingRequest] = field(default_factory=dict)  # (prefill endpoint, room id): legs gathering (A5)
    staged: dict[tuple[int, int], StagedExtent] = field(default_factory=dict)  # (room key, leg code): its extent, until fenced
