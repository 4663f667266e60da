"""The wire protocol: every message round-trips through the Codec for its union, bad
input is rejected by the typed decoders, the committed JSON Schema matches the
structs, and compatibility hashing notices every field."""

from __future__ import annotations

import json
import pathlib
import typing

import msgspec
import pytest

from pdxfer.client import raise_for
from pdxfer.core import errors, protocol as p

SCHEMA_PATH = pathlib.Path(__file__).resolve().parent.parent / "proto" / "schema.json"

K, V = p.RegionKind.K, p.RegionKind.V
COMPAT = p.Compat(
    version=p.PROTOCOL_VERSION,
    dtype="bf16",
    page_size=16,
    heads_total=8,
    bytes_per_token_head=256,
    page_order=p.PageOrder.TOKEN_MAJOR,
    kv_packing=p.KVPacking.SEPARATE,
    mla=False,
    num_layers_total=2,
    regions=((0, K, 128), (0, V, 128), (1, K, 128), (1, V, 128)),
    aux_slot_bytes=4096,
)
SPEC = p.KVSpec(
    page_size=16, dtype="fp8", num_layers_total=32, layers=(8, 16), heads=p.Heads(local=2, total=8, bytes_per_token_head=128),
    page_order=p.PageOrder.HEAD_MAJOR, kv_packing=p.KVPacking.PACKED_PER_TOKEN, mla=True,
)
REGIONS = (
    p.KVRegion(buffer=0, offset=0, page_bytes=8192, num_pages=100, layer=8, kind=p.RegionKind.KV),
    p.KVRegion(buffer=1, offset=2**40, page_bytes=8192, num_pages=100, layer=9, kind=p.RegionKind.LATENT),
)
PAGES = (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
BIG = 2**64 - 1  # largest room id / address msgpack carries

# One populated instance of every message, non-default values wherever possible so
# that a field dropped or renamed on the wire is noticed.
SAMPLES: dict[type, list[p.Message]] = {
    p.EngineHello: [
        p.EngineHello(req=1, version=p.PROTOCOL_VERSION, engine_id="sglang-prefill", role=p.Role.PREFILL,
                      rank=p.Rank(dp=1, pp=2, tp=3, cp=0), sizes=p.Rank(dp=2, pp=4, tp=8, cp=1), device="cuda:3",
                      pid=4242, pid_namespace=4026531836),
        p.EngineHello(req=1, version=p.PROTOCOL_VERSION),
    ],
    p.RegisterKV: [
        p.RegisterKV(req=2, buffers=(p.ShmHandle(name="pdxfer-kv.0", size=1 << 20), p.ShmHandle(name="v", size=3)),
                     spec=SPEC, regions=REGIONS, memory_version=3),
        p.RegisterKV(req=2, buffers=(p.CudaIpcHandle(handle=b"\x01" * 64, size=1 << 30, device=3),), spec=SPEC, regions=REGIONS, memory_version=1),
        p.RegisterKV(req=2, buffers=(p.NpuIpcHandle(handle=b"\x02" * 65, size=4096, device=0),), spec=SPEC, regions=REGIONS, memory_version=1),
    ],
    p.RegisterAux: [p.RegisterAux(req=3, memory=p.ShmHandle(name="aux", size=65536), num_slots=8, slot_bytes=8192)],
    p.AllocSlot: [p.AllocSlot(req=4)],
    p.FreeSlot: [p.FreeSlot(req=5, slot=7, generation=9)],
    p.Announce: [p.Announce(req=0, room=BIG)],
    p.Send: [
        p.Send(req=6, room=BIG, pages=PAGES, num_tokens=20, slot=1, generation=2, aux_bytes=100, memory_version=4),
        p.Send(req=6, room=BIG, pages=PAGES, memory_version=4, first_page=7, last=False, release_when_settled=True),
    ],
    p.Expect: [
        p.Expect(
            req=7, room=11, bootstrap="tcp://10.0.0.1:18998", pages=PAGES, slot=2, generation=3, memory_version=1, num_draft_tokens=4,
            skip_pages=5, prefill_sizes=p.Rank(dp=1, pp=2, tp=4, cp=1),
        )
    ],
    p.Poll: [p.Poll(req=8, room=12)],
    p.Abort: [p.Abort(req=9, room=13, reason="client went away")],
    p.Release: [p.Release(req=10, room=14)],
    p.GetStats: [p.GetStats(req=11)],
    p.AdminRooms: [p.AdminRooms(req=1, state=p.RoomState.FAILED, peer="10.0.0.1", older_than=2.5), p.AdminRooms(req=2)],
    p.AdminRoom: [p.AdminRoom(req=3, room=BIG, fail=True, reason="stuck")],
    p.AdminPeers: [p.AdminPeers(req=4, drain="10.0.0.9")],
    p.AdminSlots: [p.AdminSlots(req=5)],
    p.AdminInfo: [p.AdminInfo(req=6)],
    p.RoomsReply: [
        p.RoomsReply(req=1, rooms=[p.RoomInfo(
            room=BIG, role=p.Role.DECODE, lane=3, state=p.RoomState.FAILED, age=3.5, in_state=1.0, peer="tcp://10.0.0.1:18998",
            slot=2, generation=7, bytes_planned=4096, bytes_moved=0, fenced=True, code=p.ErrorCode.PEER_DEAD,
            reason="prefill restarted", history=((p.RoomState.BOOTSTRAPPING, 0.0), (p.RoomState.FAILED, 2.5)),
        )])
    ],
    p.PeersReply: [p.PeersReply(req=4, peers=[p.PeerInfo(
        address="tcp://10.0.0.1:18998", name="p0", incarnation="abc", state="alive", last_heard=0.3, rtt_ms=0.2,
        clock_skew_ms=-1.5, rooms=3,
    )])],
    p.SlotsReply: [p.SlotsReply(req=5, slots=[p.SlotInfo(index=0, state="quarantined", lane=2, room=9, generation=4, since=0.5, fence_in=9.5)])],
    p.InfoReply: [p.InfoReply(
        req=6, role=p.Role.PREFILL, name="prefill", incarnation="abc", version=1, uptime=12.0, wall=1.7e9, ready=False,
        not_ready=["no engine connected"], draining=False, bootstrap="10.0.0.1:18998", session="10.0.0.1:15000",
        engine="ipc:///run/pdxfer/prefill.engine.sock", config={"role": "prefill", "max_rooms": 4096},
        rooms={"success": 2}, slots={"free": 4}, failures={"timeout": 1}, counters={"bytes_moved": 1e9},
        queues={"writes_in_flight": 3},
    )],
    p.Stats: [p.Stats(req=11, rooms={"success": 3}, slots={"free": 4, "quarantined": 1}, failures={"timeout": 2}, peers=1)],
    p.Welcome: [p.Welcome(req=1, version=1, role=p.Role.DECODE, incarnation="abc", bootstrap="")],
    p.Ok: [p.Ok(req=2)],
    p.SlotGrant: [p.SlotGrant(req=3, slot=4, generation=5, payload_bytes=4064)],
    p.RoomStatus: [
        p.RoomStatus(req=0, room=15, state=p.RoomState.FAILED, code=p.ErrorCode.TIMEOUT, reason="slow peer", fenced=True),
        p.RoomStatus(req=4, room=15, state=p.RoomState.TRANSFERRING),
        p.RoomStatus(req=0, room=15, state=p.RoomState.WAITING_FOR_INPUT, pages=12, skip_pages=3),
    ],
    p.Error: [p.Error(req=5, code=p.ErrorCode.PAGE_OUT_OF_RANGE, message="page 9 of 0..7", room=16)],
    p.Busy: [p.Busy(req=6, reason="room table full", retry_after_ms=50)],
    p.PeerHello: [
        p.PeerHello(
            version=1,
            incarnation="inc-1",
            session="10.0.0.2:12345",
            lanes=(
                p.LaneInfo(
                    index=0, rank=p.Rank(), compat=COMPAT, heads_local=8, layers=(0, 2), region_bases=(0x7F00_0000_0000, BIG),
                    num_pages=1000, aux_base=0x7E00_0000_0000, aux_slots=64, memory_version=2,
                ),
                p.LaneInfo(
                    index=1, rank=p.Rank(dp=0, pp=1, tp=3, cp=0), compat=COMPAT, heads_local=2, layers=(1, 2),
                    region_bases=(0x7C00_0000_0000,), num_pages=7, aux_base=0x7B00_0000_0000, aux_slots=3, memory_version=5,
                ),
            ),
            name="10.0.0.2/decode-7",
            probe_base=0x7D00_0000_0040,
            verify_kv=True,
            sessions=("10.0.0.2:12345", "10.0.0.2:12346"),
            live_legs=p.pack_legs([(17, 0), (BIG, 2**64 - 1)]),
        )
    ],
    p.PeerWelcome: [p.PeerWelcome(version=1, incarnation="inc-2", session="10.0.0.1:1", clock=5123.25)],
    p.PeerRefused: [p.PeerRefused(code=p.ErrorCode.COMPAT_MISMATCH, reason="page_size: prefill=16 decode=32")],
    p.RoomRequest: [
        p.RoomRequest(
            room=17, legs=(p.LegRequest(pages=PAGES, slot=3, generation=8, memory_version=2, num_draft_tokens=2, skip_pages=4),),
            lease_ms=30000, writes_until=5163.5,
        ),
        p.RoomRequest(room=BIG, legs=(
            p.LegRequest(leg=(1 << 48) | (2 << 32) | (3 << 16) | 4, lane=5, pages=PAGES, slot=6, generation=7, memory_version=8,
                         src_head_start=1, head_count=2, dst_head_start=3, layers=(4, 9)),
            p.LegRequest(leg=1, lane=1, memory_version=1, real=False),
        )),
    ],
    p.RoomAccepted: [p.RoomAccepted(room=18, input_ready=True)],
    p.TransferStarted: [p.TransferStarted(room=19), p.TransferStarted(room=19, leg=2**64 - 1)],
    p.AuxRecord: [
        p.AuxRecord(room=20, slot=1, generation=2, length=3, checksum=2**32 - 1, payload=b"abc"),
        p.AuxRecord(room=20, slot=1, generation=2, length=3, checksum=0, leg=9, via_transfer_engine=True, kv_pages=5, kv_digest=7),
    ],
    p.LegWritten: [
        p.LegWritten(room=20, leg=3),
        p.LegWritten(room=20, leg=1 << 16, kv_pages=5, kv_digested=True, kv_digest=2**32 - 1),
    ],
    p.Heartbeat: [p.Heartbeat(seq=9, wall=1.7e9, writes_until=5163.5)],
    p.HeartbeatAck: [p.HeartbeatAck(seq=9, wall=1.7e9 + 0.25, clock=5123.5)],
    p.SessionsDrained: [p.SessionsDrained(sessions=("10.0.0.2:12345", "10.0.0.2:12346"))],
    p.RoomAck: [p.RoomAck(room=21), p.RoomAck(room=21, leg=5)],
    p.RoomFailed: [p.RoomFailed(room=22, code=p.ErrorCode.TRANSFER_FAILED, reason="write failed", fenced=False, leg=6)],
    p.PeerError: [p.PeerError(code=p.ErrorCode.UNKNOWN_ROOM, message="no room 23", room=23, leg=7)],
}

UNIONS = {
    "engine_requests": p.EngineRequest,
    "engine_replies": p.EngineReply,
    "peer_messages": p.PeerMessage,
    "admin_requests": p.AdminRequest,
    "admin_replies": p.AdminReply,
}
SHARED = {p.Ok, p.Error}  # replies both the engine and the admin conversations use
HANDLES = set(typing.get_args(p.MemoryHandle))


def unions_of(cls: type) -> list[str]:
    return [n for n, u in UNIONS.items() if cls in typing.get_args(u)]


def union_of(cls: type) -> str:
    (name,) = unions_of(cls)
    return name


def all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from all_subclasses(sub)


@pytest.fixture(scope="module")
def codec() -> p.Codec:
    return p.Codec()


def test_samples_cover_every_message_kind():
    # Every Message is in exactly one union (or is a memory handle nested in one),
    # and this file has a sample of each: a new message cannot skip these tests.
    messages = set(all_subclasses(p.Message)) - HANDLES
    assert set(SAMPLES) == messages
    for cls in messages - SHARED:
        union_of(cls)  # exactly one
    for cls in SHARED:
        assert unions_of(cls) == ["engine_replies", "admin_replies"]
    tags = [p.tag_of(s[0]) for s in SAMPLES.values()]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(
    "message", [m for ms in SAMPLES.values() for m in ms], ids=lambda m: f"{p.tag_of(m)}"
)
def test_round_trip(codec, message):
    raw = codec.encode(message)
    assert msgspec.msgpack.decode(raw)["kind"] == p.tag_of(message)
    for union in unions_of(type(message)):
        decoded = getattr(codec, union).decode(raw)
        assert type(decoded) is type(message)
        assert decoded == message


def test_a_message_from_another_conversation_is_rejected(codec):
    with pytest.raises(msgspec.ValidationError):
        codec.peer_messages.decode(codec.encode(p.Poll(req=1, room=2)))
    with pytest.raises(msgspec.ValidationError):
        codec.engine_requests.decode(codec.encode(p.RoomAck(room=2)))


def raw(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("decoder", "data", "where"),
    [
        ("engine_requests", raw(kind="no_such_kind", req=1), "kind"),
        ("engine_requests", raw(req=1, room=2), "kind"),  # no kind at all
        ("engine_requests", raw(kind="poll", req="1", room=2), "req"),  # wrong type
        ("engine_requests", raw(kind="poll", req=1, room="2"), "room"),
        ("engine_requests", raw(kind="poll", req=1, room=0), "room"),  # room 0 is never valid (F3)
        ("engine_requests", raw(kind="poll", req=1, room=-5), "room"),
        ("engine_requests", raw(kind="poll", req=-1, room=2), "req"),
        ("engine_requests", raw(kind="free_slot", req=1, slot=-1, generation=1), "slot"),
        ("engine_requests", raw(kind="free_slot", req=1, slot=1, generation=0), "generation"),
        ("engine_requests", raw(kind="send", req=1, room=3, pages=[1, 2], num_tokens=2, slot=0, generation=1, aux_bytes=0, memory_version=1), "pages"),
        ("engine_requests", raw(kind="register_aux", req=1, memory={"kind": "shm", "name": "../etc", "size": 1}, num_slots=1, slot_bytes=64), "name"),
        ("engine_requests", raw(kind="register_aux", req=1, memory={"kind": "shm", "name": "a", "size": 1}, num_slots=1, slot_bytes=8), "slot_bytes"),
        ("engine_replies", raw(kind="room_status", req=0, room=1, state="sleeping"), "state"),
        ("peer_messages", raw(kind="room_ack", room=0), "room"),
        ("peer_messages", raw(kind="room_failed", room=1, code="not_a_code", reason="x"), "code"),
        ("peer_messages", raw(kind="aux_record", room=1, slot=0, generation=1, length=0, checksum=2**32), "checksum"),
        ("peer_messages", raw(kind="room_request", room=1, legs=[]), "legs"),  # a room has at least one leg
        ("peer_messages", raw(kind="room_request", room=1, legs=[{"memory_version": 1, "leg": -1}]), "leg"),
        ("peer_messages", raw(kind="room_request", room=1, legs=[{"leg": 0}]), "memory_version"),
        ("peer_messages", raw(kind="leg_written", room=1), "leg"),
    ],
)
def test_decoders_reject_bad_input(codec, decoder, data, where):
    with pytest.raises(msgspec.ValidationError) as info:
        getattr(codec, decoder).decode(data)
    # The error points at the offending field, so the reply can say what was wrong.
    assert where in str(info.value)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81\xa4kind", b"\x92\x01\x02"])
def test_decoders_reject_malformed_bytes(codec, data):
    with pytest.raises(msgspec.DecodeError):
        codec.engine_requests.decode(data)


def test_schema_has_not_drifted():
    assert SCHEMA_PATH.read_text() == p.schema_text(), (
        "proto/schema.json is out of date with pdxfer/core/protocol.py: run `make schema` and commit the result"
    )


def test_protocol_version_appears_in_the_schema():
    schema = json.loads(p.schema_text())
    assert schema["protocol_version"] == p.PROTOCOL_VERSION
    assert f"v{p.PROTOCOL_VERSION}" in schema["title"]
    assert set(schema["properties"]) == {"EngineRequest", "EngineReply", "PeerMessage", "AdminRequest", "AdminReply"}
    # Every message kind is described, so a non-Python engine can speak the protocol.
    for cls in SAMPLES:
        assert cls.__name__ in schema["$defs"]


def test_compat_diff_of_equal_layouts_is_empty():
    assert p.compat_diff(COMPAT, msgspec.structs.replace(COMPAT)) == []


# Each compat field changed, and how a refusal names the change.
CHANGED = {
    "version": (p.PROTOCOL_VERSION + 1, f"version: prefill={p.PROTOCOL_VERSION} decode={p.PROTOCOL_VERSION + 1}"),
    "dtype": ("fp8", "dtype: prefill='bf16' decode='fp8'"),
    "page_size": (32, "page_size: prefill=16 decode=32"),
    "heads_total": (4, "heads_total: prefill=8 decode=4"),
    "bytes_per_token_head": (128, "bytes_per_token_head: prefill=256 decode=128"),
    "page_order": (p.PageOrder.HEAD_MAJOR, "page_order: prefill='token_major' decode='head_major'"),
    "kv_packing": (p.KVPacking.PACKED_PER_TOKEN, "kv_packing: prefill='separate' decode='packed_per_token'"),
    "mla": (True, "mla: prefill=False decode=True"),
    "num_layers_total": (3, "num_layers_total: prefill=2 decode=3"),
    "regions": (((0, K, 128), (0, V, 128), (1, K, 128), (1, V, 64)), "regions: prefill=[1:v:128] decode=[1:v:64]"),
    "aux_slot_bytes": (8192, "aux_slot_bytes: prefill=4096 decode=8192"),
}


def test_changed_covers_every_compat_field():
    assert set(CHANGED) == set(p.Compat.__struct_fields__)


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_compat_diff_notices_each_field(name):
    value, named = CHANGED[name]
    theirs = msgspec.structs.replace(COMPAT, **{name: value})
    assert p.compat_diff(COMPAT, theirs) == [named]


def test_compat_diff_names_every_differing_field_and_region():
    """A refusal names each field that differs, and each region one side has that the
    other has not (a layer missing, a kind of its own), the first 8 and a count."""
    theirs = msgspec.structs.replace(
        COMPAT, dtype="fp8", mla=True, regions=tuple((layer, p.RegionKind.LATENT, 64) for layer in range(10)),
    )
    assert p.compat_diff(COMPAT, theirs) == [
        "dtype: prefill='bf16' decode='fp8'",
        "mla: prefill=False decode=True",
        "regions: prefill=[0:k:128, 0:v:128, 1:k:128, 1:v:128] decode=[0:latent:64, 1:latent:64, 2:latent:64, 3:latent:64, "
        "4:latent:64, 5:latent:64, 6:latent:64, 7:latent:64 and 2 more]",
    ]


@pytest.mark.parametrize("code", list(p.ErrorCode))
def test_an_error_reply_raises_with_its_own_code(code):
    """Codes with a dedicated exception type raise that type; every other code still
    reaches the engine as itself, not as 'internal'."""
    with pytest.raises(errors.PdxferError) as caught:
        raise_for(p.Error(req=1, code=code, message="why", room=7))
    assert caught.value.code is code and caught.value.room == 7 and str(caught.value) == "why"
    dedicated = [cls for cls in errors.PdxferError.__subclasses__() if cls.code is code and cls is not errors.Busy]
    assert type(caught.value) is (dedicated[0] if dedicated else errors.PdxferError)


def test_a_hello_without_sessions_still_decodes(codec):
    """A decode daemon from before several engines per daemon sends no sessions: the
    prefill then writes through its one session (prefill_state.DecodePeer.sessions)."""
    hello = SAMPLES[p.PeerHello][0]
    raw = msgspec.msgpack.encode({k: v for k, v in msgspec.to_builtins(hello, builtin_types=(bytes,)).items() if k != "sessions"})
    assert codec.peer_messages.decode(raw).sessions == ()


def test_a_hello_with_too_many_sessions_is_refused(codec):
    hello = msgspec.structs.replace(SAMPLES[p.PeerHello][0], sessions=tuple(f"10.0.0.2:{port}" for port in range(17)))
    with pytest.raises(msgspec.ValidationError, match="sessions"):
        codec.peer_messages.decode(codec.encode(hello))


def test_a_hello_with_too_many_lanes_is_refused(codec):
    lane = SAMPLES[p.PeerHello][0].lanes[0]
    hello = msgspec.structs.replace(SAMPLES[p.PeerHello][0], lanes=(lane,) * 1025)
    with pytest.raises(msgspec.ValidationError, match="lanes"):
        codec.peer_messages.decode(codec.encode(hello))


def test_live_legs_round_trip_and_a_torn_list_is_refused():
    pairs = {(1, 0), (2**64 - 1, 2**64 - 1), (7, (1 << 32) | 3)}
    assert p.unpack_legs(p.pack_legs(sorted(pairs))) == pairs
    assert p.unpack_legs(b"") == set()
    with pytest.raises(ValueError, match="not a whole number"):
        p.unpack_legs(p.pack_legs([(1, 0)])[:-1])
