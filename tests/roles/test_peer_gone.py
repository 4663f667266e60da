"""When a prefill takes a decode daemon for gone before the heartbeat bound (issue 30,
smaller defects): a write to it failed while its bootstrap connection was closed.
Either alone proves nothing: a daemon that lives reconnects, and a write that fails to
one still connected is written again. Driven on PrefillService directly, with a port
that records cancellations; test_peer_death.py kills a real decode daemon."""

from __future__ import annotations

import pytest

from pdxfer.core.config import Config
from pdxfer.core.plan import Blocks, compat_of, layout_registration
from pdxfer.roles.prefill import PrefillService
from pdxfer.roles.prefill.state import DecodePeer, PrefillWork
from pdxfer.core.protocol import PROTOCOL_VERSION, ErrorCode, LaneInfo, PeerHello, Rank, Role, RoomState
from pdxfer.transport import Job
from pdxfer.core.rooms import Event

from ..conftest import small_layout
from .port import RecordingPort


def hello(name: str, sessions: tuple[str, ...]) -> PeerHello:
    spec, regions = layout_registration(small_layout())
    lane = LaneInfo(index=0, rank=Rank(), compat=compat_of(spec, regions, 96), heads_local=spec.heads.local, layers=spec.layers,
                    region_bases=(0,), num_pages=256, aux_base=0, aux_slots=32, memory_version=1)
    return PeerHello(version=PROTOCOL_VERSION, incarnation=name * 16, session=sessions[0], lanes=(lane,), name=f"host/{name}", sessions=sessions)


SESSIONS = {b"a": ("127.0.0.1:1001", "127.0.0.1:1002"), b"b": ("127.0.0.1:2001",)}


@pytest.fixture
def service(tmp_path) -> PrefillService:
    """Two connected decode daemons, a and b, with two rooms each whose writes are in flight."""
    service = PrefillService(Config(role=Role.PREFILL, runtime_dir=str(tmp_path)), "p" * 16, RecordingPort(), sessions=("127.0.0.1:9001",), bootstrap_address="127.0.0.1:8998")
    now = service.port.clock()
    for n, (identity, sessions) in enumerate(SESSIONS.items()):
        peer = service.state.peers[identity] = DecodePeer(identity, hello(identity.decode(), sessions), now)
        service.on_connection(identity, "connected")
        for room_id in (10 * (n + 1), 10 * (n + 1) + 1):
            room = service.rooms.create(room_id, Role.PREFILL, now, peer=peer.label)
            service.rooms.apply(room, Event.BOOTSTRAPPED, now)
            service.rooms.apply(room, Event.INPUT_READY, now)
            job = Job(room_id, sessions, Blocks.of([1], [2], [64]), lambda job: None)
            service.state.work[room_id] = PrefillWork(peer=identity)
            service.rooms.writer_started(room, job)
            peer.rooms.add(room_id)
    return service


def states(service: PrefillService) -> dict[int, RoomState]:
    return {room_id: service.rooms.get(room_id).state for room_id in (10, 11, 20, 21)}


LIVE = {10: RoomState.TRANSFERRING, 11: RoomState.TRANSFERRING, 20: RoomState.TRANSFERRING, 21: RoomState.TRANSFERRING}


def test_a_write_that_fails_to_a_connected_decode_daemon_fails_nothing(service):
    service.write_failed(SESSIONS[b"a"])
    assert states(service) == LIVE and service.port.cancelled == [] and b"a" in service.state.peers


def test_a_closed_connection_alone_fails_nothing(service):
    service.on_connection(b"a", "disconnected")
    service.write_failed(SESSIONS[b"b"])  # another daemon's, still connected
    assert states(service) == LIVE and service.port.cancelled == [] and b"a" in service.state.peers


def test_a_write_that_fails_while_its_connection_is_closed_fails_exactly_its_rooms_at_once(service):
    service.on_connection(b"a", "disconnected")
    service.write_failed(SESSIONS[b"a"])
    assert states(service) == {**LIVE, 10: RoomState.FAILED, 11: RoomState.FAILED}
    for room_id in (10, 11):
        room = service.rooms.get(room_id)
        assert room.code is ErrorCode.PEER_DEAD and not room.fenced, room  # its write in flight has not settled
        assert "bootstrap connection closed" in room.reason and "write to its transfer engine" in room.reason, room.reason
    assert sorted(job.id for job in service.port.cancelled) == [10, 11]
    assert b"a" not in service.state.peers and service.book.failures["peers_declared_dead"] == 1


def test_a_decode_daemon_that_reconnected_is_not_taken_for_gone(service):
    service.on_connection(b"a", "disconnected")
    service.on_connection(b"a", "connected")
    service.write_failed(SESSIONS[b"a"])
    assert states(service) == LIVE and service.port.cancelled == []
