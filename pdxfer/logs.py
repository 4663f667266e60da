"""The daemon's log on stderr: text, or one JSON object per line.

The transfer engine logs through glog, from C++, straight to file descriptor 2: 21 of
a daemon's first 24 lines, most of them routine (a protocol's default allocator, no
RDMA device on a tcp host, a lookup of its own segment before it exists that glog
calls an error). So the daemon points fd 2 at a pipe whose reader, a relay process
running this file, writes each glog line it reads in the daemon's own format (a text
line, or a JSON object) at its own level; the routine ones, and glog's info lines, are
debug (``--log-level debug`` shows them). The daemon's own records go to the real
stderr directly. A process, not a thread: it drains the pipe even after the daemon
died (glog writes a FATAL line, then aborts), and a transfer engine thread writing a
line never waits on Python in the daemon (the GIL, perhaps held by a call into that
engine).

This file imports only the standard library: the relay runs it by path, isolated
(``python -I``), so that nothing beside it shadows a standard module.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

# I1125 19:15:19.439168  5267 transfer_engine_impl.cpp:1046] Metrics reporting is disabled
GLOG_LINE = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ ([^\]\s]+)\] ?(.*)")
GLOG_LEVELS = {"I": "info", "W": "warning", "E": "error", "F": "critical"}
# glog prints this once before its first line when the program never initialised it
# (the engine's Python binding does not): a notice about glog, not about the engine.
GLOG_BANNER = "WARNING: Logging before InitGoogleLogging() is written to STDERR"
# The transfer engine's warnings and errors that every healthy start or stop prints:
# debug, not what their glog level says.
ROUTINE_GLOG = (
    "Using default malloc/free for protocol",  # tcp has no special allocator
    "Memory allocator already initialized",  # a daemon's second engine
    "No RDMA devices found",  # a tcp host (start-up refuses --protocol rdma without devices)
    "Local segment descriptor not found",  # the engine looks up its own segment before it publishes it
)
RELAY_DRAIN_SECONDS = 2.0  # at exit, the most the daemon waits for the relay to write what it read
# Record attributes (logging's ``extra``) that become keys of their own.
KEYS = ("room", "peer")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in KEYS:
            if getattr(record, key, None) is not None:
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def text_format(name: str) -> str:
    prefix = f"[{name}] " if name else ""
    return f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"


def setup_logging(level: str, fmt: str, name: str = "", relay: bool = True) -> None:
    """``relay``: start the relay for fd 2 here (a process whose fd 2 is already a
    relay's pipe, the transfer engine's own, passes False)."""
    stream = relay_native_stderr(level, fmt, name) if relay else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text_format(name)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def relay_native_stderr(level: str, fmt: str, name: str):
    """Point fd 2 (and so sys.stderr: tracebacks, the transfer engine's glog) at a
    pipe into a relay process that writes each line to the real stderr as this
    daemon's log lines are written; returns a stream on the real stderr for this
    process's own records."""
    real = os.dup(2)
    read_end, write_end = os.pipe()
    # close_fds: the relay holds no write end, so it sees EOF once this process is gone.
    relay = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), level, fmt, name], stdin=read_end, stdout=subprocess.DEVNULL,
                             stderr=real, close_fds=True)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    atexit.register(_drain, relay)
    return os.fdopen(real, "w", buffering=1)


def _drain(relay: subprocess.Popen) -> None:
    """At exit, end the pipe and give the relay time to write what it holds: in a
    container the daemon may be PID 1, whose exit kills the relay. Whatever is written
    to fd 2 after this goes to /dev/null: lost, but never a line that is not JSON."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        relay.wait(RELAY_DRAIN_SECONDS)
    except subprocess.TimeoutExpired:
        pass


def native_entry(line: str, ts: float) -> tuple[str, dict]:
    """(level, JSON entry) for one line written to fd 2 by anything but the daemon's
    logging: a glog line keeps its level and source file; anything else (a Python
    traceback, a C library's complaint) is a warning from 'stderr'."""
    match = GLOG_LINE.fullmatch(line)
    if line.startswith("{"):  # already one of ours (the transfer engine's process logs as JSON to this pipe)
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict) and isinstance(entry.get("level"), str):
            return entry["level"], entry
    if match:
        level = "debug" if match[1] == "I" or match[3].startswith(ROUTINE_GLOG) else GLOG_LEVELS[match[1]]
        logger, msg, extra = "mooncake", match[3], {"source": match[2]}
    elif line == GLOG_BANNER:
        level, logger, msg, extra = "debug", "mooncake", line, {}
    else:
        level, logger, msg, extra = "warning", "stderr", line, {}
    return level, {"ts": round(ts, 6), "level": level, "logger": logger, "msg": msg, **extra}


def text_line(line: str, entry: dict, name: str) -> str:
    """A glog line as the daemon's text lines read; anything else (a traceback, the
    transfer engine's process's own text records) as it came."""
    if entry["logger"] != "mooncake":
        return line
    record = logging.makeLogRecord({"name": "mooncake", "levelname": entry["level"].upper(), "created": entry["ts"], "msecs": entry["ts"] % 1 * 1000,
                                    "msg": f"{entry['msg']} ({entry['source']})" if "source" in entry else entry["msg"]})
    return logging.Formatter(text_format(name)).format(record)


def relay(source, out, level: str, fmt: str = "json", name: str = "") -> None:
    """Write each line of ``source`` (bytes) to ``out`` as ``fmt`` says, those below
    ``level`` left out as the daemon's logging leaves its own out, until EOF."""
    least = logging.getLevelName(level.upper())
    for raw in source:
        line = raw.decode(errors="replace").rstrip("\r\n")
        line_level, entry = native_entry(line, time.time())
        if logging.getLevelName(line_level.upper()) >= least:
            out.write((json.dumps(entry) if fmt == "json" else text_line(line, entry, name)) + "\n")
            out.flush()


if __name__ == "__main__":
    # It ends at EOF, once every line is written: a Ctrl-C or SIGTERM meant for the
    # daemon's process group must not end it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    relay(sys.stdin.buffer, sys.stderr, *sys.argv[1:4])
