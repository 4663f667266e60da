"""Signed envelopes: every peer and admin message starts with one, naming the sender's
incarnation and, with a cluster secret, carrying an HMAC over all of its payloads. The
bootstrap channel's handshake proof comes from the same secret. No ZMQ here."""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from ..core.errors import BadMessage, Unauthenticated, Unsupported
from ..core.protocol import UNDECODABLE, Envelope
from .batch import MAX_BATCH

MAC_BYTES = 16
HANDSHAKE_TAG = b"pdxfer bootstrap handshake\0"  # the connecting side's proof
HANDSHAKE_REPLY_TAG = b"pdxfer bootstrap handshake reply\0"  # the accepting side's: differs at byte 26
MIN_SECRET_BYTES = 16


def read_secret(path: str) -> bytes:
    """The cluster secret in the file at ``path`` (surrounding whitespace stripped), b""
    for no path; Unsupported for a file that cannot be read or a secret too short.
    Daemons and operator commands read it alike."""
    if not path:
        return b""
    try:
        with open(path, "rb") as fh:
            secret = fh.read().strip()
    except OSError as exc:
        raise Unsupported(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise Unsupported(f"the cluster secret in {path} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES}")
    return secret


class Seal:
    """Signs and checks peer envelopes. Without a secret it only names the sender."""

    def __init__(self, incarnation: str, secret: bytes = b"") -> None:
        self.incarnation = incarnation
        self.secret = secret
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._encoder = msgspec.msgpack.Encoder()

    def _mac(self, incarnation: str, payloads: list[bytes]) -> bytes:
        mac = hmac.new(self.secret, incarnation.encode() + b"\0", hashlib.sha256)
        for payload in payloads:  # length-prefixed: frames cannot be re-cut under one mac
            mac.update(len(payload).to_bytes(8, "little"))
            mac.update(payload)
        return mac.digest()[:MAC_BYTES]

    def prove(self, nonce: bytes, identity: bytes) -> bytes:
        """Proof that whoever answers the bootstrap channel's challenge ``nonce`` as
        ``identity`` holds this secret (see bootstrap.py). The tag keeps a proof from
        ever being a daemon's envelope mac (those start with its hex incarnation); the
        nonce has a fixed size, so nonce and identity cannot be re-cut."""
        return hmac.new(self.secret, HANDSHAKE_TAG + nonce + identity, hashlib.sha256).digest()[:MAC_BYTES]

    def prove_reply(self, nonce: bytes, counter: bytes, identity: bytes) -> bytes:
        """Proof that the side that sent challenge ``nonce``, and was answered with
        ``identity`` and challenge ``counter``, holds this secret (see bootstrap.py).
        Its own tag: a connecting side's proof, sent back to it, is never a valid
        reply; both nonces have a fixed size, so nothing can be re-cut."""
        return hmac.new(self.secret, HANDSHAKE_REPLY_TAG + nonce + counter + identity, hashlib.sha256).digest()[:MAC_BYTES]

    def envelope(self, payloads: list[bytes]) -> bytes:
        mac = self._mac(self.incarnation, payloads) if self.secret else b""
        return self._encoder.encode(Envelope(self.incarnation, mac))

    def head(self, payloads: list[bytes]) -> list[bytes]:
        """What goes before a batch's payloads (a socket's ``head``): its envelope."""
        return [self.envelope(payloads)]

    def seal(self, payloads: list[bytes]) -> list[bytes]:
        return [self.envelope(payloads), *payloads]

    def open(self, frames: list[bytes], refuse_signed: bool = False) -> tuple[str, list[bytes]]:
        """(sender incarnation, payloads), or BadMessage / Unauthenticated, which says
        which side lacks the secret: a secret set on one side only is the usual cause.
        ``refuse_signed``: without a secret, refuse a signed message too (its sender
        holds a secret this side lacks, and would refuse our unsigned answers)."""
        if not 2 <= len(frames) <= MAX_BATCH + 1:
            raise BadMessage(f"a peer message has an envelope and 1 to {MAX_BATCH} payload frames, not {len(frames)} frames")
        try:
            env = self._decoder.decode(frames[0])
        except UNDECODABLE as exc:
            raise BadMessage(f"cannot decode the envelope: {exc}") from None
        payloads = frames[1:]
        if self.secret:
            if not env.mac:
                raise Unauthenticated("message not signed: the receiver has a cluster secret (--cluster-secret-file), the sender has none")
            if not hmac.compare_digest(env.mac, self._mac(env.incarnation, payloads)):
                raise Unauthenticated("message not signed with the receiver's cluster secret (--cluster-secret-file): "
                                      "the sender has another one, or the message was altered")
        elif env.mac and refuse_signed:
            raise Unauthenticated("message signed with a cluster secret (--cluster-secret-file), and the receiver has none")
        return env.incarnation, payloads
