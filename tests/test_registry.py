"""Discovery and liveness through a real etcd server (Debian's etcd-server), started
by the test on loopback with a temporary data directory."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from pdxfer.client import Client
from pdxfer.core.protocol import RoomState
from pdxfer.daemon.registry import EtcdClient

from .conftest import needs_mooncake
from .roomkit import engine, free_port, wait_until

ETCD = shutil.which("etcd")
pytestmark = [
    needs_mooncake,
    pytest.mark.integration,
    pytest.mark.skipif(ETCD is None, reason="etcd is not installed (Debian package etcd-server; `make test` installs it)"),
]

TTL = "2"
# Heartbeats slow enough that only the registry can notice a death within the test.
SLOW_HEARTBEATS = ["--heartbeat-interval", "1", "--heartbeat-misses", "60"]


@pytest.fixture
def etcd(tmp_path):
    client_port, peer_port = free_port(), free_port()
    proc = subprocess.Popen(
        [ETCD, "--data-dir", str(tmp_path / "etcd"), "--name", "pdxfer-test",
         "--listen-client-urls", f"http://127.0.0.1:{client_port}", "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"pdxfer-test=http://127.0.0.1:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "w"),
    )
    client = EtcdClient("127.0.0.1", client_port)
    deadline = time.monotonic() + 20
    while True:
        try:
            asyncio.run(client.range_prefix(b"/"))
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"etcd did not start: {(tmp_path / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.2)
    yield f"etcd://127.0.0.1:{client_port}", client
    proc.terminate()
    proc.wait(10)


def records(client: EtcdClient, role: str) -> dict:
    kvs, _ = asyncio.run(client.range_prefix(f"/pdxfer/daemons/{role}/".encode()))
    return {key.decode().rsplit("/", 1)[1]: json.loads(value) for key, value in kvs}


def ship(prefill: Client, decode: Client, room: int, bootstrap: str, src=(1, 2), dst=(3, 4)):
    """One room by the usual path; returns the decode side's status."""
    decode.expect(room, bootstrap, np.array(dst), decode.alloc_slot())
    prefill.send(room, np.array(src), 8, prefill.alloc_slot(), aux_bytes=0)
    status = decode.wait(room)
    decode.release(room)
    prefill.wait(room)
    prefill.release(room)
    return status


def test_daemons_register_and_decode_finds_prefill_by_name(etcd, daemons):
    url, client = etcd
    prefill = daemons("prefill", "--registry", url, "--registry-ttl", TTL, "--yield-cpu", name="prefill-a")
    decode = daemons("decode", "--registry", url, "--registry-ttl", TTL, name="decode-a")
    pre = records(client, "prefill")["prefill-a"]
    assert pre["incarnation"] == prefill.ready["incarnation"] and pre["bootstrap"] == prefill.bootstrap
    assert pre["session"] == prefill.ready["session"] and pre["role"] == "prefill"
    assert records(client, "decode")["decode-a"]["incarnation"] == decode.ready["incarnation"]
    p, d = engine(prefill), engine(decode)
    try:
        assert ship(p, d, 1, "prefill-a").state is RoomState.SUCCESS  # a name, not an address
        with pytest.raises(Exception, match="no daemon named 'nobody'.*prefill-a"):
            d.expect(2, "nobody", np.array([5]), d.alloc_slot())
    finally:
        p.close()
        d.close()
    # A daemon that stops cleanly leaves the registry at once.
    prefill.stop()
    assert "prefill-a" not in records(client, "prefill")
    # A 2 s lease renewed every 2/3 s lapses after 4/3 s of a stalled loop: too tight to
    # yield the cores (a starved SCHED_IDLE loop could lose its lease), and it says so.
    assert "keep the normal CPU policy (--yield-cpu): peers or the registry declare this daemon gone after 1.33333s" in (
        open(prefill.log_path).read())


def test_lease_expiry_of_a_killed_decode_fails_its_rooms_on_the_prefill(etcd, daemons):
    url, client = etcd
    prefill = daemons("prefill", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="prefill-b")
    decode = daemons("decode", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="decode-b")
    p, d = engine(prefill), engine(decode)
    try:
        d.expect(10, "prefill-b", np.array([1]), d.alloc_slot())  # waits for the prefill engine, which holds back
        wait_until(lambda: p.stats().rooms["waiting_for_input"] == 1, 10, "the room on the prefill")
        killed = time.monotonic()
        decode.proc.send_signal(signal.SIGKILL)
        decode.proc.wait()
        status = wait_until(lambda: (s := p.poll(10)).state is RoomState.FAILED and s, 15, "the prefill to fail the room")
        took = time.monotonic() - killed
        assert status.code.value == "peer_dead" and "registry lease lapsed" in status.reason, status
        assert took < 60, "it was the lease, not the (one minute) heartbeat bound"
        assert "decode-b" not in records(client, "decode")
    finally:
        p.close()
        d.close()


def test_lease_expiry_of_a_frozen_prefill_fails_its_rooms_on_the_decode(etcd, daemons):
    """SIGSTOP: no connection drops, heartbeats are slow; only the lapsed lease tells."""
    url, client = etcd
    prefill = daemons("prefill", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="prefill-c")
    decode = daemons("decode", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="decode-c")
    p, d = engine(prefill), engine(decode)
    try:
        d.expect(20, "prefill-c", np.array([1]), d.alloc_slot())
        wait_until(lambda: d.poll(20).state is RoomState.WAITING_FOR_INPUT, 10, "the prefill to accept the room")
        prefill.proc.send_signal(signal.SIGSTOP)
        try:
            status = wait_until(lambda: (s := d.poll(20)).state is RoomState.FAILED and s, 20, "the decode to fail the room")
            assert status.code.value == "peer_dead" and "registry lease lapsed" in status.reason, status
            assert not status.fenced  # a frozen writer may wake up: the room waits for its lease
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
    finally:
        p.close()
        d.close()


def test_restart_registers_a_new_incarnation_and_rooms_follow_it(etcd, daemons):
    url, client = etcd
    first = daemons("prefill", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="prefill-d")
    decode = daemons("decode", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="decode-d")
    p, d = engine(first), engine(decode)
    try:
        d.expect(30, "prefill-d", np.array([1]), d.alloc_slot())
        wait_until(lambda: d.poll(30).state is RoomState.WAITING_FOR_INPUT, 10, "the room to be accepted")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        p.close()
        second = daemons("prefill", "--registry", url, "--registry-ttl", TTL, *SLOW_HEARTBEATS, name="prefill-d")
        assert records(client, "prefill")["prefill-d"]["incarnation"] == second.ready["incarnation"] != first.ready["incarnation"]
        status = wait_until(lambda: (s := d.poll(30)).state is RoomState.FAILED and s.fenced and s, 15, "the old room to fail, fenced")
        assert status.code.value == "peer_dead"
        p = engine(second)
        assert ship(p, d, 31, "prefill-d").state is RoomState.SUCCESS  # resolved to the new address
    finally:
        p.close()
        d.close()


def test_transfer_engine_metadata_in_the_same_etcd(etcd, daemons):
    url, _ = etcd
    flags = ["--registry", url, "--transfer-metadata", url]
    prefill = daemons("prefill", *flags, name="prefill-e")
    decode = daemons("decode", *flags, name="decode-e")
    p, d = engine(prefill), engine(decode)
    try:
        for room in range(40, 45):
            assert ship(p, d, room, "prefill-e", src=(room % 7, 8), dst=(room % 5 + 10, 20)).state is RoomState.SUCCESS
    finally:
        p.close()
        d.close()
