"""Who a peer is, proven rather than claimed (issue 30, items 3 and 4), with real
daemons: with --cluster-secret-file on both daemons, a process without the secret that
names a decode daemon on the prefill's bootstrap port (its incarnation is in its ready
line and in every envelope on the wire) is refused, logged and counted, and the real
decode daemon's rooms go on to succeed. A process without the secret at a prefill's
address learns nothing from a decode daemon that connects to it: no peer_hello, so no
addresses to write to. An admin request without the secret is refused, logged and
counted too. And a room id that a second decode daemon also expects fails only there,
not for the first one.

The handshake itself (wrong proof, replayed or reflected proof, secret on one side
only) is tested without daemons in test_peer_channel.py."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from pdxfer.core import protocol as p
from pdxfer.core.protocol import RoomState
from pdxfer.ops.inspection import AdminClient, CommandError
from pdxfer.wire.bootstrap import NONCE_BYTES, PREAMBLE, encode, split_endpoint

from .conftest import needs_mooncake
from .peersocket import PeerSocket
from .roomkit import HB_BOUND, HB_FLAGS, SLACK, all_in, engine, room_ids, send_room, start_room, statuses, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = b"pdxfer-test-cluster-secret-0123456789"
CODEC = p.Codec()
ROOMS = 7


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return str(path)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Read and discard until the other end closes (True) or ``timeout`` passes (False)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:  # closed by abort
        pass
    except socket.timeout:
        return False
    return True


def logged(daemon, *parts: str) -> bool:
    with open(daemon.log_path) as fh:
        return any(all(part in line for part in parts) for line in fh)


def test_a_peer_without_the_secret_cannot_take_over_a_decode_daemons_identity(daemons, secret_file):
    prefill = daemons("prefill", "--cluster-secret-file", secret_file, *HB_FLAGS)
    decode = daemons("decode", "--cluster-secret-file", secret_file, *HB_FLAGS)
    pc, dc = engine(prefill), engine(decode)
    impostors = []
    try:
        # Live rooms: requested by the decode daemon and accepted, their KV not sent yet.
        cases = [start_room(pc, dc, prefill.bootstrap, 500 + i, [2 * i, 2 * i + 1], [100 + 2 * i, 101 + 2 * i], seed=i, send=False)
                 for i in range(ROOMS)]
        ids = room_ids(cases)
        wait_until(lambda: all_in(dc, ids, RoomState.WAITING_FOR_INPUT), 10 + SLACK, "the rooms to be accepted by the prefill")
        identity = decode.ready["incarnation"].encode()  # what the attacker reads off the wire

        # As the framing had it: the preamble, then a frame naming the decode daemon.
        claim = socket.create_connection(split_endpoint(prefill.bootstrap), timeout=5)
        impostors.append(claim)
        claim.sendall(PREAMBLE + encode([identity]))
        time.sleep(HB_BOUND + 0.5)  # a decode daemon whose connection the prefill dropped fails its rooms at once
        live = all_in(dc, ids, RoomState.WAITING_FOR_INPUT)
        assert live, f"the impostor's claim failed the real decode daemon's rooms: {statuses(dc, ids)}"
        assert closed_by_peer(claim, 5), "the prefill kept a connection that claimed an identity without proving it"

        # As the handshake has it: the decode daemon's identity with a proof made without the secret.
        forged = PeerSocket(prefill.bootstrap, identity, secret=b"not-this-clusters-secret-0123456789")
        impostors.append(forged.sock)
        refusal = forged.recv_multipart()
        reply = CODEC.peer_messages.decode(refusal[1])
        assert isinstance(reply, p.PeerRefused) and reply.code is p.ErrorCode.UNAUTHENTICATED, reply
        assert closed_by_peer(forged.sock, 5), "the prefill kept a connection whose proof did not verify"

        assert all_in(dc, ids, RoomState.WAITING_FOR_INPUT), statuses(dc, ids)
        for case in cases:
            send_room(case)
        wait_until(lambda: all_in(dc, ids, RoomState.SUCCESS, RoomState.FAILED), 10 + SLACK, "the decode rooms to finish")
        assert all_in(dc, ids, RoomState.SUCCESS), statuses(dc, ids)
        for case in cases:
            case.check_bytes()
        wait_until(lambda: all_in(pc, ids, RoomState.SUCCESS), 5 + SLACK, "the prefill rooms to succeed")

        failures = pc.stats().failures
        assert failures.get("unauthenticated:peer-connection") == 1, failures
        assert failures.get("bad_message:peer-connection") == 1, failures
        assert pc.stats().peers == 1
        # Each refusal is logged with the impostor's address; a kind's first is logged at once.
        for sock, why in ((claim, "its first message must be its identity"), (forged.sock, "gave no proof of the prefill's cluster secret")):
            assert logged(prefill, f"closing a connection from ('127.0.0.1', {sock.getsockname()[1]})", why), why
    finally:
        for sock in impostors:
            sock.close()
        pc.close()
        dc.close()


class ImpostorPrefill:
    """A listener at a prefill's address without the cluster secret, in a thread: on
    each connection it sends a challenge, reads the decode daemon's answer, listens for
    QUIET seconds more, then sends ``forge(answer)`` in place of the prefill's proof and
    listens until the connection closes. It keeps, per connection: the answer, what
    came before its reply, what came after, and when the reply left."""

    QUIET = 1.0

    def __init__(self, forge) -> None:
        self.forge = forge
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[tuple[list[bytes], bytes, bytes, float]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self.connections.append(self._handshake(conn))
                except OSError:
                    pass

    def _handshake(self, conn: socket.socket):
        conn.settimeout(10)
        assert recv_exactly(conn, len(PREAMBLE)) == PREAMBLE
        conn.sendall(encode([os.urandom(NONCE_BYTES)]))
        (count,) = struct.unpack("<I", recv_exactly(conn, 4))  # the answer, and not a byte more
        lengths = struct.unpack(f"<{count}I", recv_exactly(conn, 4 * count))
        answer = [recv_exactly(conn, n) for n in lengths]
        before = listen(conn, self.QUIET)
        conn.sendall(encode(self.forge(answer)))
        sent = time.monotonic()
        return answer, before, listen(conn, 5.0), sent

    def close(self) -> None:
        self.listener.close()


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        data = conn.recv(n - len(got))
        assert data, f"the connection closed after {len(got)} of {n} bytes"
        got += data
    return got


def listen(conn: socket.socket, seconds: float) -> bytes:
    """What arrives within ``seconds``, or until the other end closes."""
    got, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            data = conn.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            break
        if not data:
            break
        got += data
    return got


FORGED = {
    "garbage": lambda answer: [os.urandom(16)],
    "reflected": lambda answer: [answer[1]],  # the decode daemon's own proof, sent back
}


@pytest.mark.parametrize("forged", FORGED)
def test_a_decode_daemon_tells_a_prefill_that_proves_no_secret_nothing(daemons, secret_file, forged):
    """Issue 30.4: whoever answers at a prefill's address (a wrong address, a spoofed
    name, a stranger on the port) and cannot prove the cluster secret gets the decode
    daemon's answer to its challenge and nothing after it: no peer_hello (the pool
    addresses and transfer-engine sessions to write to), no room request. The room
    there fails at once as unauthenticated, naming the secret; the refusal is logged
    and counted."""
    decode = daemons("decode", "--cluster-secret-file", secret_file)
    dc = engine(decode)
    impostor = ImpostorPrefill(FORGED[forged])
    try:
        dc.expect(9, impostor.address, [1, 2], dc.alloc_slot())
        status = dc.wait(9, timeout=ImpostorPrefill.QUIET + 10 + SLACK)
        failed_at = time.monotonic()
        # The impostor records the connection once the daemon closed it (or 5 s passed),
        # which may come after the room failed.
        answer, before, after, replied = wait_until(lambda: impostor.connections, 5 + SLACK, "the impostor's record of its connection")[0]
        assert before == b"", f"the decode daemon sent {len(before)} bytes before the prefill proved the secret: {before[:200]!r}"
        assert after == b"", f"the decode daemon sent {len(after)} bytes after a reply that proves nothing: {after[:200]!r}"
        assert len(answer) == 3 and answer[0] == decode.ready["incarnation"].encode(), answer
        assert status.state is RoomState.FAILED and status.code is p.ErrorCode.UNAUTHENTICATED, status
        assert "--cluster-secret-file" in status.reason and impostor.address in status.reason, status.reason
        assert status.fenced, status  # its request never left: nothing can land for it
        assert failed_at - replied < SLACK, failed_at - replied
        assert dc.stats().failures.get("unauthenticated:peer-connection", 0) >= 1, dc.stats().failures
        assert logged(decode, "closing a connection from", "it gave no proof of this cluster's secret (--cluster-secret-file)")
    finally:
        impostor.close()
        dc.close()


def test_an_admin_request_without_the_secret_is_refused_logged_and_counted(daemons, secret_file):
    decode = daemons("decode", "--cluster-secret-file", secret_file)
    admin = decode.ready["admin"]
    dc = engine(decode)
    try:
        assert "unauthenticated:admin-message" not in dc.stats().failures
        with AdminClient(admin) as unsigned, pytest.raises(CommandError, match="unauthenticated"):
            unsigned.call(p.AdminPeers)
        with AdminClient(admin, b"another-clusters-secret-0123456789") as other, pytest.raises(CommandError, match="not signed"):
            other.call(p.AdminPeers)
        with AdminClient(admin, SECRET) as signed:
            assert isinstance(signed.call(p.AdminPeers), p.PeersReply)
        assert dc.stats().failures.get("unauthenticated:admin-message") == 2, dc.stats().failures
        # The first is logged at once; the second, in the same interval, is counted towards the next report.
        wait_until(lambda: logged(decode, "refused an admin request", "message not signed: the receiver has a cluster secret"), 5, "the refusal to be logged")
    finally:
        dc.close()


def test_a_room_a_second_decode_daemon_also_expects_fails_only_there(daemons):
    """Decode A expects room R from a prefill, then decode B expects R too: the prefill
    refuses B's request, B's room fails (and is fenced: nothing was written for it),
    and B's room_failed for R, which the prefill knows as A's, leaves A's room alone."""
    prefill = daemons("prefill", *HB_FLAGS)
    first = daemons("decode", *HB_FLAGS, name="decode-a")
    second = daemons("decode", *HB_FLAGS, name="decode-b")
    pc, ac, bc = engine(prefill), engine(first), engine(second)
    try:
        room = 42
        case = start_room(pc, ac, prefill.bootstrap, room, [1, 2], [3, 4], seed=1, send=False)
        wait_until(lambda: ac.poll(room).state is RoomState.WAITING_FOR_INPUT, 10 + SLACK, "A's room to be accepted")
        bc.expect(room, prefill.bootstrap, [5, 6], bc.alloc_slot())
        theirs = wait_until(lambda: (s := bc.poll(room)).state is RoomState.FAILED and s, 5 + SLACK, "B's room to fail")
        assert theirs.state is RoomState.FAILED and theirs.code is p.ErrorCode.DUPLICATE_ROOM, theirs
        time.sleep(0.5)  # B's room_failed has reached the prefill by now
        assert ac.poll(room).state is RoomState.WAITING_FOR_INPUT, ac.poll(room)
        # The prefill wrote nothing for B's room: it says so, and B may reuse its pages.
        wait_until(lambda: bc.poll(room).fenced, 5 + SLACK, "B's failed room to be fenced")
        send_room(case)
        assert ac.wait(room).state is RoomState.SUCCESS, ac.poll(room)
        case.check_bytes()
        assert pc.wait(room).state is RoomState.SUCCESS, pc.poll(room)
        assert pc.stats().failures.get("ignored:room-of-another-peer") == 1, pc.stats().failures
    finally:
        for client in (pc, ac, bc):
            client.close()
