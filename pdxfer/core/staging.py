"""Staging a head slice (docs/engines.md §A6).

Between ranks of different TP, one side of a leg holds every head of its rank's pages
and the other a slice of each page: the decode side when the prefill TP is the larger,
the prefill side when the decode TP is. In a head-major page that slice is one span per
(region, page), in a token-major one a span per token, and spans of neighbouring pages
are not contiguous, so a leg of N pages is N (or N x tokens) blocks per region where
equal TP writes runs of pages as one block each. Over a transport whose cost grows with
the blocks (Mooncake's TCP path waits for each write's acknowledgement), that is most
of the difference.

The sliced side stages instead, in a buffer of its daemon's laid out as the whole side's
pages are (region pair, then page position, then the slice), so runs of pages stay runs:

* decode: the leg is written into the buffer (LegRequest.staged_at), and once its
  record says every write completed the daemon copies the slices into the pages. The
  extents are taken per leg and given back only on proof that nothing more can land in
  them: the leg's record, its prefill's fenced failure, a refusal, a request never
  sent, or the prefill's restart or an operator's cut (S2, as for aux slots).
* prefill: each chunk's slices are gathered into an extent, which is the source of
  its writes, given back once the transfer pump reported the chunk's job settled.

Pure: no I/O; the copies themselves are pools.MappedKV.copy_heads.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

ALIGN = 4096  # extents start on page boundaries: a transport may register or pin by page

# Staging costs a copy of every byte on the staging host; writing slices one by one costs
# the transport's price of a block per span. Measured over Mooncake's TCP path (pdxfer
# bench, HISTORY.md): spans of 1 KiB (token-major) move 12-26x faster staged, on either
# side. Spans of 32-64 KiB (head-major at 4:2 and 2:1) staged at the decode, whose copies
# run beside its loop, moved 1.1-1.6x as fast as written one by one on 16 cores, once
# the buffer held the legs in flight; gathered at the prefill, whose loop copies before
# the first write, half as fast. So over TCP the decode stages spans under 128 KiB and
# the prefill under 16 KiB. With RDMA a block is a work request of about a microsecond
# (not measured here): under 8 KiB on either side.
STAGE_SPANS_BELOW = {("decode", "tcp"): 128 * 1024, ("prefill", "tcp"): 16 * 1024}
STAGE_SPANS_BELOW_DEFAULT = 8 * 1024
# The buffer must hold the staged legs in flight (the bench's: four rooms of 64-96 MiB, or
# 32 of 4-16 MiB): with 64 MiB most head-major legs found it full and wrote their slices,
# slower than not staging at all. It fills only as legs use it; over RDMA, where only short
# spans are staged, registering it pins it, so it stays small there.
STAGING_MIB = {"tcp": 512}
STAGING_MIB_DEFAULT = 64


@dataclass(frozen=True)
class StagedLayout:
    """Where a staged leg's bytes lie in its extent: pair k's slices of positions
    0..positions-1 from offsets[k], one slice_bytes[k] each."""

    slice_bytes: tuple[int, ...]  # one per region pair of the leg (plan.leg_region_pairs order)
    positions: int

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for size in self.slice_bytes:
            out.append(at)
            at += size * self.positions
        return tuple(out)

    @property
    def nbytes(self) -> int:
        return sum(self.slice_bytes) * self.positions


def slice_bytes(page_bytes: Sequence[int], heads: int, head_count: int) -> tuple[int, ...]:
    """Bytes of ``head_count`` of ``heads`` heads in a page of each region (heads split a page evenly)."""
    return tuple(size * head_count // heads for size in page_bytes)


def stage_spans_below(protocol: str, role: str, kib: int = 0) -> int:
    """Bytes under which a slice's spans are staged by a daemon of ``role`` (decode or
    prefill): ``kib`` KiB where an operator set it (--stage-spans-below-kib), else what
    was measured for ``protocol``."""
    return kib * 1024 if kib else STAGE_SPANS_BELOW.get((role, protocol), STAGE_SPANS_BELOW_DEFAULT)


def staging_mib(protocol: str, mib: int | None = None) -> int:
    """MiB of the staging buffer: ``mib`` where an operator set it (--staging-mib, 0:
    none), else the default for ``protocol``."""
    return mib if mib is not None else STAGING_MIB.get(protocol, STAGING_MIB_DEFAULT)


def worth_staging(head_count: int, whole_heads: int, sliced_heads: int, host_memory: bool, span: int, below: int) -> bool:
    """Whether the sliced side of a leg gains from staging: the leg is every head of one
    side's rank (``whole_heads``), whose runs of pages then stay whole, and a slice of
    the other side's ``sliced_heads``, whose spans of ``span`` bytes would cost more to
    write one by one than the copy (shorter than ``below``, stage_spans_below). The
    sliced side's pool must be host memory: its daemon copies the slices with the CPU."""
    return host_memory and 0 < head_count == whole_heads < sliced_heads and span < below


def slice_span(page_bytes: int, heads: int, head_count: int, page_size: int, head_major: bool) -> int:
    """Bytes of one contiguous span of a ``head_count``-head slice of a page: the whole
    slice of a head-major page ([head][token]), one token's of a token-major one."""
    span = page_bytes * head_count // heads
    return span if head_major else span // page_size


class StagingArena:
    """First-fit extents of a buffer of ``size`` bytes, each ALIGN-aligned."""

    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []  # (offset, length), sorted, merged
        self._taken: dict[int, int] = {}  # offset -> length

    @property
    def taken_bytes(self) -> int:
        return sum(self._taken.values())

    def __len__(self) -> int:
        return len(self._taken)

    def take(self, nbytes: int) -> int | None:
        """An extent of at least ``nbytes``: its offset, or None when none is free."""
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (at, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (at + need, length - need)
                self._taken[at] = need
                return at
        return None

    def give(self, offset: int) -> None:
        """Give back the extent at ``offset`` (taken, and not given back since)."""
        length = self._taken.pop(offset)
        i = bisect.bisect(self._free, (offset, length))
        self._free.insert(i, (offset, length))
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:  # merge with the next
            self._free[i] = (offset, length + self._free.pop(i + 1)[1])
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])
