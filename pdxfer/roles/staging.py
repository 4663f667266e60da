"""A daemon's staging buffer (core/staging.py): shared memory registered with its
transfer engines, where legs between ranks of different TP land (decode) or are
gathered (prefill), and the extents taken in it. Pages are backed unit by unit as
extents first reach them, through the port (a full /dev/shm is refused there, never
met by a write)."""

from __future__ import annotations

import logging
from dataclasses import InitVar, dataclass
from typing import Callable

import numpy as np

from ..core import errors
from ..core.staging import StagingArena

log = logging.getLogger("pdxfer.staging")

RESERVE_UNIT = 2 << 20  # bytes of the staging buffer backed at once (Staging._back)


@dataclass(eq=False)
class Staging:
    """A daemon's staging buffer (core/staging.py): shared memory registered with its
    transfer engines, and the extents taken in it."""

    memory: object  # memory.SharedMemory (its address, size and array; never its pages' backing)
    reserve: Callable[[int, int], None]  # back [offset, +nbytes) with pages, or raise InsufficientCapacity (the port's)
    backed: InitVar[bool] = False  # every page backed already (--staging-at-start); _backed holds it from then on

    def __post_init__(self, backed: bool) -> None:
        self.arena = StagingArena(self.memory.size)
        self.full = 0  # legs or chunks that would have gained from an extent but found none free
        self.largest_refused = 0  # bytes of the largest one that could never fit, 0 if none
        self.unbacked = 0  # of those, the ones whose extent shared memory could not back
        # The buffer is created without pages (an idle daemon's takes no memory); each
        # RESERVE_UNIT is backed the first time an extent reaches into it, and stays so
        # (all of them at start with --staging-at-start).
        self._backed = np.full(-(-self.memory.size // RESERVE_UNIT), backed)

    def take(self, nbytes: int) -> int | None:
        """The offset of a free extent of ``nbytes``, backed by pages, or None (counted):
        the caller then writes between the pages. One larger than the whole buffer is
        logged, with the size that would hold it, each time one larger than any before
        comes; one that shared memory cannot back, at the 1st, 2nd, 4th, 8th... time."""
        offset = self.arena.take(nbytes)
        if offset is not None:
            why_not = self._back(offset, nbytes)
            if why_not:
                self.arena.give(offset)
                self.unbacked += 1
                if self.unbacked & (self.unbacked - 1) == 0:
                    log.warning("%s, so a leg or chunk of %.1f MiB writes between the pages, far slower for short slices (%d so far); "
                                "free some or make it larger", why_not, nbytes / 2**20, self.unbacked)
                offset = None
        if offset is None:
            self.full += 1
            if nbytes > self.arena.size and nbytes > self.largest_refused:
                self.largest_refused = nbytes
                log.warning("a leg of %.1f MiB cannot be staged in the %d MiB staging buffer, so it writes between the pages "
                            "(a block per page or per token, far slower for the short slices that are staged); start the daemon with "
                            "--staging-mib %d or more to stage legs this large", nbytes / 2**20, self.arena.size >> 20,
                            -(-nbytes // 2**20) * 2)
        return offset

    def _back(self, offset: int, nbytes: int) -> str:
        """Why [offset, +nbytes) cannot have pages, or "" once it has them, backing the
        units it reaches that had none (``reserve``, the port's): writing an
        unbacked page once /dev/shm is full kills the writer (SIGBUS), the daemon
        itself when a prefill gathers."""
        first, end = offset // RESERVE_UNIT, -(-(offset + nbytes) // RESERVE_UNIT)
        missing = np.flatnonzero(~self._backed[first:end])
        if missing.size == 0:
            return ""
        start, stop = first + int(missing[0]), first + int(missing[-1]) + 1
        try:
            self.reserve(start * RESERVE_UNIT, min(stop * RESERVE_UNIT, self.memory.size) - start * RESERVE_UNIT)
        except errors.InsufficientCapacity as exc:
            return exc.message
        self._backed[start:stop] = True
        return ""

    @property
    def base(self) -> int:
        return self.memory.address

    def extent(self, offset: int, nbytes: int) -> np.ndarray:
        return self.memory.array[offset : offset + nbytes]
