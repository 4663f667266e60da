"""H3, fuzzed: bad input from an engine or a peer gets a clear error reply, and nothing
else changes.

Both endpoints of a LIVE daemon pair are fed by raw ZMQ DEALER sockets from the test:

* the engine endpoint (one MessagePack frame a message): arbitrary bytes, random maps,
  valid kinds with a field of the wrong type or size, room 0, oversized page lists,
  unknown and duplicate rooms, out-of-range slots and pages, wrong protocol versions,
  handles the daemon cannot map. Every one must get an ``error`` (or ``busy``) reply
  echoing its ``req`` when it had a readable one;
* the prefill's bootstrap endpoint (an envelope frame and a payload frame): wrong
  frame counts, garbage envelopes, valid envelopes around random payloads, peer
  messages before any hello, hellos with the wrong version, and,
  against a daemon started with --cluster-secret-file, unsigned or wrongly signed
  messages on a connection that proved the secret in its handshake (one that did not
  is refused before its first message: test_peer_auth.py). Every one must get a
  ``peer_error`` or ``peer_refused`` reply. A hello whose lane has another KV layout
  is welcomed, and each room it requests fails naming the difference.

After every message the daemon must still run and its room and slot tables (and
peer count) must be what they were. Requests that legitimately change state (abort of
an unknown room, which leaves a tombstone; alloc_slot; a valid hello) are left out of
the fuzzing and tested on their own below.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdxfer.client import Client
from pdxfer.core import errors
from pdxfer.core import protocol as p
from pdxfer.core.plan import compat_of, layout_registration, pages_to_bytes
from pdxfer.core.protocol import RoomState
from pdxfer.daemon.server import loose_req
from pdxfer.roles.decode import bootstrap_endpoint
from pdxfer.tools.launch import start_daemon, stop_all
from pdxfer.wire.batch import MAX_BATCH
from pdxfer.wire.bootstrap import encode
from pdxfer.wire.seal import Seal

from .conftest import needs_mooncake, small_layout
from .peersocket import PeerSocket, decode_hello
from .roomkit import HB_BOUND, HB_FLAGS, SLACK, engine, start_room, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration, pytest.mark.timeout(180)]

MAX_BYTES = 65536  # --max-message-bytes of the daemons under test
NUM_PAGES = 256  # small_layout()
NUM_SLOTS = 16
PAYLOAD = 64
KNOWN_ROOM = 7  # a room that succeeded on both daemons and was never released
REPLY_TIMEOUT = 10.0  # no reply within this is a failure (a liveness bound with slack)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
CODEC = p.Codec()


# --- the live daemons


class Live:
    """A running daemon, an engine client on it, and a raw socket to poke it with."""

    def __init__(self, daemon, client: Client) -> None:
        self.daemon = daemon
        self.client = client

    def snapshot(self) -> tuple:
        stats = self.client.stats()
        return stats.rooms, stats.slots, stats.peers

    def failures(self) -> dict:
        return self.client.stats().failures


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _stop_all(daemons) -> None:
    codes = dict(zip((d.ready.get("name", d.role) for d in daemons), stop_all(daemons)))
    assert all(c == 0 for c in codes.values()), f"daemons exited abnormally: {codes}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill and a decode daemon with registered engines and one finished room."""
    runtime = tempfile.mkdtemp(prefix="pdx-")  # short: ipc paths are limited to ~107 bytes
    logs = tmp_path_factory.mktemp("pair-logs")  # kept by pytest for a look after a failure
    started, clients = [], []
    try:
        for role in ("prefill", "decode"):
            log = open(os.path.join(logs, f"{role}.log"), "w")
            started.append(start_daemon(role, runtime, "--max-message-bytes", str(MAX_BYTES), stderr=log))
        for d in started:
            clients.append(engine(d, small_layout(), slots=NUM_SLOTS, payload=PAYLOAD))
        prefill, decode = (Live(d, c) for d, c in zip(started, clients))
        case = start_room(prefill.client, decode.client, started[0].bootstrap, KNOWN_ROOM, [1, 2], [3, 4], seed=1)
        assert decode.client.wait(KNOWN_ROOM).state is RoomState.SUCCESS
        assert prefill.client.wait(KNOWN_ROOM).state is RoomState.SUCCESS
        case.check_bytes()
        yield prefill, decode
    finally:
        for c in clients:
            c.close()
        _stop_all(started)
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def engine_socks(pair):
    prefill, decode = pair
    socks = {"prefill": _dealer(prefill.daemon.engine), "decode": _dealer(decode.daemon.engine)}
    yield socks
    for s in socks.values():
        s.close(0)


def ask_engine(sock: zmq.Socket, raw: bytes):
    sock.send(raw)
    assert sock.poll(int(REPLY_TIMEOUT * 1000)), f"no reply to {raw[:80]!r}"
    return CODEC.engine_replies.decode(sock.recv())


def engine_decodes(raw: bytes) -> bool:
    """Whether the daemon's typed decoder accepts this message (then it is not 'malformed')."""
    try:
        CODEC.engine_requests.decode(raw)
        return True
    except p.UNDECODABLE:
        return False


def check_engine_error(live: Live, sock, raw: bytes, codes: set[str] | None = None, req: int = 0):
    """Send ``raw``; the reply must be an error (of one of ``codes``, echoing ``req``),
    never internal, and the daemon's tables must not change."""
    before = live.snapshot()
    reply = ask_engine(sock, raw)
    assert isinstance(reply, (p.Error, p.Busy)), f"{raw[:120]!r} got {reply}"
    if isinstance(reply, p.Error):
        assert reply.code is not p.ErrorCode.INTERNAL, f"bad input answered as an internal error: {reply}"
        assert reply.message, reply
        if codes is not None:
            assert reply.code.value in codes, f"{raw[:120]!r}: expected {codes}, got {reply}"
    assert reply.req == req, f"reply does not echo req {req}: {reply}"
    assert live.daemon.alive(), "the daemon died"
    assert live.snapshot() == before, "bad input changed the daemon's rooms, slots or peers"
    return reply


# --- strategies: engine messages

ENGINE_KINDS = ["engine_hello", "register_kv", "register_aux", "alloc_slot", "free_slot", "announce", "send", "expect",
                "poll", "abort", "release", "get_stats"]
FIELD_NAMES = ["kind", "req", "version", "engine_id", "role", "rank", "sizes", "device", "buffers", "spec", "regions", "memory",
               "memory_version", "num_slots", "slot_bytes", "slot", "generation", "room", "pages", "first_page", "last",
               "num_tokens", "aux_bytes", "bootstrap", "num_draft_tokens", "skip_pages", "reason", "name", "size"]
leaves = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=16) | st.binary(max_size=32)
)
values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)
req_ids = st.integers(min_value=1, max_value=2**63 - 1)
fresh_rooms = st.integers(min_value=1, max_value=2**64 - 1).filter(lambda r: r != KNOWN_ROOM)


def pages_bytes(pages) -> bytes:
    return pages_to_bytes(np.asarray(pages, dtype=np.int64))


def template(kind: str, req: int, room: int) -> dict:
    """A well-formed message of ``kind`` (the fuzzers then break one thing in it)."""
    shm = {"kind": "shm", "name": "pdx-fuzz-absent", "size": 1 << 20}
    spec, regions = msgspec.to_builtins(layout_registration(small_layout()))
    return {
        "engine_hello": {"version": p.PROTOCOL_VERSION, "engine_id": "fuzz"},
        "register_kv": {"buffers": [shm], "spec": spec, "regions": regions, "memory_version": 2},
        "register_aux": {"memory": shm, "num_slots": 4, "slot_bytes": 96},
        "alloc_slot": {},
        "free_slot": {"slot": 0, "generation": 1},
        "announce": {"room": room},
        "send": {"room": room, "pages": pages_bytes([5, 6]), "num_tokens": 8, "slot": 0, "generation": 1, "aux_bytes": 0, "memory_version": 1},
        "expect": {"room": room, "bootstrap": "127.0.0.1:1", "pages": pages_bytes([5, 6]), "slot": 0, "generation": 1, "memory_version": 1},
        "poll": {"room": room},
        "abort": {"room": room, "reason": "fuzz"},
        "release": {"room": room},
        "get_stats": {},
    }[kind] | {"kind": kind, "req": req}


@st.composite
def malformed_engine_messages(draw) -> bytes:
    """Bytes the daemon's decoder refuses: noise, random maps, or a valid kind with one
    field of the wrong type, missing, or over its size limit."""
    how = draw(st.sampled_from(["bytes", "map", "wrong_type", "missing", "oversize", "room0"]))
    if how == "bytes":
        raw = draw(st.binary(max_size=512))
    elif how == "map":
        keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=8)
        msg = draw(st.dictionaries(keys, values, max_size=8))
        if draw(st.booleans()):
            msg["kind"] = draw(st.sampled_from(ENGINE_KINDS) | st.text(max_size=12))
        raw = msgspec.msgpack.encode(msg)
    else:
        kind = draw(st.sampled_from(ENGINE_KINDS))
        msg = template(kind, draw(req_ids), draw(fresh_rooms))
        fields = [k for k in msg if k != "kind"]
        if how == "wrong_type":
            msg[draw(st.sampled_from(fields))] = draw(values)
        elif how == "missing":
            del msg[draw(st.sampled_from(fields))]
        elif how == "oversize":
            big = {"engine_id": "x" * 4097, "reason": "x" * 4097, "bootstrap": "h" * 300}
            field = draw(st.sampled_from([f for f in fields if f in big] or ["req"]))
            msg[field] = big.get(field, 2**64 - 1)  # 2**64 - 1 is over req's int63 bound
        else:  # room 0 is never a room
            if "room" not in msg:
                msg = template(draw(st.sampled_from(["announce", "send", "expect", "poll", "abort", "release"])), 1, 1)
            msg["room"] = 0
        raw = msgspec.msgpack.encode(msg)
    assume(not engine_decodes(raw))
    return raw


def test_engine_socket_is_owner_only(pair):
    for live in pair:
        path = live.daemon.engine[len("ipc://") :]
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, oct(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


@FUZZ
@given(raw=malformed_engine_messages(), role=st.sampled_from(["prefill", "decode"]))
def test_malformed_engine_messages_get_bad_message(pair, engine_socks, raw, role):
    live = pair[0] if role == "prefill" else pair[1]
    reply = check_engine_error(live, engine_socks[role], raw, {"bad_message"}, req=loose_req(raw))
    assert "decode" in reply.message or "exceeds" in reply.message, reply


@st.composite
def page_lists(draw, bad: bool):
    """Page indices; with ``bad``, at least one out of range (maybe a long list)."""
    n = draw(st.integers(min_value=1, max_value=draw(st.sampled_from([4, 64, 20000]))))
    good = st.integers(min_value=0, max_value=NUM_PAGES - 1)
    pages = draw(st.lists(good, min_size=n, max_size=n)) if n <= 64 else list(np.arange(n) % NUM_PAGES)
    if bad:
        wrong = draw(st.integers(min_value=-(2**31), max_value=-1) | st.integers(min_value=NUM_PAGES, max_value=2**31 - 1))
        pages[draw(st.integers(min_value=0, max_value=n - 1))] = wrong
    return pages


@st.composite
def semantic_engine_errors(draw):
    """Well-formed requests each with exactly one thing wrong, as (role, message dict, req,
    expected codes). None of them may change anything."""
    req = draw(req_ids)
    room = draw(fresh_rooms)
    case = draw(st.sampled_from([
        "unknown_poll", "unknown_release", "hello_version", "hello_role", "hello_cp", "hello_rank",
        "free_slot", "wrong_role", "announce_to_decode", "send_no_slot", "expect_pages", "expect_empty",
        "expect_ragged", "expect_version", "expect_duplicate", "expect_slot", "expect_ungranted", "expect_bootstrap",
        "send_pages", "send_tokens", "send_aux", "send_duplicate", "send_ungranted", "register_kv_version",
        "register_kv_small", "register_kv_region", "register_kv_absent", "register_gpu", "register_aux_small", "register_aux_absent",
        "register_aux_gpu",
    ]))
    role = "decode"
    expected: set[str]
    if case in ("unknown_poll", "unknown_release"):
        msg, expected = template(case.split("_")[1], req, room), {"unknown_room"}
        role = draw(st.sampled_from(["prefill", "decode"]))
    elif case == "hello_version":
        msg, expected = template("engine_hello", req, room), {"version_mismatch"}
        msg["version"] = draw(st.integers(min_value=-(2**63), max_value=2**63 - 1).filter(lambda v: v != p.PROTOCOL_VERSION))
        role = draw(st.sampled_from(["prefill", "decode"]))
    elif case.startswith("hello_"):  # a daemon serves every rank of its role (a lane each), none of these
        role = draw(st.sampled_from(["prefill", "decode"]))
        msg, expected = template("engine_hello", req, room), {"unsupported"}
        if case == "hello_role":
            msg["role"] = "decode" if role == "prefill" else "prefill"
        elif case == "hello_cp":
            msg["sizes"] = {"cp": draw(st.integers(min_value=2, max_value=2**63 - 1))}
        else:  # a rank not below its size
            dim = draw(st.sampled_from(["dp", "pp", "tp", "cp"]))
            msg["rank"], msg["sizes"], expected = {dim: draw(st.integers(min_value=1, max_value=2**63 - 1))}, {dim: 1}, {"bad_message"}
    elif case == "announce_to_decode":
        msg, expected = template("announce", req, room), {"bad_message"}
    elif case == "send_no_slot":  # the last chunk carries the aux slot
        msg, expected, role = template("send", req, room) | {"generation": 0}, {"bad_message"}, "prefill"
    elif case == "free_slot":  # no slot is granted while fuzzing, so none may be given back
        msg, expected = template("free_slot", req, room), {"stale_slot"}
        msg["slot"] = draw(st.integers(min_value=0, max_value=2**63 - 1))
        msg["generation"] = draw(st.integers(min_value=1, max_value=2**63 - 1))
        role = draw(st.sampled_from(["prefill", "decode"]))
    elif case == "wrong_role":
        role = draw(st.sampled_from(["prefill", "decode"]))
        msg, expected = template("expect" if role == "prefill" else "send", req, room), {"bad_message"}
    elif case.startswith("expect"):
        msg = template("expect", req, room)
        expected = {"stale_slot"}  # what a request with nothing else wrong gets: its slot was never granted
        if case == "expect_pages":
            msg["pages"], expected = pages_bytes(draw(page_lists(bad=True))), {"page_out_of_range"}
        elif case == "expect_empty":
            msg["pages"], expected = b"", {"page_out_of_range"}
        elif case == "expect_ragged":
            msg["pages"] = draw(st.binary(min_size=1, max_size=64).filter(lambda b: len(b) % 4))
            expected = {"bad_message"}
        elif case == "expect_version":
            msg["memory_version"] = draw(st.integers(min_value=2, max_value=2**63 - 1))
            expected = {"stale_memory_version"}
        elif case == "expect_duplicate":
            msg["room"], expected = KNOWN_ROOM, {"duplicate_room"}
        elif case == "expect_slot":
            msg["slot"] = draw(st.integers(min_value=NUM_SLOTS, max_value=2**63 - 1))
        elif case == "expect_ungranted":
            msg["pages"] = pages_bytes(draw(page_lists(bad=False)))
            msg["slot"] = draw(st.integers(min_value=0, max_value=NUM_SLOTS - 1))
            msg["generation"] = draw(st.integers(min_value=1, max_value=2**63 - 1))
        elif case == "expect_bootstrap":
            msg["bootstrap"] = draw(st.text(max_size=40))
            try:
                bootstrap_endpoint(msg["bootstrap"])
            except Exception:
                expected = {"bad_message"}
    else:
        role = "prefill"
        if case.startswith("send"):
            msg, expected = template("send", req, room), {"stale_slot"}
            if case == "send_pages":
                pages = draw(page_lists(bad=True))
                msg["pages"], msg["num_tokens"], expected = pages_bytes(pages), 4 * len(pages), {"page_out_of_range"}
            elif case == "send_tokens":  # 2 pages of 4 tokens hold 5..8 tokens
                msg["num_tokens"] = draw(st.integers(min_value=1, max_value=4) | st.integers(min_value=9, max_value=2**63 - 1))
                expected = {"insufficient_capacity"}
            elif case == "send_aux":
                msg["aux_bytes"], expected = draw(st.integers(min_value=PAYLOAD + 1, max_value=2**63 - 1)), {"insufficient_capacity"}
            elif case == "send_duplicate":
                msg["room"], expected = KNOWN_ROOM, {"duplicate_room"}
            else:
                msg["slot"] = draw(st.integers(min_value=0, max_value=2**63 - 1))
        elif case.startswith("register_kv"):
            role = draw(st.sampled_from(["prefill", "decode"]))
            msg = template("register_kv", req, room)
            if case == "register_kv_version":  # the registered pool again, under a version not above its own
                msg["buffers"], msg["memory_version"], expected = SAME_POOL, 1, {"stale_memory_version"}
            elif case == "register_kv_small":
                msg["buffers"][0]["size"], expected = draw(st.integers(min_value=1, max_value=8 * NUM_PAGES * 256 - 1)), {"insufficient_capacity"}
            elif case == "register_kv_region":  # one region past its buffer, or naming a buffer not registered
                at = draw(st.integers(min_value=0, max_value=len(msg["regions"]) - 1))
                if draw(st.booleans()):
                    msg["regions"][at]["offset"], expected = draw(st.integers(min_value=(1 << 20) - 1, max_value=2**63 - 1)), {"insufficient_capacity"}
                else:
                    msg["regions"][at]["buffer"], expected = draw(st.integers(min_value=1, max_value=2**63 - 1)), {"bad_message"}
            elif case == "register_kv_absent":
                msg["buffers"][0]["name"], expected = draw(absent_shm_names()), {"bad_message"}
            else:
                msg["buffers"] = [{"kind": draw(st.sampled_from(["cuda_ipc", "npu_ipc"])), "handle": b"\0" * 64, "size": 1 << 20, "device": 0}]
                expected = {"unsupported"}
        else:
            role = draw(st.sampled_from(["prefill", "decode"]))
            msg = template("register_aux", req, room)
            if case == "register_aux_small":
                msg["memory"]["size"], expected = draw(st.integers(min_value=1, max_value=4 * 96 - 1)), {"insufficient_capacity"}
            elif case == "register_aux_absent":
                msg["memory"]["name"], expected = draw(absent_shm_names()), {"bad_message"}
            else:
                msg["memory"] = {"kind": "cuda_ipc", "handle": b"\0" * 64, "size": 1 << 20, "device": 0}
                expected = {"unsupported"}
    return role, msg, req, expected


SAME_POOL = object()  # stands for the handle of the pool the live engine registered


def absent_shm_names():
    """Names a shm handle may carry (the protocol's pattern: no leading dot) that name
    nothing under /dev/shm. '.' and '..': see test_a_shm_name_naming_a_directory_is_bad_input."""
    return st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,39}", fullmatch=True).filter(
        lambda n: not os.path.exists(os.path.join("/dev/shm", n))
    )


@FUZZ
@given(case=semantic_engine_errors())
def test_engine_requests_with_one_thing_wrong_get_that_error_and_change_nothing(pair, engine_socks, case):
    role, msg, req, expected = case
    live = pair[0] if role == "prefill" else pair[1]
    if msg.get("buffers") is SAME_POOL:
        msg = msg | {"buffers": [msgspec.to_builtins(live.client.kv.memory.handle)]}
    raw = msgspec.msgpack.encode(msg)
    if len(raw) > MAX_BYTES:
        expected, req = {"bad_message"}, 0  # refused for its size before it is read
    else:
        assert engine_decodes(raw), msg
    check_engine_error(live, engine_socks[role], raw, expected, req=req)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_message_over_max_message_bytes_gets_a_clear_error(pair, engine_socks, role):
    live = pair[0] if role == "prefill" else pair[1]
    raw = msgspec.msgpack.encode(template("poll", 5, 9) | {"padding": b"\0" * MAX_BYTES})
    # Refused before it is decoded, so its request id is not read.
    reply = check_engine_error(live, engine_socks[role], raw, {"bad_message"}, req=0)
    assert f"exceeds the {MAX_BYTES}-byte limit" in reply.message, reply


def test_a_message_over_twice_the_limit_is_dropped_and_the_daemon_serves_on(pair):
    """Documented in proto/PROTOCOL.md: ZMQ drops it (and the connection) unbuffered."""
    _, decode = pair
    before = decode.snapshot()
    sock = _dealer(decode.daemon.engine)
    try:
        sock.send(b"\0" * (2 * MAX_BYTES + 1))
        assert not sock.poll(1000), "a message over twice the limit was answered"
    finally:
        sock.close(0)
    assert decode.daemon.alive()
    assert decode.snapshot() == before


def test_a_peer_frame_over_twice_the_limit_closes_its_connection_unread(pair):
    """Documented in proto/PROTOCOL.md: the prefill closes the connection as soon as
    the frame's length is read, before its bytes arrive, and serves others on."""
    prefill, _ = pair
    before = prefill.snapshot()
    sock = PeerSocket(f"tcp://{prefill.daemon.bootstrap}")
    try:
        # Only the lengths: a receiver that waited for the bytes would never answer.
        sock.sock.sendall(encode([envelope("a" * 16), b"x"])[:4] + (4).to_bytes(4, "little") + (2 * MAX_BYTES + 1).to_bytes(4, "little"))
        try:
            left = sock.sock.recv(1)
        except ConnectionResetError:  # closed by abort: a reset rather than an end of stream
            left = b""
        assert left == b"", "the connection stayed open"
    finally:
        sock.close()
    other = PeerSocket(f"tcp://{prefill.daemon.bootstrap}")
    try:
        reply = ask_peer(other, [envelope("a" * 16), b"\xc1 not msgpack"])
        assert isinstance(reply, p.PeerError) and reply.code is p.ErrorCode.BAD_MESSAGE, reply
    finally:
        other.close()
    assert prefill.daemon.alive()
    assert prefill.snapshot() == before


@pytest.mark.parametrize("kind", ["register_kv", "register_aux"])
@pytest.mark.parametrize("name", [".", ".."])
def test_a_shm_name_naming_a_directory_is_bad_input(pair, engine_socks, kind, name):
    _, decode = pair
    msg = template(kind, 77, 1)
    (msg["buffers"][0] if kind == "register_kv" else msg["memory"])["name"] = name
    check_engine_error(decode, engine_socks["decode"], msgspec.msgpack.encode(msg), {"bad_message"}, req=77)


def test_state_changing_requests_do_what_they_say(pair, engine_socks):
    """Left out of the fuzzing because they legitimately change state."""
    prefill, decode = pair
    # abort of an unknown room records a tombstone, so the other half learns of the
    # abort when it shows up: here the prefill engine's own send() for that room.
    before = prefill.snapshot()
    sock = engine_socks["prefill"]
    assert isinstance(ask_engine(sock, msgspec.msgpack.encode(template("abort", 3, 4242) | {"reason": "gone"})), p.Ok)
    late = template("send", 4, 4242) | {"slot": 0, "generation": 1}
    reply = check_engine_error(prefill, sock, msgspec.msgpack.encode(late), {"aborted"}, req=4)
    assert "gone" in reply.message, reply
    try:  # the tombstone may be held in the room table until released, or aside
        prefill.client.release(4242)
    except Exception:
        pass
    assert prefill.snapshot() == before
    # alloc_slot grants a slot; free_slot with its generation gives it back, a second time is stale.
    sock = engine_socks["decode"]
    before = decode.snapshot()
    grant = ask_engine(sock, msgspec.msgpack.encode(template("alloc_slot", 6, 1)))
    assert isinstance(grant, p.SlotGrant) and grant.req == 6 and grant.payload_bytes == PAYLOAD
    assert decode.snapshot()[1]["granted"] == before[1].get("granted", 0) + 1
    free = template("free_slot", 7, 1) | {"slot": grant.slot, "generation": grant.generation}
    assert isinstance(ask_engine(sock, msgspec.msgpack.encode(free)), p.Ok)
    check_engine_error(decode, sock, msgspec.msgpack.encode(free | {"req": 8}), {"stale_slot"}, req=8)
    assert decode.snapshot() == before
    # A valid hello, poll and get_stats answer and change nothing.
    welcome = ask_engine(sock, msgspec.msgpack.encode(template("engine_hello", 9, 1)))
    assert isinstance(welcome, p.Welcome) and welcome.role is p.Role.DECODE
    assert ask_engine(sock, msgspec.msgpack.encode(template("poll", 10, KNOWN_ROOM))).state is RoomState.SUCCESS
    assert isinstance(ask_engine(sock, msgspec.msgpack.encode(template("get_stats", 11, 1))), p.Stats)
    assert decode.snapshot() == before


# --- the bootstrap endpoint


@pytest.fixture(scope="module")
def peer_sock(pair):
    prefill, _ = pair
    sock = PeerSocket(prefill.daemon.bootstrap)
    yield sock
    sock.close(0)


def ask_peer(sock: PeerSocket, frames: list[bytes], timeout: float = REPLY_TIMEOUT):
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), f"no reply to {[f[:40] for f in frames]!r}"
    reply = sock.recv_multipart()
    assert len(reply) == 2, reply
    return CODEC.peer_messages.decode(reply[1])


def check_peer_error(live: Live, sock, frames: list[bytes], kinds=(p.PeerError,), codes: set[str] | None = None):
    before = live.snapshot()
    reply = ask_peer(sock, frames)
    assert isinstance(reply, kinds), f"{[f[:60] for f in frames]!r} got {reply}"
    assert reply.code is not p.ErrorCode.INTERNAL, reply
    if codes is not None:
        assert reply.code.value in codes, f"expected {codes}, got {reply}"
    assert live.daemon.alive(), "the prefill daemon died"
    assert live.snapshot() == before, "bad peer input changed the prefill's rooms, slots or peers"
    return reply


PEER_KINDS = ["peer_hello", "peer_welcome", "peer_refused", "room_request", "room_accepted", "transfer_started",
              "aux_record", "leg_written", "room_ack", "room_failed", "heartbeat", "heartbeat_ack", "peer_error"]
ENVELOPE = msgspec.msgpack.Encoder()
incarnations = st.text(alphabet="0123456789abcdef", min_size=1, max_size=16)


def envelope(incarnation: str, mac: bytes = b"") -> bytes:
    return ENVELOPE.encode(p.Envelope(incarnation, mac))


def peer_decodes(raw: bytes) -> bool:
    try:
        CODEC.peer_messages.decode(raw)
        return True
    except p.UNDECODABLE:
        return False


def envelope_decodes(raw: bytes) -> bool:
    try:
        msgspec.msgpack.decode(raw, type=p.Envelope)
        return True
    except p.UNDECODABLE:
        return False


@st.composite
def malformed_peer_frames(draw) -> list[bytes]:
    how = draw(st.sampled_from(["frame_count", "envelope", "payload_bytes", "payload_map"]))
    if how == "frame_count":  # no payload, or more than one message may carry
        return draw(st.just([draw(st.binary(max_size=64))]) | st.just([envelope(draw(incarnations))] + [b"\x80"] * (MAX_BATCH + 1)))
    if how == "envelope":
        env = draw(st.binary(max_size=64) | values.map(msgspec.msgpack.encode))
        assume(not envelope_decodes(env))
        return [env, draw(st.binary(max_size=64))]
    if how == "payload_bytes":
        payload = draw(st.binary(max_size=256))
    else:
        msg = draw(st.dictionaries(st.text(max_size=10), values, max_size=6))
        if draw(st.booleans()):
            msg["kind"] = draw(st.sampled_from(PEER_KINDS) | st.text(max_size=12))
        payload = msgspec.msgpack.encode(msg)
    assume(not peer_decodes(payload))
    return [envelope(draw(incarnations)), payload]


@FUZZ
@given(frames=malformed_peer_frames())
def test_malformed_peer_messages_get_peer_error(pair, peer_sock, frames):
    check_peer_error(pair[0], peer_sock, frames, codes={"bad_message"})


NOT_UTF8 = b"\xa5\x00\x00\x00\x00\x80"  # a msgpack string whose 5 bytes are not UTF-8


def test_a_string_that_is_not_utf8_is_bad_input_on_either_channel(pair, engine_socks, peer_sock):
    """msgspec reports bad UTF-8 inside a string as UnicodeDecodeError rather than as
    one of its own errors (hypothesis found it in an envelope); both channels answer it
    like any other undecodable message (H3)."""
    poll = b"\x83\xa4kind" + NOT_UTF8 + b"\xa3req\x09\xa4room\x01"  # {"kind": <not UTF-8>, "req": 9, "room": 1}
    reply = check_engine_error(pair[1], engine_socks["decode"], poll, {"bad_message"}, req=0)  # no part of it decodes, req neither
    assert "cannot decode engine message" in reply.message, reply
    envelope_of_bad_name = b"\x92" + NOT_UTF8 + b"\xc4\x00"  # [<not UTF-8>, b""]
    reply = check_peer_error(pair[0], peer_sock, [envelope_of_bad_name, CODEC.encode(p.Heartbeat(seq=1))], codes={"bad_message"})
    assert "cannot decode the envelope" in reply.message, reply


@st.composite
def peer_messages_before_hello(draw) -> bytes:
    """Valid peer messages other than peer_hello, from a sender the prefill never met."""
    room = draw(st.integers(min_value=1, max_value=2**64 - 1))
    code = draw(st.sampled_from(list(p.ErrorCode)))
    msg = draw(st.sampled_from([
        p.RoomRequest(room=room, legs=(p.LegRequest(pages=pages_bytes([1, 2]), slot=0, generation=1, memory_version=1),)),
        p.RoomRequest(room=KNOWN_ROOM, legs=(p.LegRequest(pages=pages_bytes([5]), slot=3, generation=9, memory_version=1),)),
        p.RoomAck(room=room),
        p.RoomAck(room=KNOWN_ROOM),
        p.RoomFailed(room=room, code=code, reason="fuzz"),
        p.RoomFailed(room=KNOWN_ROOM, code=code, reason="fuzz", fenced=False),
        p.Heartbeat(seq=room % 2**63),
        p.HeartbeatAck(seq=1),
        p.PeerWelcome(version=1, incarnation="x", session="y", clock=1.0),
        p.TransferStarted(room=room),
        p.AuxRecord(room=room, slot=0, generation=1, length=0, checksum=0),
        p.LegWritten(room=room, leg=1, kv_pages=2),
        p.PeerError(code=code, message="fuzz"),
    ]))
    return CODEC.encode(msg)


@FUZZ
@given(payload=peer_messages_before_hello(), incarnation=incarnations)
def test_peer_messages_before_hello_get_unknown_peer(pair, peer_sock, payload, incarnation):
    check_peer_error(pair[0], peer_sock, [envelope(incarnation), payload], codes={"unknown_peer"})


@FUZZ
@given(version=st.integers(min_value=-(2**63), max_value=2**63 - 1).filter(lambda v: v != p.PROTOCOL_VERSION), incarnation=incarnations)
def test_hellos_with_the_wrong_version_are_refused(pair, peer_sock, version, incarnation):
    prefill, decode = pair
    hello = msgspec.structs.replace(decode_hello(decode.client, "f" * 16, "fuzz/fuzz"), version=version)
    check_peer_error(prefill, peer_sock, [envelope(incarnation), CODEC.encode(hello)], kinds=(p.PeerRefused,), codes={"version_mismatch"})


@st.composite
def other_layouts(draw):
    """One compat field of a decode rank's lane off: (field, value)."""
    how = draw(st.sampled_from([f for f in p.Compat.__struct_fields__ if f != "version"]))
    if how == "dtype":
        return how, draw(st.text(max_size=12))
    if how in ("page_order", "kv_packing", "mla"):
        return how, draw(st.sampled_from(list({"page_order": p.PageOrder, "kv_packing": p.KVPacking}.get(how, (True, False)))))
    if how == "regions":
        region = st.tuples(st.integers(min_value=0, max_value=2**31), st.sampled_from(list(p.RegionKind)), st.integers(min_value=0, max_value=2**32))
        return how, tuple(draw(st.lists(region, max_size=10)))
    return how, draw(st.integers(min_value=-(2**31), max_value=2**31))


LAYOUT_ROOMS = 40  # examples of the test below: each fails a room and quarantines a slot
FAKE_DECODE = "a" * 16  # the incarnation of the decode daemon that test plays
LAYOUT_ROOM_IDS = itertools.count(100)


@pytest.fixture(scope="module")
def lone_prefill(tmp_path_factory):
    """A prefill daemon of its own, with a slot for every room the layout test fails,
    and a hand-played decode daemon's connection to it. Heartbeats too slow to matter:
    the decode side says only what the test says."""
    runtime = tempfile.mkdtemp(prefix="pdx-")
    log = open(tmp_path_factory.mktemp("lone") / "prefill.log", "w")
    daemon = start_daemon("prefill", runtime, "--heartbeat-interval", "5", "--heartbeat-misses", "6", name="lone", stderr=log)
    client = engine(daemon, small_layout(), slots=LAYOUT_ROOMS + 8, payload=PAYLOAD)
    sock = PeerSocket(daemon.bootstrap)
    try:
        yield Live(daemon, client), sock
    finally:
        sock.close(0)
        client.close()
        _stop_all([daemon])
        shutil.rmtree(runtime, ignore_errors=True)


def peer_reply(sock: PeerSocket, kind: type):
    """The first message of ``kind`` the prefill sends (those before it are dropped)."""
    while True:
        reply = sock.recv_multipart()
        for payload in reply[1:]:
            msg = CODEC.peer_messages.decode(payload)
            if isinstance(msg, kind):
                return msg


@settings(FUZZ, max_examples=LAYOUT_ROOMS)
@given(change=other_layouts())
def test_a_decode_rank_of_another_layout_is_welcomed_and_its_rooms_fail_naming_the_difference(lone_prefill, change):
    """A decode daemon serves many ranks, so a layout the prefill cannot write into
    refuses no daemon at hello: each room whose leg joins the two ranks fails with
    compat_mismatch, on both channels, naming the field that differs (as the refusal
    at hello did before ranks). A page size no rank here uses is still refused at hello."""
    live, sock = lone_prefill
    how, value = change
    hello = decode_hello(live.client, FAKE_DECODE, "fuzz/layout")  # the prefill's own pools: the same layout
    lane = hello.lanes[0]
    compat = msgspec.structs.replace(lane.compat, **{how: value})
    assume(compat != lane.compat)
    hello = msgspec.structs.replace(hello, lanes=(msgspec.structs.replace(lane, compat=compat),))
    reply = ask_peer(sock, [envelope(FAKE_DECODE), CODEC.encode(hello)])
    if how == "page_size":  # pages move whole (A9): refused at the handshake, naming both sizes
        assert isinstance(reply, p.PeerRefused) and reply.code is p.ErrorCode.COMPAT_MISMATCH, reply
        assert f"page_size: prefill={lane.compat.page_size} decode={value}" in reply.reason, reply
        return
    assert isinstance(reply, p.PeerWelcome), reply
    room = next(LAYOUT_ROOM_IDS)
    leg = p.LegRequest(pages=pages_bytes([5, 6]), slot=0, generation=1, memory_version=1)
    # Checked as the request comes (the prefill rank registered already), before its
    # engine computes: the decode daemon hears it at once, the engine at its send.
    sock.send_multipart([envelope(FAKE_DECODE), CODEC.encode(p.RoomRequest(room=room, legs=(leg,)))])
    failed = peer_reply(sock, p.PeerError)
    assert failed.room == room and failed.code is p.ErrorCode.COMPAT_MISMATCH, failed
    assert failed.message.startswith("incompatible KV layout: ") and how in failed.message, failed
    slot = live.client.alloc_slot()
    with pytest.raises(errors.PdxferError) as refused:
        live.client.send(room, [1, 2], num_tokens=2 * small_layout().page_size, slot=slot)
    assert refused.value.code is p.ErrorCode.COMPAT_MISMATCH and failed.message in refused.value.message, refused.value
    live.client.free_slot(slot)
    assert live.daemon.alive()


def test_a_hello_from_a_decode_whose_engine_predates_acknowledged_tcp_writes_is_refused(pair, peer_sock):
    prefill, decode = pair
    hello = msgspec.structs.replace(decode_hello(decode.client, "f" * 16, "fuzz/fuzz"), engine_release="0.3.11.post1")
    reply = check_peer_error(prefill, peer_sock, [envelope("c" * 16), CODEC.encode(hello)], kinds=(p.PeerRefused,),
                             codes={"compat_mismatch"})
    assert "0.3.11.post1" in reply.reason and "overtake" in reply.reason, reply


def test_a_hello_whose_sessions_do_not_start_with_its_session_is_refused(pair, peer_sock):
    """Where the prefill writes must be the session the hello announces: a list of
    sessions naming others first is refused, not trusted over it."""
    prefill, decode = pair
    hello = decode_hello(decode.client, "f" * 16, "fuzz/fuzz")
    hello = msgspec.structs.replace(hello, sessions=("127.0.0.1:2", hello.session))
    reply = check_peer_error(prefill, peer_sock, [envelope("d" * 16), CODEC.encode(hello)], kinds=(p.PeerRefused,),
                             codes={"bad_message"})
    assert "do not start with its session" in reply.reason, reply


def test_a_valid_hello_is_welcomed_and_a_silent_peer_forgotten(pair, daemons):
    """The positive control for the refusals above: the same hello, unchanged, to a
    prefill of its own (it adds a peer), which forgets the peer once it stays silent."""
    _, decode = pair
    prefill = daemons("prefill", *HB_FLAGS, name="hello")
    client = engine(prefill, small_layout(), slots=NUM_SLOTS, payload=PAYLOAD)
    sock = PeerSocket(prefill.bootstrap)
    try:
        assert client.stats().peers == 0
        reply = ask_peer(sock, [envelope("e" * 16), CODEC.encode(decode_hello(decode.client, "f" * 16, "fuzz/fuzz"))])
        assert isinstance(reply, p.PeerWelcome) and reply.incarnation == client.welcome.incarnation, reply
        assert client.stats().peers == 1
        wait_until(lambda: client.stats().peers == 0, HB_BOUND + SLACK, "the silent peer to be forgotten")
    finally:
        sock.close(0)
        client.close()


def test_a_peer_message_over_max_message_bytes_gets_a_clear_error(pair, peer_sock):
    payload = CODEC.encode(p.Heartbeat(seq=1)) + b"\0" * MAX_BYTES
    reply = check_peer_error(pair[0], peer_sock, [envelope("a" * 16), payload], codes={"bad_message"})
    assert f"exceeds the {MAX_BYTES}-byte limit" in reply.message, reply


def test_garbage_to_a_prefill_whose_engine_has_not_registered_is_answered_at_once(daemons):
    prefill = daemons("prefill", name="early")
    sock = PeerSocket(prefill.bootstrap)
    try:
        reply = ask_peer(sock, [envelope("a" * 16), b"\xc1 not msgpack"], timeout=3.0)
        assert isinstance(reply, p.PeerError) and reply.code is p.ErrorCode.BAD_MESSAGE, reply
    finally:
        sock.close(0)
    assert prefill.alive()


# --- a prefill daemon that requires signed bootstrap messages

SECRET = b"pdxfer-test-cluster-secret-0123456789"


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A prefill daemon started with --cluster-secret-file, with a registered engine."""
    base = tmp_path_factory.mktemp("signed")
    secret = base / "secret"
    secret.write_bytes(SECRET + b"\n")
    runtime = tempfile.mkdtemp(prefix="pdx-")
    log = open(base / "prefill.log", "w")
    # Short heartbeats: peers the tests leave behind are forgotten before the next test.
    daemon = start_daemon("prefill", runtime, "--cluster-secret-file", str(secret), "--max-message-bytes", str(MAX_BYTES),
                          *HB_FLAGS, name="signed", stderr=log)
    client = engine(daemon, small_layout(), slots=NUM_SLOTS, payload=PAYLOAD)
    # With the secret: a connection without it is refused before any message (test_peer_auth.py).
    sock = PeerSocket(daemon.bootstrap, secret=SECRET)
    try:
        yield Live(daemon, client), sock, str(secret), runtime
    finally:
        sock.close(0)
        client.close()
        _stop_all([daemon])
        shutil.rmtree(runtime, ignore_errors=True)


@st.composite
def unsigned_frames(draw) -> list[bytes]:
    """A readable envelope that is unsigned or signed wrongly, around any payload
    (random bytes, or a valid peer message, a hello among them)."""
    incarnation = draw(incarnations)
    payload = draw(st.binary(max_size=128) | peer_messages_before_hello() | st.just(b"hello"))
    if payload == b"hello":
        payload = CODEC.encode(msgspec.structs.replace(_HELLO, incarnation=incarnation))
    how = draw(st.sampled_from(["unsigned", "random_mac", "other_secret", "other_incarnation"]))
    if how == "unsigned":
        mac = b""
    elif how == "random_mac":
        mac = draw(st.binary(min_size=1, max_size=32))
    elif how == "other_secret":
        mac = Seal(incarnation, draw(st.binary(min_size=16, max_size=40).filter(lambda s: s != SECRET)))._mac(incarnation, [payload])
    else:  # signed with the right secret, but for another sender: the MAC covers the incarnation
        mac = Seal("x", SECRET)._mac(incarnation + "0", [payload])
    assume(mac != Seal(incarnation, SECRET)._mac(incarnation, [payload]))
    return [envelope(incarnation, mac), payload]


_COMPAT = p.Compat(
    version=p.PROTOCOL_VERSION, dtype="bfloat16", page_size=4, heads_total=1, bytes_per_token_head=64,
    page_order=p.PageOrder.TOKEN_MAJOR, kv_packing=p.KVPacking.SEPARATE, mla=False, num_layers_total=4,
    regions=tuple((layer, kind, 256) for layer in range(4) for kind in (p.RegionKind.K, p.RegionKind.V)),
    aux_slot_bytes=PAYLOAD + 32,
)
_HELLO = p.PeerHello(
    version=p.PROTOCOL_VERSION, incarnation="", session="127.0.0.1:1",
    lanes=(p.LaneInfo(index=0, rank=p.Rank(), compat=_COMPAT, heads_local=1, layers=(0, 4), region_bases=(0,) * 8,
                      num_pages=NUM_PAGES, aux_base=0, aux_slots=NUM_SLOTS, memory_version=1),),
)


@FUZZ
@given(frames=unsigned_frames())
def test_unsigned_or_wrongly_signed_messages_are_refused(signed, frames):
    live, sock, _, _ = signed
    check_peer_error(live, sock, frames, kinds=(p.PeerRefused,), codes={"unauthenticated"})


@FUZZ
@given(frames=malformed_peer_frames())
def test_malformed_messages_to_a_signed_prefill_get_peer_error(signed, frames):
    """Framing is checked before the signature: bad framing is bad_message; a readable
    envelope without the right signature is refused as unauthenticated."""
    live, sock, _, _ = signed
    framed = 2 <= len(frames) <= MAX_BATCH + 1 and envelope_decodes(frames[0])
    kind, codes = (p.PeerRefused, {"unauthenticated"}) if framed else (p.PeerError, {"bad_message"})
    check_peer_error(live, sock, frames, kinds=(kind,), codes=codes)


@FUZZ
@given(payload=st.binary(max_size=256) | peer_messages_before_hello(), incarnation=incarnations)
def test_signed_but_malformed_or_premature_messages_to_a_signed_prefill_get_peer_error(signed, payload, incarnation):
    """Signed correctly, the message is judged on its content like any other."""
    live, sock, _, _ = signed
    codes = {"unknown_peer"} if peer_decodes(payload) else {"bad_message"}
    check_peer_error(live, sock, Seal(incarnation, SECRET).seal([payload]), codes=codes)


def test_a_correctly_signed_hello_is_welcomed_and_a_decode_with_the_secret_moves_bytes(signed):
    live, _, secret, runtime = signed
    assert _HELLO.lanes[0].compat == compat_of(*layout_registration(live.client.kv.layout), live.client.aux.slot_bytes)
    sock = PeerSocket(live.daemon.bootstrap, secret=SECRET)
    try:
        seal = Seal("c" * 16, SECRET)
        reply = ask_peer(sock, seal.seal([CODEC.encode(msgspec.structs.replace(_HELLO, incarnation="c" * 16))]))
        assert isinstance(reply, p.PeerWelcome), reply
    finally:
        sock.close(0)
    # A real decode daemon with the secret: a room succeeds end to end.
    decode = start_daemon("decode", runtime, "--cluster-secret-file", secret, *HB_FLAGS, name="signed-decode",
                          stderr=open(os.path.join(runtime, "signed-decode.log"), "w"))
    client = engine(decode, small_layout(), slots=NUM_SLOTS, payload=PAYLOAD)
    try:
        case = start_room(live.client, client, live.daemon.bootstrap, 99, [10, 11], [12, 13], seed=3)
        assert client.wait(99).state is RoomState.SUCCESS
        case.check_bytes()
        assert live.client.wait(99).state is RoomState.SUCCESS
        live.client.release(99)
    finally:
        client.close()
        _stop_all([decode])
    wait_until(lambda: live.snapshot()[2] == 0, HB_BOUND + SLACK, "the departed peers to be forgotten")


def test_a_decode_without_the_secret_is_refused_and_its_room_fails(signed):
    live, _, _, runtime = signed
    before = live.snapshot()
    decode = start_daemon("decode", runtime, *HB_FLAGS, name="unsigned-decode",
                          stderr=open(os.path.join(runtime, "unsigned-decode.log"), "w"))
    client = engine(decode, small_layout(), slots=NUM_SLOTS, payload=PAYLOAD)
    try:
        client.expect(98, live.daemon.bootstrap, [1, 2], client.alloc_slot())
        status = client.wait(98)
        assert status.state is RoomState.FAILED and status.code is p.ErrorCode.UNAUTHENTICATED, status
        assert live.snapshot() == before
    finally:
        client.close()
        _stop_all([decode])

