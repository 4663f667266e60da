"""The pure core imports no I/O or concurrency machinery (DESIGN: "The core is pure").
Checked in a fresh interpreter, since this test process has long since imported
asyncio, threading and the rest through pytest and its plugins."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = ["protocol", "errors", "config", "rooms", "slots", "plan", "stamp", "paths", "topology"]
# socket and threading are checked too: today no stdlib or third-party dependency of
# the core (msgspec, numpy, tomllib, zlib) pulls them in. If one ever does indirectly
# (logging, for instance, imports threading), narrow this list to the first four
# and say which import did it.
FORBIDDEN = ["asyncio", "zmq", "mooncake", "torch", "socket", "threading", "uvloop"]


def loaded_after_importing(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    return set(json.loads(out.stdout))


def test_core_imports_nothing_impure():
    loaded = loaded_after_importing([f"pdxfer.{m}" for m in CORE])
    assert {f"pdxfer.{m}" for m in CORE} <= loaded  # the check really imported them
    hits = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert hits == [], f"the pure core imported {hits}"


def test_the_check_can_fail():
    # pump is deliberately not pure (it owns a thread); seeing threading there proves
    # the subprocess check detects an impure import.
    assert "threading" in loaded_after_importing(["pdxfer.pump"])
