"""Two network namespaces joined by a veth pair, and pdxfer daemons started inside them.

    namespace P (prefill)  10.77.1.1/24  <== veth ==>  10.77.1.2/24  namespace D (decode)

Each pair lives in its own namespaces, so the addresses never clash with another
pair (or another test run) on the host; only the names, which carry the pid, must be
unique. Daemons run as ``ip netns exec NS python -m pdxfer serve --host ADDR ...``
(``ip netns exec`` execs the command, so the Popen pid is the daemon's). Their engine
sockets are ipc:// paths on the shared filesystem and the engines' pools live in
/dev/shm, which every namespace shares, so engine clients in the test process reach
them as usual. Needs root and iproute2; ``unavailable()`` says why not.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time

from pdxfer.tools.launch import DaemonProcess

_ids = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str:
    """Why network namespaces cannot be used here, or "" if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    sweep_stale()
    name = f"pdxchk{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        a, b = f"pdxc{os.getpid()}a", f"pdxc{os.getpid()}b"
        pair = _ip("link", "add", a, "type", "veth", "peer", "name", b, check=False)
        if pair.returncode != 0:
            return f"cannot create a veth pair: {pair.stderr.strip()}"
        _ip("link", "del", a, check=False)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip: {exc}"
    finally:
        _ip("netns", "del", name, check=False)


_OURS = re.compile(r"^pdx[pd](\d+)x\d+$")


def sweep_stale() -> list[str]:
    """Delete namespaces a killed test run left behind (named for a pid that is gone)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for name in (line.split()[0] for line in listed if line.strip()):
        match = _OURS.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class NetPair:
    PREFILL_ADDR = "10.77.1.1"
    DECODE_ADDR = "10.77.1.2"

    def __init__(self) -> None:
        tag = f"{os.getpid()}x{next(_ids)}"  # the pid lets sweep_stale() tell leftovers apart
        self.ns_prefill = f"pdxp{tag}"
        self.ns_decode = f"pdxd{tag}"
        self.veth_prefill = f"vp{tag}"[:15]
        self.veth_decode = f"vd{tag}"[:15]
        self.created: list[str] = []

    def create(self) -> "NetPair":
        try:
            for ns in (self.ns_prefill, self.ns_decode):
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.veth_prefill, "type", "veth", "peer", "name", self.veth_decode)
            for ns, dev, addr in (
                (self.ns_prefill, self.veth_prefill, self.PREFILL_ADDR),
                (self.ns_decode, self.veth_decode, self.DECODE_ADDR),
            ):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise RuntimeError(f"setting up namespaces failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from None
        return self

    def destroy(self) -> None:
        """Delete both namespaces (their veth ends go with them). Safe to call twice."""
        _ip("link", "del", self.veth_prefill, check=False)  # only if it never left the root namespace
        while self.created:
            _ip("netns", "del", self.created.pop(), check=False)

    def set_link(self, up: bool) -> None:
        """Take the decode's end of the veth down (a partition: the prefill's end loses its carrier) or up."""
        _ip("-n", self.ns_decode, "link", "set", self.veth_decode, "up" if up else "down")

    def prefix(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_daemon_in(ns: str, role: str, runtime_dir: str, *flags: str, name: str, stderr, timeout: float = 30.0) -> DaemonProcess:
    """Like pdxfer.tools.launch.start_daemon, inside network namespace ``ns``."""
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "pdxfer", "serve", "--role", role, "--name", name,
            "--runtime-dir", runtime_dir, *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=_env(), text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(0.1):
                line = proc.stdout.readline()
                if line.startswith("{"):
                    return DaemonProcess(role, proc, json.loads(line))
                if not line:
                    break
    finally:
        sel.close()
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{role} daemon in namespace {ns} did not become ready (exit code {proc.returncode})")
