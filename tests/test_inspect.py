"""The operator commands (pdxfer rooms, room, peers, peer, slots, top, doctor) against
real daemons holding rooms in every state, each produced on purpose.

One module-scoped scene (four daemons, an engine client beside each) holds:

    room  decode daemon                     prefill side                      how
    1     released (gone)                   released (gone)                   ran to success, released on both sides
    2     success (unreleased)              success, 6144 KV bytes            ran to success, kept
    3     failed: aborted                   gone (no engine joined it)        decode engine aborted it before send()
    4     failed: insufficient_capacity     failed: insufficient_capacity     1 destination page for 8 tokens
    5     failed: compat_mismatch           -                                 expect() to a prefill with page_size 8
    6     bootstrapping (stuck)             -                                 expect() to an address nobody serves
    7     -                                 bootstrapping (stuck)             send() with no decode side
    8     waiting_for_input                 waiting_for_input                 expect() with no send() yet
    9     transferring (on the slow prefill, whose completions are held up to 600 s by --inject-faults delay)
    10    -                                 failed: aborted by an operator    send(), then `pdxfer room 10 --fail`
    11    failed: aborted, slot quarantined (on the slow prefill)             aborted while its writes are held: no fence
    12    bootstrapping (created ~2 s after the others: --older-than splits here)

The CLI runs as a subprocess, as an operator runs it; its JSON is compared with the
daemons' own stats (Client.stats) and with what the scene did.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from pdxfer.client import Client
from pdxfer.core.protocol import PeerInfo, Role, RoomInfo, RoomState, SlotInfo
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.host import memory
from pdxfer.ops import inspection as inspect_mod
from pdxfer.ops import tables
from pdxfer.ops.inspection import daemon_counters
from pdxfer.tools.launch import DaemonProcess, start_daemon

from .conftest import ENGINE_PATH, needs_mooncake, orphan_pool, small_layout
from .roomkit import engine, free_port, wait_until

PAGE_BYTES = 4 * 64 * 8  # small_layout: 4 tokens x 64 bytes per region, 8 regions (4 layers, K and V)
AUX_BYTES = 16


def pdxfer(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdxfer", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def send(client: Client, room: int, pages: list[int], tokens: int):
    slot = client.alloc_slot()
    client.aux.payload(slot)[:AUX_BYTES] = np.arange(AUX_BYTES, dtype=np.uint8)
    client.send(room, np.array(pages), tokens, slot, aux_bytes=AUX_BYTES)
    return slot


@dataclass
class Scene:
    runtime_dir: str
    prefill: DaemonProcess  # --admin-writes
    decode: DaemonProcess  # read-only admin API
    slow: DaemonProcess  # completions held by injected delays
    other: DaemonProcess  # a pool of another page size
    p: Client
    d: Client
    slow_p: Client
    other_p: Client
    nobody: str  # host:port nobody serves
    slots: dict = field(default_factory=dict)  # (side, room) -> Slot
    fail_run: subprocess.CompletedProcess | None = None

    def state(self, client: Client, room: int) -> RoomState:
        return client.poll(room).state

    def cli(self, daemon: DaemonProcess, *args: str, **kw) -> subprocess.CompletedProcess:
        return pdxfer(*args, "--name", daemon.ready["name"], "--runtime-dir", self.runtime_dir, **kw)

    def json(self, daemon: DaemonProcess, *args: str):
        out = self.cli(daemon, *args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


pytestmark = [needs_mooncake, pytest.mark.integration]


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")
    logs = tmp_path_factory.mktemp("inspect-logs")
    started: list[DaemonProcess] = []
    clients: list[Client] = []

    def start(role: str, name: str, *flags: str) -> DaemonProcess:
        log = open(logs / f"{name}.log", "w")
        daemon = start_daemon(role, runtime_dir, "--log-level", "info", "--drain-timeout", "0.5", *ENGINE_PATH, *flags, name=name, stderr=log)
        started.append(daemon)
        return daemon

    def client(daemon, layout=None) -> Client:
        clients.append(engine(daemon, layout, slots=16))
        return clients[-1]

    try:
        prefill = start("prefill", "prefill", "--admin-writes")
        # Many heartbeat misses: the link to nobody must stay 'connecting' rather than be declared dead.
        decode = start("decode", "decode", "--heartbeat-misses", "100", "--transfer-timeout", "600")
        # Room 9's writes complete up to 600 s late: it stays Transferring however long
        # this module takes (with 20 s, a slow run saw it finish before the tests that look at it).
        slow = start("prefill", "slow", "--inject-faults", "delay=1.0:600000", "--transfer-timeout", "600", "--stall-timeout", "600")
        other = start("prefill", "other")
        s = Scene(runtime_dir, prefill, decode, slow, other, client(prefill), client(decode), client(slow),
                  client(other, small_layout(page_size=8)), f"127.0.0.1:{free_port()}")
        p, d = s.p, s.d

        def expect(room, bootstrap, pages):
            s.slots["d", room] = d.alloc_slot()
            d.expect(room, bootstrap, np.array(pages), s.slots["d", room])

        expect(1, prefill.bootstrap, [1, 2])
        s.slots["p", 1] = send(p, 1, [10, 11], 8)
        assert d.wait(1).state is RoomState.SUCCESS and p.wait(1).state is RoomState.SUCCESS
        d.release(1)
        p.release(1)
        expect(2, prefill.bootstrap, [3, 4, 5])
        s.slots["p", 2] = send(p, 2, [12, 13, 14], 12)
        assert d.wait(2).state is RoomState.SUCCESS and p.wait(2).state is RoomState.SUCCESS
        expect(3, prefill.bootstrap, [6])
        d.abort(3, "the router gave up")
        expect(4, prefill.bootstrap, [7])  # one page of 4 tokens for an 8-token prompt
        s.slots["p", 4] = send(p, 4, [15, 16], 8)
        expect(5, other.bootstrap, [8])
        expect(6, s.nobody, [9])
        s.slots["p", 7] = send(p, 7, [17], 4)
        expect(8, prefill.bootstrap, [20, 21])
        expect(9, slow.bootstrap, [30, 32, 34, 36])
        s.slots["slow", 9] = send(s.slow_p, 9, [40, 41, 42, 43], 16)
        s.slots["p", 10] = send(p, 10, [18], 4)
        wait_until(lambda: all(d.poll(r).fenced for r in (3, 4, 5)) and p.poll(4).fenced, 10, "failed rooms fenced")
        wait_until(lambda: s.state(d, 8) is RoomState.WAITING_FOR_INPUT and s.state(d, 9) is RoomState.TRANSFERRING, 10, "rooms 8 and 9 to settle")
        # Room 11 is aborted once its writes are in flight (held by the delays), so nothing
        # confirms a fence. The slow prefill writes one block per destination page and
        # region: 4 pages of room 9's, then room 11's one.
        regions = len(s.slow_p.kv.arrays())

        def in_flight(pages: int) -> bool:
            return daemon_counters(slow.ready["admin"])["blocks_submitted"] >= pages * regions

        wait_until(lambda: in_flight(4), 10, "room 9's writes to be in flight")
        expect(11, slow.bootstrap, [22])
        s.slots["slow", 11] = send(s.slow_p, 11, [44], 4)
        wait_until(lambda: in_flight(5), 10, "room 11's writes to be in flight")
        d.abort(11, "the router gave up")
        s.fail_run = s.cli(prefill, "room", "10", "--fail", "--reason", "stuck in the test", "--json")
        time.sleep(2.0)
        expect(12, s.nobody, [23])
        yield s
    finally:
        for c in clients:
            c.close()
        for d in started:  # all drain at once; one SIGTERM each (a second one during shutdown kills)
            d.proc.send_signal(signal.SIGTERM)
        codes = {}
        for d in started:
            try:
                codes[d.ready.get("name", d.role)] = d.proc.wait(15)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                codes[d.ready.get("name", d.role)] = d.proc.wait()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert all(code == 0 for code in codes.values()), f"daemons exited abnormally: {codes}"


def by_id(reply: dict) -> dict[int, dict]:
    return {r["room"]: r for r in reply["rooms"]}


def nonzero(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if v}


# --- rooms


def test_rooms_json_is_each_daemons_actual_state(scene):
    s = scene
    boot, slow, other, nobody = (f"tcp://{x}" for x in (s.prefill.bootstrap, s.slow.bootstrap, s.other.bootstrap, s.nobody))
    expected = {  # room: (state, code, peer)
        2: ("success", None, boot), 3: ("failed", "aborted", boot), 4: ("failed", "insufficient_capacity", boot),
        5: ("failed", "compat_mismatch", other), 6: ("bootstrapping", None, nobody), 8: ("waiting_for_input", None, boot),
        9: ("transferring", None, slow), 11: ("failed", "aborted", slow), 12: ("bootstrapping", None, nobody),
    }
    rooms = by_id(s.json(s.decode, "rooms"))
    assert {r: (x["state"], x["code"], x["peer"]) for r, x in rooms.items()} == expected
    for room, info in rooms.items():
        assert info["role"] == "decode"
        assert (info["slot"], info["generation"]) == tuple(s.slots["d", room])
    assert rooms[2]["fenced"] and rooms[3]["fenced"] and not rooms[11]["fenced"]
    assert "page_size: prefill=8 decode=4" in rooms[5]["reason"]
    assert "the router gave up" in rooms[3]["reason"]
    assert collections.Counter(x["state"] for x in rooms.values()) == nonzero(s.d.stats().rooms)
    ages = sorted(x["age"] for x in rooms.values())
    assert all(x["in_state"] <= x["age"] for x in rooms.values()) and ages[0] >= 0


def test_rooms_json_on_the_prefill_side(scene):
    s = scene
    session = s.decode.ready["session"]
    rooms = by_id(s.json(s.prefill, "rooms"))
    assert {r: (x["state"], x["code"], x["peer"]) for r, x in rooms.items()} == {
        2: ("success", None, session), 4: ("failed", "insufficient_capacity", session), 7: ("bootstrapping", None, ""),
        8: ("waiting_for_input", None, session), 10: ("failed", "aborted", ""),
    }
    assert collections.Counter(x["state"] for x in rooms.values()) == nonzero(s.p.stats().rooms)
    assert rooms[2]["bytes_moved"] == 3 * PAGE_BYTES + HEADER_BYTES + AUX_BYTES  # KV, then the stamped aux record
    assert rooms[4]["bytes_moved"] == 0 and rooms[7]["bytes_planned"] == 0
    for room in (2, 4, 7, 10):
        assert (rooms[room]["slot"], rooms[room]["generation"]) == tuple(s.slots["p", room])
    assert rooms[8]["slot"] == -1  # no send() yet: no slot on this side
    slow = by_id(s.json(s.slow, "rooms"))
    assert slow[9]["state"] == "transferring" and slow[9]["bytes_moved"] == 0
    assert slow[9]["bytes_planned"] == 4 * PAGE_BYTES + HEADER_BYTES + AUX_BYTES


def test_a_successful_room_moved_what_it_planned(scene):
    room = by_id(scene.json(scene.prefill, "rooms"))[2]
    assert room["bytes_moved"] == room["bytes_planned"]


def test_decode_rooms_report_the_bytes_they_received(scene):
    room = by_id(scene.json(scene.decode, "rooms"))[2]
    assert room["bytes_planned"] >= 3 * PAGE_BYTES and room["bytes_moved"] >= 3 * PAGE_BYTES


def test_rooms_filters(scene):
    s = scene
    assert set(by_id(s.json(s.decode, "rooms", "--state", "failed"))) == {3, 4, 5, 11}
    assert set(by_id(s.json(s.decode, "rooms", "--state", "transferring"))) == {9}
    assert set(by_id(s.json(s.decode, "rooms", "--peer", s.nobody.split(":")[1]))) == {6, 12}
    assert set(by_id(s.json(s.decode, "rooms", "--peer", "no-such-peer"))) == set()
    # Room 12 came ~2 s after the rest: a threshold just under the youngest of the rest splits them.
    snapshot = by_id(s.json(s.decode, "rooms"))
    threshold = min(x["age"] for r, x in snapshot.items() if r != 12) - 0.05
    assert snapshot[12]["age"] < threshold - 1.0
    assert set(by_id(s.json(s.decode, "rooms", "--older-than", f"{threshold:.3f}s"))) == set(snapshot) - {12}
    assert set(by_id(s.json(s.decode, "rooms", "--older-than", "1h"))) == set()


def test_rooms_table_shows_the_documented_columns(scene):
    s = scene
    out = s.cli(s.decode, "rooms")
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert re.split(r"\s{2,}", header.strip()) == list(inspect_mod.ROOM_COLUMNS)
    rows = {int(m.group(1)): line for line in lines if (m := re.match(r"\s*(\d+)\s{2}", line))}
    assert set(rows) == {2, 3, 4, 5, 6, 8, 9, 11, 12}
    assert "transferring" in rows[9] and f"tcp://{s.slow.bootstrap}" in rows[9]
    assert "[compat_mismatch]" in rows[5] and "[aborted]" in rows[11]
    assert "{}/{}".format(*s.slots["d", 9]) in rows[9]
    assert lines[-1].startswith("9 rooms: 2 bootstrapping, 1 waiting_for_input, 1 transferring, 1 success, 4 failed")
    prefill = s.cli(s.prefill, "rooms").stdout
    assert re.search(r"^\s+2\s+prefill\s+success\s+\S+s\s+\S+s\s+127\.0\.0\.1:\d+\s+\d+/\d+\s+6\.0 KiB\s+6\.0 KiB\s+-$", prefill, re.M), prefill


def test_tables_name_the_lane_of_each_room_and_slot_where_a_daemon_serves_several_ranks():
    """A daemon beside one rank shows the tables as ever. One serving two ranks of an
    engine holds room 7 and slot 0 once per rank: a LANE column after the first tells
    the two apart, and `pdxfer room` names the lane of each part."""
    def room(lane: int) -> RoomInfo:
        return RoomInfo(room=7, role=Role.PREFILL, lane=lane, state=RoomState.SUCCESS, age=2.0, in_state=1.0, peer="127.0.0.1:15000",
                        slot=0, generation=1, bytes_planned=4096, bytes_moved=4096, fenced=True, history=((RoomState.SUCCESS, 1.0),))

    def slot(lane: int) -> SlotInfo:
        return SlotInfo(index=0, state="armed", lane=lane, room=7, generation=1, since=1.0)

    def header(table: str) -> list[str]:
        return re.split(r"\s{2,}", table.splitlines()[0].strip())

    assert header(inspect_mod.rooms_table([room(0)])) == list(inspect_mod.ROOM_COLUMNS)
    assert header(inspect_mod.slots_table([slot(0)])) == list(inspect_mod.SLOT_COLUMNS)
    rooms, slots = inspect_mod.rooms_table([room(0), room(1)]), inspect_mod.slots_table([slot(0), slot(1)])
    assert header(rooms) == ["ROOM", "LANE", *inspect_mod.ROOM_COLUMNS[1:]]
    assert [line.split()[:3] for line in rooms.splitlines()[1:]] == [["7", "0", "prefill"], ["7", "1", "prefill"]]
    assert header(slots) == ["SLOT", "LANE", *inspect_mod.SLOT_COLUMNS[1:]]
    assert [line.split()[:4] for line in slots.splitlines()[1:]] == [["0", "0", "armed", "7"], ["0", "1", "armed", "7"]]
    assert inspect_mod.room_detail(room(1), wall=1e9, lane=True).startswith("room 7 (prefill, lane 1): success for 1.0s")
    assert inspect_mod.room_detail(room(0), wall=1e9).startswith("room 7 (prefill): success")


# --- one room


def test_room_shows_its_history_with_timestamps(scene):
    s = scene
    room = s.json(s.prefill, "room", "2")
    assert [h[0] for h in room["history"]] == ["bootstrapping", "waiting_for_input", "transferring", "success"]
    ats = [h[1] for h in room["history"]]
    assert ats[0] == 0 and ats == sorted(ats) and ats[-1] <= room["age"]
    assert room["fenced"] and room["code"] is None and room["bytes_moved"] == 3 * PAGE_BYTES + HEADER_BYTES + AUX_BYTES
    decode = s.json(s.decode, "room", "9")
    assert [h[0] for h in decode["history"]] == ["bootstrapping", "waiting_for_input", "transferring"]
    text = s.cli(s.decode, "room", "5").stdout
    assert "room 5 (decode): failed" in text and "[compat_mismatch]" in text
    assert re.search(r"STATE\s+AT\s+WALL CLOCK\s+FOR", text)
    assert re.search(r"bootstrapping\s+\+0\.000s\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", text)
    assert re.search(r"^\s+failed\s+\+\d+\.\d{3}s\s+\d{4}-", text, re.M)


def test_a_released_room_answers_with_its_outcome(scene):
    """Room 1 ran to success and both engines released it: the daemons keep only its
    outcome, and say so, rather than that no such room exists."""
    s = scene
    for daemon in (s.decode, s.prefill):
        room = s.json(daemon, "room", "1")
        assert room["released"] and room["state"] == "success" and room.get("code") is None, room
    text = s.cli(s.decode, "room", "1").stdout
    assert "room 1 (decode): released by its engine after it ended success" in text, text
    refused = s.cli(s.prefill, "room", "1", "--fail", "--reason", "late")  # the prefill runs with --admin-writes
    assert refused.returncode != 0 and "released already" in refused.stderr, refused.stderr


def test_room_that_does_not_exist(scene):
    out = scene.cli(scene.decode, "room", "999")
    assert out.returncode == inspect_mod.EXIT_REFUSED
    assert "unknown room 999" in out.stderr


def test_room_fail_works_with_admin_writes(scene):
    s = scene
    assert s.fail_run.returncode == 0, s.fail_run.stderr
    room = json.loads(s.fail_run.stdout)
    assert room["state"] == "failed" and room["code"] == "aborted"
    assert room["reason"] == "failed by an operator: stuck in the test"
    assert [h[0] for h in room["history"]] == ["bootstrapping", "failed"]
    status = s.p.poll(10)  # the engine was told
    assert status.state is RoomState.FAILED and status.code.value == "aborted" and status.fenced
    assert by_id(s.json(s.prefill, "rooms"))[10]["reason"] == room["reason"]
    again = s.cli(s.prefill, "room", "10", "--fail")
    assert again.returncode == inspect_mod.EXIT_REFUSED and "already finished" in again.stderr


def test_room_fail_reply_has_a_sane_time_in_state(scene):
    assert json.loads(scene.fail_run.stdout)["in_state"] >= 0


def test_operator_actions_are_refused_without_admin_writes(scene):
    s = scene
    fail = s.cli(s.decode, "room", "6", "--fail")
    assert fail.returncode == inspect_mod.EXIT_REFUSED
    assert "read-only" in fail.stderr and "--admin-writes" in fail.stderr
    drain = s.cli(s.decode, "peer", s.prefill.bootstrap, "--drain")
    assert drain.returncode == inspect_mod.EXIT_REFUSED and "--admin-writes" in drain.stderr
    assert s.state(s.d, 6) is RoomState.BOOTSTRAPPING  # nothing changed
    assert {p["state"] for p in s.json(s.decode, "peers")["peers"]} == {"alive", "connecting"}


# --- peers


def test_peers_json_matches_the_links_and_their_rooms(scene):
    s = scene
    peers = {p["address"]: p for p in s.json(s.decode, "peers")["peers"]}
    rooms = s.json(s.decode, "rooms")["rooms"]
    boot, slow, nobody = (f"tcp://{x}" for x in (s.prefill.bootstrap, s.slow.bootstrap, s.nobody))
    assert set(peers) == {boot, slow, nobody}  # the refusing prefill's link was closed
    assert len(peers) == s.d.stats().peers
    assert peers[boot]["incarnation"] == s.prefill.ready["incarnation"] and peers[boot]["state"] == "alive"
    assert peers[slow]["incarnation"] == s.slow.ready["incarnation"] and peers[slow]["state"] == "alive"
    assert peers[nobody]["incarnation"] == "" and peers[nobody]["state"] == "connecting" and peers[nobody]["rtt_ms"] == -1
    for address, peer in peers.items():
        assert peer["rooms"] == sum(1 for r in rooms if r["peer"] == address), address
    assert peers[boot]["rtt_ms"] >= 0 and abs(peers[boot]["clock_skew_ms"]) < 1000
    assert peers[boot]["last_heard"] < 3.0 and peers[nobody]["last_heard"] > 2.0

    (decode,) = s.json(s.prefill, "peers")["peers"]
    prefill_rooms = s.json(s.prefill, "rooms")["rooms"]
    assert decode["address"] == s.decode.ready["session"] and decode["incarnation"] == s.decode.ready["incarnation"]
    assert decode["name"] == "127.0.0.1/decode" and decode["state"] == "alive"
    assert decode["rooms"] == sum(1 for r in prefill_rooms if r["peer"] == decode["address"])


def test_peers_table_and_peer_filter(scene):
    s = scene
    out = s.cli(s.decode, "peers")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("decode daemon 'decode': 3 peer(s)")
    assert re.split(r"\s{2,}", lines[1].strip()) == list(inspect_mod.PEER_COLUMNS)
    row = next(line for line in lines if s.nobody in line)
    assert "connecting" in row and " ago" in row
    one = s.json(s.decode, "peer", s.slow.bootstrap)["peers"]
    assert [p["address"] for p in one] == [f"tcp://{s.slow.bootstrap}"]
    missing = s.cli(s.decode, "peer", "10.9.9.9:1")
    assert missing.returncode == inspect_mod.EXIT_REFUSED and "no peer matches" in missing.stderr


def test_the_peers_table_shows_a_silent_peers_waiting_rooms_and_when_they_will_be_fenced():
    silent = PeerInfo(address="tcp://10.0.0.5:8998", name="p1", incarnation="ab12", state="silent", last_heard=3.2, rtt_ms=-1.0,
                      clock_skew_ms=0.0, rooms=4, fence_pending=3, fence_in=7.5)
    alive = PeerInfo(address="tcp://10.0.0.6:8998", name="p2", incarnation="cd34", state="alive", last_heard=0.1, rtt_ms=0.4,
                     clock_skew_ms=0.1, rooms=2)
    header, *rows = inspect_mod.peers_table([silent, alive]).splitlines()
    cells = {row.split()[0]: re.split(r"\s{2,}", row.strip()) for row in rows}
    assert re.split(r"\s{2,}", header.strip())[-2:] == ["FENCE-PENDING", "FENCED IN"]
    assert cells["tcp://10.0.0.5:8998"][3] == "silent" and cells["tcp://10.0.0.5:8998"][-2:] == ["3", "7.5s"]
    assert cells["tcp://10.0.0.6:8998"][-2:] == ["0", "-"]  # nothing waits: nothing to fence


# --- slots


def test_slots_json_and_table(scene):
    s = scene
    slots = s.json(s.decode, "slots")["slots"]
    assert len(slots) == 16
    assert collections.Counter(x["state"] for x in slots) == nonzero(s.d.stats().slots)
    table = {x["index"]: x for x in slots}
    index, gen = s.slots["d", 2]
    assert (table[index]["state"], table[index]["room"], table[index]["generation"]) == ("written", 2, gen)
    index, gen = s.slots["d", 11]
    assert (table[index]["state"], table[index]["room"], table[index]["generation"]) == ("quarantined", 11, gen)
    assert table[index]["fence_in"] == -1  # no deadline: held until the prefill confirms, restarts, or a cut (S2)
    for room in (6, 8, 9, 12):
        index, gen = s.slots["d", room]
        assert (table[index]["state"], table[index]["room"]) == ("armed", room)
    for room in (1, 3, 4, 5):  # released, or failed and fenced
        assert table[s.slots["d", room][0]]["state"] == "free"
    assert {x["index"] for x in s.json(s.decode, "slots", "--state", "armed")["slots"]} == {s.slots["d", r][0] for r in (6, 8, 9, 12)}

    out = s.cli(s.decode, "slots").stdout.splitlines()
    assert re.split(r"\s{2,}", out[0].strip()) == list(inspect_mod.SLOT_COLUMNS)
    assert out[-1].startswith("16 slots: 10 free, 5 held (granted 0, armed 4, written 1), 1 quarantined")
    assert len(out) == 1 + 6 + 1  # header, the six slots that are not free, summary
    assert [line.split()[-1] for line in out[1:-1] if line.split()[1] == "quarantined"] == ["pending"]
    assert len(s.cli(s.decode, "slots", "--free").stdout.splitlines()) == 1 + 16 + 1


# --- top


def test_top_once_json_matches_the_daemon(scene):
    s = scene
    out = s.cli(s.decode, "top", "--once", "--json")
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    frame = json.loads(line)
    stats = s.d.stats()
    assert frame["info"]["rooms"] == stats.rooms and frame["info"]["slots"] == stats.slots
    assert frame["info"]["failures"] == stats.failures
    assert {r["room"] for r in frame["live_rooms"]} == {6, 8, 9, 12}
    assert len(frame["peers"]) == 3 and frame["rates_over"] is None
    assert frame["info"]["counters"]["rooms_succeeded"] == 2 and frame["info"]["ready"]
    assert frame["info"]["sessions"][0] == frame["info"]["session"]


def test_top_refreshes_and_shows_each_section(scene):
    s = scene
    out = s.cli(s.slow, "top", "--iterations", "2", "--interval", "0.3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pdxfer top - prefill daemon 'slow'") == 2
    assert "\x1b[" not in out.stdout  # not a terminal: no redraw codes
    text = out.stdout
    for section in ("rooms      bootstrapping 0   waiting_for_input 0   transferring 1", "throughput", "totals", "queues     writes_in_flight",
                    "failures", "peers (1)", "oldest live rooms (1 of 1)", "(average since start)", "(last "):
        assert section in text, section


def test_top_rates_come_from_counter_deltas():
    from pdxfer.ops.top import rates

    assert rates(None, {"bytes_moved": 100.0}, 4.0) == {"bytes_moved": 25.0}
    assert rates({"bytes_moved": 100.0, "rooms_failed": 1}, {"bytes_moved": 400.0, "rooms_failed": 1}, 2.0) == {"bytes_moved": 150.0, "rooms_failed": 0.0}
    assert rates({"bytes_moved": 100.0}, {"bytes_moved": 50.0}, 1.0) == {"bytes_moved": 0.0}  # a restarted daemon never shows negative rates
    assert rates({}, {"x": 1.0}, 0) == {"x": 0.0}


# --- choosing a daemon, reaching it


def test_daemon_selection_and_clear_errors(scene, tmp_path):
    s = scene
    several = pdxfer("rooms", "--runtime-dir", s.runtime_dir)
    assert several.returncode == 2
    for name in ("decode", "prefill", "slow", "other"):
        assert name in several.stderr
    assert "--name" in several.stderr
    by_endpoint = pdxfer("rooms", "--json", "--daemon", s.decode.ready["admin"])
    assert set(by_id(json.loads(by_endpoint.stdout))) == set(by_id(s.json(s.decode, "rooms")))
    # Exactly one admin socket in the directory: it is the one.
    single = tmp_path / "one"
    single.mkdir()
    os.symlink(s.decode.ready["admin"][len("ipc://"):], single / "only.admin.sock")
    alone = pdxfer("peers", "--json", "--runtime-dir", str(single))
    assert alone.returncode == 0 and len(json.loads(alone.stdout)["peers"]) == 3
    env_dir = pdxfer("peers", "--json", env={"PDXFER_RUNTIME_DIR": str(single)})
    assert env_dir.returncode == 0
    nothing = pdxfer("rooms", "--runtime-dir", str(tmp_path))
    assert nothing.returncode == inspect_mod.EXIT_UNREACHABLE and "no daemon admin socket in" in nothing.stderr
    gone = pdxfer("rooms", "--name", "ghost", "--runtime-dir", s.runtime_dir)
    assert gone.returncode == inspect_mod.EXIT_UNREACHABLE and f"{s.runtime_dir}/ghost.admin.sock" in gone.stderr
    stale = tmp_path / "stale"
    stale.mkdir()
    with socket.socket(socket.AF_UNIX) as dead:  # a daemon that exited leaves its socket file
        dead.bind(str(stale / "gone.admin.sock"))
    started = time.monotonic()
    exited = pdxfer("rooms", "--runtime-dir", str(stale))
    assert exited.returncode == inspect_mod.EXIT_UNREACHABLE and "nothing listens on" in exited.stderr
    assert time.monotonic() - started < 4  # said at once, not after the 5 s timeout
    port = free_port()
    silent = pdxfer("rooms", "--daemon", f"tcp://127.0.0.1:{port}", "--timeout", "0.3")
    assert silent.returncode == inspect_mod.EXIT_UNREACHABLE
    assert f"no answer from tcp://127.0.0.1:{port} within 0.3s" in silent.stderr


def test_choose_endpoint_rules(tmp_path):
    choose = inspect_mod.choose_endpoint
    assert choose("tcp://10.0.0.5:9000", None, "/x") == "tcp://10.0.0.5:9000"
    assert choose("10.0.0.5:9000", None, "/x") == "tcp://10.0.0.5:9000"
    assert choose(None, "decode", "/run/pdx") == "ipc:///run/pdx/decode.admin.sock"
    (tmp_path / "a.admin.sock").touch()
    (tmp_path / "a.engine.sock").touch()
    assert choose(None, None, str(tmp_path)) == f"ipc://{tmp_path}/a.admin.sock"
    (tmp_path / "b.admin.sock").touch()
    with pytest.raises(inspect_mod.CommandError, match=r"2 daemons .*\(a, b\)"):
        choose(None, None, str(tmp_path))
    with pytest.raises(inspect_mod.CommandError, match="not an endpoint"):
        choose("decode", None, "/x")


def test_requests_are_signed_when_the_daemon_has_a_cluster_secret(daemons, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("fedcba98765432100000\n")
    daemon = daemons("decode", "--cluster-secret-file", str(secret))
    admin = daemon.ready["admin"]
    unsigned = pdxfer("peers", "--daemon", admin)
    assert unsigned.returncode == inspect_mod.EXIT_REFUSED
    assert "unauthenticated" in unsigned.stderr and "--secret-file" in unsigned.stderr
    assert pdxfer("peers", "--json", "--daemon", admin, "--secret-file", str(secret)).returncode == 0
    assert pdxfer("slots", "--json", "--daemon", admin, env={"PDXFER_CLUSTER_SECRET_FILE": str(secret)}).returncode == 0
    other = pdxfer("peers", "--daemon", admin, "--secret-file", str(wrong))
    assert other.returncode == inspect_mod.EXIT_REFUSED and "not signed" in other.stderr


def test_drain_a_peer_with_admin_writes(daemons):
    """`pdxfer peer P --drain`: no new rooms with P; the rooms it holds finish."""
    prefill = daemons("prefill", "--admin-writes")
    decode = daemons("decode")
    p, d = engine(prefill), engine(decode)
    try:
        held = d.alloc_slot()
        d.expect(1, prefill.bootstrap, np.array([1]), held)
        wait_until(lambda: d.poll(1).state is RoomState.WAITING_FOR_INPUT, 10, "room 1 waiting for input")
        session = decode.ready["session"]
        out = pdxfer("peer", session, "--drain", "--json", "--daemon", prefill.ready["admin"])
        assert out.returncode == 0, out.stderr
        (peer,) = json.loads(out.stdout)["peers"]
        assert peer["address"] == session and peer["state"] == "draining" and peer["rooms"] == 1
        d.expect(2, prefill.bootstrap, np.array([2]), d.alloc_slot())  # a new room: refused by the prefill
        refused = d.wait(2, timeout=10)
        assert refused.state is RoomState.FAILED and refused.code.value == "busy" and "draining" in refused.reason
        send(p, 1, [3], 4)  # the room it already held finishes
        assert d.wait(1, timeout=10).state is RoomState.SUCCESS and p.wait(1, timeout=10).state is RoomState.SUCCESS
        text = pdxfer("peers", "--daemon", prefill.ready["admin"]).stdout
        assert re.search(rf"{re.escape(session)}\s+127\.0\.0\.1/decode\s+\w+\s+draining", text), text
        unknown = pdxfer("peer", "10.9.9.9:1", "--drain", "--daemon", prefill.ready["admin"])
        assert unknown.returncode == inspect_mod.EXIT_REFUSED and "unknown_peer" in unknown.stderr
    finally:
        p.close()
        d.close()


def test_cut_replaces_the_decode_daemons_sessions_and_says_how_many_rooms_it_fenced(daemons):
    """`pdxfer peer P --cut` on a decode daemon (--admin-writes): answered once its old
    transfer sessions ended, with how many fence-pending rooms that fenced (none here:
    the prefill is healthy), and the prefill writes the next room through the new ones."""
    prefill, decode = daemons("prefill"), daemons("decode", "--admin-writes")
    p, d = engine(prefill), engine(decode)
    try:
        d.expect(1, prefill.bootstrap, np.array([1]), d.alloc_slot())
        send(p, 1, [3], 4)
        assert d.wait(1, timeout=10).state is RoomState.SUCCESS
        out = pdxfer("peer", prefill.bootstrap, "--cut", "--daemon", decode.ready["admin"])
        assert out.returncode == 0, out.stderr
        assert "cut: transfer sessions replaced; 0 fence-pending room(s) fenced" in out.stdout, out.stdout
        info = json.loads(pdxfer("peers", "--json", "--daemon", decode.ready["admin"]).stdout)["peers"]
        assert [peer["state"] for peer in info] == ["alive"]
        d.expect(2, prefill.bootstrap, np.array([2]), d.alloc_slot())
        send(p, 2, [5], 4)
        assert d.wait(2, timeout=10).state is RoomState.SUCCESS
    finally:
        p.close()
        d.close()
    counters = inspect_mod.daemon_counters(decode.ready["admin"])
    assert counters["session_rotations"] == 1


# --- help, units, doctor


def test_every_command_explains_every_flag():
    from pdxfer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("rooms", "room", "peers", "peer", "slots", "top", "doctor"):
        text = sub.choices[name].format_help()
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            for flag in action.option_strings:
                assert flag in text, f"pdxfer {name} --help does not mention {flag}"


def test_human_units():
    assert [tables.duration(x) for x in (0.0042, 0.25, 3.21, 125, 7322, -1)] == ["4.2ms", "250ms", "3.2s", "2m05s", "2h02m", "-"]
    assert [tables.size(x) for x in (512, 6144, 3 << 20, 5 << 30)] == ["512 B", "6.0 KiB", "3.0 MiB", "5.0 GiB"]
    assert tables.ago(3.21) == "3.2s ago" and tables.millis(-1, unknown=-1) == "-" and tables.millis(1.234) == "1.23ms"
    text = tables.table(("A", "LONG NAME"), [(1, "x"), (100, "yy")], right=("A",))
    assert text.splitlines() == ["  A  LONG NAME", "  1  x", "100  yy"]


def test_doctor_with_running_daemons(scene):
    s = scene
    busy = s.prefill.bootstrap.split(":")[1]
    out = pdxfer("doctor", "--json", "--runtime-dir", s.runtime_dir, "--bootstrap-port", busy, timeout=60)
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["transfer engine"]["status"] == "OK" and "initialised tcp on 127.0.0.1" in checks["transfer engine"]["detail"]
    assert checks["protocols"]["status"] == "OK" and "usable here: tcp" in checks["protocols"]["detail"]
    # The bootstrap port is held, but by one of the daemons found: fine.
    assert checks["bootstrap port"]["status"] == "OK" and "prefill daemon 'prefill'" in checks["bootstrap port"]["detail"]
    for name in ("decode", "prefill", "slow", "other"):
        assert checks[f"daemon {name}"]["status"] == "OK", checks[f"daemon {name}"]
    # Every transfer engine's session, the one peers are told first.
    sessions = s.decode.ready["sessions"]
    assert len(sessions) == 2 and f"sessions {' '.join(sessions)}" in checks["daemon decode"]["detail"]
    # The decode daemon waits on an address nobody serves: its peer check says so.
    assert checks["peers of decode"]["status"] == "WARN" and s.nobody in checks["peers of decode"]["fix"]
    assert "skew" in checks["peers of prefill"]["detail"] and checks["peers of prefill"]["status"] == "OK"
    failed = [c for c in report["checks"] if c["status"] == "FAIL"]
    assert report["ok"] == (not failed) and out.returncode == (1 if failed else 0), failed

    # Checking only the decode daemon, the prefill's bootstrap port is someone else's: FAIL, with a fix.
    out = pdxfer("doctor", "--name", "decode", "--runtime-dir", s.runtime_dir, "--bootstrap-port", busy, timeout=60)
    assert out.returncode == 1
    assert re.search(rf"^FAIL\s+bootstrap port\s+127\.0\.0\.1:{busy} is in use by another process$", out.stdout, re.M), out.stdout
    assert "fix: stop it, or choose another --bootstrap-port" in out.stdout


def test_doctor_fails_pools_that_fit_in_dev_shm_but_not_in_the_memory_left(monkeypatch):
    """tmpfs pages are RAM: a /dev/shm larger than what the kernel still has available
    would let pools in that the OOM killer ends (the host's state is faked here)."""
    from pdxfer.ops import hostchecks as checks

    monkeypatch.setattr(checks, "available_memory", lambda: 1 << 20)
    short = checks.check_shm(64 << 20)
    assert short.status == "FAIL" and "free memory on this host" in short.fix, short
    assert "1.0 MiB of memory available" in short.detail, short.detail
    monkeypatch.setattr(checks, "available_memory", lambda: None)  # no /proc/meminfo: /dev/shm alone decides
    unknown = checks.check_shm(64 << 20)
    assert unknown.status == "OK" and "available" not in unknown.detail, unknown


def test_doctor_counts_the_pools_engines_that_exited_left_in_dev_shm():
    from pdxfer.ops import hostchecks as checks

    orphan = orphan_pool(memory.AUX_BUFFER_PREFIX, 1 << 20)
    try:
        detail = checks.check_shm(1 << 20).detail
        assert "left by engines that exited: the next pool made here removes them" in detail, detail
        assert os.path.exists(orphan)  # counted, not removed: the doctor only looks
    finally:
        os.unlink(orphan)


def test_doctor_checks_fail_with_a_fix(tmp_path):
    from pdxfer.ops import hostchecks as checks

    s = checks.Settings(role="decode", protocol="rdma", device="cuda:3", host="127.0.0.1", bootstrap_port=0, http_port=0,
                        runtime_dir=str(tmp_path / "rt"), name="", rdma_devices="", pool_bytes=1 << 60)
    assert checks.check_runtime_dir(s).status == "OK"  # created by the daemon
    (tmp_path / "rt").mkdir(mode=0o755)
    os.chmod(tmp_path / "rt", 0o755)
    loose = checks.check_runtime_dir(s)
    assert loose.status == "FAIL" and "chmod 700" in loose.fix and "--runtime-dir" in loose.fix
    long = checks.check_runtime_dir(checks.Settings(**{**s.__dict__, "runtime_dir": "/tmp/" + "x" * 100}))
    assert long.status == "FAIL" and "shorter --runtime-dir" in long.fix
    shm = checks.check_shm(1 << 60)
    assert shm.status == "FAIL" and "--shm-size" in shm.fix
    assert checks.check_shm(1 << 20).status == "OK" and "of memory available" in checks.check_shm(1 << 20).detail
    assert checks.check_rdma(s, {}).status == "FAIL"
    assert checks.check_rdma(s, {"mlx5_0": ["port 1 DOWN"]}).status == "FAIL"
    assert checks.check_rdma(s, {"mlx5_0": ["port 1 ACTIVE"]}).status == "OK"
    gpu = checks.check_gpu(s, {"cudart": None, "count": 0, "error": "", "smi": "", "nodes": []}, {})
    assert gpu.status == "FAIL" and "libcudart" in gpu.fix
    probe = {"rc": 0, "flags": {"SUPPORT_CUDA": False}}
    npu = {"acl": None, "devices": []}
    protocols = checks.check_protocols(s, probe, {}, {"cudart": None, "count": 0}, npu)
    assert protocols.status == "FAIL" and "rdma (no RDMA devices" in protocols.detail and "tcp" in protocols.fix
    tcp = checks.Settings(**{**s.__dict__, "protocol": "tcp"})
    legacy = checks.check_engine_env(tcp, {"MC_TCP_PROTO": "1"}, "0.3.13")
    assert legacy.status == "FAIL" and "overtake" in legacy.detail and "unset MC_TCP_PROTO" in legacy.fix
    old = checks.check_engine_env(tcp, {}, "0.3.11.post1")
    assert old.status == "FAIL" and "0.3.11.post1" in old.detail and "pip install" in old.fix
    assert checks.check_engine_env(tcp, {}, "0.3.13.post1").status == "OK"
    assert checks.check_engine_env(s, {"MC_TCP_PROTO": "1"}, "0.3.11").status == "OK"  # rdma does not use either
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert checks.check_port("http port", "--http-port", "127.0.0.1", port, {}).status == "FAIL"
        assert checks.check_port("http port", "--http-port", "127.0.0.1", port, {port: "x"}).status == "OK"
    assert checks.check_port("http port", "--http-port", "192.0.2.77", 8000, {}).status == "FAIL"
    every = checks.check_host("0.0.0.0")  # advertised to peers as the daemon's address, it reaches nobody
    assert every.status == "FAIL" and "every address" in every.detail and "status.podIP" in every.fix, every
    assert checks.check_host("127.0.0.1").status == "OK"
