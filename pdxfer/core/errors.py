"""Typed errors. Each carries a protocol error code, the side at fault, and the room
it concerns when there is one, so a reply or a log line can say who broke what."""

from __future__ import annotations

import enum

from .protocol import ErrorCode


class Side(str, enum.Enum):
    ENGINE = "engine"  # our engine sent something we cannot accept
    PEER = "peer"  # the remote daemon did
    LOCAL = "local"  # this daemon or its transport failed


class PdxferError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL
    side: Side = Side.LOCAL

    def __init__(self, message: str, *, room: int = 0, side: Side | None = None, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.room = room
        if side is not None:
            self.side = side
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class BadMessage(PdxferError):
    code = ErrorCode.BAD_MESSAGE
    side = Side.ENGINE


class VersionMismatch(PdxferError):
    code = ErrorCode.VERSION_MISMATCH


class CompatMismatch(PdxferError):
    code = ErrorCode.COMPAT_MISMATCH
    side = Side.PEER


class NotRegistered(PdxferError):
    code = ErrorCode.NOT_REGISTERED
    side = Side.ENGINE


class UnknownRoom(PdxferError):
    code = ErrorCode.UNKNOWN_ROOM
    side = Side.ENGINE


class DuplicateRoom(PdxferError):
    code = ErrorCode.DUPLICATE_ROOM
    side = Side.ENGINE


class PageOutOfRange(PdxferError):
    code = ErrorCode.PAGE_OUT_OF_RANGE
    side = Side.ENGINE


class StaleMemoryVersion(PdxferError):
    code = ErrorCode.STALE_MEMORY_VERSION
    side = Side.ENGINE


class InsufficientCapacity(PdxferError):
    code = ErrorCode.INSUFFICIENT_CAPACITY
    side = Side.ENGINE


class StaleSlot(PdxferError):
    code = ErrorCode.STALE_SLOT
    side = Side.ENGINE


class AuxStampMismatch(PdxferError):
    code = ErrorCode.AUX_STAMP_MISMATCH
    side = Side.PEER


class TransferFailed(PdxferError):
    code = ErrorCode.TRANSFER_FAILED


class Timeout(PdxferError):
    code = ErrorCode.TIMEOUT


class Aborted(PdxferError):
    code = ErrorCode.ABORTED


class PeerUnreachable(PdxferError):
    code = ErrorCode.PEER_UNREACHABLE
    side = Side.PEER


class DaemonGone(PeerUnreachable):
    """The engine's own daemon closed its connection (it died or restarted): the rooms
    in flight on it are lost. Connect and register the pools again."""

    side = Side.LOCAL


class Unsupported(PdxferError):
    code = ErrorCode.UNSUPPORTED


class Unauthenticated(PdxferError):
    """A message not signed with the receiver's cluster secret, or signed where the
    receiver has none (wire.seal.Seal says which side lacks it)."""

    code = ErrorCode.UNAUTHENTICATED


class Busy(PdxferError):
    """Out of rooms, slots or queue space: retry after ``retry_after_ms``."""

    code = ErrorCode.BUSY

    def __init__(self, message: str, *, retry_after_ms: int = 50, room: int = 0) -> None:
        super().__init__(message, room=room)
        self.retry_after_ms = retry_after_ms


class IllegalTransition(PdxferError):
    """A bug in pdxfer: the room state machine was asked for a move it forbids."""

    code = ErrorCode.INTERNAL
