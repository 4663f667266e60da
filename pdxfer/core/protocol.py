"""Every message pdxfer sends, as frozen msgspec structs in tagged unions.

Two conversations use this module:

* engine <-> daemon (the engine's ZMQ DEALER to the daemon's ROUTER), and
* daemon <-> daemon (the bootstrap channel: a decode daemon's TCP connection to a
  prefill daemon, framed by wire/bootstrap.py).

Every message is one MessagePack map whose ``kind`` field names its struct. Page
index lists travel as ``bytes`` holding little-endian int32 values, so a request of
a million pages is one memcpy, not a million msgpack integers. ``proto/`` holds the
human-readable spec and the JSON Schema generated from these structs
(``python -m pdxfer.core.protocol``); a test fails if they drift.

The version's changelog sits beside PROTOCOL_VERSION, one line per version;
proto/PROTOCOL.md ("Version history") has the details, and the compatible changes made
within a version.
"""

from __future__ import annotations

import enum
import json
import struct
import sys
from typing import Annotated, Any, Union

import msgspec

# Changelog. Bump PROTOCOL_VERSION on any incompatible change, with a line here (a new
# field with a default needs no bump: older peers still decode the message).
# 1: first version (unreleased).
# 2: messages to one destination in one loop turn leave as one batch (one envelope, up to 256 frames).
# 3: leave to write: writes_until on room_request and heartbeat, clock on peer_welcome and heartbeat_ack.
# 4: engine identity (rank), engine-owned KV buffers and regions, announce, chunked send, prefix skip, every state change pushed.
# 5: sessions that end: peer_hello names the link's live legs (a prefill fails the others and moves these to the hello's
#    sessions), sessions_drained; a room's part writes only through the sessions it was given.
PROTOCOL_VERSION = 5

# MessagePack integers stop at 2**64 - 1, so 64-bit ids need no upper bound here.
RoomId = Annotated[int, msgspec.Meta(ge=1, description="bootstrap room id (uint64), never 0")]
ReqId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1, description="request id; 0 on pushed events, and on a request that wants no ok")]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Address = Annotated[int, msgspec.Meta(ge=0, description="uint64 address")]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Sessions = Annotated[tuple[Text, ...], msgspec.Meta(max_length=16, description="transfer engine sessions (host:port), one per engine")]
# int32 little-endian page indices; 4 bytes each.
PageBytes = Annotated[bytes, msgspec.Meta(max_length=64 * 1024 * 1024)]
AuxPayload = Annotated[bytes, msgspec.Meta(max_length=16 * 1024 * 1024)]
# (room, leg) pairs as little-endian uint64s, 16 bytes a pair (pack_legs).
LegPairs = Annotated[bytes, msgspec.Meta(max_length=16 * 1024 * 1024)]
_LEG_PAIR = struct.Struct("<QQ")
MAX_INLINE_KV_BYTES = 1024 * 1024  # KV that may ride an aux record instead of the transfer engine
InlineKV = Annotated[bytes, msgspec.Meta(max_length=MAX_INLINE_KV_BYTES)]


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Layout(str, enum.Enum):
    """How a KV pool arranges its pages (see plan.layout_regions)."""

    MHA = "mha"  # per layer, one K buffer and one V buffer
    MLA = "mla"  # per layer, one latent buffer
    PAGE_FIRST = "page_first"  # one buffer; a page holds every layer's K and V
    PAGE_FIRST_KV = "page_first_kv"  # a K buffer and a V buffer; a page holds every layer


class RegionKind(str, enum.Enum):
    """What one KV region holds; regions are matched between prefill and decode by (layer, kind)."""

    K = "k"
    V = "v"
    KV = "kv"  # K and V together (packed per token, or a page of K then V)
    LATENT = "latent"  # MLA
    DRAFT = "draft"  # a draft model's KV
    STATE = "state"


class PageOrder(str, enum.Enum):
    """How a page is laid out inside a region."""

    TOKEN_MAJOR = "token_major"  # [token][head][...] (SGLang, NHD)
    HEAD_MAJOR = "head_major"  # [head][token][...] (vLLM LBHNC)


class KVPacking(str, enum.Enum):
    SEPARATE = "separate"  # K and V in regions of their own
    PACKED_PER_TOKEN = "packed_per_token"  # one KV region, K then V for each token (vLLM CPU)


class RoomState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RoomState.SUCCESS, RoomState.FAILED})


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"
    VERSION_MISMATCH = "version_mismatch"
    COMPAT_MISMATCH = "compat_mismatch"
    NOT_REGISTERED = "not_registered"
    UNKNOWN_ROOM = "unknown_room"
    DUPLICATE_ROOM = "duplicate_room"
    PAGE_OUT_OF_RANGE = "page_out_of_range"
    STALE_MEMORY_VERSION = "stale_memory_version"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    STALE_SLOT = "stale_slot"
    AUX_STAMP_MISMATCH = "aux_stamp_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    PEER_UNREACHABLE = "peer_unreachable"
    PEER_DEAD = "peer_dead"
    UNKNOWN_PEER = "unknown_peer"
    UNAUTHENTICATED = "unauthenticated"
    KV_DIGEST_MISMATCH = "kv_digest_mismatch"
    LEASE_EXPIRED = "lease_expired"
    UNSUPPORTED = "unsupported"
    BUSY = "busy"
    ENGINE_GONE = "engine_gone"
    INTERNAL = "internal"


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", omit_defaults=True):
    """Base of every message; ``kind`` carries the tag."""


# --- memory handles: what an engine hands its daemon so the daemon can map a buffer


class ShmHandle(Message, tag="shm"):
    """A POSIX shared-memory object under /dev/shm (CPU pools)."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")]
    size: Positive


class CudaIpcHandle(Message, tag="cuda_ipc"):
    """``cudaIpcGetMemHandle`` bytes of a GPU pool's base allocation."""

    handle: Annotated[bytes, msgspec.Meta(max_length=128)]
    size: Positive
    device: Count


class NpuIpcHandle(Message, tag="npu_ipc"):
    """Ascend IPC name of an NPU pool (``aclrtIpcMemGetExportKey``)."""

    handle: Annotated[bytes, msgspec.Meta(max_length=128)]
    size: Positive
    device: Count


MemoryHandle = Union[ShmHandle, CudaIpcHandle, NpuIpcHandle]
MAX_REGIONS = 4096  # KV regions (and buffers) one registration may name


class Rank(msgspec.Struct, frozen=True, kw_only=True):
    """An engine rank, or (as ``sizes``) the size of each parallel dimension, where a
    size left 0 means 1: ``sizes=Rank(tp=2)`` is TP 2 alone."""

    dp: Count = 0
    pp: Count = 0
    tp: Count = 0
    cp: Count = 0


ONE_RANK = Rank(dp=1, pp=1, tp=1, cp=1)  # the sizes of an engine that runs one rank


class Heads(msgspec.Struct, frozen=True, kw_only=True):
    """KV heads: held by this rank, in the model, and bytes of one token of one head."""

    local: Positive
    total: Positive
    bytes_per_token_head: Positive


class KVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the pages of an engine's KV cache mean: the layout descriptor of its regions."""

    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20, description="tokens per page")]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    num_layers_total: Positive
    layers: tuple[Count, Count]  # [start, end): the layers this rank holds
    heads: Heads
    page_order: PageOrder = PageOrder.TOKEN_MAJOR
    kv_packing: KVPacking = KVPacking.SEPARATE
    mla: bool = False


class KVRegion(msgspec.Struct, frozen=True, kw_only=True):
    """``num_pages`` pages of ``page_bytes`` at ``offset`` in buffer ``buffer`` (an index
    into the registration's buffers). Page p of the cache is page p of every region."""

    buffer: Count
    offset: Count
    page_bytes: Positive
    num_pages: Positive
    layer: Count
    kind: RegionKind


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a KV pool pdxfer creates for an engine (client.create_kv_pool), which
    registers it as one buffer and its regions (plan.layout_registration). ``token_bytes``
    is the size of one token of one layer in one K (or V, or latent) buffer: kv heads x
    head dim x dtype size."""

    layout: Layout
    num_layers: Positive
    num_pages: Positive
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20, description="tokens per page")]
    token_bytes: Positive
    dtype: Annotated[str, msgspec.Meta(max_length=32)]


class Compat(msgspec.Struct, frozen=True, kw_only=True):
    """What two daemons must agree on to move KV between their registrations.
    ``regions`` is every region as (layer, kind, page_bytes), sorted by (layer, kind):
    the order both sides plan in, so equal regions pair up by position."""

    version: int
    dtype: str
    page_size: int
    heads_total: int
    bytes_per_token_head: int
    page_order: PageOrder
    kv_packing: KVPacking
    mla: bool
    num_layers_total: int
    regions: tuple[tuple[int, RegionKind, int], ...]
    aux_slot_bytes: int


def compat_diff(prefill: Compat, decode: Compat) -> list[str]:
    """Each field that differs, as 'name: prefill=X decode=Y': the refusal is read in
    both sides' logs, where 'ours' would mean the opposite. Regions are named one by
    one (layer:kind:page_bytes), only those that differ."""
    out = []
    for name in prefill.__struct_fields__:
        ours, theirs = getattr(prefill, name), getattr(decode, name)
        if ours == theirs:
            continue
        if name == "regions":
            out.append(f"regions: prefill={_regions_only(ours, theirs)} decode={_regions_only(theirs, ours)}")
        else:
            out.append(f"{name}: prefill={_plain(ours)!r} decode={_plain(theirs)!r}")
    return out


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def _regions_only(these, those, most: int = 8) -> str:
    """The regions in ``these`` that are not in ``those``, the first ``most`` of them."""
    other = set(those)
    only = [f"{layer}:{kind.value}:{page_bytes}" for layer, kind, page_bytes in these if (layer, kind, page_bytes) not in other]
    more = f" and {len(only) - most} more" if len(only) > most else ""
    return "[" + ", ".join(only[:most]) + more + "]"


# --- engine -> daemon


class EngineHello(Message, tag="engine_hello"):
    """First message of an engine connection: who speaks (A1). A daemon serves every rank
    of every engine of its role on its node, each with its own pools, slots and rooms (a
    lane); it refuses a role other than its own and CP > 1."""

    req: ReqId
    version: int
    engine_id: Text = ""  # the engine instance, stable across its restarts
    role: Role | None = None
    rank: Rank = Rank()
    sizes: Rank = ONE_RANK
    device: Text = ""  # "cpu", "cuda:0", ...
    pid: Count = 0  # the engine's process, in its pid namespace: a daemon in the same one fails its rooms when it exits
    pid_namespace: Count = 0  # the inode of the engine's /proc/self/ns/pid


class RegisterKV(Message, tag="register_kv"):
    """Register (or replace, with a higher memory_version) the engine's KV cache: memory
    it owns (``buffers``, each mapped once however many regions it holds) and what its
    pages mean (``spec``, ``regions``)."""

    req: ReqId
    buffers: Annotated[tuple[MemoryHandle, ...], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]
    spec: KVSpec
    regions: Annotated[tuple[KVRegion, ...], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]
    memory_version: Positive


class RegisterAux(Message, tag="register_aux"):
    """Register the aux buffer: num_slots slots of slot_bytes each (a 32-byte stamp
    header then the payload; an engine that needs no aux record registers stamp-only
    slots, of 32 bytes, and the stamp tells it the room landed)."""

    req: ReqId
    memory: MemoryHandle
    num_slots: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    slot_bytes: Annotated[int, msgspec.Meta(ge=32, le=16 * 1024 * 1024)]


class AllocSlot(Message, tag="alloc_slot"):
    """Ask for an aux slot, or up to ``count`` at once (an engine may keep a few at
    hand; slots granted and never used go back after --retention)."""

    req: ReqId
    count: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class FreeSlot(Message, tag="free_slot"):
    """Give back a granted slot that was never bound to a room."""

    req: ReqId
    slot: Count
    generation: Positive


class Announce(Message, tag="announce"):
    """Prefill: this engine will send ``room``. The daemon pushes its status when the
    decode's request for it arrives (waiting_for_input, with the decode's pages and
    skip_pages), at once if it already did."""

    req: ReqId
    room: RoomId


class Send(Message, tag="send"):
    """Prefill: a chunk of ``room``'s KV: source pages for positions [first_page,
    first_page + len(pages)), written as soon as the decode's request is in. The
    ``last`` chunk carries the token count and the aux record (in ``slot``); a send
    without first_page and last is the whole room in one chunk. With
    ``release_when_settled`` the daemon releases the room itself once it has pushed its
    settled status (Success, or Failed and fenced): the engine sends no ``release``."""

    req: ReqId
    room: RoomId
    pages: PageBytes
    memory_version: Positive
    first_page: Count = 0
    last: bool = True
    num_tokens: Count = 0  # the room's prompt tokens; on the last chunk
    slot: Count = 0  # the aux slot, with its generation; on the last chunk
    generation: Count = 0
    aux_bytes: Count = 0  # payload bytes of the aux record in the slot
    release_when_settled: bool = False
    # A CUDA IPC event handle (cudaIpcEventHandle_t, 64 bytes) the engine recorded after the
    # work that wrote this chunk's pages: the daemon writes them once it completed.
    cuda_event: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Expect(Message, tag="expect"):
    """Decode: receive ``room`` from the prefill daemon at ``bootstrap`` into ``pages``
    (positions skip_pages.. of the room, with room for ``num_draft_tokens`` more) and
    ``slot``. The first ``skip_pages`` positions (a prefix this side holds) are not sent.
    ``prefill_sizes`` are the prefill engine's TP and PP sizes: with this rank's own,
    they say which prefill ranks write which heads and layers here (core/topology.py)."""

    req: ReqId
    room: RoomId
    bootstrap: Annotated[str, msgspec.Meta(max_length=256)]
    pages: PageBytes
    slot: Count
    generation: Positive
    memory_version: Positive
    num_draft_tokens: Count = 0
    skip_pages: Count = 0
    prefill_sizes: Rank = ONE_RANK


class Poll(Message, tag="poll"):
    req: ReqId
    room: RoomId


class Abort(Message, tag="abort"):
    req: ReqId
    room: RoomId
    reason: Text = "aborted by engine"


class Release(Message, tag="release"):
    """The engine is done with a finished room: its record and slot may be recycled.
    With req 0 (as free_slot) the daemon sends no reply; an error is only logged."""

    req: ReqId
    room: RoomId


class GetStats(Message, tag="get_stats"):
    req: ReqId


EngineRequest = Union[
    EngineHello, RegisterKV, RegisterAux, AllocSlot, FreeSlot, Announce, Send, Expect, Poll, Abort, Release, GetStats
]


# --- daemon -> engine


class Welcome(Message, tag="welcome"):
    req: ReqId
    version: int
    role: Role
    incarnation: str
    bootstrap: str  # where peer daemons reach this one ("" on decode)
    # Decode: seconds from a prefill's last word to the fencing of its failed rooms at the
    # latest (their pages and slots back to the engine): an engine must hold a failed
    # request's pages at least this long. 0 on prefill.
    fence_bound: float = 0.0


class Ok(Message, tag="ok"):
    req: ReqId


class SlotGrant(Message, tag="slot_grant"):
    req: ReqId
    slot: Count
    generation: Positive
    payload_bytes: Count
    more: tuple[tuple[Count, Positive], ...] = ()  # further (slot, generation) grants, when count > 1


class RoomStatus(Message, tag="room_status"):
    """Reply to Poll, and pushed (req=0) to the engine connection that owns the room on
    every change of its state, and again when a failed room becomes fenced. The engine
    may reuse a failed room's destination pages only once ``fenced`` is true: until
    then a write may land. On the prefill, once the decode's request is in, ``pages``
    is the positions the decode wants (skip_pages + its pages) and ``skip_pages`` the
    prefix it holds."""

    req: ReqId
    room: RoomId
    state: RoomState
    code: ErrorCode | None = None
    reason: str = ""
    fenced: bool = False
    pages: Count = 0
    skip_pages: Count = 0


class Error(Message, tag="error"):
    req: ReqId
    code: ErrorCode
    message: str
    room: int = 0


class Busy(Message, tag="busy"):
    req: ReqId
    reason: str
    retry_after_ms: Count
    room: int = 0  # the room a refused send or expect was for


class Stats(Message, tag="stats"):
    """Counts a daemon holds now; ``failures`` counts, since start, failed rooms by error code, handler and task errors (``task:NAME``) and peer messages dropped (``dropped:peer-message``)."""

    req: ReqId
    rooms: dict[str, int]
    slots: dict[str, int]
    failures: dict[str, int]
    peers: int


EngineReply = Union[Welcome, Ok, SlotGrant, RoomStatus, Error, Busy, Stats]


# --- daemon <-> daemon (bootstrap channel)


LegCode = Annotated[int, msgspec.Meta(ge=0, description="a leg's ranks: prefill (pp, tp), decode (pp, tp), 16 bits each")]


class LaneInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One engine rank's memory on a decode daemon (a lane): where a prefill writes its
    legs. Indexed by ``index``, which room requests name."""

    index: Count
    rank: Rank
    compat: Compat
    heads_local: Positive
    layers: tuple[Count, Count]
    region_bases: tuple[Address, ...]  # one per region, in compat.regions order, in the decode daemon's address space
    num_pages: Positive
    aux_base: Address
    aux_slots: Positive
    memory_version: Positive


class PeerHello(Message, tag="peer_hello"):
    """Decode -> prefill, first on a connection and again whenever a decode engine
    rank registers: where to write (every lane's pools) and what they look like."""

    version: int
    incarnation: str
    session: str  # transfer engine session id ("host:port"): its first engine's
    lanes: Annotated[tuple[LaneInfo, ...], msgspec.Meta(max_length=1024)]
    name: str = ""  # stable name of the sender (host/instance): a new incarnation under it replaces the old
    probe_base: Address = 0  # 64 scratch bytes a prefill may write to test its transfer session
    verify_kv: bool = False  # ask the prefill to send a KV digest with every aux record
    inline_kv_bytes: Count = 0  # the most KV this side takes inside an aux record (0: none; its pool is not host memory)
    engine_release: str = ""  # version of this side's transfer engine package ("": unknown)
    # Every transfer engine session of this daemon, ``session`` first: a prefill spreads
    # its writes over them (empty: ``session`` alone; a prefill that ignores them writes
    # through ``session``, which accepts writes to all of this daemon's memory too).
    sessions: Sessions = ()
    # The decode daemon's staging buffer (core/staging.py), which a LegRequest's staged_at
    # points into; size 0: it stages nothing.
    staging_base: Address = 0
    staging_bytes: Count = 0
    # Every leg of a room this decode daemon requested on the link and holds live (not
    # failed), as (room, leg) pairs (pack_legs). The prefill fails its parts of the link
    # that are not listed, then writes the listed ones through ``sessions`` from now on.
    live_legs: LegPairs = b""


class PeerWelcome(Message, tag="peer_welcome"):
    version: int
    incarnation: str
    session: str
    clock: float  # the prefill's monotonic clock when it answered: the decode side bounds the two clocks' offset from it
    stages: bool = False  # it writes a LegRequest with staged_at where that says (a prefill from before ignores it)


class PeerRefused(Message, tag="peer_refused"):
    code: ErrorCode
    reason: str


class LegRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One leg of a room request (docs/engines.md §A4): what one prefill rank writes into
    one decode rank's pages. A dummy leg (``real`` false) moves nothing: it lets the
    prefill rank's status complete. ``head_count`` 0 and ``layers`` (0, 0) mean whole
    pages and every layer (equal TP and PP)."""

    leg: LegCode = 0
    lane: Count = 0  # the decode lane (PeerHello.lanes index) whose pages and slot these are
    pages: PageBytes = b""
    slot: Count = 0
    generation: Count = 0  # 0: the leg carries no aux record
    memory_version: Positive
    num_draft_tokens: Count = 0
    skip_pages: Count = 0  # positions the decode holds already: pages[i] receives position skip_pages + i
    real: bool = True
    src_head_start: Count = 0
    head_count: Count = 0
    dst_head_start: Count = 0
    layers: tuple[Count, Count] = (0, 0)
    fan_out: Positive = 1  # decode ranks this leg's prefill rank writes to (decode TP / prefill TP, at least 1)
    # Nonzero: write the leg into the decode daemon's staging buffer at this address instead
    # of the pages (core/staging.py): region pair by pair, position by position, a slice of
    # head_count heads each; the decode daemon copies them into the pages once it landed.
    staged_at: Address = 0

    @property
    def carries_aux(self) -> bool:
        return self.generation > 0


class RoomRequest(Message, tag="room_request"):
    """Decode -> prefill: please write ``room``'s legs into these pages and slots. A
    decode daemon sends one per room per prefill daemon, listing the legs of all its
    local ranks (A5)."""

    room: RoomId
    legs: Annotated[tuple[LegRequest, ...], msgspec.Meta(min_length=1, max_length=1024)]
    lease_ms: Count = 0  # the prefill submits no write for this room later than this after it starts writing
    writes_until: float = 0.0  # leave to write, on the prefill's monotonic clock (see Heartbeat); 0: none given


class RoomAccepted(Message, tag="room_accepted"):
    """Prefill -> decode, once per room request: the legs it took."""

    room: RoomId
    input_ready: bool
    legs: Annotated[tuple[LegCode, ...], msgspec.Meta(max_length=1024)] = ()


class TransferStarted(Message, tag="transfer_started"):
    room: RoomId
    leg: LegCode = 0


class AuxRecord(Message, tag="aux_record"):
    """Prefill -> decode, after every KV block of the room completed. The stamp
    (room, generation, length, checksum) is what the destination slot must match;
    ``payload`` is set when aux travels over this channel, empty when it was
    written through the transfer engine."""

    room: RoomId
    slot: Count
    generation: Positive
    length: Count
    checksum: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    leg: LegCode = 0
    payload: AuxPayload = b""
    via_transfer_engine: bool = False
    kv_pages: Count = 0  # how many of the decode's pages (the first ones) were written in each region
    kv_digested: bool = False  # kv_digest is set (the decode side asked for --verify-kv)
    kv_digest: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0  # CRC-32 of those pages, region by region
    kv: InlineKV = b""  # a small room's KV itself, region by region, page by page, instead of transfer-engine writes


class RoomAck(Message, tag="room_ack"):
    """Decode -> prefill: the aux stamp verified; the room succeeded."""

    room: RoomId
    leg: LegCode = 0


class LegWritten(Message, tag="leg_written"):
    """Prefill -> decode, for a leg that carries no aux record, after every KV block of
    it completed: what AuxRecord says of KV for the leg that carries it."""

    room: RoomId
    leg: LegCode
    kv_pages: Count = 0
    kv_digested: bool = False
    kv_digest: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0


class RoomFailed(Message, tag="room_failed"):
    """Either direction: this room failed. ``fenced`` says the sender has no write
    to the receiver's memory still in flight for it."""

    room: RoomId
    code: ErrorCode
    reason: str
    fenced: bool = True
    leg: LegCode = 0


class Heartbeat(Message, tag="heartbeat"):
    """Decode -> prefill every heartbeat interval on every link.

    ``writes_until`` (also on RoomRequest) is the decode side's leave to write: a time
    on the prefill's monotonic clock, a lower bound of "sent + transfer timeout + fence
    timeout". Messages arrive in order, so every room the decode side failed before
    sending this has already been read as failed; any other room was live when it was
    sent, and its pages are held at least that long. The prefill submits no write to
    this decode side after the newest leave it has read."""

    seq: Count
    wall: float = 0.0  # sender's wall clock, seconds since the epoch
    writes_until: float = 0.0


class HeartbeatAck(Message, tag="heartbeat_ack"):
    seq: Count
    wall: float = 0.0  # the prefill's wall clock when it answered: the decode estimates skew from it
    clock: float = 0.0  # the prefill's monotonic clock when it answered (as PeerWelcome.clock)


class SessionsDrained(Message, tag="sessions_drained"):
    """Prefill -> decode, once per replaced set of sessions: nothing this prefill sent
    through ``sessions`` is in flight, and it sends nothing more through them."""

    sessions: Sessions


class PeerError(Message, tag="peer_error"):
    """Reply to a peer message that could not be accepted at all."""

    code: ErrorCode
    message: str
    room: int = 0
    leg: LegCode = 0


PeerMessage = Union[
    PeerHello,
    PeerWelcome,
    PeerRefused,
    RoomRequest,
    RoomAccepted,
    TransferStarted,
    AuxRecord,
    LegWritten,
    RoomAck,
    RoomFailed,
    Heartbeat,
    HeartbeatAck,
    SessionsDrained,
    PeerError,
]


# --- operator <-> daemon (admin endpoint; read-only unless the daemon runs with --admin-writes)


class RoomInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    room: int
    role: Role
    lane: int = 0  # the engine rank's lane on this daemon
    state: RoomState
    age: float  # seconds since the room was created
    in_state: float  # seconds in its current state
    peer: str
    slot: int
    generation: int
    bytes_planned: int
    bytes_moved: int
    fenced: bool
    code: ErrorCode | None = None
    reason: str = ""
    history: tuple[tuple[RoomState, float], ...] = ()  # (state, seconds after creation); in admin_room replies
    released: bool = False  # admin_room: its engine released it; only its outcome (state, code, reason) is kept


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    address: str  # bootstrap endpoint (decode side) or transfer session (prefill side)
    name: str
    incarnation: str
    state: str  # alive, draining, connecting (no connection now, or not welcomed yet), silent (heard from longer ago than the heartbeat bound)
    last_heard: float  # seconds ago
    rtt_ms: float  # heartbeat round trip (decode side; -1 where unknown)
    clock_skew_ms: float  # peer's wall clock minus ours, estimated from heartbeats (0 where unknown)
    rooms: int
    fence_pending: int = 0  # decode side: failed rooms whose pages wait for this prefill's proof (or the end of their sessions)
    fence_in: float = -1.0  # decode side: seconds until its fence-pending rooms are fenced at the latest; -1: none wait


class SlotInfo(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    state: str
    lane: int = 0  # whose aux buffer: the engine rank's lane on this daemon
    room: int
    generation: int
    since: float  # seconds in this state
    fence_in: float = 0.0  # quarantined: seconds until the fence deadline; -1: no deadline, waits for its writer's proof or a cut


class AdminRooms(Message, tag="admin_rooms"):
    req: ReqId
    state: RoomState | None = None
    peer: str = ""
    older_than: float = 0.0  # seconds


class AdminRoom(Message, tag="admin_room"):
    """One room in full; with ``fail`` (needs --admin-writes) the operator fails it."""

    req: ReqId
    room: RoomId
    fail: bool = False
    reason: str = "failed by an operator"


class AdminPeers(Message, tag="admin_peers"):
    """The peer table; with ``drain`` (needs --admin-writes) stop new rooms with that peer.
    With ``cut`` (decode side, needs --admin-writes) replace every transfer session of this
    daemon, so nothing a matching (or any) prefill sent can land, and fence every
    fence-pending room; the reply comes once that is done."""

    req: ReqId
    drain: str = ""
    cut: str = ""


class AdminSlots(Message, tag="admin_slots"):
    req: ReqId


class AdminInfo(Message, tag="admin_info"):
    req: ReqId


AdminRequest = Union[AdminRooms, AdminRoom, AdminPeers, AdminSlots, AdminInfo]


class RoomsReply(Message, tag="rooms"):
    req: ReqId
    rooms: list[RoomInfo]


class PeersReply(Message, tag="peers"):
    req: ReqId
    peers: list[PeerInfo]
    fenced: int = 0  # the answer to a cut: the rooms waiting for proof that its rotation fenced


class SlotsReply(Message, tag="slots"):
    req: ReqId
    slots: list[SlotInfo]


class InfoReply(Message, tag="info"):
    req: ReqId
    role: Role
    name: str
    incarnation: str
    version: int
    uptime: float
    wall: float
    ready: bool
    not_ready: list[str]  # what /readyz is waiting for
    draining: bool
    bootstrap: str
    session: str
    engine: str
    config: dict[str, Any]
    rooms: dict[str, int]
    slots: dict[str, int]
    failures: dict[str, int]
    counters: dict[str, float]  # bytes_moved, blocks_submitted, rooms_succeeded, rooms_failed, ...
    queues: dict[str, int]  # writes in flight per peer, jobs waiting
    sessions: list[str] = []  # every transfer engine session, ``session`` first


AdminReply = Union[RoomsReply, PeersReply, SlotsReply, InfoReply, Ok, Error]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """The first frame of every peer or admin batch, before its 1 to 256 message frames:
    who sends (its incarnation, new on every start) and, when the cluster has a
    secret, an HMAC-SHA256 over the incarnation and every message frame, each
    length-prefixed (first 16 bytes)."""

    incarnation: str
    mac: bytes = b""


def pack_legs(pairs) -> bytes:
    """(room, leg) pairs as PeerHello.live_legs carries them."""
    return b"".join(_LEG_PAIR.pack(room, leg) for room, leg in pairs)


def unpack_legs(data: bytes) -> set[tuple[int, int]]:
    """PeerHello.live_legs as a set of (room, leg); ValueError for a length that is no whole number of pairs."""
    if len(data) % _LEG_PAIR.size:
        raise ValueError(f"live_legs of {len(data)} bytes is not a whole number of 16-byte (room, leg) pairs")
    return set(_LEG_PAIR.iter_unpack(data))


def tag_of(message: Message) -> str:
    """The ``kind`` a message carries on the wire."""
    return type(message).__struct_config__.tag


# What a typed decoder raises for input that is not a valid message: msgspec reports
# bad UTF-8 inside a string as UnicodeDecodeError, not as one of its own errors.
UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError)


class Codec:
    """One encoder and typed decoders, built once and reused."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.encode = self.encoder.encode  # Message -> bytes; the encoder's own method, called for every message
        self.engine_requests = msgspec.msgpack.Decoder(EngineRequest)
        self.engine_replies = msgspec.msgpack.Decoder(EngineReply)
        self.peer_messages = msgspec.msgpack.Decoder(PeerMessage)
        self.admin_requests = msgspec.msgpack.Decoder(AdminRequest)
        self.admin_replies = msgspec.msgpack.Decoder(AdminReply)


def json_schema() -> dict:
    """The JSON Schema of every union, as committed under proto/."""
    (engine_req, engine_rep, peer, admin_req, admin_rep), components = msgspec.json.schema_components(
        [EngineRequest, EngineReply, PeerMessage, AdminRequest, AdminReply], ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"pdxfer protocol v{PROTOCOL_VERSION}",
        "description": "MessagePack on the wire; bytes fields are raw msgpack bin. "
        "Page index lists are little-endian int32 arrays.",
        "protocol_version": PROTOCOL_VERSION,
        "$defs": components,
        "properties": {
            "EngineRequest": engine_req,
            "EngineReply": engine_rep,
            "PeerMessage": peer,
            "AdminRequest": admin_req,
            "AdminReply": admin_rep,
        },
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_text())
