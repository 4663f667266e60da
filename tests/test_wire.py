"""Framing: messages posted in one turn of the loop leave as one ZMQ message per
destination, in order, and peer envelopes sign the whole batch."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from pdxfer.core.errors import BadMessage, Unauthenticated
from pdxfer.wire.batch import MAX_BATCH, SEND_AT
from pdxfer.wire.seal import Seal
from pdxfer.wire.sockets import Dealer, Router

from .roomkit import arrived


@pytest.fixture
def sockets(runtime_dir):
    """Factory: a bound Router and a connected Dealer, (router, dealer, what the router
    got as (identity, frames), what the dealer got); closed at teardown."""
    made = []

    def make(head=None):
        loop, ctx = asyncio.get_running_loop(), zmq.Context.instance()
        at_router: list[tuple[bytes, list[bytes]]] = []
        at_dealer: list[list[bytes]] = []
        router = Router(ctx, f"ipc://{runtime_dir}/w{len(made)}.sock", 1 << 20, 10_000)
        bound = router.start(loop, lambda frames: at_router.append((frames[0], frames[1:])), *([head] if head else []))
        dealer = Dealer(ctx, bound, b"dealer-1", 1 << 20, 10_000)
        dealer.start(loop, at_dealer.append, *([None, head] if head else []))
        made.extend((dealer, router))
        return router, dealer, at_router, at_dealer

    yield make
    for sock in made:
        sock.close()


async def test_posts_of_one_turn_leave_as_one_message_per_destination_in_order(sockets):
    router, dealer, at_router, at_dealer = sockets()
    for i in range(5):
        dealer.post(b"m%d" % i)
    await arrived(lambda: at_router)
    identity, frames = at_router[0]
    assert identity == b"dealer-1" and frames == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert len(at_router) == 1
    router.post(identity, b"r0")
    router.post(identity, b"r1")
    await arrived(lambda: at_dealer)
    assert at_dealer == [[b"r0", b"r1"]]


async def test_a_handler_that_raises_is_reported_and_the_next_message_still_arrives(runtime_dir):
    loop, ctx = asyncio.get_running_loop(), zmq.Context.instance()
    got, failures = [], []

    def handle(frames):
        if frames[1:] == [b"bad"]:
            raise RuntimeError("a bug in the handler")
        got.append(frames[1:])

    router = Router(ctx, f"ipc://{runtime_dir}/raise.sock", 1 << 20, 10_000)
    router.on_error = lambda: failures.append(1)
    dealer = Dealer(ctx, router.start(loop, handle), b"d", 1 << 20, 10_000)
    dealer.start(loop, lambda frames: None)
    try:
        dealer.post(b"bad")
        dealer._io.outbox.flush()  # two ZMQ messages, not one batch
        dealer.post(b"good")
        await arrived(lambda: got)
        assert got == [[b"good"]] and failures == [1]
    finally:
        dealer.close()
        router.close()


async def test_a_full_batch_leaves_at_once_and_the_rest_follows(sockets):
    router, dealer, at_router, _ = sockets()
    n = 3 * SEND_AT + 3
    for i in range(n):
        dealer.post(i.to_bytes(4, "little"))
    await arrived(lambda: sum(len(frames) for _, frames in at_router) == n)
    assert [len(frames) for _, frames in at_router] == [SEND_AT] * 3 + [3]
    got = [int.from_bytes(f, "little") for _, frames in at_router for f in frames]
    assert got == list(range(n))


async def test_a_big_message_is_not_held_for_the_end_of_the_turn(sockets):
    router, dealer, at_router, _ = sockets()
    dealer.post(b"small")
    dealer.post(b"x" * 100_000)
    dealer.post(b"after")
    await arrived(lambda: sum(len(frames) for _, frames in at_router) == 3)
    assert [[len(f) for f in frames] for _, frames in at_router] == [[5, 100_000], [5]]


async def test_close_sends_what_was_posted(sockets):
    router, dealer, at_router, _ = sockets()
    await asyncio.sleep(0.05)  # connected, so the close below has a pipe to flush into
    dealer.post(b"last words")
    dealer.close()
    await arrived(lambda: at_router)
    assert at_router[0][1] == [b"last words"]


async def test_a_signed_batch_has_one_envelope_that_covers_every_frame(sockets):
    sender, receiver = Seal("sender-1", b"s" * 16), Seal("receiver-1", b"s" * 16)
    router, dealer, at_router, _ = sockets(lambda payloads: [sender.envelope(payloads)])
    dealer.post(b"one")
    dealer.post(b"two")
    await arrived(lambda: at_router)
    frames = at_router[0][1]
    assert len(frames) == 3
    assert receiver.open(frames) == ("sender-1", [b"one", b"two"])


def test_the_mac_covers_where_frames_are_cut_their_order_and_every_frame():
    seal, check = Seal("a" * 16, b"k" * 16), Seal("b" * 16, b"k" * 16)
    envelope = seal.envelope([b"ab", b"c"])
    assert check.open([envelope, b"ab", b"c"]) == ("a" * 16, [b"ab", b"c"])
    for forged in ([b"a", b"bc"], [b"abc"], [b"c", b"ab"], [b"ab"], [b"ab", b"c", b"d"]):
        with pytest.raises(Unauthenticated):
            check.open([envelope, *forged])


def test_a_refusal_says_which_side_lacks_the_cluster_secret():
    """A secret set on one side only is the usual misconfiguration: the reason names the
    option and the side without it, so neither side waits out a timeout to learn it."""
    secret, unsigned, other = Seal("s" * 16, b"k" * 16), Seal("u" * 16), Seal("o" * 16, b"j" * 16)
    with pytest.raises(Unauthenticated, match=r"not signed: the receiver has a cluster secret \(--cluster-secret-file\), the sender has none"):
        secret.open(unsigned.seal([b"x"]))
    with pytest.raises(Unauthenticated, match=r"not signed with the receiver's cluster secret \(--cluster-secret-file\): the sender has another"):
        secret.open(other.seal([b"x"]))
    with pytest.raises(Unauthenticated, match=r"signed with a cluster secret \(--cluster-secret-file\), and the receiver has none"):
        unsigned.open(secret.seal([b"x"]), refuse_signed=True)
    assert unsigned.open(secret.seal([b"x"])) == ("s" * 16, [b"x"])  # a refusal signed by a prefill with the secret is read


def test_frame_counts_outside_one_to_max_batch_payloads_are_bad_messages():
    seal = Seal("a" * 16)
    with pytest.raises(BadMessage, match="envelope and 1 to"):
        seal.open([seal.envelope([])])
    with pytest.raises(BadMessage, match="envelope and 1 to"):
        seal.open(seal.seal([b"x"] * (MAX_BATCH + 1)))
    assert seal.open(seal.seal([b"x"] * MAX_BATCH))[1] == [b"x"] * MAX_BATCH
