"""The Mooncake transfer engine as a Transport.

Writes are submitted one block at a time with ``transfer_submit_write`` and finished
with ``transfer_check_status``: both return at once, whereas the engine's batch and
synchronous calls spin a core until the whole batch is done (and
``transfer_check_status`` only looks at the first block of a multi-block batch).
The engine is imported here only, so the rest of pdxfer runs without it.

A session to a peer can break inside the engine (seen here: after a batch over the
per-peer queue limit, every later write to that peer failed). ``reset`` replaces
the engine and re-registers everything; the pump calls it when a probe fails.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from typing import Mapping

import numpy as np

from ..cpu_yield import normal_policy
from ..errors import Unsupported
from ..paths import ENGINE_PROTOCOL
from . import PROBE_BYTES, Status

log = logging.getLogger("pdxfer.transport")

# transfer_check_status: 1 completed, 0 pending, -1 failed, -2 timed out.
_STATUS = {1: Status.DONE, 0: Status.PENDING, -1: Status.FAILED, -2: Status.FAILED}
SCRATCH_BYTES = 4096
PROBE_TIMEOUT = 2.0
DEFAULT_TCP_QUEUE = 1024  # the engine's per-peer queue unless MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER says otherwise
# Engines replaced by a reset stay alive, so tearing one down cannot race the writes it
# still had in flight; each holds 2 threads and ~5 descriptors, so a daemon that outlives
# hundreds of peer restarts would run out of descriptors. Past this many the oldest goes:
# its writes ended resets ago, and its destructor holds the interpreter ~0.5-1 s here.
RETIRED_KEPT = 8


ENGINE_WHEELS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


@functools.lru_cache(maxsize=1)  # reading package metadata scans sys.path; the answer cannot change
def installed_engine() -> tuple[str, str] | None:
    """(package, version) of the transfer engine installed here, or None."""
    from importlib import metadata

    for dist in ENGINE_WHEELS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_release() -> str:
    """The installed transfer engine's version, or "" when unknown."""
    found = installed_engine()
    return found[1] if found else ""


def peer_queue_limit(protocol: str, env) -> int | None:
    """How many writes the engine queues per peer before refusing more (tcp only)."""
    if protocol != "tcp":
        return None
    try:
        return max(1, int(env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", DEFAULT_TCP_QUEUE)))
    except ValueError:
        return DEFAULT_TCP_QUEUE


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def load_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise Unsupported(
            "the Mooncake transfer engine is not importable "
            f"({exc}); install mooncake-transfer-engine-non-cuda (CPU hosts, needs "
            "libibverbs1 and libnuma1) or mooncake-transfer-engine (CUDA hosts)"
        ) from None
    return TransferEngine


class MooncakeTransport:
    def __init__(self, host: str, protocol: str = "tcp", devices: str = "", metadata: str = "P2PHANDSHAKE",
                 engine_env: Mapping[str, str] | None = None) -> None:
        self.host = host
        self.engine_env = dict(engine_env or {})  # set in the environment before an engine starts (it reads it there)
        self.protocol = protocol
        self.devices = devices
        self.metadata = metadata
        self.scratch = 0
        self.session = ""
        self.resets = 0
        self._engine = None
        self._retired: list = []  # replaced engines, the newest RETIRED_KEPT
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._scratch = np.zeros(SCRATCH_BYTES, np.uint8)

    def _session_name(self, engine) -> str:
        # With a metadata store the name we gave is the segment's key; peer to peer, host:rpc port.
        return self._local_name if self.metadata != "P2PHANDSHAKE" else f"{self.host}:{engine.get_rpc_port()}"

    def _new_engine(self):
        os.environ.update(self.engine_env)
        # A metadata store keys segments by the name given: make it unique with a free port.
        self._local_name = self.host if self.metadata == "P2PHANDSHAKE" else f"{self.host}:{free_port(self.host)}"
        with normal_policy():  # the engine's threads must not inherit a yielding caller's SCHED_IDLE (cpu_yield.py)
            engine = load_engine_class()()
            rc = engine.initialize(self._local_name, self.metadata, ENGINE_PROTOCOL[self.protocol], self.devices)
        if rc != 0:
            raise Unsupported(
                f"transfer engine failed to initialise protocol {self.protocol} on {self.host} (code {rc}); "
                "see the engine's log lines above"
            )
        return engine

    def start(self) -> str:
        with self._lock:
            self._engine = self._new_engine()
            self.session = self._session_name(self._engine)
        self.scratch = int(self._scratch.ctypes.data)
        self.register(self.scratch, SCRATCH_BYTES)
        return self.session

    def register(self, address: int, length: int) -> None:
        with self._lock:
            rc = self._engine.register_memory(address, length)
            if rc != 0:
                raise Unsupported(f"transfer engine refused to register {length} bytes at {address:#x} (code {rc})")
            self._registered[address] = length

    def unregister(self, address: int) -> None:
        with self._lock:
            self._registered.pop(address, None)
            self._engine.unregister_memory(address)

    def submit(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        write = self._engine.transfer_submit_write
        return [write(peer, s, d, n) for s, d, n in zip(src, dst, length)]

    def poll(self, handle: int) -> Status:
        return _STATUS.get(self._engine.transfer_check_status(handle), Status.FAILED)

    def probe(self, peer: str, dst: int) -> bool:
        handle = self._engine.transfer_submit_write(peer, self.scratch, dst, PROBE_BYTES)
        if handle == 0:
            return False
        deadline = time.monotonic() + PROBE_TIMEOUT
        while time.monotonic() < deadline:
            status = self.poll(handle)
            if status is not Status.PENDING:
                return status is Status.DONE
            time.sleep(0.001)
        return False  # the handle stays with the engine; it is retired on reset

    def reset(self) -> str:
        with self._lock:
            engine = self._new_engine()
            for address, length in self._registered.items():
                if engine.register_memory(address, length) != 0:
                    raise Unsupported(f"re-registering {length} bytes at {address:#x} failed after an engine reset")
            self._retired.append(self._engine)
            self._engine = engine
            self.session = self._session_name(engine)
            self.resets += 1
            oldest = self._retired[:-RETIRED_KEPT]
            del self._retired[:-RETIRED_KEPT]
        log.warning("transfer engine re-created (reset %d); new session %s", self.resets, self.session)
        if oldest:
            started = time.monotonic()
            oldest.clear()
            log.warning("destroyed the transfer engine replaced %d resets ago (took %.2fs)", RETIRED_KEPT, time.monotonic() - started)
        return self.session

    def close(self) -> None:
        self._engine = None
        self._retired.clear()
