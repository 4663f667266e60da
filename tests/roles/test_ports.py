"""Every member of a role's port is implemented by the daemon's port for that role and
by the recording one the role tests use: a port missing a method would fail only when
a role first calls it, in a daemon, perhaps on a rare path."""

from __future__ import annotations

import pytest

from pdxfer.core.config import Config
from pdxfer.core.protocol import Role
from pdxfer.daemon.decode_side import DecodeDaemonPort
from pdxfer.daemon.prefill_side import PrefillDaemonPort
from pdxfer.daemon.server import Daemon
from pdxfer.roles.ports import DecodePort, Port, PrefillPort

from .port import RecordingPort


def members(protocol: type) -> set[str]:
    """What a typing.Protocol asks for (methods and attributes), its bases' included."""
    return {name for cls in protocol.__mro__ if Port in cls.__mro__ for name in (*vars(cls), *vars(cls).get("__annotations__", {}))
            if not name.startswith("_")}


def attributes(protocol: type) -> set[str]:
    """The members a port holds as values (which may be None), not methods."""
    return {name for cls in protocol.__mro__ if Port in cls.__mro__ for name in vars(cls).get("__annotations__", {})}


def test_the_ports_ask_for_what_the_roles_do():
    assert members(PrefillPort) == members(Port) | {"send_peer", "submit", "cancel", "after_event"}
    assert members(DecodePort) == members(Port) | {"open_link", "close_link", "send_link", "later", "off_loop", "resolve", "incarnation_of",
                                                   "rotate_sessions", "end_sessions"}
    assert members(Port) == {"clock", "wall", "send_engine", "map_memory", "release_mapping", "same_memory", "observe", "watch_engine",
                             "back_staging"}


@pytest.mark.parametrize("protocol, role, made", [
    (PrefillPort, Role.PREFILL, lambda daemon, observe: PrefillDaemonPort(daemon, observe, None, None, None, "cpu")),
    (DecodePort, Role.DECODE, lambda daemon, observe: DecodeDaemonPort(daemon, observe, None, None)),
])
def test_the_daemon_and_the_recording_port_implement_every_member(protocol, role, made):
    daemon = Daemon(Config(role=role))
    for port in (made(daemon, lambda room, left, now: None), RecordingPort()):
        missing = sorted(name for name in members(protocol) if not hasattr(port, name)
                         or (name not in attributes(protocol) and not callable(getattr(port, name))))
        assert missing == [], f"{type(port).__name__} lacks {missing}"
