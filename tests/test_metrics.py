"""What a daemon shows the cluster around it, scraped from real daemons: the
Prometheus /metrics endpoint (the counters move by exactly what the test did),
/healthz and /readyz as Kubernetes probes, and the logs (one line per room
transition at debug level; JSON lines with --log-format json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdxfer.client import Client
from pdxfer.core.errors import UnknownRoom
from pdxfer.core.protocol import RoomState
from pdxfer.daemon.metrics import BUCKETS, Histogram

from .conftest import needs_mooncake, small_layout
from .roomkit import engine, free_port, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

PAGE_BYTES = 4 * 64 * 8  # small_layout: a page is 4 tokens x 64 bytes in each of 8 regions
REGIONS = 8


def test_a_histogram_folds_waiting_values_into_cumulative_le_buckets():
    """Values wait in a list and are bucketed together: a value on a bound counts in
    that bound's bucket (Prometheus's le), later folds add to earlier ones, and what
    waits is counted whenever the histogram is read."""
    h = Histogram()
    h.waiting.extend([0.0, BUCKETS[0], BUCKETS[0] * 1.5, 120.0])
    h.fold()
    h.waiting.extend([121.0, 0.0007])  # read without a fold: the reader folds them
    buckets = dict(h.buckets())
    assert buckets[str(BUCKETS[0])] == 2  # 0 and the bound itself
    assert buckets[str(BUCKETS[1])] == 4  # + 0.00075 and 0.0007
    assert buckets["120"] == 5 and buckets["+Inf"] == 6
    assert h.total == pytest.approx(0.0 + BUCKETS[0] + BUCKETS[0] * 1.5 + 120.0 + 121.0 + 0.0007)
    assert h.waiting == []


def get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of GET http://127.0.0.1:port/path."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape(port: int) -> dict[tuple, float]:
    """Every sample of /metrics: (name, sorted label pairs) -> value."""
    status, ctype, body = get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def state_or_none(client: Client, room: int):
    try:
        return client.poll(room).state
    except UnknownRoom:
        return None


def run_room(p: Client, d: Client, bootstrap: str, room: int, src: list[int], dst: list[int]) -> None:
    """expect(), wait until the prefill holds the request (so both sides go through
    every state: bootstrapping, waiting_for_input, transferring, success), then send()."""
    d.expect(room, bootstrap, np.array(dst), d.alloc_slot())
    wait_until(lambda: state_or_none(p, room) is RoomState.WAITING_FOR_INPUT, 10, f"room {room} waiting on the prefill")
    slot = p.alloc_slot()
    p.send(room, np.array(src), 4 * len(src), slot, aux_bytes=8)
    assert d.wait(room).state is RoomState.SUCCESS and p.wait(room).state is RoomState.SUCCESS


def test_health_and_readiness_probes(daemons):
    port = free_port()
    daemon = daemons("decode", "--http-port", str(port))
    assert daemon.ready["http_port"] == port
    assert get(port, "/healthz")[::2] == (200, "ok\n")
    status, ctype, body = get(port, "/readyz")
    assert status == 503 and ctype == "application/json"
    assert json.loads(body) == {"ready": False, "waiting_for": ["no KV pool registered", "no aux buffer registered", "no engine connected"]}
    client = Client(daemon.engine, timeout=20.0)
    try:
        client.connect()
        assert json.loads(get(port, "/readyz")[2])["waiting_for"] == ["no KV pool registered", "no aux buffer registered"]
        client.create_kv_pool(small_layout())
        assert get(port, "/readyz")[0] == 503
        client.create_aux_buffer(16, 64)
        assert get(port, "/readyz")[::2] == (200, json.dumps({"ready": True, "waiting_for": []}) + "\n")
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/nope")[0] == 404
    finally:
        client.close()


def test_readiness_drops_when_the_engine_goes_away(daemons):
    port = free_port()
    daemon = daemons("decode", "--http-port", str(port))
    client = Client(daemon.engine, timeout=20.0)
    client.connect()
    client.create_kv_pool(small_layout())
    client.create_aux_buffer(16, 64)
    assert get(port, "/readyz")[0] == 200
    client.close()
    time.sleep(0.5)
    assert get(port, "/readyz")[0] == 503


def test_counters_move_by_exactly_what_the_test_did(daemons):
    pport, dport = free_port(), free_port()
    prefill = daemons("prefill", "--http-port", str(pport))
    decode = daemons("decode", "--http-port", str(dport))
    p, d = engine(prefill, slots=16), engine(decode, slots=16)
    try:
        boot = prefill.bootstrap
        before = {"p": scrape(pport), "d": scrape(dport)}
        rooms = {1: ([10], [1]), 2: ([20, 21], [2, 3]), 3: ([30, 31, 32, 33], [4, 5, 6, 7])}  # contiguous: one block per region
        for room, (src, dst) in rooms.items():
            run_room(p, d, boot, room, src, dst)
        n = len(rooms)
        pages = sum(len(src) for src, _ in rooms.values())
        after = {"p": scrape(pport), "d": scrape(dport)}
        for side in ("p", "d"):
            b, a = before[side], after[side]
            for state in ("bootstrapping", "waiting_for_input", "transferring", "success"):
                assert delta(b, a, "pdxfer_room_transitions_total", state=state) == n, (side, state)
            assert delta(b, a, "pdxfer_room_transitions_total", state="failed") == 0
            for state in ("bootstrapping", "waiting_for_input", "transferring"):
                assert delta(b, a, "pdxfer_room_state_seconds_count", state=state) == n, (side, state)
            assert delta(b, a, "pdxfer_room_success_seconds_count") == n
            assert value(a, "pdxfer_rooms", state="success") == n  # not released yet
            assert value(a, "pdxfer_peers", state="alive") == 1
            assert value(a, "pdxfer_queue_depth", queue="writes_in_flight") == 0
            assert value(a, "pdxfer_slots", state="free") + value(a, "pdxfer_slots", state="written") + value(a, "pdxfer_slots", state="armed") == 16
            # Only decode daemons heartbeat: a prefill exports no always-zero miss counter.
            assert (("pdxfer_heartbeat_misses_total", ()) in a) == (side == "d"), side
        # The prefill writes the KV (aux rides the bootstrap channel on tcp): exactly these bytes and blocks.
        assert delta(before["p"], after["p"], "pdxfer_bytes_moved_total") == pages * PAGE_BYTES
        assert delta(before["p"], after["p"], "pdxfer_blocks_submitted_total") == n * REGIONS
        assert delta(before["d"], after["d"], "pdxfer_bytes_moved_total") == 0
        assert value(after["d"], "pdxfer_slots", state="written") == n

        for room in rooms:
            d.release(room)
            p.release(room)
        released = {"p": scrape(pport), "d": scrape(dport)}
        for side in ("p", "d"):
            assert value(released[side], "pdxfer_rooms", state="success") == 0
            assert value(released[side], "pdxfer_slots", state="free") == 16

        aborts = (11, 12)
        for room in aborts:
            d.expect(room, boot, np.array([40 + room]), d.alloc_slot())
            d.abort(room, "the router gave up")
        k = len(aborts)

        def both_counted():
            now = {"p": scrape(pport), "d": scrape(dport)}
            done = all(delta(released[s], now[s], "pdxfer_errors_total", reason="aborted") >= k for s in now)
            return now if done and all(d.poll(r).fenced for r in aborts) else None

        wait_until(both_counted, 10, "both daemons to count the aborts")
        time.sleep(0.3)  # nothing more may arrive
        final = {"p": scrape(pport), "d": scrape(dport)}
        for side in ("p", "d"):
            assert delta(released[side], final[side], "pdxfer_errors_total", reason="aborted") == k, side
            assert delta(released[side], final[side], "pdxfer_room_transitions_total", state="failed") == k, side
            assert delta(released[side], final[side], "pdxfer_room_transitions_total", state="success") == 0, side
            assert {key[1] for key in final[side] if key[0] == "pdxfer_errors_total"} == {(("reason", "aborted"),)}, side
        assert value(final["d"], "pdxfer_rooms", state="failed") == k  # the decode engine still holds them
        assert value(final["p"], "pdxfer_rooms", state="failed") == 0  # no prefill engine joined them: dropped
        assert value(final["d"], "pdxfer_slots", state="quarantined") == 0  # the prefill confirmed the fence
        assert delta(released["p"], final["p"], "pdxfer_bytes_moved_total") == 0
    finally:
        p.close()
        d.close()


def test_a_dead_prefill_counts_its_failed_rooms_once(daemons):
    port = free_port()
    prefill = daemons("prefill")
    decode = daemons("decode", "--http-port", str(port), "--heartbeat-interval", "0.2", "--heartbeat-misses", "3")
    p, d = engine(prefill, slots=16), engine(decode, slots=16)
    try:
        d.expect(1, prefill.bootstrap, np.array([1]), d.alloc_slot())
        wait_until(lambda: d.poll(1).state is RoomState.WAITING_FOR_INPUT, 10, "room 1 accepted")
        prefill.proc.kill()  # its one room fails: one failure, reason peer_dead
        wait_until(lambda: d.poll(1).state is RoomState.FAILED, 10, "room 1 to fail")
        assert d.poll(1).code.value == "peer_dead"
        time.sleep(2.0)  # over three more heartbeat bounds (0.6 s each)
        assert value(scrape(port), "pdxfer_errors_total", reason="peer_dead") == 1
    finally:
        p.close()
        d.close()


TRANSITION = re.compile(r"room (\d+) (\w+) -> (\w+) peer=(\S+)")


def test_logs_one_line_per_transition_and_json_lines(daemons):
    prefill = daemons("prefill", "--log-level", "debug")
    decode = daemons("decode", "--log-level", "debug", "--log-format", "json")
    p, d = engine(prefill, slots=16), engine(decode, slots=16)
    try:
        run_room(p, d, prefill.bootstrap, 5, [1, 2], [3, 4])
        history = {}
        for side, daemon in (("p", prefill), ("d", decode)):
            out = subprocess.run([sys.executable, "-m", "pdxfer", "room", "5", "--json", "--daemon", daemon.ready["admin"]],
                                 capture_output=True, text=True, timeout=30)
            history[side] = [state for state, _ in json.loads(out.stdout)["history"]]
        d.expect(6, prefill.bootstrap, np.array([9]), d.alloc_slot())
        d.abort(6, "the router gave up")
        wait_until(lambda: d.poll(6).fenced, 10, "room 6 fenced")
        time.sleep(0.2)
    finally:
        p.close()
        d.close()

    # decode: every line is JSON, the transfer engine's own (glog) lines included,
    # and room and peer are keys of their own
    entries = [json.loads(line) for line in open(decode.log_path).read().splitlines()]
    assert entries and all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
    assert any(e["logger"] == "mooncake" for e in entries)  # the engine's error lines pass GLOG_minloglevel=2
    moves = [(e, TRANSITION.search(e["msg"]).groups()) for e in entries if e["level"] == "debug" and TRANSITION.search(e["msg"])]
    room5 = [(e, old, new) for e, (room, old, new, _) in moves if room == "5"]
    assert [new for _, _, new in room5] == history["d"]  # one line per transition, in order
    assert [old for _, old, _ in room5] == ["new"] + history["d"][:-1]
    # The creation line comes before the room knows its peer (the table logs it as it creates the room).
    assert [(e["room"], e["peer"]) for e, _, _ in room5] == [(5, f"tcp://{prefill.bootstrap}")] * len(room5)  # known from creation on
    warning = [e for e in entries if e["level"] == "warning" and "room 6 failed" in e["msg"]]
    assert len(warning) == 1 and "[aborted]" in warning[0]["msg"] and f"peer=tcp://{prefill.bootstrap}" in warning[0]["msg"]
    assert (warning[0]["room"], warning[0]["peer"]) == (6, f"tcp://{prefill.bootstrap}")

    # prefill: text lines, the same one line per transition
    text = open(prefill.log_path).read()
    lines = [TRANSITION.search(line).groups() for line in text.splitlines() if " DEBUG " in line and TRANSITION.search(line)]
    assert [new for room, _, new, _ in lines if room == "5"] == history["p"]
    assert history["p"] == ["bootstrapping", "waiting_for_input", "transferring", "success"]
    failed = [line for line in text.splitlines() if "room 6 failed" in line]
    assert len(failed) == 1 and " WARNING " in failed[0] and f"peer={decode.ready['session']}" in failed[0]
