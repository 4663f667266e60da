"""Prometheus metrics of one daemon, in a registry of its own.

Counters that pdxfer already keeps (bytes and blocks moved, failures by reason) and
tables it already holds (rooms, slots, peers, queues) are read at scrape time by a
collector, so the hot path pays nothing for them; only room transitions are
observed as they happen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .protocol import RoomState
from .rooms import Room

# Seconds, from a loopback room (~1 ms) to a room stuck until its timeout.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=True)
        self.transitions = Counter(
            "pdxfer_room_transitions", "Rooms entering each state", ["state"], registry=self.registry
        )
        self.state_seconds = Histogram(
            "pdxfer_room_state_seconds", "Time rooms spent in a state before leaving it", ["state"],
            buckets=BUCKETS, registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "pdxfer_room_success_seconds", "Time from a room's creation to Success", buckets=BUCKETS, registry=self.registry
        )
        self.registry.register(_Tables(daemon))

    def observe(self, room: Room, left: RoomState | None, now: float) -> None:
        """RoomTable observer: one call per state change."""
        self.transitions.labels(room.state.value).inc()
        if left is not None and len(room.history) >= 2:
            self.state_seconds.labels(left.value).observe(now - room.history[-2][1])
        if room.state is RoomState.SUCCESS:
            self.transfer_seconds.observe(now - room.created)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Tables:
    """Gauges and counters read from the daemon when Prometheus scrapes."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def describe(self):
        return []

    def collect(self):
        service, pump = self.daemon.service, self.daemon.pump
        rooms = GaugeMetricFamily("pdxfer_rooms", "Rooms held, by state", labels=["state"])
        for state, n in service.rooms.counts().items():
            rooms.add_metric([state.value], n)
        yield rooms
        slots = GaugeMetricFamily("pdxfer_slots", "Aux slots, by state", labels=["state"])
        for state, n in (service.aux.slots.counts().items() if service.aux is not None else ()):
            slots.add_metric([state.value], n)
        yield slots
        peers = GaugeMetricFamily("pdxfer_peers", "Peers, by state", labels=["state"])
        for state, n in service.peer_states().items():
            peers.add_metric([state], n)
        yield peers
        queues = GaugeMetricFamily("pdxfer_queue_depth", "Writes in flight and jobs waiting in the transfer pump", labels=["queue"])
        for name, n in pump.depths().items():
            queues.add_metric([name], n)
        yield queues
        errors = CounterMetricFamily("pdxfer_errors", "Failed rooms and task errors, by reason", labels=["reason"])
        for reason, n in service.failures.items():
            errors.add_metric([reason], n)
        yield errors
        yield CounterMetricFamily("pdxfer_bytes_moved", "Bytes written by this daemon's transfers", value=pump.bytes_done)
        yield CounterMetricFamily("pdxfer_bytes_received", "Bytes of rooms this (decode) daemon verified and delivered", value=service.bytes_received)
        yield CounterMetricFamily("pdxfer_blocks_submitted", "Blocks handed to the transfer engine", value=pump.blocks_submitted)
        yield CounterMetricFamily("pdxfer_failed_writes", "Writes the transfer engine refused or failed", value=pump.failed_writes)
        yield CounterMetricFamily("pdxfer_transport_resets", "Times the transfer engine was re-created", value=pump.resets)
        yield CounterMetricFamily(
            "pdxfer_heartbeat_misses", "Heartbeats sent with no word from the peer since the one before (decode side)",
            value=service.heartbeat_misses,
        )
