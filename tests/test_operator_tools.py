"""The operator tools as an operator meets them on a host with several daemons:
`pdxfer top` in a real 80x24 terminal (tmux), `rooms`/`peers`/`slots --all`,
`doctor` counting pools a daemon still maps after their engine exited, the
standard process metrics on the daemon's /metrics endpoint, and `--log-format json`
giving JSON lines only, the transfer engine's own log included.

One module-scoped scene: a prefill and a decode daemon in one runtime directory, an
engine beside each. The decode engine expects rooms from an address nobody serves
(they stay Bootstrapping: --bootstrap-timeout 600); the prefill engine sends a room
no decode asked for."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import io

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdxfer import logs
from pdxfer.client import Client
from pdxfer.ops import top
from pdxfer.tools.launch import start_daemon, stop_all

from .conftest import ENGINE_PATH, needs_mooncake, small_layout
from .roomkit import engine, free_port, wait_until

pytestmark = [needs_mooncake, pytest.mark.integration]

STUCK_ROOMS = range(100, 114)  # more than top shows (LIVE_ROOMS_SHOWN): the table must be cut to fit


class Scene:
    def __init__(self, runtime_dir: str, prefill, decode, http_port: int, p: Client, d: Client) -> None:
        self.runtime_dir, self.prefill, self.decode, self.http_port, self.p, self.d = runtime_dir, prefill, decode, http_port, p, d

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdxfer", *args, "--runtime-dir", self.runtime_dir],
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")
    logs = tmp_path_factory.mktemp("operator-logs")
    started, clients = [], []

    def start(role: str, *flags: str):
        log = open(logs / f"{role}.log", "w")
        started.append(start_daemon(role, runtime_dir, "--log-level", "info", "--drain-timeout", "0.5", "--bootstrap-timeout", "600",
                                    "--heartbeat-misses", "1000", *ENGINE_PATH, *flags, stderr=log))
        return started[-1]

    try:
        http_port = free_port()
        prefill = start("prefill")
        decode = start("decode", "--http-port", str(http_port))
        p, d = engine(prefill, slots=16), engine(decode, slots=16)
        clients += [p, d]
        nobody = f"127.0.0.1:{free_port()}"
        for room in STUCK_ROOMS:
            d.expect(room, nobody, np.array([room - 100]), d.alloc_slot())
        p.send(99, np.array([1]), 4, p.alloc_slot(), aux_bytes=8)
        yield Scene(runtime_dir, prefill, decode, http_port, p, d)
    finally:
        for client in clients:
            client.close()
        stop_all(started)
        shutil.rmtree(runtime_dir, ignore_errors=True)


# --- top


def test_top_layout_fits_every_terminal_size():
    """fit() (pure): never more lines than the terminal has nor longer than it is wide;
    the header first; tables cut to the rows that fit, the others counted."""
    header = ["pdxfer top - decode daemon 'decode' (incarnation 4bf7e42b29e34452), up 4.3s, ready   2026-11-22 01:32:06.910",
              "rooms      bootstrapping 14   waiting_for_input 0   transferring 0   success 0   failed 0"]
    sections = [top.Section("peers (2)", "  ADDRESS  STATE", ["  a  alive", "  b  connecting"]),
                top.Section("oldest live rooms (10 of 14)", "  ROOM  STATE", [f"  {100 + i}  bootstrapping" for i in range(10)])]
    for width, height in ((80, 24), (80, 12), (120, 40), (40, 10), (20, 3), (1, 1)):
        lines = top.fit(header, sections, width, height)
        assert 0 < len(lines) <= height and all(len(line) <= width for line in lines), (width, height, lines)
        assert lines[0].startswith("pdxfer top"[:width])
    tall = top.fit(header, sections, 200, 60)
    assert tall[:2] == header and "  109  bootstrapping" in tall and not any("more" in line for line in tall)
    short = top.fit(header, sections, 120, 12)  # 2 header + 2 x (blank, title) leaves 6 lines, 3 for each table
    assert len(short) == 12
    assert short[4:7] == ["  ADDRESS  STATE", "  a  alive", "  b  connecting"]  # the peers table fits whole
    assert short[9:] == ["  ROOM  STATE", "  100  bootstrapping", "  ... 9 more (a taller terminal shows them)"]
    # Nothing to show in a table: "none", as before.
    empty = top.fit(header, [top.Section("peers (0)", "", [])], 80, 24)
    assert empty[-2:] == ["peers (0)", "  none"]


def tmux(socket: str, *args: str) -> str:
    out = subprocess.run(["tmux", "-S", socket, *args], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("stale", ["", "COLUMNS=200 LINES=50 "], ids=["fresh", "stale-columns-and-lines"])
def test_top_fits_an_80x24_terminal_and_quits_on_q(scene, tmp_path, stale):
    """pdxfer top in a real terminal (tmux, 80x24): the whole screen fits, header
    on top; q quits at once (well before --iterations would end it). Also where the
    shell holds $COLUMNS and $LINES of another size (a tmux or screen pane after a
    resize): top asks the terminal."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: apt-get install -y tmux")
    socket = str(tmp_path / "tmux.sock")
    exited = tmp_path / "exited"
    command = (f"cd {os.getcwd()} && {stale}PYTHONPATH={os.environ.get('PYTHONPATH', '')} {sys.executable} -m pdxfer top "
               f"--runtime-dir {scene.runtime_dir} --name decode --interval 0.3 --iterations 1000; "
               f"echo $? > {exited}; sleep 60")
    tmux(socket, "new-session", "-d", "-s", "top", "-x", "80", "-y", "24", command)
    try:
        screen = wait_until(lambda: (s := tmux(socket, "capture-pane", "-p", "-t", "top")) and "oldest live rooms" in s and s,
                            timeout=30, what="top's first screen")
        time.sleep(1.0)  # a few refreshes: later ones must fit too
        lines = tmux(socket, "capture-pane", "-p", "-t", "top").rstrip("\n").split("\n")
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), screen
        assert lines[0].startswith("pdxfer top - decode daemon 'decode'"), "\n".join(lines)
        assert any(line.startswith("rooms      bootstrapping 14") for line in lines), "\n".join(lines)
        assert "oldest live rooms (10 of 14)" in lines
        assert any("more (a taller terminal shows them)" in line for line in lines), "\n".join(lines)
        tmux(socket, "send-keys", "-t", "top", "q")
        wait_until(exited.exists, timeout=10, what="top to exit on q")
        assert exited.read_text().strip() == "0"
        # The alternate screen is left: the shell's screen is back, without top's frames.
        assert "pdxfer top -" not in tmux(socket, "capture-pane", "-p", "-t", "top")
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True, timeout=10)


# --- --all


def test_rooms_peers_and_slots_show_every_daemon_with_all(scene):
    several = scene.cli("rooms")
    assert several.returncode == 2 and "--all" in several.stderr  # the refusal names the way out

    rooms = scene.cli("rooms", "--all", "--json")
    assert rooms.returncode == 0, rooms.stderr
    held = {(r["daemon"], r["room"], r["state"]) for r in json.loads(rooms.stdout)["rooms"]}
    assert held == {("prefill", 99, "bootstrapping"), *(("decode", room, "bootstrapping") for room in STUCK_ROOMS)}
    table = scene.cli("rooms", "--all").stdout.splitlines()
    assert table[0].split()[:3] == ["DAEMON", "ROOM", "ROLE"]
    assert sum(line.startswith("decode ") for line in table) == len(STUCK_ROOMS)
    assert sum(line.startswith("prefill ") and " 99 " in line for line in table) == 1
    assert table[-2:] == [f"decode: {len(STUCK_ROOMS)} rooms: {len(STUCK_ROOMS)} bootstrapping", "prefill: 1 rooms: 1 bootstrapping"]

    peers = json.loads(scene.cli("peers", "--all", "--json").stdout)["peers"]
    assert [(p["daemon"], p["state"]) for p in peers] == [("decode", "connecting")]
    assert scene.cli("peers", "--all").stdout.splitlines()[0].split()[:2] == ["DAEMON", "ADDRESS"]

    slots = json.loads(scene.cli("slots", "--all", "--json", "--state", "armed").stdout)["slots"]
    assert sorted(s["daemon"] for s in slots) == ["decode"] * len(STUCK_ROOMS) + ["prefill"]
    out = scene.cli("slots", "--all")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["DAEMON", "SLOT"]
    assert any(line.startswith("decode: 16 slots: 2 free") for line in lines), lines
    assert any(line.startswith("prefill: 16 slots: 15 free") for line in lines), lines
    assert len(scene.cli("slots", "--all", "--free").stdout.splitlines()) > len(lines)  # free slots listed too

    chosen = scene.cli("rooms", "--all", "--name", "decode")
    assert chosen.returncode == 2 and "leave out --daemon and --name" in chosen.stderr


# --- doctor


def test_doctor_counts_pools_a_daemon_still_maps_after_their_engine_exited(daemons, runtime_dir):
    """An engine that exits removes its pools' names from /dev/shm, but its daemon keeps
    them mapped until a new engine registers: the memory is held, and doctor says so
    and by whom."""
    daemon = daemons("decode")
    client = engine(daemon, small_layout(num_pages=1024), slots=16)  # 8 regions x 1024 pages x 256 B = 2 MiB
    client.close()  # unlinks the pools; the daemon keeps its mappings
    out = subprocess.run([sys.executable, "-m", "pdxfer", "doctor", "--json", "--runtime-dir", runtime_dir],
                         capture_output=True, text=True, timeout=120)
    shm = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "shared memory")
    held = re.search(rf"([0-9.]+) (\w+) by pid {daemon.pid}\b", shm["detail"])
    assert held, shm
    assert (float(held.group(1)), held.group(2)) >= (2.0, "MiB") and held.group(2) == "MiB", shm  # the KV pool and aux buffer


# --- metrics


def test_metrics_include_the_standard_process_metrics(scene):
    with urllib.request.urlopen(f"http://127.0.0.1:{scene.http_port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(body) for s in family.samples}
    with open(f"/proc/{scene.decode.pid}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    assert 0.5 * rss < samples["process_resident_memory_bytes"] < 2 * rss  # the daemon's own process
    assert samples["process_open_fds"] > 3 and samples["process_max_fds"] >= samples["process_open_fds"]
    assert samples["process_cpu_seconds_total"] > 0 and samples["process_start_time_seconds"] > 0
    assert samples["process_virtual_memory_bytes"] >= samples["process_resident_memory_bytes"]
    assert "python_info" in samples and "python_gc_collections_total" in samples
    assert "pdxfer_rooms" in samples  # pdxfer's own families are still there


# --- logs


def test_native_stderr_lines_become_json_entries():
    assert logs.native_entry("W1125 19:15:19.439092  5267 tcp_transport.cpp:120] Failed to connect: 10.0.0.5:15001", 1.5) == (
        "warning", {"ts": 1.5, "level": "warning", "logger": "mooncake", "msg": "Failed to connect: 10.0.0.5:15001",
                    "source": "tcp_transport.cpp:120"})
    # What every healthy start prints, glog's info lines and its routine warnings and errors, is debug.
    assert logs.native_entry("W1125 19:15:19.4 5267 transfer_engine_py.cpp:120] Using default malloc/free for protocol: tcp", 0)[0] == "debug"
    assert logs.native_entry("E1125 19:15:19.4 5267 transfer_metadata.cpp:1098] Local segment descriptor not found", 0)[0] == "debug"
    assert logs.native_entry("I1125 19:15:19.4 5267 tcp_transport.cpp:391] TcpTransport: listen on port 15745", 0)[0] == "debug"
    assert logs.native_entry("F1125 01:02:03.000001 77 tcp_transport.cpp:9] Check failed: x", 0)[1]["level"] == "critical"
    assert logs.native_entry(logs.GLOG_BANNER, 0)[0] == "debug"
    assert logs.native_entry("Traceback (most recent call last):", 0)[1]["logger"] == "stderr"
    # The transfer engine's process logs JSON records of its own to the pipe: passed on as they are.
    ours = {"ts": 2.0, "level": "error", "logger": "pdxfer.transport.engine_process", "msg": "x"}
    assert logs.native_entry(json.dumps(ours), 0) == ("error", ours)
    assert logs.native_entry("{not json", 0)[1]["logger"] == "stderr"
    out = io.StringIO()
    logs.relay(io.BytesIO(b"I1125 19:15:19.1 1 a.cpp:1] quiet\nE1125 19:15:19.1 1 a.cpp:2] loud\n\xff no newline at the end"), out, "warning")
    assert [json.loads(line)["msg"] for line in out.getvalue().splitlines()] == ["loud", "\ufffd no newline at the end"]


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_text_log_keeps_the_transfer_engines_routine_lines_out_of_the_way(runtime_dir, tmp_path, level):
    """`pdxfer serve` with every glog level let through: at info, nothing from the
    transfer engine before the ready line (it printed ~20 lines, two of them errors of
    no consequence); at debug, each of those lines in the daemon's own format, with
    its source file, and no raw glog line either way."""
    path = tmp_path / "stderr"
    with open(path, "w") as stderr:
        daemon = start_daemon("prefill", runtime_dir, "--log-level", level, stderr=stderr, env={"GLOG_minloglevel": "0"})
    assert daemon.stop() == 0
    lines = path.read_text().splitlines()
    assert not [line for line in lines if logs.GLOG_LINE.fullmatch(line) or line == logs.GLOG_BANNER], lines
    engine = [line for line in lines if " mooncake: " in line]
    if level == "info":
        assert engine == [] and "Local segment descriptor not found" not in path.read_text(), lines
    else:
        assert any("DEBUG [prefill] mooncake: Local segment descriptor not found (transfer_metadata.cpp:" in line for line in engine), engine
        assert len(engine) >= 10 and all(" DEBUG " in line for line in engine), engine


def relay_of(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        children = [int(c) for c in fh.read().split()]
    relays = [c for c in children if b"logs.py" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(relays) == 1, children  # one log relay (beside the transfer engine's process)
    return relays[0]


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_json_logs_are_json_lines_only_the_transfer_engines_own_included(runtime_dir, tmp_path, stop):
    """`pdxfer serve --log-format json` with every glog level let through: each stderr
    line parses, the transfer engine's lines keep their source (routine ones debug), and the
    relay that turns them into JSON writes what it read and exits once the daemon has
    gone, even killed."""
    path = tmp_path / "stderr"
    with open(path, "w") as stderr:
        daemon = start_daemon("prefill", runtime_dir, "--log-format", "json", "--log-level", "debug", stderr=stderr, env={"GLOG_minloglevel": "0"})
    relay = relay_of(daemon.pid)
    if stop == "sigterm":
        assert daemon.stop() == 0
        assert not os.path.exists(f"/proc/{relay}")  # the daemon waited for it at exit, which a container's PID 1 must
    else:
        daemon.proc.kill()
        daemon.wait()
        wait_until(lambda: not os.path.exists(f"/proc/{relay}"), 10, "the relay to exit")
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    engine_lines = [e for e in entries if e["logger"] == "mooncake"]
    # A healthy start and stop print only glog's routine lines: each with its source, all debug (logs.ROUTINE_GLOG).
    assert len(engine_lines) >= 10 and {e["level"] for e in engine_lines} == {"debug"}, engine_lines
    assert all(e["source"].split(":")[0].endswith(".cpp") for e in engine_lines if e["msg"] != logs.GLOG_BANNER)
    assert any(e["logger"] == "pdxfer.daemon" and "ready" in e["msg"] for e in entries)
    if stop == "sigterm":  # the engines' lines as they shut down, and the daemon's last line after them
        assert any("removeSegmentDesc" in e["msg"] for e in engine_lines) and entries[-1]["msg"].endswith("stopped")


# --- docs/operating.md's example of a room nobody serves


def test_a_room_from_an_address_nobody_serves_says_so_at_once_and_times_out_as_the_docs_show(daemons):
    """A decode room expected from an address where no prefill daemon listens: the
    decode keeps trying (a prefill may be starting), but its status and its log say at
    once that the address refuses connections, the log once, not once per retry. It
    ends at the bootstrap timeout as `timeout` (no link ever came up, so no heartbeat
    was missed), saying what it waited for, and docs/operating.md's example says so
    rather than `peer_dead` after 5 s."""
    decode = daemons("decode", "--bootstrap-timeout", "2")
    client = engine(decode)
    nobody = f"127.0.0.1:{free_port()}"
    try:
        started = time.monotonic()
        client.expect(1, nobody, np.array([0]), client.alloc_slot())
        waiting = wait_until(lambda: (st := client.poll(1)).reason and st, 1.5, "the room's status to say why it waits")
        assert waiting.state.value == "bootstrapping" and f"connection refused by {nobody}" in waiting.reason, waiting
        status = client.wait(1)
        assert status.state.value == "failed" and status.code.value == "timeout", status
        assert status.reason.startswith("no progress for 2s in bootstrapping, waiting for prefill") and f"connection refused by {nobody}" in status.reason
        assert time.monotonic() - started >= 2
    finally:
        client.close()
    with open(decode.log_path) as fh:
        warned = [line for line in fh if f"cannot reach prefill tcp://{nobody}" in line]
    assert len(warned) == 1 and " WARNING " in warned[0] and "connection refused" in warned[0] and "1 rooms waiting" in warned[0], warned
    tour = open(os.path.join(os.path.dirname(__file__), "..", "docs", "operating.md")).read()
    failed_rows = [line for line in tour.splitlines() if line.startswith("7004  decode  failed")]
    assert failed_rows and all("[timeout] no progress for 30s in bootstrapping, waiting for prefill" in line for line in failed_rows), failed_rows
    waiting = [line for line in tour.splitlines() if line.startswith("decode   7004  decode   bootstrapping")]
    assert waiting and all("waiting for prefill tcp://127.0.0.1:39543: connection refused" in line for line in waiting), waiting
    assert "[peer_dead] prefill tcp://127.0.0.1:39543" not in tour
