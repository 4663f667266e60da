"""What ``pdxfer serve`` makes sure of before any transfer engine starts: each failure
here would otherwise end in a traceback after the engines started, a hang, or a
daemon that runs but is not what it says. The judgements are doctor's
(hostchecks.py); this module runs them for one configuration, creates the runtime
directory, and holds the daemon's name for its life.

A name is held by an flock on RUNTIME_DIR/NAME.lock, which holds the daemon's pid.
The kernel drops the lock when the process ends, however it ends, so a daemon that
was killed leaves a stale socket that its successor may replace, and a live one
leaves sockets nobody else may unlink.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket

from ..core.config import Config
from ..core.errors import Unsupported
from ..core.protocol import Role
from ..ops import hostchecks
from ..ops.hostchecks import Check


def settings(cfg: Config) -> hostchecks.Settings:
    return hostchecks.Settings(
        role=cfg.role.value, protocol=cfg.protocol, device=cfg.device, host=cfg.host, bootstrap_port=cfg.bootstrap_port,
        http_port=cfg.http_port, runtime_dir=cfg.socket_dir, name=cfg.instance, rdma_devices=cfg.rdma_devices, pool_bytes=0,
    )


def ipc_paths(cfg: Config) -> list[tuple[str, str]]:
    """(flag, socket path) of each ipc endpoint the daemon binds."""
    endpoints = (("--engine-endpoint", cfg.engine_address), ("--admin-endpoint", cfg.admin_address))
    return [(flag, address[len("ipc://") :]) for flag, address in endpoints if address.startswith("ipc://")]


def check_admin_writes(cfg: Config) -> Check:
    """Operator actions (fail a room, drain or cut a peer) over TCP need the cluster
    secret: without it the admin API takes them from anyone who reaches the port, where
    the default ipc socket lies in an owner-only directory."""
    if not (cfg.admin_writes and cfg.admin_address.startswith("tcp://") and not cfg.cluster_secret_file):
        return Check("admin endpoint", "OK", f"{cfg.admin_address}, {'writes allowed' if cfg.admin_writes else 'read-only'}")
    return Check("admin endpoint", "FAIL",
                 f"--admin-writes on --admin-endpoint {cfg.admin_address} without --cluster-secret-file: anyone who reaches that port "
                 "could fail rooms and drain or cut peers",
                 "give --cluster-secret-file (operators then pass the same file with --secret-file), or leave --admin-endpoint at its "
                 "default ipc:// socket, or drop --admin-writes")


def host_checks(cfg: Config, engine_needed: bool) -> list[Check]:
    """Everything about this host and configuration, before the name is taken."""
    s = settings(cfg)
    found = [hostchecks.check_engine_installed()] if engine_needed else []
    found += [hostchecks.check_host(cfg.host), hostchecks.check_runtime_dir(s), check_admin_writes(cfg)]
    for flag, path in ipc_paths(cfg):
        if os.path.dirname(path) != cfg.socket_dir.rstrip("/"):
            found.append(hostchecks.check_socket_dir("socket dir", flag, os.path.dirname(path) or ".", path))
    if cfg.protocol == "rdma":
        found.append(hostchecks.check_rdma(s, hostchecks.rdma_devices()))
    return found


def port_checks(cfg: Config) -> list[Check]:
    found = [hostchecks.check_port("http port", "--http-port", cfg.host, cfg.http_port, {})]
    if cfg.role is Role.PREFILL:  # only a prefill listens for peers
        found.insert(0, hostchecks.check_port("bootstrap port", "--bootstrap-port", cfg.host, cfg.bootstrap_port, {}))
    return found


def refuse_failed(checks: list[Check]) -> None:
    failed = [c for c in checks if c.status == "FAIL"]
    if failed:
        raise Unsupported(" | ".join(f"{c.detail}; fix: {c.fix}" for c in failed))


class NameLock:
    """This daemon's hold on its name in the runtime directory (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def acquire(self, instance: str) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a directory on a read-only filesystem, say
            raise Unsupported(f"cannot create {self.path}: {exc.strerror}; fix: choose a --runtime-dir on a writable filesystem") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Unsupported(f"cannot lock {self.path}: {exc.strerror}; fix: choose another --runtime-dir") from None
            raise Unsupported(
                f"a pdxfer daemon named {instance!r} is already running here (pid {holder}, holding {self.path}); "
                f"fix: give this one another --name, or stop pid {holder} first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Drop the lock, after the daemon removed its sockets. The file stays: removing
        it would let a daemon that opened it just before lock a file no one else sees."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def refuse_live_sockets(cfg: Config) -> None:
    """A socket someone answers on belongs to a live process (a daemon of another name
    given the same --engine-endpoint, or one from before name locks): never unlinked."""
    for flag, path in ipc_paths(cfg):
        if not os.path.exists(path):
            continue
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
            except OSError:
                continue  # stale: the daemon that bound it is gone, and replacing it is safe
        raise Unsupported(f"{path} ({flag}) is in use by a live process; fix: give this daemon another --name or {flag}")


def prepare(cfg: Config, engine_needed: bool = True) -> NameLock:
    """Refuse, saying what to do, a start that cannot succeed; create the runtime
    directory owner-only when it is missing; take the daemon's name. The caller
    releases the lock once its sockets are gone."""
    refuse_failed(host_checks(cfg, engine_needed))
    try:  # the checks above judge by permission bits; a read-only or special filesystem (/sys) says no only here
        os.makedirs(cfg.socket_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise Unsupported(f"cannot create the runtime directory {cfg.socket_dir}: {exc.strerror}; "
                          "fix: choose a --runtime-dir on a writable filesystem (or unset it: $XDG_RUNTIME_DIR/pdxfer, else /tmp/pdxfer-UID)") from None
    lock = NameLock(os.path.join(cfg.socket_dir, f"{cfg.instance}.lock"))
    lock.acquire(cfg.instance)
    try:
        refuse_live_sockets(cfg)
        refuse_failed(port_checks(cfg))
    except Unsupported:
        lock.release()
        raise
    return lock
