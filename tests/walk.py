"""The way one room's data goes from a prefill rank's send() to Success at its decode
rank: every function of pdxfer's it crosses into, in order, and the files they are in.
Run it (``python -m tests.walk``) to print the route.

How it is measured: a prefill and a decode daemon (each with its transfer engine in a
process of its own) and, in this process, the SGLang backend's two links (a prefill
rank's and a decode rank's, adapters/sglang/link.py). Every process records each call
into a function of pdxfer's (sys.setprofile and threading.setprofile, through a
sitecustomize put first on the daemons' PYTHONPATH). A warm-up room goes first; the
measured room runs from the prefill link's send() of its one chunk to the decode link
reading Success. A function is on the route when it was entered in that window and not
in a quiet window of the same length right after (ticks, heartbeats and the like run in
both); each counts once, in the order first entered. Once the decode daemon holds the
room's Success (it entered ``RoomBook.succeed``, which pushes the status to its engine
first), only the engines' calls count: the decode's ack and the prefill hearing it are
not on the data's way (the push's own functions were counted on their first use). A
comprehension or generator expression is an expression, not a function the data
crosses into (Python 3.12 inlines most of them): not counted. SGLang's own scheduler
calls (conn.py) are not counted: they need the engine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[1] / "pdxfer")

SITECUSTOMIZE = textwrap.dedent('''
    import atexit, json, os, sys, threading, time
    _out, _root = os.environ["WALK_TRACE_DIR"], os.environ["WALK_TRACE_ROOT"]
    _events = []
    def _profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_root):
                _events.append((time.monotonic(), code.co_filename, code.co_qualname, os.getpid()))
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    @atexit.register
    def _dump():
        with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as fh:
            json.dump(_events, fh)
''')


@dataclass
class Route:
    functions: list[tuple[str, str]]  # (file relative to the package's parent, qualname), in order first entered

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(path for path, _ in self.functions))


COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")
SUCCEEDED = "RoomBook.succeed"  # where a daemon's room becomes Success


def _record(events: list, root: str):
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            events.append((time.monotonic(), frame.f_code.co_filename, frame.f_code.co_qualname, os.getpid()))
    return profile


def walk() -> Route:
    import threading

    from pdxfer.core.protocol import Role, RoomState
    from pdxfer.tools.launch import start_daemon, stop_all
    from tests.test_sglang_adapter import Engine, requested, wait_for

    out = tempfile.mkdtemp(prefix="pdx-walk-")
    site = tempfile.mkdtemp(prefix="pdx-walk-site-")
    Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"WALK_TRACE_DIR": out, "WALK_TRACE_ROOT": PACKAGE, "PYTHONPATH": os.pathsep.join([site, *sys.path])}
    runtime = tempfile.mkdtemp(prefix="pdx-")
    quiet = ("--heartbeat-interval", "30", "--inline-kv-bytes", "0")
    daemons = [start_daemon("prefill", runtime, *quiet, "--bootstrap-port", "0", name="wp", env=env),
               start_daemon("decode", runtime, *quiet, name="wd", env=env)]
    events: list = []
    try:
        prefill, decode = Engine(daemons[0], Role.PREFILL), Engine(daemons[1], Role.DECODE)
        for room, measured in ((1, False), (2, True)):
            pages = [3, 4]
            for tensor in prefill.page(pages[0]) + prefill.page(pages[1]):
                tensor.fill_(room)
            requested(prefill, decode, room, [5, 6])
            if measured:
                sys.setprofile(_record(events, PACKAGE))
                threading.setprofile(_record(events, PACKAGE))
            start = time.monotonic()
            prefill.link.send(room, pages, 0, last=True, num_tokens=2 * 16, row=0)
            status = wait_for(decode.link, room, RoomState.SUCCESS)
            end = time.monotonic()
            sys.setprofile(None)
            threading.setprofile(None)
            assert status.state is RoomState.SUCCESS, status
            wait_for(prefill.link, room, RoomState.SUCCESS)
            prefill.link.release(room)
            decode.link.release(room)
        time.sleep(end - start + 0.2)  # the quiet window
        prefill.link.close()
        decode.link.close()
    finally:
        stop_all(daemons)
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as fh:
            events += [tuple(e) for e in json.load(fh)]
    return _route(events, start, end, daemons[1].pid)


def _route(events: list, start: float, end: float, decode_pid: int) -> Route:
    quiet_start, quiet_end = end + 0.1, end + 0.1 + (end - start)
    noise = {(path, name) for t, path, name, _ in events if quiet_start <= t <= quiet_end}
    succeeded = min((t for t, _, name, pid in events if pid == decode_pid and name.endswith(SUCCEEDED) and start <= t <= end), default=end)
    seen: dict[tuple[str, str], float] = {}
    for t, path, name, pid in sorted(events):
        if not start <= t <= end or (path, name) in noise or (path, name) in seen or name.endswith(COMPREHENSIONS):
            continue
        if t > succeeded and pid != os.getpid():
            continue
        seen[(path, name)] = t
    parent = str(Path(PACKAGE).parent) + os.sep
    return Route([(path[len(parent):], name) for path, name in seen])


def main() -> None:
    route = walk()
    for n, (path, name) in enumerate(route.functions, 1):
        print(f"{n:4d}  {path}:{name}")
    print(f"{len(route.functions)} moves over {len(route.files)} files: {', '.join(route.files)}")


if __name__ == "__main__":
    main()
