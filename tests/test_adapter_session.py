"""The adapters' daemon session (pdxfer.adapters.session) against live daemons: connect
and register, a room through two sessions, a daemon that goes away failing the rooms in
flight, connecting again at most once a RECONNECT_SECONDS (a clock the test turns), a
refusal settling its room, and aborts and releases that never raise. The adapters'
own tests drive it as SGLang and vLLM do (test_sglang_adapter.py, tests/engines)."""

from __future__ import annotations

import ctypes
import time
from typing import NamedTuple

import numpy as np
import pytest

from pdxfer.adapters.session import RECONNECT_SECONDS, Session, Timeouts
from pdxfer.client import Client, KVPool
from pdxfer.core import errors
from pdxfer.core.plan import layout_registration
from pdxfer.core.protocol import ErrorCode, KVRegion, KVSpec, MemoryHandle, Rank, Role, RoomState, RoomStatus, Welcome

from .conftest import needs_mooncake, small_layout

pytestmark = needs_mooncake

RECORD = b"the room's aux record"


class Memory(NamedTuple):
    buffers: list[MemoryHandle]
    spec: KVSpec
    regions: list[KVRegion]


class Clock:
    """A monotonic clock the test turns by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sessions(daemons):
    """Factory: session(daemon) -> an opened Session for a rank of the daemon's role,
    over a small shared-memory KV pool; each welcome it hears goes into ``welcomes``."""
    made: list[tuple[Session, KVPool]] = []

    def session(daemon, clock=time.monotonic, timeouts: Timeouts = Timeouts(register=20.0, reconnect=20.0, call=20.0),
                welcomes: list[Welcome] | None = None) -> Session:
        layout = small_layout()
        pool = KVPool.create(layout)
        spec, regions = layout_registration(layout)
        s = Session(daemon.engine, engine_id=f"test-{daemon.role}", role=Role(daemon.role), rank=Rank(), sizes=Rank(), device="cpu",
                    kv=Memory([pool.memory.handle], spec, regions), aux_slots=16, aux_bytes=len(RECORD), timeouts=timeouts,
                    on_welcome=None if welcomes is None else welcomes.append, clock=clock)
        made.append((s, pool))
        s.open()
        return s

    yield session
    for s, pool in made:
        s.close()
        pool.close()


def write_record(address: int) -> None:
    ctypes.memmove(address, RECORD, len(RECORD))


def wait_for(session: Session, room: int, state: RoomState, seconds: float = 20.0) -> RoomStatus:
    deadline = time.monotonic() + seconds
    while (status := session.status(room)) is None or status.state is not state:
        assert time.monotonic() < deadline, f"room {room} is {status.state.value if status else 'unknown'}, not {state.value}"
        time.sleep(0.02)
    return status


def slots(daemon) -> dict[str, int]:
    with Client(daemon.engine, timeout=10.0) as client:
        return client.stats().slots


def test_a_room_through_two_sessions_each_connected_and_registered(daemons, sessions):
    """Each session registered its KV and aux buffer on open (a room moves between
    them) and heard its daemon's welcome: the decode's fence bound, the prefill's
    bootstrap endpoint."""
    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode", "--fence-bound", "12")
    heard: list[Welcome] = []
    prefill, decode = sessions(prefill_daemon, welcomes=heard), sessions(decode_daemon, welcomes=heard)
    assert heard[0].bootstrap.rpartition("//")[2] == prefill_daemon.bootstrap.rpartition("//")[2] and heard[1].fence_bound == 12.0

    prefill.announce(7)
    assert prefill.status(7).state is RoomState.BOOTSTRAPPING
    decode.expect(7, prefill_daemon.bootstrap, [20, 21])
    wait_for(prefill, 7, RoomState.WAITING_FOR_INPUT)
    prefill.send(7, np.array([3], np.int32), last=False)
    prefill.send(7, np.array([4], np.int32), first_page=1, num_tokens=8, write_record=write_record)
    wait_for(decode, 7, RoomState.SUCCESS)
    assert decode.record(7) == RECORD
    wait_for(prefill, 7, RoomState.SUCCESS)
    for s in (prefill, decode):
        s.release(7)
        assert s.status(7) is None and not s.posted(7)


def test_a_daemon_that_went_away_fails_the_rooms_in_flight_and_is_connected_to_once_a_second(daemons, sessions):
    """Every room posted on the lost connection fails, fenced: nothing more of it can
    land. Until RECONNECT_SECONDS passed since the last try, posts fail at once with
    DaemonGone, though a daemon is back; a try that finds none counts too."""
    clock = Clock()
    daemon = daemons("prefill")
    welcomes: list[Welcome] = []
    session = sessions(daemon, clock, Timeouts(register=20.0, reconnect=0.5, call=20.0), welcomes)
    session.announce(1)
    session.announce(2)
    daemon.proc.kill()
    daemon.proc.wait()
    for room in (1, 2):
        status = wait_for(session, room, RoomState.FAILED)
        assert status.fenced and status.code is ErrorCode.PEER_UNREACHABLE and "went away" in status.reason
    assert not session.posted(1)

    with pytest.raises(errors.DaemonGone, match=f"connecting again every {RECONNECT_SECONDS:g}s"):
        session.announce(3)
    clock.now += RECONNECT_SECONDS
    with pytest.raises(errors.Timeout):  # a try, and no daemon answers it
        session.announce(3)
    again = daemons("prefill")  # the same name and runtime directory: the same endpoint
    assert again.engine == daemon.engine
    with pytest.raises(errors.DaemonGone, match="connecting again"):  # not its turn yet
        session.announce(3)
    clock.now += RECONNECT_SECONDS
    session.keep_connected()
    assert len(welcomes) == 2  # connected and registered again
    session.announce(3)
    assert session.status(3).state is RoomState.BOOTSTRAPPING
    assert session.status(1).state is RoomState.FAILED  # the lost room stays failed until released
    session.release(1)
    assert session.status(1) is None


def test_a_refused_expect_settles_its_room_and_gives_its_slot_back(daemons, sessions):
    """The daemon refuses an expect that did not wait (pages past the pool) after
    expect() returned: the room reads failed and fenced with the daemon's reason, and
    its slot is free again (the session keeps a batch of spares granted)."""
    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode")
    decode = sessions(decode_daemon)
    decode.expect(9, prefill_daemon.bootstrap, [10_000])
    status = wait_for(decode, 9, RoomState.FAILED)
    assert status.fenced and status.code is ErrorCode.PAGE_OUT_OF_RANGE and not decode.posted(9)
    assert slots(decode_daemon)["granted"] == 15  # the batch of 16 but the one given back


def test_a_refused_send_settles_its_room_and_aborts_it_so_the_decode_learns_now(daemons, sessions):
    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode")
    prefill, decode = sessions(prefill_daemon), sessions(decode_daemon)
    decode.expect(11, prefill_daemon.bootstrap, [20])
    prefill.send(11, np.array([10_000], np.int32), num_tokens=4)
    status = wait_for(prefill, 11, RoomState.FAILED)
    assert status.fenced and status.code is ErrorCode.PAGE_OUT_OF_RANGE
    landed = wait_for(decode, 11, RoomState.FAILED)
    assert "the daemon refused it" in landed.reason, landed.reason


def test_aborts_and_releases_never_raise_once_the_daemon_went_away(daemons, sessions):
    """An abort that finds the daemon gone fails the rooms in flight instead of raising;
    aborts and releases after it have nothing to reach."""
    daemon = daemons("prefill")
    session = sessions(daemon)
    session.announce(5)
    session.abort(5, "a live abort")
    assert wait_for(session, 5, RoomState.FAILED).code is ErrorCode.ABORTED
    session.release(5)
    session.announce(6)
    daemon.proc.kill()
    daemon.proc.wait()
    session.abort(6, "the daemon is gone")
    status = session.status(6)
    assert status.state is RoomState.FAILED and status.fenced and status.code is ErrorCode.PEER_UNREACHABLE
    session.abort(6, "again")
    session.release(6)
    session.release(404)
    assert session.status(6) is None
