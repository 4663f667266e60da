"""The transfer engine's own process: what ``isolated.IsolatedTransport`` runs
(``python -m pdxfer.transport.engine_process``).

Why a process of its own: the transfer engine listens on TCP ports that nothing
authenticates, and bytes from anyone can end it. Nine bytes to its handshake port
throw an exception no code of ours can catch (``std::terminate``), and a stranger's
header on its data port names any address to read or write. In the daemon's process
either took every engine on the node off the network. Here only this process dies;
the daemon sees its socket close, fails what was in flight, and starts another.

Memory: the daemon maps engines' pools from files (shared memory), and this process
maps the same files at the same virtual addresses (MAP_FIXED_NOREPLACE), so every
address the daemon plans with, and advertises to peers, is valid here too. An
address already taken here (a rare clash of the two processes' layouts) is reported
as such, and the daemon starts a fresh process, laid out anew.

The messages either way are engine_messages.py's.
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import mmap
import os
import select
import signal
import socket
import sys
from collections import deque

import msgspec
import numpy as np

from ..host import memory
from ..host.processes import listening_ports
from . import Peer, Status
from .engine_messages import MAX_PACKET, Probe, Region, Register, Reply, Request, Settled, Start, Submit, Unregister, Answer

log = logging.getLogger("pdxfer.transport.engine_process")

# Polling, as the pump does (pump.py): a short sleep between rounds while writes are pending.
POLL_MIN, POLL_MAX = 0.00002, 0.0005

_PAGE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_PDEATHSIG = 1
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)  # one descriptor a message


class AddressTaken(Exception):
    pass


def page_span(address: int, length: int) -> tuple[int, int]:
    """The page-aligned (start, length) that covers [address, address + length)."""
    start = address - address % _PAGE
    end = -(-(address + length) // _PAGE) * _PAGE
    return start, end - start


class Mappings:
    """This process's copies of the daemon's regions, at the daemon's addresses."""

    def __init__(self) -> None:
        self._libc = memory.libc()
        self._mapped: dict[int, tuple[int, int]] = {}  # daemon address -> (page start, page length)

    def map(self, region: Region, fd: int) -> None:
        start, length = page_span(region.address, region.length)
        offset = region.offset - (region.address - start)
        flags = mmap.MAP_SHARED | memory.MAP_FIXED_NOREPLACE | (mmap.MAP_POPULATE if region.populate else 0)
        got = self._libc.mmap(start, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
        if got == memory.MAP_FAILED:
            err = ctypes.get_errno()
            if err == errno.EEXIST:
                raise AddressTaken(f"{start:#x}+{length:#x}")
            raise OSError(err, f"cannot map the region at {start:#x}: {os.strerror(err)}")
        if got != start:  # a kernel before 4.17 takes the flag as a hint
            self._libc.munmap(got, length)
            raise AddressTaken(f"{start:#x}+{length:#x} (placed at {got:#x})")
        self._mapped[region.address] = (start, length)

    def unmap(self, address: int) -> None:
        span = self._mapped.pop(address, None)
        if span is not None:
            self._libc.munmap(*span)


class _Writes:
    """The engine's handles behind the daemon's, per peer in submission order."""

    def __init__(self) -> None:
        self.by_peer: dict[Peer, deque] = {}  # peer -> deque of (our handle, engine handle)
        self.settled_handles: list[int] = []
        self.settled_statuses: list[int] = []

    def pending(self) -> bool:
        return any(self.by_peer.values())

    def settle(self, handle: int, status: Status) -> None:
        self.settled_handles.append(handle)
        self.settled_statuses.append(int(status))

    def take_settled(self) -> Settled | None:
        if not self.settled_handles:
            return None
        msg = Settled(np.array(self.settled_handles, np.int64).tobytes(), np.array(self.settled_statuses, np.int8).tobytes())
        self.settled_handles, self.settled_statuses = [], []
        return msg


class Host:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.transport = None
        self.mappings = Mappings()
        self.writes = _Writes()
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Answer) -> None:
        self.sock.sendall(self._encoder.encode(msg))

    def run(self) -> None:
        pause = 0.0
        while True:
            pending = self.writes.pending()
            ready, _, _ = select.select([self.sock], [], [], pause if pending else None)
            if ready and not self._read():
                if self.transport is not None:
                    self.transport.close()
                return
            try:
                progressed = self._poll()
            except Exception:  # a binding's bug: what the engine holds may land or not; once we are gone, it cannot
                log.exception("polling the transfer engine failed; ending this process so that none of its writes can land")
                os._exit(70)
            settled = self.writes.take_settled()
            if settled is not None:
                self.send(settled)
            pause = 0.0 if (ready or progressed) else min(pause * 2, POLL_MAX) or POLL_MIN

    def _read(self) -> bool:
        """Handle every request waiting; False when the daemon is gone."""
        while True:
            try:  # recvmsg itself: socket.recv_fds drops its flags before Python 3.12
                data, ancillary, _, _ = self.sock.recvmsg(MAX_PACKET, _FD_SPACE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            if not data:
                return False
            fds = [fd for level, kind, raw in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
                   for fd in array.array("i", raw[: len(raw) - len(raw) % 4])]
            self._handle(self._decoder.decode(data), fds[0] if fds else -1)

    def _handle(self, msg: Request, fd: int) -> None:
        if isinstance(msg, Submit):
            self._submit(msg)
            return
        try:
            try:
                reply = self._answer(msg, fd)
            finally:
                if fd >= 0:
                    os.close(fd)
        except AddressTaken as exc:
            reply = Reply(getattr(msg, "req", 0), error=f"address taken here: {exc}", taken=True, ok=False)
        except Exception as exc:  # the daemon raises it where it waits
            log.exception("transfer engine process: %s failed", type(msg).__name__)
            reply = Reply(getattr(msg, "req", 0), error=f"{type(exc).__name__}: {exc}", ok=False)
        self.send(reply)

    def _answer(self, msg: Request, fd: int) -> Reply:
        if isinstance(msg, Start):
            from ..core.config import Config
            from ..logs import setup_logging
            from . import build

            cfg = msgspec.json.decode(msg.config, type=Config)
            # Lines like the daemon's own, on the stderr it left us (with JSON, its relay's pipe).
            setup_logging(cfg.log_level, cfg.log_format, f"{cfg.instance} engine", relay=False)
            self.mappings.map(msg.scratch, fd)
            self.transport = build.make_transport(cfg, scratch=msg.scratch.address, replacing=msg.replacing)
            sessions = self.transport.start()
            return Reply(0, sessions=list(sessions), ports=sorted(listening_ports()))
        if isinstance(msg, Register):
            self.mappings.map(msg.region, fd)
            self.transport.register(msg.region.address, msg.region.length)
            return Reply(msg.req)
        if isinstance(msg, Unregister):
            self.transport.unregister(msg.address)
            self.mappings.unmap(msg.address)
            return Reply(msg.req)
        if isinstance(msg, Probe):
            return Reply(msg.req, ok=self.transport.probe(tuple(msg.peer), msg.dst))
        raise TypeError(f"unknown request {msg!r}")

    def _submit(self, msg: Submit) -> None:
        peer = tuple(msg.peer)
        src, dst, length = (np.frombuffer(b, np.int64).tolist() for b in (msg.src, msg.dst, msg.length))
        handles = self.transport.submit(peer, src, dst, length)
        queue = self.writes.by_peer.setdefault(peer, deque())
        for ours, theirs in enumerate(handles, msg.first):
            if theirs:
                queue.append((ours, theirs))
            else:
                self.writes.settle(ours, Status.FAILED)

    def _poll(self) -> bool:
        progressed = False
        for queue in self.writes.by_peer.values():
            while queue:
                ours, theirs = queue[0]
                status = self.transport.poll(theirs)
                if status is Status.PENDING:
                    break
                queue.popleft()
                self.writes.settle(ours, status)
                progressed = True
        return progressed


def main() -> None:
    # The daemon's end of the pair is fd 3 (isolated.py passes it); this process dies with the daemon.
    memory.libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Ctrl-C, or a SIGTERM to the daemon's process group, is the daemon's to act on: it
    # drains, then ends this process. Taken here too, it would end the writes of the
    # drain (a KeyboardInterrupt traceback; "ended, writes lost" from the daemon).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    if os.getppid() == 1:  # the daemon died before we could ask to die with it
        return
    Host(sock).run()


if __name__ == "__main__":
    main()
