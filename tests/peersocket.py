"""Blocking ends of the bootstrap channel for tests that play one daemon by hand:
``PeerSocket`` connects as a decode daemon would, ``PeerListener`` listens as a
prefill daemon without a cluster secret would. Both speak pdxfer.wire.bootstrap's
framing and handshake with plain sockets; ``decode_hello`` is the first thing a
hand-played decode daemon says."""

from __future__ import annotations

import collections
import os
import select
import socket
import time

from pdxfer.core.plan import compat_of, layout_registration
from pdxfer.core.protocol import PROTOCOL_VERSION, LaneInfo, PeerHello
from pdxfer.wire.bootstrap import NONCE_BYTES, PREAMBLE, Deframer, encode, split_endpoint
from pdxfer.wire.seal import Seal

NO_LIMIT = 1 << 31


def decode_hello(client, incarnation: str, name: str) -> PeerHello:
    """The peer_hello of a decode daemon serving ``client``'s pools, as the test plays it:
    its session and buffer addresses name nothing, so no write it allows can land."""
    spec, regions = layout_registration(client.kv.layout)
    lane = LaneInfo(
        index=0, rank=client.rank, compat=compat_of(spec, regions, client.aux.slot_bytes), heads_local=spec.heads.local,
        layers=spec.layers, region_bases=(0,) * len(regions), num_pages=client.kv.layout.num_pages, aux_base=0,
        aux_slots=client.aux.num_slots, memory_version=1,
    )
    return PeerHello(
        version=PROTOCOL_VERSION, incarnation=incarnation, session="127.0.0.1:1", lanes=(lane,), name=name,
    )


class PeerSocket:
    """A connection to a prefill daemon's bootstrap endpoint under ``identity``
    (random by default), its challenge answered with a proof made with ``secret``
    (with none, an empty proof). The prefill's reply, its own proof, is kept in
    ``reply`` unchecked; a refusal in its place is the first message received."""

    def __init__(self, endpoint: str, identity: bytes = b"", secret: bytes = b"") -> None:
        self.sock = socket.create_connection(split_endpoint(endpoint), timeout=5)
        self.identity = identity or os.urandom(8)
        self._deframer = Deframer(NO_LIMIT)
        self._received: collections.deque = collections.deque()
        self.sock.sendall(PREAMBLE)
        (self.nonce,) = self.recv_multipart()
        proof = Seal("", secret).prove(self.nonce, self.identity) if secret else b""
        self.sock.sendall(encode([self.identity, proof, os.urandom(NONCE_BYTES)]))
        reply = self.recv_multipart()
        if len(reply) == 1:
            (self.reply,) = reply
        else:
            self.reply = None
            self._received.appendleft(reply)

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sock.sendall(encode(frames))

    def poll(self, timeout_ms: int) -> bool:
        """Whether a whole message arrived within ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._received:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return False
            data = self.sock.recv(1 << 20)
            if not data:
                return False
            self._received.extend(self._deframer.feed(data))
        return True

    def recv_multipart(self) -> list[bytes]:
        assert self.poll(10_000), "nothing arrived"
        return self._received.popleft()

    def close(self, linger: int = 0) -> None:
        self.sock.close()


class PeerListener:
    """A bootstrap endpoint on 127.0.0.1:``port`` that accepts any number of
    connections; messages come out as ``[identity, *frames]`` like a ZMQ ROUTER's."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self._conns: dict[socket.socket, list] = {}  # -> [bytes before the preamble is whole, deframer, identity]
        self._by_identity: dict[bytes, socket.socket] = {}
        self._received: collections.deque = collections.deque()

    def poll(self, timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._received:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for sock in select.select([self.listener, *self._conns], [], [], left)[0]:
                if sock is self.listener:
                    conn, _ = sock.accept()
                    self._conns[conn] = [b"", Deframer(NO_LIMIT), None]
                else:
                    self._read(sock)
        return True

    def _read(self, sock: socket.socket) -> None:
        state = self._conns[sock]
        data = sock.recv(1 << 20)
        if not data:
            del self._conns[sock]
            sock.close()
            return
        if state[0] is not None:
            state[0] += data
            if len(state[0]) < len(PREAMBLE):
                return
            assert state[0].startswith(PREAMBLE), state[0][:16]
            data, state[0] = state[0][len(PREAMBLE) :], None
            sock.sendall(encode([os.urandom(NONCE_BYTES)]))
        for frames in state[1].feed(data):
            if state[2] is None:  # its identity, a proof and a challenge: a listener without a secret takes it on trust
                state[2] = frames[0]
                self._by_identity[state[2]] = sock
                sock.sendall(encode([b""]))  # and has no proof to give
            else:
                self._received.append([state[2], *frames])

    def recv_multipart(self) -> list[bytes]:
        assert self.poll(10_000), "nothing arrived"
        return self._received.popleft()

    def send_multipart(self, frames: list[bytes]) -> None:
        identity, *rest = frames
        self._by_identity[identity].sendall(encode(rest))

    def close(self, linger: int = 0) -> None:
        for sock in [self.listener, *self._conns]:
            sock.close()
        self._conns.clear()
