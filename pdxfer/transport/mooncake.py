"""The Mooncake transfer engine as a Transport.

Writes are submitted one block at a time with ``transfer_submit_write`` and finished
with ``transfer_check_status``: both return at once, whereas the engine's batch and
synchronous calls spin a core until the whole batch is done (and
``transfer_check_status`` only looks at the first block of a multi-block batch).
The engine is imported here only, so the rest of pdxfer runs without it.

A transport may run several engines (``engines``, see paths.engine_count); each
registers all memory, and writes to a peer take the stripes of paths.stripes in
turn, one write each.

A session to a peer can break inside the engine (seen here: after a batch over the
per-peer queue limit, every later write to that peer failed). ``reset`` replaces
the engines and re-registers everything; the pump calls it when a probe fails.

Ending engines is what proves that nothing sent to them can land any more: an engine
destroyed here has closed its listening and data sockets and stopped the threads that
apply what arrives (a receiver checks every write against the memory registered with
it, so only a live engine lands anything). ``rotate`` starts new engines beside the
current ones, which go on receiving until ``end`` names their sessions; ``reset`` is
both at once. No new engine takes a port an ended one of this transport had: a writer
that resumes after a freeze with writes queued for that port would otherwise reach it.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import threading
import time
from typing import Callable, Mapping

import numpy as np

from ..core.errors import Unsupported
from ..core.paths import ENGINE_PROTOCOL, stripes
from ..host.cpu_yield import normal_policy
from ..host.processes import listening_ports
from . import PROBE_BYTES, Peer, Status, label

log = logging.getLogger("pdxfer.transport")

# transfer_check_status: 1 completed, 0 pending, -1 failed, -2 timed out.
_STATUS = {1: Status.DONE, 0: Status.PENDING, -1: Status.FAILED, -2: Status.FAILED}
SCRATCH_BYTES = 4096
PROBE_TIMEOUT = 2.0
DEFAULT_TCP_QUEUE = 1024  # the engine's per-peer queue unless MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER says otherwise
FRESH_PORT_TRIES = 8  # engines made in a row that took a port an ended engine had, before giving up


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
                 engine_env: Mapping[str, str] | None = None, engines: int = 1, scratch: int = 0) -> None:
        self.host = host
        self.engine_env = dict(engine_env or {})  # set in the environment before an engine starts (it reads it there)
        self.protocol = protocol
        self.devices = devices
        self.metadata = metadata
        self.engine_count = engines  # how many this transport runs (paths.engine_count)
        self.scratch = scratch  # 0: our own, made in start()
        self.sessions: Peer = ()
        self.resets = 0
        self.ports: frozenset[int] = frozenset()  # every TCP port this transport's engines ever listened on
        self._engines: list = []
        self._retiring: dict[Peer, list] = {}  # sessions -> engines replaced by rotate, still receiving until end()
        self._registered: dict[int, int] = {}
        self._turn = 0  # the stripe the next write takes
        self._lock = threading.Lock()
        self._scratch = None if scratch else np.zeros(SCRATCH_BYTES, np.uint8)

    def _new_engine(self) -> tuple[object, str]:
        """A started engine and the session name peers address it by."""
        os.environ.update(self.engine_env)
        # A metadata store keys segments by the name given: make it unique with a free port.
        local = self.host if self.metadata == "P2PHANDSHAKE" else f"{self.host}:{free_port(self.host)}"
        with normal_policy():  # the engine's threads must not inherit a yielding caller's SCHED_IDLE (cpu_yield.py)
            engine = load_engine_class()()
            rc = engine.initialize(local, self.metadata, ENGINE_PROTOCOL[self.protocol], self.devices)
        if rc != 0:
            raise Unsupported(
                f"transfer engine failed to initialise protocol {self.protocol} on {self.host} (code {rc}); "
                "see the engine's log lines above"
            )
        # Peer to peer, a segment is named host:rpc port; with a store, by the name given.
        return engine, (f"{self.host}:{engine.get_rpc_port()}" if self.metadata == "P2PHANDSHAKE" else local)

    def _new_engines(self) -> tuple[list, Peer]:
        """Started engines (every registered region registered with them) on ports no
        engine of this transport had before."""
        for _ in range(FRESH_PORT_TRIES):
            before = listening_ports()
            made = [self._new_engine() for _ in range(self.engine_count)]
            engines, sessions = [engine for engine, _ in made], tuple(session for _, session in made)
            ports = listening_ports() - before  # what the new engines listen on: nothing else here opens a listener meanwhile
            if not ports & self.ports:
                self.ports |= ports
                for address, length in self._registered.items():
                    _register(engines, address, length, "re-registering after an engine reset: ")
                return engines, sessions
            log.warning("new transfer engines %s took a port an ended one had (%s); making others", label(sessions), sorted(ports & self.ports))
            self.ports |= ports
            _destroy(engines)
        raise Unsupported(f"{FRESH_PORT_TRIES} sets of transfer engines in a row took ports ended engines had; restart the daemon")

    def start(self) -> Peer:
        with self._lock:
            self._engines, self.sessions = self._new_engines()
        if self._scratch is not None:
            self.scratch = int(self._scratch.ctypes.data)
        self.register(self.scratch, SCRATCH_BYTES)
        return self.sessions

    def register(self, address: int, length: int, populate: bool = True) -> None:
        with self._lock:
            _register(self._engines, address, length)
            self._registered[address] = length

    def unregister(self, address: int) -> None:
        with self._lock:
            self._registered.pop(address, None)
            for engine in [*self._engines, *(e for engines in self._retiring.values() for e in engines)]:
                engine.unregister_memory(address)

    def _routes(self, peer: Peer) -> list[tuple[Callable, str, int]]:
        """(write call, peer session, our engine's index) per stripe (paths.stripes)."""
        return [(self._engines[e].transfer_submit_write, peer[s], e) for e, s in stripes(len(self._engines), len(peer))]

    def submit(self, peer: Peer, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        routes = self._routes(peer)
        if len(routes) == 1:  # one engine, one session: the engine's handles as they are
            write, session, _ = routes[0]
            return [write(session, s, d, n) for s, d, n in zip(src, dst, length)]
        # A handle names its engine too: engine index + engines * the engine's handle.
        count, engines, turn = len(routes), len(self._engines), self._turn
        self._turn = (turn + len(src)) % count
        handles = []
        for i, (s, d, n) in enumerate(zip(src, dst, length)):
            write, session, e = routes[(turn + i) % count]
            handle = write(session, s, d, n)
            handles.append(handle * engines + e if handle else 0)
        return handles

    def poll(self, handle: int) -> Status:
        engines = self._engines
        if len(engines) == 1:
            return _STATUS.get(engines[0].transfer_check_status(handle), Status.FAILED)
        engine, own = engines[handle % len(engines)], handle // len(engines)
        return _STATUS.get(engine.transfer_check_status(own), Status.FAILED)

    def probe(self, peer: Peer, dst: int) -> bool:
        ways = len(self._routes(peer))  # one write over each route
        handles = self.submit(peer, [self.scratch] * ways, [dst] * ways, [PROBE_BYTES] * ways)
        if not all(handles):
            return False
        deadline = time.monotonic() + PROBE_TIMEOUT
        while handles and time.monotonic() < deadline:
            statuses = [self.poll(h) for h in handles]
            if Status.FAILED in statuses:
                return False
            handles = [h for h, status in zip(handles, statuses) if status is Status.PENDING]
            if handles:
                time.sleep(0.001)
        return not handles  # a handle left pending stays with its engine until it ends

    def rotate(self) -> Peer:
        with self._lock:
            engines, sessions = self._new_engines()
            self._retiring[self.sessions] = self._engines
            self._engines, self.sessions = engines, sessions
        log.info("new transfer engines %s; %s receive until they are ended", label(sessions), ", ".join(map(label, self._retiring)))
        return sessions

    def end(self, sessions: Peer) -> None:
        with self._lock:
            engines = self._retiring.pop(sessions, None)
        if engines is not None:
            started = time.monotonic()
            _destroy(engines)
            log.info("ended the transfer engines %s (took %.2fs)", label(sessions), time.monotonic() - started)

    def reset(self) -> Peer:
        old = self.sessions
        self.rotate()
        self.end(old)
        self.resets += 1
        log.warning("transfer engines re-created (reset %d); new sessions %s", self.resets, label(self.sessions))
        return self.sessions

    def close(self) -> None:
        with self._lock:
            every = [self._engines, *self._retiring.values()]
            self._engines, self._retiring = [], {}
        for engines in every:
            _destroy(engines)


def _register(engines: list, address: int, length: int, context: str = "") -> None:
    """Register with every engine, or with none: one that refuses undoes the others."""
    for done, engine in enumerate(engines):
        rc = engine.register_memory(address, length)
        if rc != 0:
            for earlier in engines[:done]:
                earlier.unregister_memory(address)
            raise Unsupported(f"{context}transfer engine refused to register {length} bytes at {address:#x} (code {rc})")


def _destroy(engines: list) -> None:
    """End engines for real: the last reference goes, and with it their sockets and threads."""
    engines.clear()
    gc.collect()  # an engine caught in a reference cycle would live on, and keep receiving
