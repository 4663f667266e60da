"""Start daemons and simulated engines as child processes and read what they print.

Used by the demo, the benchmark and the integration tests, so all three run the
same processes a deployment runs.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..host.processes import descendants, exit_status


class LaunchError(RuntimeError):
    pass


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")  # the transfer engine's info lines drown ours
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class DaemonProcess:
    role: str
    proc: subprocess.Popen
    ready: dict = field(default_factory=dict)

    @property
    def engine(self) -> str:
        return self.ready["engine"]

    @property
    def bootstrap(self) -> str:
        return self.ready["bootstrap"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def freeze(self, frozen: bool) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) the daemon and every process below it (its
        transfer engine's, whichever runs now) together, as a paused host or cgroup
        would: the engine's writes wait with the daemon. Stopped top down, resumed
        bottom up."""
        pids = [self.pid, *descendants(self.pid)]
        for pid in pids if frozen else reversed(pids):
            try:
                os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
            except ProcessLookupError:  # exited meanwhile (an ended engine's process)
                continue

    def terminate(self) -> None:
        """Ask the daemon to shut down (SIGTERM), without waiting. Once: a second
        SIGTERM during its shutdown ends it at once."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 10.0) -> int:
        """Its exit code, killing it if it has not exited within ``timeout``."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode

    def stop(self, timeout: float = 10.0) -> int:
        self.terminate()
        return self.wait(timeout)


def stop_all(daemons, timeout: float = 10.0) -> list[int]:
    """Stop daemons together, their exit codes in order: each takes a second or two to
    exit (its transfer engines' shutdown), so all are asked before any is waited for."""
    for daemon in daemons:
        daemon.terminate()
    return [daemon.wait(timeout) for daemon in daemons]


def start_daemon(
    role: str, runtime_dir: str, *flags: str, name: str = "", stderr=None, timeout: float = 30.0, env: dict | None = None,
    own_group: bool = False,
) -> DaemonProcess:
    """Run ``pdxfer serve`` and wait for its ready line (``env``: extra variables;
    ``own_group``: in a process group of its own, as a shell's job is)."""
    name = name or role
    argv = [sys.executable, "-m", "pdxfer", "serve", "--role", role, "--name", name, "--runtime-dir", runtime_dir]
    if role == "prefill" and "--bootstrap-port" not in flags:
        argv += ["--bootstrap-port", "0"]
    proc = subprocess.Popen(argv + list(flags), stdout=subprocess.PIPE, stderr=stderr, env={**_env(), **(env or {})}, text=True,
                            process_group=0 if own_group else None)
    line = _read_line(proc, timeout)
    if line is None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.returncode is not None and proc.returncode != -signal.SIGKILL:
            raise LaunchError(f"{role} daemon exited with code {proc.returncode} before it was ready")
        raise LaunchError(f"{role} daemon did not become ready within {timeout:g}s")
    daemon = DaemonProcess(role, proc, json.loads(line))
    return daemon


def _read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                rest = proc.stdout.readline()
                return rest or None
            if sel.select(0.1):
                line = proc.stdout.readline()
                if line.startswith("{"):
                    return line
                if not line:
                    return None
        return None
    finally:
        sel.close()


def sim_argv(role: str, engine: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdxfer.tools.sim", role, "--engine", engine, *flags]


def start_sim(role: str, engine: str, *flags: str, stderr=None) -> subprocess.Popen:
    return subprocess.Popen(sim_argv(role, engine, *flags), stdout=subprocess.PIPE, stderr=stderr, env=_env(), text=True)


def read_events(procs: dict[str, subprocess.Popen], on_event=None, timeout: float = 600.0,
                watch: dict[str, subprocess.Popen] | None = None) -> dict[str, dict]:
    """Read JSON lines from every process until all exit; return each one's last
    ``summary`` event, calling ``on_event(name, event)`` for every line. A process of
    ``watch`` (the daemons the engines use) that exits first ends it at once."""
    sel = selectors.DefaultSelector()
    for name, proc in procs.items():
        sel.register(proc.stdout, selectors.EVENT_READ, name)
    summaries: dict[str, dict] = {}
    open_streams = len(procs)
    deadline = time.monotonic() + timeout
    try:
        while open_streams and time.monotonic() < deadline:
            for key, _ in sel.select(0.5):
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "summary":
                    summaries[key.data] = event
                if on_event is not None:
                    on_event(key.data, event)
            gone = [(name, proc.returncode) for name, proc in (watch or {}).items() if proc.poll() is not None]
            if gone and open_streams:
                for proc in procs.values():
                    proc.kill()
                raise LaunchError("; ".join(f"{name} ended ({exit_status(code)}) while the simulated engines ran" for name, code in gone))
    finally:
        sel.close()
    if open_streams:
        for proc in procs.values():
            proc.kill()
        raise LaunchError(f"simulated engines did not finish within {timeout:g}s")
    for proc in procs.values():
        proc.wait()
    return summaries
