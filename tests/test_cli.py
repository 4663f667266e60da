"""The `pdxfer` command itself, before any subcommand: what a new user types first."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pdxfer
from pdxfer.core.protocol import PROTOCOL_VERSION
from pdxfer.transport.mooncake import installed_engine


def pdxfer_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdxfer", *args], capture_output=True, text=True, timeout=60)


def test_version_names_pdxfer_its_protocol_and_the_transfer_engine():
    out = pdxfer_command("--version")
    assert out.returncode == 0 and not out.stderr, out
    engine = " ".join(installed_engine()) if installed_engine() else "not installed"
    assert out.stdout == f"pdxfer {pdxfer.__version__}, protocol {PROTOCOL_VERSION}, transfer engine {engine}\n", out.stdout
    assert metadata.version("pdxfer") == pdxfer.__version__  # the package's metadata takes it from the same place


def test_no_command_prints_the_help_listing_every_command():
    out = pdxfer_command()
    assert out.returncode == 0 and not out.stderr, out
    assert out.stdout.startswith("usage: pdxfer") and "--version" in out.stdout, out.stdout
    for command in ("serve", "demo", "bench", "proxy", "rooms", "peers", "slots", "top", "doctor"):
        assert f"    {command} " in out.stdout, (command, out.stdout)
