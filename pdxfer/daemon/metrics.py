"""Prometheus metrics of one daemon, in a registry of its own.

Everything is read at scrape time by one collector: counters pdxfer already keeps
(bytes and blocks moved, failures by reason), the tables it holds (rooms, slots,
peers, queues), and the room table's moves (core/rooms.py) folded into plain integers
and bucket counts. The hot path pays a list append per transition, not a call, let
alone a prometheus_client one (those cost several microseconds each).
"""

from __future__ import annotations

import collections
import time

import numpy as np
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..core.protocol import RoomState

# A role's own counters (RoleInbound.counters): (metric, kind, help), each only where its role counts it.
ROLE_COUNTERS = {
    "bytes_received": ("pdxfer_bytes_received", CounterMetricFamily, "Bytes of rooms this (decode) daemon verified and delivered"),
    "kv_inline_rooms": ("pdxfer_kv_inline_rooms", CounterMetricFamily, "Rooms whose KV rode their aux record instead of transfer-engine writes (prefill side)"),
    "kv_inline_bytes": ("pdxfer_kv_inline_bytes", CounterMetricFamily, "KV bytes sent inside aux records (prefill side)"),
    "session_rotations": ("pdxfer_session_rotations", CounterMetricFamily, "Times this (decode) daemon moved its prefills to new transfer sessions and ended the old ones"),
    "rooms_fenced_by_session_end": ("pdxfer_rooms_fenced_by_session_end", CounterMetricFamily,
                                    "Failed rooms fenced because every transfer session they could be written into ended (decode side)"),
    "legs_staged": ("pdxfer_legs_staged", CounterMetricFamily, "Legs between ranks of different TP received through the staging buffer (decode side)"),
    "chunks_gathered": ("pdxfer_chunks_gathered", CounterMetricFamily,
                        "Chunks of legs to decode ranks of higher TP gathered into the staging buffer and written from it (prefill side)"),
    "staging_taken_bytes": ("pdxfer_staging_taken_bytes", GaugeMetricFamily,
                            "Bytes of the staging buffer held by legs or chunks now (a decode leg's until nothing more of it can land)"),
    "staging_full": ("pdxfer_staging_full", CounterMetricFamily,
                     "Legs (decode) or chunks (prefill) that would have been staged but found the staging buffer full, or /dev/shm too full to back their extent, so wrote between the pages"),
    "engine_messages": ("pdxfer_engine_messages", CounterMetricFamily, "Messages received from engines (a poll() answered from pushed statuses sends none)"),
    "lanes": ("pdxfer_lanes", GaugeMetricFamily, "Engine ranks this daemon serves (each with its own pools, slots and rooms)"),
    "heartbeat_misses": ("pdxfer_heartbeat_misses", CounterMetricFamily, "Heartbeats sent with no word from the peer since the one before (decode side)"),
}
PEER_STATES = ("alive", "draining", "connecting", "silent")


def peer_states(peers) -> dict[str, int]:
    """Peers by state (every state, 0 where none is)."""
    counts = collections.Counter(p.state for p in peers)
    return {state: counts.get(state, 0) for state in PEER_STATES}


# Seconds, from a loopback room (~1 ms) to a room stuck until its timeout.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Histogram:
    """Bucket counts and a sum, as Prometheus wants them. Observed values are appended
    to ``waiting`` and sorted into buckets together (``fold``, vectorised): on the hot
    path an observation costs a list append, not a Python call."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(BUCKETS) + 1, dtype=np.int64)  # the last is +Inf
        self._total = 0.0
        self.waiting: list[float] = []

    def fold(self) -> None:
        if self.waiting:
            values = np.array(self.waiting)
            self.waiting.clear()
            self.counts += np.bincount(np.searchsorted(BUCKETS, values, side="left"), minlength=self.counts.size)
            self._total += float(values.sum())

    @property
    def total(self) -> float:
        self.fold()
        return self._total

    @property
    def count(self) -> int:
        self.fold()
        return int(self.counts.sum())

    def buckets(self) -> list[tuple[str, int]]:
        self.fold()
        return list(zip((*map(str, BUCKETS), "+Inf"), np.cumsum(self.counts).tolist()))


class Metrics:
    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.transitions = dict.fromkeys(RoomState, 0)  # keyed by the enum: .value costs ~0.2 us per room event
        self.state_seconds = {state: Histogram() for state in RoomState}
        self.success_seconds = Histogram()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        # The standard process_*, python_info and python_gc_* families every exporter has:
        # prometheus_client registers these only in its global REGISTRY, not in ours.
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(standard)

    def fold(self) -> None:
        """Count the room table's moves since the last fold and sort what the histograms
        were told into their buckets (the daemon's ticker calls this, and a scrape: what
        waits stays bounded by the room rate times the tick)."""
        service = self.daemon.service
        for state, left, seconds_in_left, age in (service.rooms.take_moves() if service is not None else ()):
            self.transitions[state] += 1
            if left is not None:
                self.state_seconds[left].waiting.append(seconds_in_left)
            if state is RoomState.SUCCESS:
                self.success_seconds.waiting.append(age)
        for histogram in (*self.state_seconds.values(), self.success_seconds):
            histogram.fold()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        metrics = self.metrics
        metrics.fold()
        service, pump = metrics.daemon.service, metrics.daemon.pump
        transitions = CounterMetricFamily("pdxfer_room_transitions", "Rooms entering each state", labels=["state"])
        for state in RoomState:
            transitions.add_metric([state.value], metrics.transitions[state])
        yield transitions
        state_seconds = HistogramMetricFamily(
            "pdxfer_room_state_seconds", "Time rooms spent in a state before leaving it", labels=["state"]
        )
        for state, histogram in metrics.state_seconds.items():
            state_seconds.add_metric([state.value], histogram.buckets(), histogram.total)
        yield state_seconds
        success = HistogramMetricFamily("pdxfer_room_success_seconds", "Time from a room's creation to Success")
        success.add_metric([], metrics.success_seconds.buckets(), metrics.success_seconds.total)
        yield success
        rooms = GaugeMetricFamily("pdxfer_rooms", "Rooms held, by state", labels=["state"])
        for state, n in service.rooms.counts().items():
            rooms.add_metric([state.value], n)
        yield rooms
        slots = GaugeMetricFamily("pdxfer_slots", "Aux slots, by state", labels=["state"])
        for state, n in service.lanes.slot_counts().items():
            slots.add_metric([state.value], n)
        yield slots
        peers = GaugeMetricFamily("pdxfer_peers", "Peers, by state", labels=["state"])
        for state, n in peer_states(service.peer_infos(time.monotonic(), 0.0)).items():
            peers.add_metric([state], n)
        yield peers
        yield GaugeMetricFamily(
            "pdxfer_fence_pending_rooms",
            "Failed rooms whose pages and slot wait for their writer's proof that nothing is in flight, or the end of their transfer sessions (decode side)",
            value=sum(p.fence_pending for p in service.peer_infos(time.monotonic(), 0.0)),
        )
        queues = GaugeMetricFamily("pdxfer_queue_depth", "Writes in flight and jobs waiting in the transfer pump", labels=["queue"])
        for name, n in pump.depths().items():
            queues.add_metric([name], n)
        yield queues
        errors = CounterMetricFamily("pdxfer_errors", "Failed rooms, task errors and peer messages dropped, by reason", labels=["reason"])
        for reason, n in service.book.failures.items():
            errors.add_metric([reason], n)
        yield errors
        yield CounterMetricFamily("pdxfer_bytes_moved", "Bytes written by this daemon's transfers", value=pump.bytes_done)
        yield CounterMetricFamily("pdxfer_blocks_submitted", "Blocks handed to the transfer engine", value=pump.blocks_submitted)
        counters = service.counters()
        for key, (name, kind, text) in ROLE_COUNTERS.items():
            if key in counters:  # a role's own: the other role never counts it
                yield kind(name, text, value=counters[key])
        peer_messages = CounterMetricFamily("pdxfer_peer_messages_received", "Messages received from peer daemons, by kind (one room_request per room per node pair: A5)", labels=["kind"])
        for key, n in counters.items():
            if key.startswith("peer_messages_in:"):
                peer_messages.add_metric([key.split(":", 1)[1]], n)
        yield peer_messages
        yield CounterMetricFamily("pdxfer_failed_writes", "Writes the transfer engine refused or failed", value=pump.failed_writes)
        yield CounterMetricFamily("pdxfer_transport_stalls", "Times no write to a peer completed within stall_timeout", value=pump.stalls)
        yield CounterMetricFamily("pdxfer_transport_resets", "Times the transfer engine was re-created", value=pump.resets)
        yield CounterMetricFamily("pdxfer_jobs_written", "Write jobs (a leg's chunk each) whose every write completed", value=pump.jobs_written)
        yield CounterMetricFamily("pdxfer_job_queue_seconds", "Seconds those jobs waited for their first write, behind other jobs to the peer",
                                  value=pump.job_queue_seconds)
        yield CounterMetricFamily("pdxfer_job_write_seconds", "Seconds those jobs took from their first write until every write completed",
                                  value=pump.job_write_seconds)
        daemon = metrics.daemon
        yield CounterMetricFamily(
            "pdxfer_transfer_engine_process_restarts", "Times the transfer engine's own process ended and another took over (--transfer-engine-process child)",
            value=daemon.engine_process_restarts,
        )
        yield GaugeMetricFamily(
            "pdxfer_cpu_yielding", "1 while the daemon's own threads yield the cores to the transfer engine's (SCHED_IDLE, --yield-cpu)",
            value=int(daemon.yielding is not None and daemon.yielding.active),
        )
        yield CounterMetricFamily(
            "pdxfer_cpu_takebacks", "Times the daemon's threads left SCHED_IDLE because other processes starved its event loop", value=daemon.cpu_takebacks,
        )

