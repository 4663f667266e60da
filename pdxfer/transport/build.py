"""Which transport a daemon runs, built from its configuration.

``daemon_transport`` is the daemon's: the transfer engine in a process of its own
(``isolated``, host memory) or in the daemon's (``inline``, device memory, which
another process cannot map by address). ``make_transport`` builds the engine itself,
in whichever process runs it; both check the configuration the same way first.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..core import paths
from ..core.config import Config
from ..core.errors import Unsupported
from . import Peer, Transport

log = logging.getLogger("pdxfer.transport")


def engine_process(cfg: Config) -> str:
    """'child' or 'inline', with 'auto' decided: child for host memory (cpu), inline for
    a device's, whose memory another process cannot map by address."""
    if cfg.transfer_engine_process != "auto":
        return cfg.transfer_engine_process
    return "child" if paths.device_kind(cfg.device) == "cpu" else "inline"


def check(cfg: Config) -> dict[str, str]:
    """Refuse, naming the fix, what the engine could not run with; the environment it starts with."""
    from .mooncake import installed_release

    paths.check_engine_release(cfg.protocol, installed_release(), "this daemon's")
    if engine_process(cfg) == "child" and paths.device_kind(cfg.device) != "cpu":
        raise Unsupported(f"--transfer-engine-process child maps only host memory; with --device {cfg.device} use inline (or auto)")
    fault_spec(cfg)
    return paths.engine_env(cfg.protocol, cfg.tcp_lanes, os.environ)


def fault_spec(cfg: Config):
    if not cfg.inject_faults:
        return None
    from .faults import FaultSpec

    try:
        return FaultSpec.parse(cfg.inject_faults)
    except ValueError as exc:
        raise Unsupported(f"--inject-faults: {exc}") from None


def make_transport(cfg: Config, scratch: int = 0, replacing: bool = False) -> Transport:
    """The transfer engines themselves (``scratch``: a registered-to-be buffer to probe from,
    else their own; ``replacing``: in a process that replaces an ended one, where a fault
    that lasts until a reset is over)."""
    from .mooncake import MooncakeTransport

    engine_env = check(cfg)
    lanes = engine_env.get(paths.TCP_LANES_ENV)
    if lanes and os.environ.get(paths.TCP_LANES_ENV, lanes) != lanes:
        log.warning("tcp_lanes %s overrides %s=%s from the environment (tcp_lanes 0 keeps the environment's)",
                    lanes, paths.TCP_LANES_ENV, os.environ[paths.TCP_LANES_ENV])
    transport = MooncakeTransport(cfg.host, cfg.protocol, cfg.rdma_devices, cfg.transfer_metadata, engine_env,
                                  paths.engine_count(cfg.protocol, cfg.tcp_engines), scratch=scratch)
    spec = fault_spec(cfg)
    if spec is None:
        return transport
    from .faults import FaultInjectingTransport

    return FaultInjectingTransport(transport, spec, repaired=replacing)


def daemon_transport(cfg: Config, on_lost: Callable[[Peer, bool], None]) -> Transport:
    """``on_lost``: called (from another thread) when an isolated engine's process died,
    with its sessions and whether it was the current one."""
    if engine_process(cfg) == "inline":
        return make_transport(cfg)
    from .isolated import IsolatedTransport

    check(cfg)  # here, so that a bad setting is refused before any process starts
    return IsolatedTransport(cfg, on_lost)
