"""A Transport whose transfer engine runs in a process of its own (engine_process.py), so that
whatever ends the engine leaves the daemon serving.

The daemon keeps what a new engine process needs to take over: every registered
region, with a descriptor of the file behind it. When the process dies, the writes it
held settle as FAILED, and ``on_lost`` runs with its sessions (whether it was the
current one), so that the daemon asks the pump for a reset once nothing is in flight;
``reset`` starts a new process with every region and new sessions. Later submissions
are refused until then.

A process ended is the proof that nothing sent to its sessions can land any more: the
kernel closed every socket it had, with whatever they held unread, and nothing else
maps those ports to our memory. ``rotate`` starts a new process beside the current
one, which goes on receiving until ``end`` names its sessions and kills it (a decode
daemon moves its prefills to new sessions so, without failing their writes in flight);
``reset`` does both at once. A new process that listens on a port an ended one had is
replaced before it is used: a writer frozen with writes queued for that port would
reach it on resuming.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np

from ..core.config import Config
from ..core.errors import Unsupported
from ..host.cpu_yield import normal_policy
from ..host.memory import SharedMemory, place_mappings_apart
from ..host.processes import exit_status
from . import Peer, Status, label
from .engine_messages import BLOCKS_PER_SUBMIT, MAX_PACKET, SOCKET_BUFFER, Answer, Probe, Region, Register, Reply, Settled, Start, Submit, Unregister
from .mooncake import PROBE_TIMEOUT, SCRATCH_BYTES

log = logging.getLogger("pdxfer.transport")

START_TIMEOUT = 60.0  # an engine's start, or mapping and registering a large pool (MAP_POPULATE)
CALL_TIMEOUT = 300.0
STOP_TIMEOUT = 5.0
SPAWN_TRIES = 8  # fresh processes tried when the daemon's addresses, or an ended process's ports, are taken in one
_STATUS = {int(s): s for s in Status}


class EngineProcessLost(Exception):
    pass


@dataclass(eq=False)
class EngineProcess:
    """One transfer engine process and the sessions peers reach it at."""

    proc: subprocess.Popen
    sock: socket.socket
    sessions: Peer
    ports: frozenset[int]
    ending: bool = False  # killed or let go on purpose: its exit is nobody's news


def _backing(address: int, length: int, maps: str = "/proc/self/maps") -> tuple[int, int]:
    """(a descriptor of the file mapped at ``address``, the file offset of ``address``):
    what another process needs to map the same memory."""
    with open(maps) as fh:
        for line in fh:
            span, _, offset, _, _, *path = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                break
        else:
            raise Unsupported(f"no mapping holds address {address:#x}")
    if address + length > end:
        raise Unsupported(f"[{address:#x}, +{length}) spans more than one mapping")
    name = path[0].strip() if path else ""
    if not name.startswith("/"):
        raise Unsupported(
            f"memory at {address:#x} is not backed by a file ({name or 'anonymous'}), so the transfer engine's process "
            "cannot map it: host pools must be shared memory, or run the daemon with --transfer-engine-process inline"
        )
    try:
        fd = os.open(name, os.O_RDWR)
    except OSError:  # unlinked since it was mapped: the mapping's own entry still opens it
        fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDWR)
    return fd, int(offset, 16) + address - start


class IsolatedTransport:
    def __init__(self, config: Config, on_lost: Callable[[Peer, bool], None]) -> None:
        self.config = config
        self.on_lost = on_lost  # called from a reader thread: (the dead process's sessions, whether it was the current one)
        self.scratch = 0
        self.restarts = 0
        self.ports: frozenset[int] = frozenset()  # every TCP port an engine process of this transport listened on
        self._lifecycle = threading.Lock()  # start, rotate, end, register, unregister, reset, close
        self._state = threading.Lock()  # the short one: handles, waiters, which process is current
        self._regions: dict[int, tuple[Region, int]] = {}  # address -> (region, our descriptor)
        self._scratch: SharedMemory | None = None
        self._current: EngineProcess | None = None  # where writes and calls go
        self._retiring: dict[Peer, EngineProcess] = {}  # replaced by rotate, receiving until end()
        self._closing = False
        self._next_handle = 1
        self._lost_below = 0  # handles below this that never settled were a dead process's
        self._settled: dict[int, Status] = {}
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._reqs = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Answer)
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdxfer-engine-spawner")

    @property
    def sessions(self) -> Peer:
        current = self._current
        return current.sessions if current is not None else ()

    @property
    def pid(self) -> int:
        current = self._current
        return current.proc.pid if current is not None else 0

    # --- lifecycle

    def start(self) -> Peer:
        place_mappings_apart()  # where the engine's process has nothing of its own either
        self._scratch = SharedMemory.create(SCRATCH_BYTES, prefix="pdxfer-scratch")
        self.scratch = self._scratch.address
        with self._lifecycle:
            self._current = self._spawn()
        return self.sessions

    def rotate(self) -> Peer:
        with self._lifecycle:
            new = self._spawn()
            with self._state:
                old, self._current = self._current, new
            if old is not None and old.proc.poll() is None:
                self._retiring[old.sessions] = old
        log.info("transfer engine process %d started with sessions %s; %s receive until ended",
                 new.proc.pid, label(new.sessions), ", ".join(map(label, self._retiring)) or "no others")
        return new.sessions

    def end(self, sessions: Peer) -> None:
        with self._lifecycle:
            old = self._retiring.pop(sessions, None)
            if old is not None:
                _stop(old)
                log.info("ended transfer engine process %d (sessions %s)", old.proc.pid, label(sessions))

    def reset(self) -> Peer:
        old = self.sessions
        sessions = self.rotate()
        self.end(old)
        self.restarts += 1
        log.warning("transfer engine process %d started (restart %d); new sessions %s", self.pid, self.restarts, label(sessions))
        return sessions

    def _spawn(self) -> EngineProcess:
        """A new engine process with every region mapped and registered, on ports no process
        of this transport had (lifecycle lock held)."""
        for attempt in range(1, SPAWN_TRIES + 1):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for sock in (ours, theirs):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            # Forked by one thread that lives as long as this transport: the process dies with
            # the thread that started it (PR_SET_PDEATHSIG), and the pump's ends before close().
            proc = self._spawner.submit(_start_process, theirs.fileno()).result()
            theirs.close()
            ours.settimeout(START_TIMEOUT)
            fd, offset = _backing(self.scratch, SCRATCH_BYTES)
            try:
                start = Start(msgspec.json.encode(self.config), Region(self.scratch, SCRATCH_BYTES, offset), replacing=bool(self.ports))
                reply = self._exchange(ours, start, fd)
            finally:
                os.close(fd)
            sessions, ports = tuple(reply.sessions), frozenset(reply.ports)
            reused = ports & self.ports
            self.ports |= ports
            for region, region_fd in self._regions.values():
                if reply.ok and not reused:
                    reply = self._exchange(ours, Register(0, region), region_fd)
            if reply.ok and not reused:
                ours.settimeout(None)
                engine = EngineProcess(proc, ours, sessions, ports)
                with self._state:
                    self._lost_below = self._next_handle  # a dead predecessor's unsettled handles stay failed
                threading.Thread(target=self._read, args=(engine,), name="pdxfer-engine-reader", daemon=True).start()
                return engine
            _kill(EngineProcess(proc, ours, sessions, ports))
            if reused:
                log.warning("transfer engine process listened on %s, which an ended one had (try %d); starting another", sorted(reused), attempt)
                continue
            if not reply.taken:
                raise Unsupported(f"the transfer engine's process could not start: {reply.error}")
            log.warning("transfer engine process: the daemon's memory at %s is taken in that process (try %d); starting another", reply.error, attempt)
        raise Unsupported(f"{SPAWN_TRIES} transfer engine processes in a row had the daemon's memory addresses or an ended "
                          "process's ports taken; run with --transfer-engine-process inline, or restart the daemon")

    def _exchange(self, sock: socket.socket, msg, fd: int) -> Reply:
        """One request and its reply, before the reader thread runs."""
        socket.send_fds(sock, [self._encoder.encode(msg)], [fd])
        try:
            data = sock.recv(MAX_PACKET)
        except (OSError, socket.timeout) as exc:
            return Reply(0, error=f"no answer ({exc})", ok=False)
        if not data:
            return Reply(0, error="it exited (see the log lines above)", ok=False)
        return self._decoder.decode(data)

    def close(self) -> None:
        self._closing = True
        with self._lifecycle:
            with self._state:
                current, self._current = self._current, None
                self._lost_below = self._next_handle
            for engine in [*self._retiring.values(), *([current] if current else [])]:
                _stop(engine)
            self._retiring.clear()
            for _, fd in self._regions.values():
                os.close(fd)
            self._regions.clear()
        self._spawner.shutdown()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    # --- the readers, one per process

    def _read(self, engine: EngineProcess) -> None:
        while True:
            try:
                data = engine.sock.recv(MAX_PACKET)
            except OSError:
                data = b""
            if not data:
                break
            msg = self._decoder.decode(data)
            if isinstance(msg, Settled):
                statuses = map(_STATUS.__getitem__, np.frombuffer(msg.statuses, np.int8).tolist())
                self._settled.update(zip(np.frombuffer(msg.handles, np.int64).tolist(), statuses))
                continue
            waiter = self._waiting.pop(msg.req, None)
            if waiter is not None:
                waiter.set_result(msg)
        with self._state:
            if engine.ending:
                return  # ended on purpose
            engine.ending = True
            current = engine is self._current
            if current:
                self._current = None
                self._lost_below = self._next_handle
                waiting, self._waiting = self._waiting, {}
            else:
                self._retiring.pop(engine.sessions, None)
                waiting = {}
        for waiter in waiting.values():
            waiter.set_exception(EngineProcessLost("the transfer engine process exited"))
        code = engine.proc.wait()
        engine.sock.close()
        if self._closing:
            return
        log.error("transfer engine process %d ended (%s): nothing sent to its sessions %s can land any more%s", engine.proc.pid,
                  exit_status(code), label(engine.sessions), "; its writes in flight are lost, starting another" if current else "")
        self.on_lost(engine.sessions, current)

    # --- requests

    def _call(self, msg, fd: int = -1, timeout: float = CALL_TIMEOUT) -> Reply:
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            current = self._current
            if current is None:
                raise EngineProcessLost("the transfer engine process is not running")
            self._waiting[msg.req] = waiter
        data = self._encoder.encode(msg)
        try:
            if fd >= 0:
                socket.send_fds(current.sock, [data], [fd])
            else:
                current.sock.sendall(data)
        except OSError as exc:
            self._waiting.pop(msg.req, None)
            raise EngineProcessLost(str(exc)) from None
        return waiter.result(timeout)

    def register(self, address: int, length: int, populate: bool = True) -> None:
        fd, offset = _backing(address, length)
        region = Region(address, length, offset, populate)
        with self._lifecycle:
            self._regions[address] = (region, fd)
            try:
                reply = self._call(Register(next(self._reqs), region), fd)
            except EngineProcessLost:
                return  # the next process registers it
            if reply.taken:  # rare: a process laid out afresh can take it
                log.warning("transfer engine process: the daemon's memory at %s is taken there; replacing the process", reply.error)
                os.kill(self.pid, signal.SIGKILL)
                return
            if not reply.ok:
                del self._regions[address]
                os.close(fd)
                raise Unsupported(f"transfer engine refused to register {length} bytes at {address:#x}: {reply.error}")

    def unregister(self, address: int) -> None:
        """From the current process only: one still receiving for old sessions maps the
        file on its own, so the daemon letting its mapping go harms nothing there."""
        with self._lifecycle:
            entry = self._regions.pop(address, None)
            if entry is None:
                return
            try:
                self._call(Unregister(next(self._reqs), address))
            except EngineProcessLost:
                pass
            finally:
                os.close(entry[1])

    def submit(self, peer: Peer, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        count = len(src)
        with self._state:
            current = self._current
            if current is None:
                return [0] * count
            first = self._next_handle
            self._next_handle += count
        sessions = list(peer)
        try:
            for at in range(0, count, BLOCKS_PER_SUBMIT):
                end = min(count, at + BLOCKS_PER_SUBMIT)
                arrays = (np.array(x[at:end], np.int64).tobytes() for x in (src, dst, length))
                current.sock.sendall(self._encoder.encode(Submit(first + at, sessions, *arrays)))
        except OSError:
            pass  # it died meanwhile: the reader settles these handles as lost
        return list(range(first, first + count))

    def poll(self, handle: int) -> Status:
        status = self._settled.pop(handle, None)
        if status is not None:
            return status
        return Status.FAILED if handle < self._lost_below else Status.PENDING

    def probe(self, peer: Peer, dst: int) -> bool:
        try:
            return self._call(Probe(next(self._reqs), list(peer), dst), timeout=PROBE_TIMEOUT + 10).ok
        except (EngineProcessLost, concurrent.futures.TimeoutError):
            return False


def _start_process(fd: int) -> subprocess.Popen:
    with normal_policy():  # the engine's threads must not inherit a yielding daemon's SCHED_IDLE
        return subprocess.Popen([sys.executable, "-m", "pdxfer.transport.engine_process", str(fd)], pass_fds=[fd])


def _kill(engine: EngineProcess) -> None:
    """End a process at once and wait until it is gone: the kernel has then closed its
    sockets, and whatever they held unread with them."""
    engine.ending = True
    if engine.proc.poll() is None:
        engine.proc.kill()
    engine.proc.wait()
    engine.sock.close()


def _stop(engine: EngineProcess) -> None:
    """End a process: it exits when its socket closes (ending its engines, logging what it
    must), or is killed after STOP_TIMEOUT; either way it is gone once this returns."""
    engine.ending = True
    engine.sock.shutdown(socket.SHUT_RDWR)
    engine.sock.close()
    _end(engine.proc)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

