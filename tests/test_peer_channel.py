"""The bootstrap channel between daemons (pdxfer.wire.bootstrap): framing cut at any
byte, bounds checked before bytes are waited for, batching and identity, the
handshake in which each side proves the cluster secret (a link sends nothing to a
prefill that has not), reconnects, and bounded queues. Real TCP on loopback; no
daemons."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdxfer.core.errors import BadMessage
from pdxfer.core.protocol import ErrorCode
from pdxfer.wire import bootstrap
from pdxfer.wire.batch import SEND_AT
from pdxfer.wire.bootstrap import MAX_FRAMES, NONCE_BYTES, PREAMBLE, Deframer, PeerLink, PeerServer, encode, split_endpoint
from pdxfer.wire.seal import Seal

from .roomkit import arrived, free_port

messages = st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=5), max_size=8)


@given(batch=messages, cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=12))
def test_messages_come_out_whole_and_in_order_wherever_the_stream_is_cut(batch, cuts):
    stream = b"".join(encode(frames) for frames in batch)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    deframer = Deframer(1000)
    out = []
    for a, b in zip(points, points[1:]):
        out.extend(deframer.feed(stream[a:b]))
    assert out == batch


def test_a_count_out_of_bounds_is_refused_from_its_first_four_bytes():
    for count in (0, MAX_FRAMES + 1):
        with pytest.raises(BadMessage, match="frames"):
            Deframer(1000).feed(count.to_bytes(4, "little"))
    # A ZMQ greeting read as a count (0xff 00 00 00 = 255) is within bounds: the
    # preamble, not the count, is what tells a ZMQ peer apart.
    assert Deframer(1000).feed(b"\xff\x00\x00\x00") == []


def test_an_oversized_frame_is_refused_before_its_bytes_arrive():
    head = encode([b"x" * 1001])[:8]  # the count and the length, none of the frame
    with pytest.raises(BadMessage, match="1001 bytes is over the 1000-byte limit"):
        Deframer(1000).feed(head)
    assert Deframer(1001).feed(head) == []  # at the limit: it waits for the bytes


def test_endpoints_parse_with_or_without_scheme_and_for_ipv6():
    assert split_endpoint("tcp://10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert split_endpoint("host:1") == ("host", 1)
    assert split_endpoint("tcp://[::1]:9") == ("::1", 9)
    for bad in ("tcp://host", "host:", ":80", "host:x"):
        with pytest.raises(ValueError):
            split_endpoint(bad)


SECRET = b"a-cluster-secret-0123456789"
OTHER_SECRET = b"another-clusters-secret-0123456789"


def prover(secret: bytes):
    return Seal("", secret) if secret else None


@pytest.fixture
async def channel():
    """Factory: (server, link, what the server got as (identity, frames), what the
    link got, the link's connection events); all closed at teardown. ``secret`` is
    the cluster secret of both ends, ``link_secret`` the link's when it differs."""
    made = []

    async def make(port: int = 0, max_bytes: int = 1 << 20, serve: bool = True, secret: bytes = b"", link_secret: bytes | None = None):
        loop = asyncio.get_running_loop()
        at_server, at_link, events = [], [], []
        server = PeerServer("127.0.0.1", port, max_bytes, prover(secret))
        # Its connection events are tested on their own (below).
        bound = await server.start(loop, lambda identity, frames: at_server.append((identity, frames)), lambda identity, event: None)
        if serve:
            await server.serve()
        link = PeerLink(bound, b"link-1", max_bytes, prover(secret if link_secret is None else link_secret))
        link.start(loop, at_link.append, events.append)
        made.extend((link, server))
        return server, link, at_server, at_link, events

    yield make
    for end in made:
        end.close()
    await asyncio.sleep(0.01)  # let the transports finish closing on this loop


async def test_posts_of_one_turn_arrive_as_one_batch_under_the_links_identity_and_replies_return(channel):
    server, link, at_server, at_link, events = await channel()
    for i in range(3):
        link.post(b"m%d" % i)
    await arrived(lambda: at_server)
    assert at_server == [(b"link-1", [b"m0", b"m1", b"m2"])]
    assert events == ["connected"]
    for i in range(SEND_AT + 1):
        server.post(b"link-1", b"r%d" % i)
    await arrived(lambda: sum(map(len, at_link)) == SEND_AT + 1)
    assert [len(frames) for frames in at_link] == [SEND_AT, 1]
    assert [f for frames in at_link for f in frames] == [b"r%d" % i for i in range(SEND_AT + 1)]


async def test_posts_before_the_server_listens_are_delivered_once_it_does(channel):
    server, link, at_server, _, events = await channel(serve=False)
    link.post(b"early")
    await asyncio.sleep(0.3)  # a few refused connects
    assert at_server == [] and events == []
    await server.serve()
    await arrived(lambda: at_server)
    assert at_server == [(b"link-1", [b"early"])] and events == ["connected"]


async def test_a_restarted_server_is_reconnected_to_and_hears_the_same_identity(channel):
    port = free_port()
    server, link, at_server, at_link, events = await channel(port)
    link.post(b"one")
    await arrived(lambda: at_server)
    server.close()
    await arrived(lambda: events == ["connected", "disconnected"])
    again, _, at_again, _, _ = await channel(port)  # its own link is not the one under test
    link.post(b"two")
    await arrived(lambda: (b"link-1", [b"two"]) in at_again)
    assert events == ["connected", "disconnected", "connected"]
    again.post(b"link-1", b"back")
    await arrived(lambda: [b"back"] in at_link)


async def test_a_second_connection_under_one_identity_replaces_the_first(channel):
    server, link, at_server, _, _ = await channel()
    link.post(b"x")
    await arrived(lambda: at_server)
    loop = asyncio.get_running_loop()
    got = []
    twin = PeerLink(server.bound, b"link-1", 1 << 20)
    twin.start(loop, got.append)
    try:
        twin.post(b"y")
        await arrived(lambda: (b"link-1", [b"y"]) in at_server)
        server.post(b"link-1", b"to-the-newest")
        await arrived(lambda: got)
        assert got == [[b"to-the-newest"]]
    finally:
        twin.close()


async def test_a_stream_without_the_preamble_is_closed_and_others_are_served(channel):
    server, link, at_server, _, _ = await channel()
    host, port = split_endpoint(server.bound)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\xff" + b"\x00" * 8 + b"\x7f")  # what a ZMQ peer opens with
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    link.post(b"still")
    await arrived(lambda: at_server)
    assert at_server == [(b"link-1", [b"still"])]


async def test_posts_while_unconnected_are_bounded_and_the_excess_is_reported(channel):
    server, link, at_server, _, _ = await channel(max_bytes=4096, serve=False)
    dropped = []
    link.on_dropped = lambda to, payloads: dropped.extend(payloads)
    for i in range(20):
        link.post(bytes([i]) * 1000)  # one batch each: at SEND_AT or not, 20 KB > 2 x 4096
        link._outbox.flush()
    assert len(dropped) == 20 - 8, len(dropped)  # 8 x 1000 bytes fit in 2 x 4096
    await server.serve()
    await arrived(lambda: len(at_server) == 8)
    assert [frames[0][0] for _, frames in at_server] == list(range(8))


async def test_replies_to_a_peer_not_connected_are_dropped_and_reported(channel):
    server, link, at_server, _, _ = await channel()
    dropped = []
    server.on_dropped = lambda to, payloads: dropped.append((to, payloads))
    link.post(b"hello")
    await arrived(lambda: at_server)
    server.post(b"link-1", b"reaches it")
    server.post(b"gone", b"lost")
    server._outbox.flush()
    assert dropped == [(b"gone", [b"lost"])]


async def test_a_peer_that_never_reads_holds_a_bounded_send_buffer(channel):
    server, _, _, _, _ = await channel(max_bytes=64 * 1024)
    host, port = split_endpoint(server.bound)
    raw = socket.create_connection((host, port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.sendall(PREAMBLE + encode([b"stuck", b"", b"c" * NONCE_BYTES]))  # its challenge unread: a server without a secret takes the claim
    try:
        await arrived(lambda: b"stuck" in server._by_identity)
        conn = server._by_identity[b"stuck"]
        for _ in range(400):  # 400 x 60 KiB: far more than the kernel's buffers hold
            server.post(b"stuck", b"z" * 60_000)
            await asyncio.sleep(0)
        assert conn.transport.get_write_buffer_size() <= 2 * 64 * 1024 + 60_100
    finally:
        raw.close()


async def test_a_connection_that_never_answers_its_challenge_is_closed(channel, monkeypatch):
    monkeypatch.setattr(bootstrap, "HANDSHAKE_SECONDS", 0.2)
    server, link, at_server, _, _ = await channel()
    reader, writer = await asyncio.open_connection(*split_endpoint(server.bound))
    writer.write(PREAMBLE)  # the preamble, then nothing
    assert len(await asyncio.wait_for(reader.read(), 5)) == len(encode([b"n" * NONCE_BYTES]))  # the challenge, then the close
    writer.close()
    link.post(b"named")  # a link that did name itself stays
    await arrived(lambda: at_server)
    assert at_server == [(b"link-1", [b"named"])]


async def test_refused_connections_are_logged_once_per_interval_with_a_count(channel, caplog, monkeypatch):
    server, _, _, _, _ = await channel()
    host, port = split_endpoint(server.bound)
    for _ in range(4):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\xff" + b"\x00" * 8 + b"\x7f")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    refusals = [r for r in caplog.records if "closing a connection" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    monkeypatch.setattr(bootstrap, "REFUSAL_LOG_SECONDS", 0.0)  # the interval passed: the next one reports the rest
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET / HTTP/1.1\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    refusals = [r.getMessage() for r in caplog.records if "closing a connection" in r.getMessage()]
    assert len(refusals) == 2 and "(3 more refused since the last report)" in refusals[1], refusals


# --- the handshake: an identity is proven, not claimed


async def read_message(reader: asyncio.StreamReader) -> list[bytes]:
    (count,) = struct.unpack("<I", await reader.readexactly(4))
    lengths = struct.unpack(f"<{count}I", await reader.readexactly(4 * count))
    return [await reader.readexactly(n) for n in lengths]


async def challenged(bound: str):
    """A raw connection that opened with the preamble: (reader, writer, its challenge)."""
    reader, writer = await asyncio.open_connection(*split_endpoint(bound))
    writer.write(PREAMBLE)
    (nonce,) = await asyncio.wait_for(read_message(reader), 5)
    assert len(nonce) == NONCE_BYTES
    return reader, writer, nonce


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What arrived until the server closed the connection."""
    try:
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:  # closed by abort
        return b""


COUNTER = b"c" * NONCE_BYTES  # a raw connection's own challenge


async def test_a_connection_without_proof_cannot_take_the_identity_of_a_connected_peer(channel):
    server, link, at_server, at_link, events = await channel(secret=SECRET)
    refused = []
    server.on_refused = lambda code, why: refused.append(code) or [b"refused: " + why.encode()]
    link.post(b"x")
    await arrived(lambda: at_server)
    held = server._by_identity[b"link-1"]
    # The identity alone, as before the handshake; then with no proof; then with a proof made with another secret.
    reader, writer = await asyncio.open_connection(*split_endpoint(server.bound))
    writer.write(PREAMBLE + encode([b"link-1"]))
    await closed(reader)
    for proof, why in (
        (lambda nonce: b"", "gave no proof: the prefill has a cluster secret (--cluster-secret-file), the decode has none"),
        (lambda nonce: Seal("", OTHER_SECRET).prove(nonce, b"link-1"), "gave no proof of the prefill's cluster secret (--cluster-secret-file): it has another one"),
    ):
        reader, writer, nonce = await challenged(server.bound)
        writer.write(encode([b"link-1", proof(nonce), COUNTER]) + encode([b"said after the handshake"]))
        last = Deframer(1 << 20).feed(await closed(reader))
        assert len(last) == 1 and last[0][0].startswith(b"refused: decode daemon b'link-1' " + why.encode()), last
    assert refused == [ErrorCode.BAD_MESSAGE, ErrorCode.UNAUTHENTICATED, ErrorCode.UNAUTHENTICATED]
    # The peer that proved the identity holds it, hears what is posted to it, and was never disconnected.
    assert server._by_identity[b"link-1"] is held and events == ["connected"]
    server.post(b"link-1", b"still yours")
    link.post(b"y")
    await arrived(lambda: [b"still yours"] in at_link and len(at_server) == 2)
    assert at_server == [(b"link-1", [b"x"]), (b"link-1", [b"y"])]


async def test_the_server_tells_when_an_identity_connects_and_when_its_connection_is_lost():
    """Only a proven identity connects; one taken over by a newer connection stays
    connected; only the loss of the connection that holds it disconnects it."""
    events = []
    server = PeerServer("127.0.0.1", 0, 1 << 20, prover(SECRET))
    bound = await server.start(asyncio.get_running_loop(), lambda identity, frames: None, lambda identity, event: events.append((identity, event)))
    await server.serve()
    link = PeerLink(bound, b"link-1", 1 << 20, prover(SECRET))
    try:
        link.start(asyncio.get_running_loop(), lambda frames: None)
        await arrived(lambda: events == [(b"link-1", "connected")])
        link.close()
        await arrived(lambda: len(events) == 2)
        assert events[1] == (b"link-1", "disconnected")
        reader, writer, nonce = await challenged(bound)
        writer.write(encode([b"link-2", b"", COUNTER]))  # unproven: no event
        await closed(reader)
        proven = []
        for _ in range(2):
            reader, writer, nonce = await challenged(bound)
            writer.write(encode([b"link-2", Seal("", SECRET).prove(nonce, b"link-2"), COUNTER]))
            await asyncio.wait_for(read_message(reader), 5)  # the server's proof: it took the identity
            proven.append((reader, writer))
        await closed(proven[0][0])  # taken over by the second: closed, and the identity still connected
        assert events[2:] == [(b"link-2", "connected"), (b"link-2", "connected")], events
        proven[1][1].close()
        await arrived(lambda: len(events) == 5)
        assert events[4] == (b"link-2", "disconnected")
    finally:
        link.close()
        server.close()


async def test_a_recorded_answer_is_refused_on_another_connection(channel):
    server, _, _, _, _ = await channel(secret=SECRET)
    refused = []
    server.on_refused = lambda code, why: refused.append(code) or []
    reader, writer, nonce = await challenged(server.bound)
    answer = encode([b"recorded", Seal("", SECRET).prove(nonce, b"recorded"), COUNTER])
    writer.write(answer)
    # The server proves the secret in turn, over both challenges.
    assert await asyncio.wait_for(read_message(reader), 5) == [Seal("", SECRET).prove_reply(nonce, COUNTER, b"recorded")]
    held = server._by_identity[b"recorded"]
    replayer, replay, other_nonce = await challenged(server.bound)
    assert other_nonce != nonce
    replay.write(answer)
    assert await closed(replayer) == b""
    assert refused == [ErrorCode.UNAUTHENTICATED]
    assert server._by_identity[b"recorded"] is held
    server.post(b"recorded", b"to the one that proved it")
    assert await asyncio.wait_for(read_message(reader), 5) == [b"to the one that proved it"]
    writer.close()


async def test_a_link_without_the_secret_is_refused_and_hears_why(channel):
    """Its refusal comes where the server's proof would: a link without a secret,
    which has nothing to check it by, hands it on (a daemon reads peer_refused in it)."""
    server, link, at_server, at_link, events = await channel(secret=SECRET, link_secret=b"")
    refused = []
    why = [b"an envelope", b"not without the secret"]
    server.on_refused = lambda code, _: refused.append(code) or why
    link.post(b"let me in")
    await arrived(lambda: why in at_link)
    assert at_server == [] and server._by_identity == {} and events == []
    assert refused and set(refused) == {ErrorCode.UNAUTHENTICATED}


async def test_without_a_secret_an_identity_is_only_claimed(channel):
    server, link, at_server, at_link, events = await channel()
    link.post(b"claimed")
    await arrived(lambda: at_server)
    assert at_server == [(b"link-1", [b"claimed"])] and events == ["connected"]
    reader, writer, _ = await challenged(server.bound)
    writer.write(encode([b"link-1", b"", COUNTER]))  # anyone may then take it over
    await arrived(lambda: events == ["connected", "disconnected"])
    writer.close()


async def test_a_secret_on_the_link_only_is_refused_by_both_and_nothing_posted_leaves(channel):
    """The server cannot check the link's proof, so it refuses it (logged and counted
    there) after its empty reply, which tells the link it has no secret; the link,
    which cannot trust a server without one, refuses it in turn."""
    server, link, at_server, at_link, events = await channel(link_secret=SECRET)
    at_server_refused, at_link_refused = [], []
    server.on_refused = lambda code, why: at_server_refused.append((code, why)) or [b"an envelope", b"refused"]
    link.on_refused = lambda code, why: at_link_refused.append((code, why)) or []
    link.post(b"the decode's addresses")
    await arrived(lambda: at_server_refused and at_link_refused)
    assert at_server_refused[0] == (ErrorCode.UNAUTHENTICATED, "decode daemon b'link-1' answered with a proof of a cluster secret "
                                    "(--cluster-secret-file), and the prefill has none")
    assert at_link_refused[0] == (ErrorCode.UNAUTHENTICATED, "it gave no proof: the prefill has no cluster secret (--cluster-secret-file), "
                                  "the decode has one")
    assert at_server == [] and at_link == [] and events == []


# --- the link's side: nothing leaves it before the prefill proved the secret


SEAL, OTHER_SEAL = Seal("", SECRET), Seal("", OTHER_SECRET)
# What a process at the prefill's address that lacks the secret might send in place of
# the prefill's proof, given its challenge and the link's answer: (reply, why the link refuses it).
NO_PROOF = "it gave no proof of this cluster's secret (--cluster-secret-file)"
FORGED_REPLIES = {
    "reflected": (lambda nonce, identity, proof, counter: [proof], NO_PROOF),
    "another-secret": (lambda nonce, identity, proof, counter: [OTHER_SEAL.prove_reply(nonce, counter, identity)], NO_PROOF),
    "another-connections": (lambda nonce, identity, proof, counter: [SEAL.prove_reply(nonce, b"x" * NONCE_BYTES, identity)], NO_PROOF),
    "garbage": (lambda nonce, identity, proof, counter: [b"\x5a" * 16], NO_PROOF),
    "empty": (lambda nonce, identity, proof, counter: [b""], "it gave no proof: the prefill has no cluster secret"),
    "a-refusal": (lambda nonce, identity, proof, counter: [b"an envelope", b"peer_refused"], "it refused this daemon's proof and gave none of its own (2 frames where its proof should be)"),
}


class FakePrefill:
    """A listener at a prefill's address that takes one connection, plays the
    handshake with ``reply(nonce, identity, proof, counter)`` in place of a prefill's
    proof, and keeps the link's answer and whatever it sent after it until it closed."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections: list[tuple[list[bytes], bytes]] = []
        self.listener: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.listener = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.listener.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.listener.close()  # the link's next tries are refused: one connection tells all
        assert await reader.readexactly(len(PREAMBLE)) == PREAMBLE
        nonce = b"n" * NONCE_BYTES
        writer.write(encode([nonce]))
        answer = await read_message(reader)
        writer.write(encode(self.reply(nonce, *answer)))
        self.connections.append((answer, await closed(reader)))
        writer.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
async def fake_prefill():
    made = []

    async def make(reply):
        fake = FakePrefill(reply)
        made.append(fake)
        return fake, await fake.start()

    yield make
    for fake in made:
        fake.close()


@pytest.mark.parametrize("forged", FORGED_REPLIES)
async def test_a_link_sends_nothing_to_a_prefill_that_does_not_prove_the_secret(fake_prefill, forged):
    reply, why = FORGED_REPLIES[forged]
    fake, bound = await fake_prefill(reply)
    link = PeerLink(bound, b"link-1", 1 << 20, prover(SECRET))
    refused, events, got = [], [], []
    link.on_refused = lambda code, why: refused.append((code, why)) or []
    link.post(b"peer_hello: where to write")
    link.start(asyncio.get_running_loop(), got.append, events.append)
    try:
        await arrived(lambda: fake.connections)
        (identity, proof, counter), after = fake.connections[0]
        assert identity == b"link-1" and proof == SEAL.prove(b"n" * NONCE_BYTES, b"link-1") and len(counter) == NONCE_BYTES
        assert after == b"", f"the link sent {after!r} to a prefill that did not prove the secret"
        assert refused[0][0] is ErrorCode.UNAUTHENTICATED and refused[0][1].startswith(why), refused
        assert events == [] and got == []
    finally:
        link.close()


async def test_a_link_sends_what_waited_once_the_prefill_proves_the_secret(fake_prefill):
    """The same fake with the right reply: what it receives after the answer is what
    the forged replies above must not get."""
    fake, bound = await fake_prefill(lambda nonce, identity, proof, counter: [SEAL.prove_reply(nonce, counter, identity)])
    link = PeerLink(bound, b"link-1", 1 << 20, prover(SECRET))
    events = []
    link.post(b"peer_hello: where to write")
    link.start(asyncio.get_running_loop(), lambda frames: None, events.append)
    await arrived(lambda: events == ["connected"])
    link.close()
    await arrived(lambda: fake.connections)
    assert Deframer(1 << 20).feed(fake.connections[0][1]) == [[b"peer_hello: where to write"]]


async def test_a_link_to_a_server_that_sends_no_challenge_gives_up_and_tries_again(monkeypatch):
    monkeypatch.setattr(bootstrap, "HANDSHAKE_SECONDS", 0.2)
    accepted = []

    async def silent(reader, writer):  # a bootstrap port of an older framing would close; this one just says nothing
        accepted.append(await reader.readexactly(len(PREAMBLE)))

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    link = PeerLink(f"tcp://127.0.0.1:{port}", b"link-1", 1 << 20, prover(SECRET))
    refused, events = [], []
    link.on_refused = lambda code, why: refused.append(code) or []
    link.start(asyncio.get_running_loop(), lambda frames: None, events.append)
    try:
        await arrived(lambda: len(accepted) >= 2)
        assert accepted[0] == PREAMBLE and refused[0] is ErrorCode.BAD_MESSAGE
        assert events == []  # never connected: nothing posted could have left
    finally:
        link.close()
        listener.close()
