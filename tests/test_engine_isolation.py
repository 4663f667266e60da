"""Issue 30.2: bytes from a stranger to a transfer engine's ports must not end the
daemon. Nine bytes to the engine's handshake port abort the process that runs it
(an exception thrown inside the engine, std::terminate), and a header on its data
port names any address to write. The engine now runs in a process of its own
(pdxfer/transport/isolated.py): that process may die; the daemon keeps serving,
starts another and moves rooms through it. Real daemons, real transfer engines."""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import struct
import threading
import time

import pytest

from pdxfer.host import memory
from pdxfer.tools.chaos import ChaosSpec, run_chaos

from .conftest import needs_mooncake
from .roomkit import engine

pytestmark = [needs_mooncake, pytest.mark.integration]

FAST = [
    "--heartbeat-interval", "0.5", "--heartbeat-misses", "10", "--transfer-timeout", "10",
    "--bootstrap-timeout", "10", "--waiting-timeout", "10",
]
NINE_BYTES = struct.pack("<Q", 1) + b"5"  # a length of 1, then a JSON number where the engine wants an object


def listening_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on (from /proc: no tools needed); none once it
    is gone (an engine process the last attack ended, before its successor started)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                lines = list(fh)[1:]
        except FileNotFoundError:
            return []
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def engine_pid(daemon, old: int = 0, timeout: float = 30.0) -> int:
    """The daemon's transfer engine process (a new one, if ``old`` is given), from its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = re.findall(r"transfer engine process (\d+) started", open(daemon.log_path).read())
        pid = int(started[-1]) if started else daemon.ready["engine_pid"]
        if pid != old:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"{daemon.role}: no transfer engine process replaced {old} within {timeout:g}s")


def send(port: int, payload: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(payload)
            time.sleep(0.05)
    except OSError:
        pass  # the process behind it is gone already: what the daemon does next is the test


def chaos(prefill, decode, rooms: int, seed: int):
    spec = ChaosSpec(rooms=rooms, in_flight=4, slots=16, abort_rate=0, seed=seed)
    return asyncio.run(run_chaos(prefill.engine, decode.engine, prefill.bootstrap, spec))


def test_the_daemon_runs_its_transfer_engine_in_a_process_of_its_own(daemons):
    prefill = daemons("prefill")
    pid = prefill.ready["engine_pid"]
    assert pid != prefill.ready["pid"]
    session_ports = {int(s.rsplit(":", 1)[1]) for s in prefill.ready["sessions"]}
    assert session_ports <= set(listening_ports(pid)), "the engine's ports belong to its own process"
    assert session_ports.isdisjoint(listening_ports(prefill.ready["pid"]))


def pool_mappings(pid: int) -> dict[str, int]:
    """Start address of each engine pool (pdxfer-kv-*, pdxfer-aux-*) process ``pid`` maps."""
    found = {}
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            fields = line.split()
            name = os.path.basename(fields[-1]) if len(fields) >= 6 else ""
            if name.startswith(("pdxfer-kv-", "pdxfer-aux-")):
                found.setdefault(name, int(fields[0].split("-")[0], 16))
    return found


def test_engine_pools_are_mapped_apart_at_the_same_addresses_in_both_processes(daemons):
    """The engine's process maps every pool at the daemon's own address; the daemon
    places them where neither process puts anything of its own (memory.APART), so no
    registration finds its address taken there."""
    decode = daemons("decode")
    client = engine(decode)
    try:
        ours, theirs = pool_mappings(decode.ready["pid"]), pool_mappings(decode.ready["engine_pid"])
        assert len(ours) == 2 and ours == theirs, (ours, theirs)
        assert all(memory.APART[0] <= address < memory.APART[1] for address in ours.values()), ours
        assert "taken" not in open(decode.log_path).read()
    finally:
        client.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_nine_bytes_to_the_handshake_port_end_only_the_engine_process(daemons, role):
    prefill, decode = daemons("prefill", *FAST), daemons("decode", *FAST)
    before = chaos(prefill, decode, 20, seed=1)
    assert before.decode == {"success": 20} and before.corruptions == 0, before.line()
    target = prefill if role == "prefill" else decode
    old = target.ready["engine_pid"]
    send(int(target.ready["session"].rsplit(":", 1)[1]), NINE_BYTES)
    new = engine_pid(target, old)
    assert prefill.alive() and decode.alive()
    assert re.search(rf"transfer engine process {old} ended \(killed by signal SIGABRT\)", open(target.log_path).read())
    after = chaos(prefill, decode, 20, seed=2)
    assert after.decode == {"success": 20} and after.corruptions == 0, after.line()
    assert new != old


def test_stray_bytes_to_every_engine_port_while_rooms_flow_leave_both_daemons_serving(daemons):
    """The issue's test: the nine bytes, and random bytes, to every transfer-engine
    port of both daemons while rooms flow; both daemons keep serving, no room is
    corrupted, and rooms started afterwards all succeed."""
    prefill, decode = daemons("prefill", *FAST), daemons("decode", *FAST)
    rng = random.Random(7)
    result = {}
    flow = threading.Thread(target=lambda: result.setdefault("report", chaos(prefill, decode, 1500, seed=3)))
    flow.start()
    attacks = rounds = 0
    while flow.is_alive() and rounds < 12:
        time.sleep(0.3)
        for daemon in (prefill, decode):
            for port in listening_ports(engine_pid(daemon)):
                send(port, NINE_BYTES if rounds % 2 == 0 else rng.randbytes(rng.randint(1, 256)))
                attacks += 1
        rounds += 1
    assert rounds >= 2, "the rooms were over before the attacks began: make the flow longer"
    flow.join(600)
    assert not flow.is_alive(), "rooms stopped settling after the attacks"
    during = result["report"]
    print(during.line(), f"attacks={attacks} in {rounds} rounds")
    assert during.corruptions == 0, during.line()
    assert prefill.alive() and decode.alive()
    restarts = sum(len(re.findall(r"transfer engine process \d+ started", open(d.log_path).read())) for d in (prefill, decode))
    assert restarts >= 2, "the attacks should have ended engine processes of both daemons"
    after = chaos(prefill, decode, 30, seed=4)
    assert after.decode == {"success": 30} and after.prefill == {"success": 30} and after.corruptions == 0, after.line()
