"""Staging a head slice on the decode side (ENGINES.md §7.A6).

Between ranks of different TP, a decode rank that holds more KV heads than the prefill
rank receives each prefill rank's heads into a slice of every page. In a head-major page
that slice is one span per (region, page), and spans of neighbouring pages are not
contiguous, so a leg of N pages is N blocks per region where equal TP writes runs of
pages as one block each. Over a transport whose cost grows with the blocks (Mooncake's
TCP path waits for each write's acknowledgement), that is most of the difference.

A staged leg writes into a buffer of the decode daemon's instead, laid out as the
prefill rank's pages are (region pair, then page position, then the slice), so runs of
source pages stay runs; once the leg's record says every write completed, the decode
daemon copies the slices into the pages. The buffer's extents are taken per leg and
given back only on proof that nothing more can land in them: the leg's record, its
prefill's fenced failure, a refusal, a request never sent, or the prefill's restart or
an operator's cut (S2, as for aux slots).

Pure: no I/O; the copy itself is pools.MappedKV.scatter_heads.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

ALIGN = 4096  # extents start on page boundaries: a transport may register or pin by page

# Staging costs a copy of every byte on the decode host (5-10 GB/s here: 0.1-0.2 ns a
# byte); writing slices straight into the pages costs the transport's price of a block
# per span. A leg is staged when its span is under that price over the copy's: over
# Mooncake's TCP path a block costs about 20 us of CPU (pdxfer bench, raw engine, 20 ->
# 100 blocks per room), so spans up to 128 KiB; with RDMA a block is a work request of
# about a microsecond (not measured here), so only spans under 8 KiB, which token-major
# slices (a span per token) are.
STAGE_SPANS_BELOW = {"tcp": 128 * 1024}
STAGE_SPANS_BELOW_DEFAULT = 8 * 1024


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


def worth_staging(head_count: int, src_heads: int, dst_heads: int, host_memory: bool, span: int, protocol: str) -> bool:
    """Whether a leg gains from staging: it fills a slice of each decode page (the decode
    rank holds more heads) with every head of the prefill rank's pages, whose runs then
    stay whole, and written into the pages its spans of ``span`` bytes would cost
    ``protocol`` more than the copy (STAGE_SPANS_BELOW). A decode pool outside host
    memory is not staged: the daemon copies the slices with the CPU."""
    below = STAGE_SPANS_BELOW.get(protocol, STAGE_SPANS_BELOW_DEFAULT)
    return host_memory and 0 < head_count == src_heads < dst_heads and span < below


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
