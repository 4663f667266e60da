"""Per-destination batches of one turn of the event loop, for any message channel:
the ZMQ sockets (sockets.py) and the bootstrap channel between daemons (bootstrap.py).
No ZMQ here.

Messages posted to one destination during one turn of the event loop leave together,
as one message of frames (``Outbox``): under load that is one wake-up of each side's
I/O thread and of the receiver's loop for many messages, not one each.
"""

from __future__ import annotations

import asyncio
from typing import Callable

MAX_BATCH = 256  # messages (frames) one batch may carry; receivers refuse more
# A batch leaves once it holds this many messages, not at the end of the turn: a turn
# that handles hundreds of rooms' messages would otherwise hold every reply until its
# end, the next process would do the same, and rooms would move in waves with cores
# idle between them. Small rooms, 64 in flight: ~3,500 rooms/s with whole-turn batches,
# ~4,500 with 8 (with 1, ~3,000: the sends then cost more than the waves).
SEND_AT = 8
# A message this big leaves at once, in a batch of its own; the ZMQ sockets copy the
# frames smaller than this (cheaper than tracking zero-copy).
COPY_BELOW = 65536

Head = Callable[[list[bytes]], list[bytes]]  # the frames that go before a batch's payloads
Dropped = Callable[["bytes | None", list[bytes]], None]  # (destination, payloads) that could not be queued


def no_head(payloads: list[bytes]) -> list[bytes]:
    """The Head of a channel whose batches are their payloads alone (no envelope)."""
    return []


class Outbox:
    """Messages posted per destination (a ROUTER's peer identity, or None on a
    connected socket), handed to ``send_batch`` together: at the end of this turn of
    the loop, or at once when a destination's batch holds SEND_AT messages or a big one."""

    def __init__(self, send_batch: Callable[[bytes | None, list[bytes]], None]) -> None:
        self.send_batch = send_batch
        self.loop: asyncio.AbstractEventLoop | None = None
        self._batches: dict[bytes | None, list[bytes]] = {}
        self._flush_pending = False

    def post(self, payload: bytes, to: bytes | None = None) -> None:
        batch = self._batches.get(to)
        if batch is None:
            batch = self._batches[to] = []
            if not self._flush_pending and self.loop is not None:
                self._flush_pending = True
                self.loop.call_soon(self.flush)
        batch.append(payload)
        if len(batch) >= SEND_AT or len(payload) >= COPY_BELOW:
            self.send_batch(to, self._batches.pop(to))

    def flush(self) -> bool:
        """Send every posted message now; whether there were any."""
        self._flush_pending = False
        batches, self._batches = self._batches, {}
        for to, payloads in batches.items():
            self.send_batch(to, payloads)
        return bool(batches)
