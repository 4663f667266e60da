"""What a daemon and its transfer engine's own process (engine_process.py) say to
each other: msgpack over a SOCK_SEQPACKET socket pair. Requests the daemon waits for
(``Reply``), writes it does not (``Submit``), and batches of settled writes
(``Settled``). Handles are the daemon's: the process keeps the engine's behind them and
reports each once it settles, oldest first per peer. A region travels with the file
descriptor behind it (SCM_RIGHTS).
"""

from __future__ import annotations

import msgspec

MAX_PACKET = 1 << 20  # bytes of one message either way; a Submit of more blocks is split
SOCKET_BUFFER = 4 << 20
BLOCKS_PER_SUBMIT = MAX_PACKET // 32  # three int64 per block, with room for the rest


class Region(msgspec.Struct, array_like=True, frozen=True):
    """[address, address + length) of the daemon, backed from ``offset`` by the file
    whose descriptor travels with the message (SCM_RIGHTS): by descriptor, not name,
    so that a pool whose name its engine already unlinked maps all the same."""

    address: int
    length: int
    offset: int
    populate: bool = True  # map it with MAP_POPULATE (false: a buffer that fills as used, like the staging one)


class Start(msgspec.Struct, tag=True, array_like=True):
    config: bytes  # the daemon's Config as JSON: this side builds the transport it would have
    scratch: Region
    replacing: bool = False  # another process ran before this one (a fault injector's broken_after ends with the first)


class Register(msgspec.Struct, tag=True, array_like=True):
    req: int
    region: Region


class Unregister(msgspec.Struct, tag=True, array_like=True):
    req: int
    address: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    first: int  # the daemon's handle of the first block; the rest follow in order
    peer: list[str]
    src: bytes  # int64 arrays
    dst: bytes
    length: bytes


class Probe(msgspec.Struct, tag=True, array_like=True):
    req: int
    peer: list[str]
    dst: int


class Reply(msgspec.Struct, tag=True, array_like=True):
    req: int
    error: str = ""
    taken: bool = False  # Register: the address is taken in this process
    sessions: list[str] = []
    ok: bool = True
    ports: list[int] = []  # Start: the TCP ports this process listens on (the daemon refuses one an ended process had)


class Settled(msgspec.Struct, tag=True, array_like=True):
    handles: bytes  # int64
    statuses: bytes  # int8, Status values


Request = Start | Register | Unregister | Submit | Probe
Answer = Reply | Settled
