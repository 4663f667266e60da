"""What the prefill role keeps: the decode daemons that said hello, the chunks an engine
handed over, and each room part's work (its request, its chunks, its writes). Its parts
(service, writer, fan-out) share one ``PrefillState``, handed to each at construction."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from ...core.protocol import LaneInfo, LegRequest, PeerHello, RoomStatus
from ...core.staging import StagedLayout
from ...core.topology import room_of
from ...transport import Job, Peer


@dataclass(eq=False)
class DecodePeer:
    """A decode daemon that said hello on the bootstrap channel."""

    identity: bytes
    hello: PeerHello
    last_heard: float
    lanes: dict[int, LaneInfo] = field(default_factory=dict)  # its engine ranks' memory, by lane index (from hello)
    rooms: set[int] = field(default_factory=set)
    draining: bool = False
    retiring: set[Peer] = field(default_factory=set)  # its replaced sessions we owe a sessions_drained for (once nothing of ours is in flight there)
    skew: float = 0.0  # its wall clock minus ours, from its last heartbeat (seconds, one-way)
    writes_until: float = 0.0  # the newest leave to write it gave (our clock; 0: none), see protocol.Heartbeat

    def __post_init__(self) -> None:
        self.said(self.hello)

    def said(self, hello: PeerHello) -> None:
        """Its latest hello: where each of its ranks' memory is now."""
        self.hello, self.lanes = hello, {lane.index: lane for lane in hello.lanes}

    @property
    def label(self) -> str:
        return self.hello.session

    @property
    def sessions(self) -> Peer:
        """Where its KV is written: every session it announced, or the one (a daemon before striping)."""
        return self.hello.sessions or (self.hello.session,)


@dataclass(eq=False)
class Chunk:
    """A piece of a room's input as the engine handed it over (send)."""

    first_page: int
    pages: np.ndarray
    last: bool
    num_tokens: int
    aux_bytes: int
    release_when_settled: bool
    waiting: bool = False  # for its CUDA event: the work that writes its pages has not completed yet


@dataclass(eq=False)
class PrefillWork:
    engine: bytes = b""  # the engine connection that announced or sent the room
    chunks: list[Chunk] = field(default_factory=list)  # handed over, not written yet
    first: int = -1  # the first chunk's first position (-1: no chunk yet)
    end: int = 0  # where the chunks handed over so far end
    last: bool = False  # the last chunk is in
    num_tokens: int = 0
    aux_bytes: int = 0
    memory_version: int = 0
    peer: bytes = b""  # identity of the decode daemon, once its request arrived
    sessions: Peer = ()  # the decode daemon's sessions this part writes through: those it knew when its request came, or a later peer_hello's that listed it live
    request: LegRequest | None = None  # this rank's leg of the room request
    lease_ms: int = 0  # the request's lease
    dst_pages: np.ndarray | None = None
    staged_layout: StagedLayout | None = None  # a staged leg: where it lies in its extent of the decode's buffer, once checked
    started: bool = False  # both halves were in and checked: chunks are written as they come
    kept: list[np.ndarray] = field(default_factory=list)  # source pages written (positions the decode skips dropped), in order
    written: int = 0  # destination pages written: the first ``written`` of dst_pages
    aux_slot: int = -1  # the engine's aux slot the record is read from (a fan-out room's is its first room's)
    handed: list[Chunk] = field(default_factory=list)  # every chunk handed over, for a fan-out room made later
    fans: list[int] = field(default_factory=list)  # the first room of a prefill rank: its fan-out rooms' keys
    first_room: int = 0  # a fan-out room: its first room's key
    aux_sent: bool = False
    lease_end: float = 0.0
    digest: int | None = None

    def take(self, room, chunk: Chunk) -> None:
        """A chunk of the room's input, handed over (its first, its last, in order)."""
        if chunk.last:
            self.last, self.num_tokens, self.aux_bytes = True, chunk.num_tokens, chunk.aux_bytes
            room.release_when_settled = chunk.release_when_settled
        if self.first < 0:
            self.first = chunk.first_page
        self.end = chunk.first_page + chunk.pages.size
        self.chunks.append(chunk)
        self.handed.append(chunk)

    @property
    def leg(self) -> int:
        """The leg code of the room's request (0 before it came)."""
        return self.request.leg if self.request is not None else 0

    def fans_out(self) -> bool:
        """Whether this room part is one of several of a prefill rank's room (parts.py):
        a first part with fan-out parts, or a fan-out part, or the first of a request
        that said more are to come."""
        return bool(self.fans or self.first_room or (self.request is not None and self.request.fan_out > 1))

    def status(self, room, req: int = 0) -> RoomStatus:
        """What the engine hears of a room that is its only part: its own state, and the
        positions the decode's request wants."""
        pages, skip = (self.request.skip_pages + self.dst_pages.size, self.request.skip_pages) if self.request is not None else (0, 0)
        return RoomStatus(req=req, room=room_of(room.id), state=room.state, code=room.code, reason=room.reason, fenced=room.fenced,
                          pages=pages, skip_pages=skip)

    def source_pages(self) -> np.ndarray:
        """Every source page written, in the order of the destination pages they went to."""
        return np.concatenate(self.kept) if self.kept else np.zeros(0, np.int32)


@dataclass(eq=False)
class PrefillState:
    """What the prefill role's parts share."""

    peers: dict[bytes, DecodePeer] = field(default_factory=dict)  # by bootstrap connection identity
    work: dict[int, PrefillWork] = field(default_factory=dict)  # by room key
    gathered: dict[Job, int] = field(default_factory=dict)  # a chunk's job: the staging extent it is written from, until its writes settled
    # Jobs not settled, or given up on by the pump, by the sessions they write to: a decode
    # daemon hears sessions_drained for replaced sessions once none is left there.
    in_flight_to: collections.Counter[Peer] = field(default_factory=collections.Counter)
