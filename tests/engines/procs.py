"""An engine in a process of its own, driven over a Unix socket.

Engines start subprocesses, read the environment once at import and keep global
state, so every engine a test uses runs in a fresh interpreter
(``python -m <worker module> <socket path>``), its stdout and stderr in a log file.
The worker answers ``(op, kwargs)`` messages with ``("ok", result)`` or
``("error", traceback)``; its first message says it is ready (or why it is not).
Both sides are here: `Worker` for the test, `serve` for the worker module."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_TAIL_LINES = 60
LOG_LINE_WIDTH = 300


class WorkerError(RuntimeError):
    """A worker died, timed out or raised; the message ends with its log's tail."""


def log_tail(path: str, lines: int = LOG_TAIL_LINES, width: int = LOG_LINE_WIDTH) -> str:
    """The last ``lines`` lines of a log, each cut to ``width`` characters (SGLang
    logs its whole server_args on one line of 10,000)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    tail = text.splitlines()[-lines:]
    return "\n".join(line if len(line) <= width else line[:width] + " [...]" for line in tail)


class Worker:
    """The test's handle on one worker process. `start` returns at once; `ready`
    waits for the engine to come up; `submit` and `result` split a call, so a test
    can have two engines working at once."""

    def __init__(self, name: str, module: str, workdir: str, env: dict[str, str],
                 shm_leaks: tuple[str, ...] = ()):
        self.name = name
        # /dev/shm name prefixes the engine creates and does not unlink: what appears
        # under them while the worker lives is removed once its processes are gone.
        self.shm_leaks = shm_leaks
        self.shm_before: set[str] = set()
        self.module = module
        # Socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
        self.socket_dir = tempfile.mkdtemp(prefix="pdxw-")
        self.socket_path = os.path.join(self.socket_dir, "worker.sock")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.info: object = None

    def start(self) -> None:
        self.shm_before = _shm_names(self.shm_leaks)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, self.socket_path],
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _fail(self, what: str) -> WorkerError:
        return WorkerError(f"{self.name}: {what}\n--- {self.log_path} (tail) ---\n{log_tail(self.log_path)}")

    def _wait(self, timeout: float, what: str) -> object:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} while {what}")
            if time.monotonic() > deadline:
                raise self._fail(f"no answer in {timeout:.0f} s while {what}")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise self._fail(f"closed its socket while {what}") from None
        if status != "ok":
            raise self._fail(f"raised while {what}:\n{value}")
        return value

    def ready(self, timeout: float) -> object:
        """Wait for the engine to be up; what the worker's setup returned."""
        deadline = time.monotonic() + timeout
        while self.conn is None:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise self._fail(f"did not listen in {timeout:.0f} s")
            try:
                self.conn = Client(self.socket_path, family="AF_UNIX")
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.1)
        self.info = self._wait(max(1.0, deadline - time.monotonic()), "starting its engine")
        return self.info

    def submit(self, op: str, **kwargs) -> None:
        self.conn.send((op, kwargs))

    def result(self, timeout: float, what: str = "working") -> object:
        return self._wait(timeout, what)

    def call(self, op: str, timeout: float, **kwargs) -> object:
        self.submit(op, **kwargs)
        return self.result(timeout, f"running {op}")

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to shut its engine down and wait for its whole process
        group (the engine's subprocesses and multiprocessing's resource tracker,
        which unlinks shared memory they leave) to end; past ``timeout``, SIGTERM,
        then SIGKILL."""
        if self.proc is None:
            return
        if self.conn is not None and self.proc.poll() is None:
            try:
                self.conn.send(("shutdown", {}))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                _signal_group(self.proc.pid, sig)
                deadline = time.monotonic() + 5.0
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, or the group stays alive
                time.sleep(0.1)
            if not _group_alive(self.proc.pid):
                break
        self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if not _group_alive(self.proc.pid):
            for name in _shm_names(self.shm_leaks) - self.shm_before:
                _unlink_unused(os.path.join(SHM_DIR, name))


SHM_DIR = "/dev/shm"

PLUGIN_DIST = "pdxfer_engine_tests-0.dist-info"


def plugin_dist(workdir: str, group: str, entries: dict[str, str]) -> str:
    """A directory holding a ``.dist-info`` that declares ``entries`` (name ->
    ``module:function``) in the entry point ``group``: put it on PYTHONPATH and the
    engine loads them in every process, as it would an installed plugin's."""
    root = os.path.join(workdir, "plugins")
    dist = os.path.join(root, PLUGIN_DIST)
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: pdxfer-engine-tests\nVersion: 0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write(f"[{group}]\n")
        f.writelines(f"{name} = {target}\n" for name, target in entries.items())
    return root


def _shm_names(prefixes: tuple[str, ...]) -> set[str]:
    if not prefixes or not os.path.isdir(SHM_DIR):
        return set()
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}


def _unlink_unused(path: str) -> None:
    """Unlink ``path`` unless a process holds it open or mapped (another engine's)."""
    if shutil.which("fuser") and subprocess.run(["fuser", "-s", path]).returncode == 0:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(setup: Callable[[], tuple[object, object]], ops: dict[str, Callable[..., object]],
          shutdown: Callable[[], None]) -> None:
    """The worker side: listen on the path in argv[1], start the engine with
    ``setup() -> (engine, info)``, send ``info`` as the ready message, then answer
    ``ops[op](engine, **kwargs)`` until told to shut down."""
    listener = Listener(sys.argv[1], family="AF_UNIX")
    conn = listener.accept()
    try:
        engine, info = setup()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("ok", info))
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:
            break
        if op == "shutdown":
            break
        try:
            conn.send(("ok", ops[op](engine, **kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    shutdown(engine)
    conn.close()
    listener.close()
