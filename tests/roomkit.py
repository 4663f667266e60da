"""Helpers shared by the fault tests (peer death, network faults, bad input): engine
clients, rooms with recognisable bytes, polling until a condition holds, and the
heartbeat settings and liveness bounds those tests use.

Liveness bounds, never speed: every bound below is what the daemon states plus a
generous slack, because other CPU-heavy work shares this 2-core machine.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

import numpy as np

from pdxfer.client import Client, Slot
from pdxfer.core.protocol import KVLayout, RoomState, RoomStatus
from pdxfer.ops.inspection import daemon_counters

from .conftest import small_layout
from .listen_ports import free_port  # the tests take it from here

# Small heartbeat settings keep the tests short. The stated bound for declaring a
# peer dead is interval x misses + one 0.05 s daemon tick.
HB_INTERVAL = 0.2
HB_MISSES = 3
HB_FLAGS = ("--heartbeat-interval", str(HB_INTERVAL), "--heartbeat-misses", str(HB_MISSES))
HB_BOUND = HB_INTERVAL * HB_MISSES + 0.05
# Added to every liveness bound: scheduling delays on a loaded 2-core machine, and
# the test's own polling interval.
SLACK = 3.0


def engine(daemon, layout: KVLayout | None = None, slots: int = 32, payload: int = 64, timeout: float = 20.0) -> Client:
    """A connected engine client with a registered KV pool and aux buffer."""
    client = Client(daemon.engine, timeout=timeout)
    client.connect()
    client.create_kv_pool(layout or small_layout())
    client.create_aux_buffer(slots, payload)
    return client


@dataclass
class RoomCase:
    """One room between a prefill client and a decode client, and what the decode
    side must hold once it succeeds."""

    id: int
    prefill: Client
    decode: Client
    src: np.ndarray
    dst: np.ndarray
    decode_slot: Slot
    expected: list  # per KV region: the page bytes
    aux: bytes

    def check_bytes(self) -> None:
        """Every destination page and the aux record hold what the prefill sent."""
        for region, (arr, want) in enumerate(zip(self.decode.kv.arrays(), self.expected)):
            assert np.array_equal(arr[self.dst], want), f"room {self.id}: KV region {region} differs at the destination"
        assert self.decode.aux.read(self.decode_slot, self.id) == self.aux, f"room {self.id}: aux record differs"


def start_room(prefill: Client, decode: Client, bootstrap: str, room: int, src, dst, seed: int, send: bool = True) -> RoomCase:
    """expect() on the decode side, then fill the source pages and send() on the prefill side."""
    src, dst = np.asarray(src), np.asarray(dst)
    rng = np.random.default_rng(seed)
    slot_d = decode.alloc_slot()
    decode.expect(room, bootstrap, dst, slot_d)
    expected = []
    for arr in prefill.kv.arrays():
        data = rng.integers(0, 256, size=(src.size, arr.shape[1]), dtype=np.uint8)
        arr[src] = data
        expected.append(data)
    aux = rng.integers(0, 256, size=32, dtype=np.uint8).tobytes()
    case = RoomCase(room, prefill, decode, src, dst, slot_d, expected, aux)
    if send:
        send_room(case)
    return case


def send_room(case: RoomCase) -> None:
    slot_p = case.prefill.alloc_slot()
    case.prefill.aux.payload(slot_p)[: len(case.aux)] = np.frombuffer(case.aux, np.uint8)
    tokens = case.src.size * case.prefill.kv.layout.page_size
    case.prefill.send(case.id, case.src, tokens, slot_p, aux_bytes=len(case.aux))


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; return that value.
    Raises AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def statuses(client: Client, rooms) -> dict[int, RoomStatus]:
    return {r: client._call(client._poll(r)) for r in rooms}


def all_in(client: Client, rooms, *states: RoomState) -> dict[int, RoomStatus] | None:
    """The rooms' statuses if every one is in one of ``states``, else None."""
    got = statuses(client, rooms)
    return got if all(s.state in states for s in got.values()) else None


def reuse_pages(case: RoomCase, byte: int) -> list[np.ndarray]:
    """Fill the case's destination pages in every KV region with ``byte``, as the room
    that reuses them after release would; returns what each region now holds there."""
    reused = [np.full_like(arr[case.dst], byte) for arr in case.decode.kv.arrays()]
    for arr, data in zip(case.decode.kv.arrays(), reused):
        arr[case.dst] = data
    return reused


def assert_nothing_written(prefill_daemon, blocks_before: float, case: RoomCase, reused: list[np.ndarray]) -> None:
    """The prefill daemon submitted no block since ``blocks_before``, and the reused pages are intact."""
    time.sleep(0.5)  # a write that was going to start has been submitted by now
    assert daemon_counters(prefill_daemon.ready["admin"])["blocks_submitted"] == blocks_before
    for region, (arr, data) in enumerate(zip(case.decode.kv.arrays(), reused)):
        assert np.array_equal(arr[case.dst], data), f"KV region {region}: a write landed in released pages"


def kill(daemon, sig=signal.SIGKILL) -> float:
    daemon.proc.send_signal(sig)
    return time.monotonic()


class Freezer:
    """Stops (SIGSTOP) and resumes (SIGCONT) a daemon with its transfer engine's process. ``thaw`` in a test's teardown
    resumes one still stopped (an assertion failed while it was frozen), so the
    daemon fixture can stop it."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.stopped = False

    def stop(self) -> float:
        self.stopped = True
        self.daemon.freeze(True)
        return time.monotonic()

    def resume(self) -> None:
        self.daemon.freeze(False)
        self.stopped = False

    def thaw(self) -> None:
        if self.stopped:
            self.resume()


def room_ids(cases) -> list[int]:
    return [c.id for c in cases]


async def arrived(predicate, timeout: float = 5.0) -> None:
    """Wait on the running loop until ``predicate()`` holds (sockets deliver meanwhile)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "nothing arrived in time"
        await asyncio.sleep(0.005)
