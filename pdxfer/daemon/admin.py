"""The admin API: what ``pdxfer rooms``, ``room``, ``peers``, ``slots``, ``top`` and
``doctor`` ask a running daemon. Read-only unless the daemon runs with
--admin-writes; requests are signed like bootstrap messages when the cluster has a
secret (see wire.seal.Seal)."""

from __future__ import annotations

import math
import time

import msgspec

from ..core import errors
from ..core.protocol import (
    PROTOCOL_VERSION,
    AdminInfo,
    AdminPeers,
    AdminRoom,
    AdminRooms,
    AdminSlots,
    Error,
    ErrorCode,
    InfoReply,
    Message,
    PeersReply,
    RoomInfo,
    RoomsReply,
    RoomState,
    SlotInfo,
    SlotsReply,
)
from ..core.rooms import Room
from ..core.slots import SlotState
from ..core.topology import room_key, room_of


def room_info(room: Room, now: float, history: bool = False) -> RoomInfo:
    return RoomInfo(
        room=room_of(room.id), lane=room.lane, role=room.role, state=room.state, age=now - room.created, in_state=now - room.entered,
        peer=room.peer, slot=room.slot, generation=room.generation, bytes_planned=room.bytes_planned,
        bytes_moved=room.bytes_moved, fenced=room.fenced, code=room.code, reason=room.reason,
        history=tuple((state, at - room.created) for state, at in room.history) if history else (),
    )


def slot_infos(lanes, now: float) -> list[SlotInfo]:
    """Every lane's slots, lane by lane."""
    return [
        SlotInfo(
            index=s.index, lane=lane.index, state=s.state.value, room=room_of(s.room), generation=s.generation,
            since=now - s.since if s.since else 0.0, fence_in=_fence_in(s, now),
        )
        for lane in lanes if lane.aux is not None
        for s in lane.aux.slots.slots
    ]


def _rank_rooms(service, room: int) -> list[Room]:
    """Every local rank's live part of ``room``."""
    return list({key: found for lane in service.lanes if (found := service.rooms.find(key := room_key(room, lane.code))) is not None}.values())


def _released(service, room: int) -> list[RoomInfo]:
    """The outcome of every local rank's part of ``room`` that its engine released
    (kept for a while, bounded); UnknownRoom when there is none either."""
    finished = service.book.finished
    found = [(lane, finished[key]) for lane in service.lanes if (key := room_key(room, lane.code)) in finished]
    if not found:
        service.rooms.get(room)  # raises UnknownRoom, naming it
    return [
        RoomInfo(room=room, lane=lane.index, role=service.role, state=state, age=0.0, in_state=0.0, peer="", slot=-1, generation=0,
                 bytes_planned=0, bytes_moved=0, fenced=False, code=code, reason=reason, released=True)
        for lane, (state, code, reason) in found
    ]


def _fence_in(slot, now: float) -> float:
    if slot.state is not SlotState.QUARANTINED:
        return 0.0
    return -1.0 if math.isinf(slot.fence_deadline) else max(0.0, slot.fence_deadline - now)


def not_ready(daemon) -> list[str]:
    """What /readyz waits for; empty when ready."""
    service = daemon.service
    waiting = []
    if not daemon.session:
        waiting.append("transfer engine not initialised")
    if service is None or not any(lane.kv is not None for lane in service.lanes):
        waiting.append("no KV pool registered")
    if service is None or not any(lane.aux is not None for lane in service.lanes):
        waiting.append("no aux buffer registered")
    if service is None or not service.lanes.engines or not daemon.engine_connections():
        waiting.append("no engine connected")
    if daemon.draining:
        waiting.append("draining for shutdown")
    return waiting


def info(daemon, req: int = 0) -> InfoReply:
    service, pump, cfg = daemon.service, daemon.pump, daemon.config
    stats = service.desk.stats()
    counters = {
        "bytes_moved": float(pump.bytes_done),
        "blocks_submitted": float(pump.blocks_submitted),
        "failed_writes": float(pump.failed_writes),
        "transport_stalls": float(pump.stalls),
        "transport_resets": float(pump.resets),
        "jobs_written": float(pump.jobs_written),
        "job_queue_seconds": pump.job_queue_seconds,
        "job_write_seconds": pump.job_write_seconds,
        "cpu_takebacks": float(daemon.cpu_takebacks),
        "transfer_engine_process_restarts": float(daemon.engine_process_restarts),
        **service.counters(),
    }
    for state in (s for s in RoomState if not s.terminal):  # the pdxfer_room_state_seconds histogram's sum and count: where rooms spend their time
        histogram = daemon.metrics.state_seconds[state]
        counters.update({f"state_seconds:{state.value}": histogram.total, f"state_left:{state.value}": float(histogram.count)})
    waiting = not_ready(daemon)
    return InfoReply(
        req=req, role=cfg.role, name=cfg.instance, incarnation=daemon.incarnation, version=PROTOCOL_VERSION,
        uptime=time.monotonic() - daemon.started, wall=time.time(), ready=not waiting, not_ready=waiting,
        draining=daemon.draining, bootstrap=daemon.bootstrap_address, session=daemon.session, engine=daemon.engine_endpoint,
        config=msgspec.to_builtins(cfg), rooms=stats.rooms, slots=stats.slots, failures=stats.failures,
        counters=counters, queues=pump.depths(), sessions=list(daemon.sessions),
    )


def handle(daemon, msg: Message) -> Message:
    """Answer one admin request."""
    service = daemon.service
    try:
        if isinstance(msg, AdminInfo):
            return info(daemon, msg.req)
        now = time.monotonic()
        if isinstance(msg, AdminRooms):
            rooms = [
                room_info(r, now) for r in service.rooms
                if (msg.state is None or r.state is msg.state)
                and (not msg.peer or msg.peer in r.peer)
                and now - r.created >= msg.older_than
            ]
            return RoomsReply(req=msg.req, rooms=sorted(rooms, key=lambda r: -r.age))
        if isinstance(msg, AdminRoom):
            rooms = _rank_rooms(service, msg.room)
            if not rooms:
                released = _released(service, msg.room)
                if msg.fail:
                    _writes_allowed(daemon, "fail a room")
                    raise errors.BadMessage(f"room {msg.room} was released already ({released[0].state.value})", room=msg.room)
                return RoomsReply(req=msg.req, rooms=released)
            if msg.fail:
                _writes_allowed(daemon, "fail a room")
                failed = [service.fail(room, ErrorCode.ABORTED, f"failed by an operator: {msg.reason}") for room in rooms]
                if not any(failed):
                    raise errors.BadMessage(f"room {msg.room} already finished ({rooms[0].state.value})", room=msg.room)
            return RoomsReply(req=msg.req, rooms=[room_info(room, time.monotonic(), history=True) for room in rooms])
        if isinstance(msg, AdminPeers):
            if msg.cut:
                _writes_allowed(daemon, "cut a peer")
                return daemon.cut(msg)  # the reply comes once the sessions are replaced
            if msg.drain:
                _writes_allowed(daemon, "drain a peer")
                service.drain(msg.drain)
            return PeersReply(req=msg.req, peers=service.peer_infos(now, time.time()))
        if isinstance(msg, AdminSlots):
            return SlotsReply(req=msg.req, slots=slot_infos(service.lanes, now))
    except errors.PdxferError as exc:
        return Error(req=msg.req, code=exc.code, message=exc.message, room=exc.room)
    return Error(req=msg.req, code=ErrorCode.BAD_MESSAGE, message=f"unexpected admin request {type(msg).__name__}")


def _writes_allowed(daemon, what: str) -> None:
    if not daemon.config.admin_writes:
        raise errors.PdxferError(f"this daemon's admin API is read-only: start it with --admin-writes to {what}", code=ErrorCode.UNSUPPORTED)
