"""Chaos engines: a prefill and a decode engine in one process that abort rooms on
either side at random moments, stall at random, retry when the daemon is busy, and
check every byte they are handed. The fault-injection tests and ``pdxfer soak`` drive
daemons with them.

A *corruption* is a delivery the decode engine accepted whose KV pages or aux record
differ from what the prefill engine sent. It must never happen. A room pdxfer
reported as Success whose aux record then failed its stamp check when the engine
read it (a late write that landed after Success) is *caught*, not corrupted: the
engine never used the bad record.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..client import AsyncClient, Slot
from ..core import errors
from ..core.plan import pages_for_tokens
from ..core.protocol import KVLayout, Layout, RoomState
from .sim import AUX_RECORD_BYTES, PageAllocator, aux_record, fill_pages, pages_match

SLOT_WAIT = 60.0


@dataclass
class ChaosReport:
    rooms: int = 0
    prefill: Counter = field(default_factory=Counter)
    decode: Counter = field(default_factory=Counter)
    corruptions: int = 0
    caught_after_success: int = 0
    verified: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"{self.rooms} rooms in {self.seconds:.1f}s: decode {dict(self.decode)}, prefill {dict(self.prefill)}, "
            f"verified {self.verified}, caught after success {self.caught_after_success}, corruptions {self.corruptions}"
        )


@dataclass(frozen=True)
class ChaosSpec:
    rooms: int = 1000
    in_flight: int = 8
    abort_rate: float = 0.1  # per side, per room
    stall_ms: float = 2.0  # random pause before send/expect and before an abort
    max_tokens: int = 32
    layout: KVLayout = KVLayout(layout=Layout.MHA, num_layers=2, num_pages=512, page_size=4, token_bytes=1280, dtype="uint8")
    slots: int = 4
    seed: int = 1
    client_timeout: float = 30.0  # an engine call the daemon does not answer in time fails that room


async def _slot(client: AsyncClient) -> Slot:
    deadline = time.monotonic() + SLOT_WAIT
    while True:
        try:
            return await client.alloc_slot()
        except errors.Busy as exc:  # backpressure: the daemon says when to come back
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(exc.retry_after_ms / 1000)


def _outcome(status) -> str:
    return "success" if status.state is RoomState.SUCCESS else f"failed:{status.code.value}"


async def _settle(client: AsyncClient, room: int) -> str:
    status = await client.wait(room, timeout=120)
    await client.release(room, wait=False)
    return _outcome(status)


async def run_chaos(prefill_engine: str, decode_engine: str, bootstrap: str, spec: ChaosSpec) -> ChaosReport:
    report = ChaosReport(rooms=spec.rooms)
    rng = random.Random(spec.seed)
    pre = AsyncClient(prefill_engine, timeout=spec.client_timeout, engine_id="chaos-prefill")
    dec = AsyncClient(decode_engine, timeout=spec.client_timeout, engine_id="chaos-decode")
    await pre.connect()
    await dec.connect()
    try:
        for client in (pre, dec):
            await client.create_kv_pool(spec.layout)
            await client.create_aux_buffer(spec.slots, AUX_RECORD_BYTES)
        src_pages = PageAllocator(spec.layout.num_pages, spec.seed + 1)
        dst_pages = PageAllocator(spec.layout.num_pages, spec.seed + 2)
        src_arrays, dst_arrays = pre.kv.arrays(), dec.kv.arrays()
        gate = asyncio.Semaphore(spec.in_flight)

        async def stall() -> None:
            await asyncio.sleep(rng.random() * spec.stall_ms / 1000)

        async def begin(client: AsyncClient, start, slot: Slot, counts: Counter, room: int, abort: bool, side: str) -> bool:
            """Start the room on one side (send or expect); maybe abort it later. False if refused."""
            await stall()
            try:
                await start()
            except errors.PdxferError as exc:
                await _free(client, slot)
                counts[f"refused:{exc.code.value}"] += 1
                return False
            if abort:
                await stall()
                await client.abort(room, f"chaos: {side} engine gave up")
            return True

        async def give_up(counts: Counter, exc: errors.PdxferError) -> None:
            """The room's pages stay out of use (a write from or into them may still be in
            flight), and no later room starts (the pools close): the engine would reconnect
            and register again."""
            if src_pages.closed:  # the session was lost already
                counts["lost with the engine session"] += 1
                return
            counts[f"error:{exc.code.value}"] += 1
            for pool in (src_pages, dst_pages):
                await pool.close(f"engine session lost: {exc}")

        async def prefill_side(room: int, tokens: int, abort: bool) -> None:
            n = pages_for_tokens(tokens, spec.layout.page_size)
            try:
                pages = await src_pages.take(n)
                fill_pages(src_arrays, room, pages)
                slot = await _slot(pre)
                pre.aux.payload(slot)[:AUX_RECORD_BYTES] = np.frombuffer(aux_record(room, tokens), np.uint8)
                send = lambda: pre.send(room, pages, tokens, slot, aux_bytes=AUX_RECORD_BYTES)  # noqa: E731
                if await begin(pre, send, slot, report.prefill, room, abort, "prefill"):
                    report.prefill[await _settle(pre, room)] += 1
            except errors.PdxferError as exc:  # its daemon went away, or did not answer
                await give_up(report.prefill, exc)
                return
            await src_pages.give(pages)

        async def decode_side(room: int, tokens: int, abort: bool) -> None:
            n_src = pages_for_tokens(tokens, spec.layout.page_size)
            try:
                pages = await dst_pages.take(n_src)
                slot = await _slot(dec)
                expect = lambda: dec.expect(room, bootstrap, pages, slot)  # noqa: E731
                if await begin(dec, expect, slot, report.decode, room, abort, "decode"):
                    report.decode[await _settle_and_check(room, tokens, slot, pages)] += 1
            except errors.PdxferError as exc:
                await give_up(report.decode, exc)
                return
            await dst_pages.give(pages)  # wait() returned: Success or fenced, so no write can land

        async def _settle_and_check(room: int, tokens: int, slot: Slot, pages: np.ndarray):
            status = await dec.wait(room, timeout=120)
            if status.state is RoomState.SUCCESS:
                try:
                    record = dec.aux.read(slot, room)
                except errors.AuxStampMismatch:
                    report.caught_after_success += 1
                else:
                    if record != aux_record(room, tokens) or not pages_match(dst_arrays, room, pages):
                        report.corruptions += 1
                    else:
                        report.verified += 1
            await dec.release(room, wait=False)
            return _outcome(status)

        async def one(i: int) -> None:
            room = rng.getrandbits(63) | 1 << 63
            tokens = rng.randint(1, spec.max_tokens)
            abort_p, abort_d = rng.random() < spec.abort_rate, rng.random() < spec.abort_rate
            async with gate:
                await asyncio.gather(prefill_side(room, tokens, abort_p), decode_side(room, tokens, abort_d))

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(spec.rooms)))
        report.seconds = time.monotonic() - started
    finally:
        await pre.close()
        await dec.close()
    return report


async def _free(client: AsyncClient, slot: Slot) -> None:
    try:
        await client.free_slot(slot)
    except errors.PdxferError:
        pass  # bound after all: it goes with the room


async def settled_stats(engine: str, timeout: float) -> object:
    """A daemon's stats once no room is held and no slot quarantined (or the timeout)."""
    client = AsyncClient(engine, engine_id="chaos-stats")
    await client.connect()
    try:
        deadline = time.monotonic() + timeout
        while True:
            stats = await client.stats()
            busy = sum(stats.rooms.values()) + stats.slots.get("quarantined", 0)
            if not busy or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.2)
    finally:
        await client.close()
