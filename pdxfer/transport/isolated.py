"""A Transport whose transfer engine runs in a process of its own (host.py), so that
whatever ends the engine leaves the daemon serving.

The daemon keeps what a new engine process needs to take over: every registered
region, with a descriptor of the file behind it. When the process dies, the writes it
held settle as FAILED: a dead writer writes no more, the proof a new incarnation of a
daemon gives (decode.py); the pump writes them again once a new process runs. Later
submissions are refused until then, and ``on_lost`` runs so that the daemon asks the
pump for a reset once nothing is in flight; ``reset`` starts a new process with every
region and new sessions.
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
from typing import Callable

import msgspec
import numpy as np

from ..core.config import Config
from ..core.errors import Unsupported
from ..host.cpu_yield import normal_policy
from ..host.memory import SharedMemory, place_mappings_apart
from ..host.processes import exit_status
from . import Peer, Status
from .host import BLOCKS_PER_SUBMIT, MAX_PACKET, SOCKET_BUFFER, Answer, Probe, Region, Register, Reply, Reset, Settled, Start, Submit, Unregister
from .mooncake import PROBE_TIMEOUT, SCRATCH_BYTES

log = logging.getLogger("pdxfer.transport")

START_TIMEOUT = 60.0  # an engine's start, or mapping and registering a large pool (MAP_POPULATE)
CALL_TIMEOUT = 300.0
STOP_TIMEOUT = 5.0
SPAWN_TRIES = 5  # fresh processes tried when the daemon's addresses are taken in one
_STATUS = {int(s): s for s in Status}


class EngineProcessLost(Exception):
    pass


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
    def __init__(self, config: Config, on_lost: Callable[[], None]) -> None:
        self.config = config
        self.on_lost = on_lost  # called from the reader thread when the process died
        self.scratch = 0
        self.sessions: Peer = ()
        self.restarts = 0
        self.pid = 0
        self._lifecycle = threading.Lock()  # start, restart, register, unregister, reset, close
        self._state = threading.Lock()  # the short one: alive, handles, waiters
        self._regions: dict[int, tuple[Region, int]] = {}  # address -> (region, our descriptor)
        self._scratch: SharedMemory | None = None
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._generation = 0
        self._alive = False
        self._closing = False
        self._next_handle = 1
        self._lost_below = 0  # handles below this that never settled were the dead process's
        self._settled: dict[int, Status] = {}
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._reqs = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Answer)

    # --- lifecycle

    def start(self) -> Peer:
        place_mappings_apart()  # where the engine's process has nothing of its own either
        self._scratch = SharedMemory.create(SCRATCH_BYTES, prefix="pdxfer-scratch")
        self.scratch = self._scratch.address
        with self._lifecycle:
            self._spawn()
        return self.sessions

    def reset(self) -> Peer:
        with self._lifecycle:
            if self._alive:
                try:
                    self.sessions = tuple(self._call(Reset(next(self._reqs))).sessions)
                    return self.sessions
                except EngineProcessLost:
                    pass
            self.restarts += 1
            self._spawn()
            log.warning("transfer engine process %d started (restart %d); new sessions %s", self.pid, self.restarts, ",".join(self.sessions))
        return self.sessions

    def _spawn(self) -> None:
        """A new engine process with every region mapped and registered (lifecycle lock held)."""
        self._stop_process()
        for attempt in range(1, SPAWN_TRIES + 1):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for sock in (ours, theirs):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            with normal_policy():  # the engine's threads must not inherit a yielding daemon's SCHED_IDLE
                proc = subprocess.Popen([sys.executable, "-m", "pdxfer.transport.host", str(theirs.fileno())], pass_fds=[theirs.fileno()])
            theirs.close()
            ours.settimeout(START_TIMEOUT)
            fd, offset = _backing(self.scratch, SCRATCH_BYTES)
            try:
                reply = self._exchange(ours, Start(msgspec.json.encode(self.config), Region(self.scratch, SCRATCH_BYTES, offset)), fd)
            finally:
                os.close(fd)
            sessions = tuple(reply.sessions)
            for region, region_fd in self._regions.values():
                if reply.ok:
                    reply = self._exchange(ours, Register(0, region), region_fd)
            if reply.ok:
                ours.settimeout(None)
                self._proc, self._sock, self.pid = proc, ours, proc.pid
                self.sessions = sessions
                with self._state:
                    self._generation += 1
                    self._alive = True
                threading.Thread(target=self._read, args=(ours, proc, self._generation), name="pdxfer-engine-reader", daemon=True).start()
                return
            _end(proc)
            ours.close()
            if not reply.taken:
                raise Unsupported(f"the transfer engine's process could not start: {reply.error}")
            log.warning("transfer engine process: the daemon's memory at %s is taken in that process (try %d); starting another", reply.error, attempt)
        raise Unsupported(f"{SPAWN_TRIES} transfer engine processes in a row had the daemon's memory addresses taken; "
                          "run with --transfer-engine-process inline")

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
            self._stop_process()
            for _, fd in self._regions.values():
                os.close(fd)
            self._regions.clear()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def _stop_process(self) -> None:
        """Let the engine process go: it exits when its socket closes (logging what it must)."""
        with self._state:
            self._alive = False
            self._lost_below = self._next_handle
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            _end(self._proc)
            self._proc = None

    # --- the reader

    def _read(self, sock: socket.socket, proc: subprocess.Popen, generation: int) -> None:
        while True:
            try:
                data = sock.recv(MAX_PACKET)
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
            if generation != self._generation or not self._alive:
                return  # stopped on purpose
            self._alive = False
            self._lost_below = self._next_handle
            waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            waiter.set_exception(EngineProcessLost("the transfer engine process exited"))
        code = proc.wait()
        if self._closing:
            return
        log.error("transfer engine process %d ended (%s): its writes in flight are lost; starting another", proc.pid, exit_status(code))
        self.on_lost()

    # --- requests

    def _call(self, msg, fd: int = -1, timeout: float = CALL_TIMEOUT) -> Reply:
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            if not self._alive:
                raise EngineProcessLost("the transfer engine process is not running")
            self._waiting[msg.req] = waiter
        data = self._encoder.encode(msg)
        try:
            if fd >= 0:
                socket.send_fds(self._sock, [data], [fd])
            else:
                self._sock.sendall(data)
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
            if not self._alive:
                return [0] * count
            first = self._next_handle
            self._next_handle += count
        sessions = list(peer)
        try:
            for at in range(0, count, BLOCKS_PER_SUBMIT):
                end = min(count, at + BLOCKS_PER_SUBMIT)
                arrays = (np.array(x[at:end], np.int64).tobytes() for x in (src, dst, length))
                self._sock.sendall(self._encoder.encode(Submit(first + at, sessions, *arrays)))
        except (OSError, AttributeError):
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


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

