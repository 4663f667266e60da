"""Shared fixtures: real daemons (separate processes, real transfer engine over TCP
on loopback) and engine clients in the test process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdxfer.client import Client
from pdxfer.core.protocol import KVLayout, Layout
from pdxfer.host import memory
from pdxfer.tools.launch import start_daemon, stop_all


def _transfer_engine_available() -> str:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake transfer engine is not importable here: {exc}"
    return ""


MOONCAKE_MISSING = _transfer_engine_available()
needs_mooncake = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "-")


def settle(transport, handle: int, seconds: float):
    """Poll a write until it is no longer pending, for up to ``seconds``; its last
    status. (A settled handle is freed by the engine: it is not polled again.)"""
    from pdxfer.transport import Status

    deadline = time.monotonic() + seconds
    status = transport.poll(handle)
    while status is Status.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
        status = transport.poll(handle)
    return status


@pytest.fixture
def runtime_dir():
    # Short path: ipc socket paths are limited to ~107 bytes.
    path = tempfile.mkdtemp(prefix="pdx-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Test rooms are a few KiB, which would ride their aux records (--inline-kv-bytes);
# tests are about the transfer engine unless they say otherwise (test_inline_kv.py).
ENGINE_PATH = ("--inline-kv-bytes", "0")


@pytest.fixture
def daemons(runtime_dir, tmp_path):
    """Factory: start(role, *flags) -> DaemonProcess; all are stopped at teardown and
    must exit cleanly (a crash in a daemon fails the test that caused it)."""
    started = []

    def start(role: str, *flags: str, name: str = "", env: dict | None = None):
        if "--inline-kv-bytes" not in flags:
            flags = (*ENGINE_PATH, *flags)
        log = open(tmp_path / f"{name or role}-{len(started)}.log", "w")
        daemon = start_daemon(role, runtime_dir, "--log-level", "info", *flags, name=name, stderr=log, env=env)
        daemon.log_path = log.name
        started.append(daemon)
        return daemon

    yield start
    codes = dict(zip((d.ready.get("name", d.role) for d in started), stop_all(started)))
    crashed = {name: code for name, code in codes.items() if code not in (0, -9)}
    assert not crashed, f"daemons exited abnormally: {crashed}"


@pytest.fixture
def pair(daemons):
    """A prefill and a decode daemon with default options, started together (each
    takes about a second to start)."""
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(daemons, ("prefill", "decode"))
    return prefill, decode


def orphan_pool(prefix: str, nbytes: int) -> str:
    """A shared-memory pool as an engine killed before it could remove it leaves one:
    named after a process that has exited (pids count up: not reused for a long while).
    Returns its path."""
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    path = os.path.join(memory.SHM_DIR, f"{prefix}-{gone.pid}-0badf00d")
    with open(path, "wb") as fh:
        fh.truncate(nbytes)
    return path


def small_layout(layout: Layout = Layout.MHA, **overrides) -> KVLayout:
    fields = dict(layout=layout, num_layers=4, num_pages=256, page_size=4, token_bytes=64, dtype="bfloat16")
    fields.update(overrides)
    return KVLayout(**fields)


@pytest.fixture
def engines(pair):
    """Connected engine clients for the prefill and decode daemons, each with a
    small registered KV pool and aux buffer. Returns (prefill, decode, bootstrap)."""
    prefill_daemon, decode_daemon = pair
    made = []

    def connect(daemon, layout: KVLayout, slots: int = 16, payload: int = 64) -> Client:
        client = Client(daemon.engine, timeout=20.0)
        client.connect()
        client.create_kv_pool(layout)
        client.create_aux_buffer(slots, payload)
        made.append(client)
        return client

    connect.prefill_daemon, connect.decode_daemon = prefill_daemon, decode_daemon
    yield connect
    for client in made:
        client.close()
