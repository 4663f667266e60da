"""Processes on this host, as /proc tells them: whether an engine process still runs
(what lets a daemon fail a killed engine rank's rooms at once instead of at their
timeouts, A10), and which TCP ports a process listens on (what keeps a new transfer
engine off a port an ended one had, transport/isolated.py).

A pid means something only inside its pid namespace, and pids are reused: an engine says
its pid and its namespace (the inode of /proc/self/ns/pid), and the daemon, when it shares
that namespace, opens a pidfd for the process (checking its start time, so that a reused
pid is not taken for it), or where it cannot, remembers the start time and asks for it again."""

from __future__ import annotations

import os
import signal


def exit_status(code: int) -> str:
    """A child's return code in words: the name of the signal that ended it, if one did."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def pid_namespace() -> int:
    """This process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


class EngineWatch:
    """The engine processes a daemon can see, and which of them have gone. Where the
    kernel gives pidfds (Linux 5.3 and later), each watched process has one, readable
    once it exits, for the daemon's event loop to wait on; the others are asked for
    their start time again at every gone()."""

    def __init__(self) -> None:
        self.namespace = pid_namespace()
        self.started: dict[bytes, tuple[int, int]] = {}  # connection -> (pid, start time), asked at every gone()
        self.pidfds: dict[bytes, tuple[int, int]] = {}  # connection -> (pid, its pidfd)

    def add(self, identity: bytes, pid: int, namespace: int) -> bool:
        """Watch a connection's engine; False when this daemon cannot see its process."""
        if not pid or not namespace or namespace != self.namespace:
            return False
        started = start_time(pid)
        if started is None:
            return False
        fd = _pidfd(pid)
        if fd is not None and start_time(pid) == started:  # still the same process once the fd is open
            self.pidfds[identity] = (pid, fd)
        else:
            if fd is not None:
                os.close(fd)
            self.started[identity] = (pid, started)
        return True

    def pidfd(self, identity: bytes) -> int | None:
        """The pidfd that becomes readable when the connection's engine exits, if it has one."""
        held = self.pidfds.get(identity)
        return held[1] if held else None

    def forget(self, identity: bytes) -> int:
        """Stop watching the connection's engine through its pidfd, which is closed (the
        loop must wait on it no more); its pid."""
        pid, fd = self.pidfds.pop(identity)
        os.close(fd)
        return pid

    def gone(self) -> list[tuple[bytes, int]]:
        """The connections watched without a pidfd whose process exited since (connection,
        pid); each told once."""
        out = [(identity, pid) for identity, (pid, started) in self.started.items() if start_time(pid) != started]
        for identity, _ in out:
            del self.started[identity]
        return out


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), parents first; those that
    exit while they are read are left out."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as fh:
                    children = [int(c) for c in fh.read().split()]
            except FileNotFoundError:
                continue
            found += children
            queue += children
    return found


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The inodes of process ``pid``'s socket descriptors, as /proc/net's tables name them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_ports(pid: int | str = "self") -> frozenset[int]:
    """The TCP ports (IPv4 and IPv6) that process ``pid`` listens on: its sockets among
    the listening ones of its network namespace."""
    base, inodes = f"/proc/{pid}", socket_inodes(pid)
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{base}/net/{table}") as fh:
                next(fh)  # the header
                for line in fh:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # st 0A: LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except FileNotFoundError:  # no IPv6 here
            continue
    return frozenset(ports)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+), or None where the kernel or Python gives none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
