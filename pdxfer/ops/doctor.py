"""``pdxfer doctor``: check what a daemon needs on this host, and say how to fix what fails.

Each check prints OK, WARN, FAIL (or SKIP when it does not apply) with what it found
and, unless OK, how to fix it; the command exits 1 if any check failed. Settings
(protocol, device, host, ports, runtime directory) are read like ``pdxfer serve``
reads them: flags, then PDXFER_* variables, then --config, then defaults.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from ..transport.mooncake import installed_release
from .hostchecks import (
    Check,
    Settings,
    check_engine,
    check_cpu_yield,
    check_engine_env,
    check_gpu,
    check_host,
    check_libraries,
    check_npu,
    check_port,
    check_protocols,
    check_rdma,
    check_runtime_dir,
    check_shm,
    gpu_facts,
    npu_facts,
    rdma_devices,
)

DESCRIPTION = """\
Check this host for what a pdxfer daemon needs, and say how to fix each failure:
the Mooncake transfer engine (importable, initialises over tcp on 127.0.0.1, which
protocols it can serve here, a release that acknowledges tcp writes and no
MC_TCP_PROTO=1 in the environment), RDMA devices, libibverbs and libnuma, /dev/shm space
for the engines' pools (--pool-bytes), the runtime directory for the sockets
(owner-only, short enough for socket paths), the bootstrap and HTTP ports, the
GPU or NPU for --device, and, for each daemon found (--daemon, --name, or every
admin socket in the runtime directory), its readiness and each peer's clock skew
and last heartbeat. Options are read like pdxfer serve reads them: flags, then
PDXFER_* environment variables, then --config, then defaults."""

SKEW_WARN_MS = 100.0


# --- running daemons


def check_daemons(args, s: Settings) -> tuple[list[Check], dict[int, str]]:
    """Readiness, clock skew and heartbeats of each daemon found; also the ports they hold."""
    from .inspection import AdminClient, CommandError, admin_sockets, choose_endpoint, command_secret, daemon_name
    from ..core.protocol import AdminInfo, AdminPeers

    named = bool(args.daemon or args.name)
    if named:
        endpoints = [choose_endpoint(args.daemon, args.name, s.runtime_dir)]
    else:
        endpoints = [f"ipc://{p}" for p in admin_sockets(s.runtime_dir)]
        if not endpoints:
            return [Check("daemons", "SKIP", f"no daemon running here (no admin socket in {s.runtime_dir}); --daemon checks one elsewhere")], {}
    checks, live = [], {}
    try:
        secret = command_secret(args.secret_file)
    except CommandError as exc:
        return [Check("daemons", "FAIL", exc.message, "fix --secret-file / PDXFER_CLUSTER_SECRET_FILE")], {}
    for endpoint in endpoints:
        label = daemon_name(endpoint) if endpoint.endswith(".admin.sock") else endpoint
        try:
            with AdminClient(endpoint, secret, args.timeout if named else min(args.timeout, 2.0)) as admin:
                info = admin.call(AdminInfo)
                peers = admin.call(AdminPeers).peers
        except CommandError as exc:
            checks.append(Check(f"daemon {label}", "FAIL" if named else "WARN", exc.message,
                                "start the daemon, or remove the stale socket of one that exited" if not named else "check the endpoint, --secret-file and that the daemon runs"))
            continue
        who = f"{info.role.value} daemon {info.name!r}"
        if info.bootstrap:
            live[int(info.bootstrap.rsplit(":", 1)[1])] = f"{who} (its bootstrap endpoint)"
        if info.config.get("http_port"):
            live[int(info.config["http_port"])] = f"{who} (its /metrics endpoint)"
        checks.append(_readiness(who, info))
        checks.append(_peer_health(who, info, peers))
    return checks, live


def _readiness(who: str, info) -> Check:
    detail = f"{who}: up {_duration(info.uptime)}, incarnation {info.incarnation}, sessions {' '.join(info.sessions)}" + (
        f", bootstrap {info.bootstrap}" if info.bootstrap else "")
    if info.ready:
        return Check(f"daemon {info.name}", "OK", f"{detail}: ready")
    fixes = []
    if any("registered" in w or w == "no engine connected" for w in info.not_ready):
        fixes.append("start the engine beside it and let it register its KV pool and aux buffer (Client.create_kv_pool, create_aux_buffer)")
    if any("transfer engine" in w for w in info.not_ready):
        fixes.append("the transport did not start: see the daemon's log")
    if info.draining:
        fixes.append("it is shutting down (SIGTERM): wait for its replacement")
    return Check(f"daemon {info.name}", "WARN", f"{detail}: not ready: {'; '.join(info.not_ready)}", "; ".join(fixes))


def _peer_health(who: str, info, peers) -> Check:
    name = f"peers of {info.name}"
    if not peers:
        return Check(name, "OK", f"{who} has no peers yet")
    interval = float(info.config.get("heartbeat_interval", 1.0))
    parts, skewed, quiet, unanswered = [], [], [], []
    for p in peers:
        if p.state == "connecting":
            parts.append(f"{p.address} connecting: not welcomed yet, nothing heard for {_duration(p.last_heard)}, {p.rooms} room(s) on it")
            if p.last_heard > 3 * interval:
                unanswered.append(p.address)
            continue
        rtt = f", rtt {p.rtt_ms:.2f}ms" if p.rtt_ms >= 0 else ""
        parts.append(f"{p.address} {p.state}: skew {p.clock_skew_ms:+.2f}ms, last heard {_duration(p.last_heard)} ago{rtt}")
        if abs(p.clock_skew_ms) > SKEW_WARN_MS:
            skewed.append(p.address)
        if p.last_heard > 3 * interval:
            quiet.append(p.address)
    fixes = []
    if skewed:
        fixes.append(f"clocks differ by over {SKEW_WARN_MS:g}ms with {', '.join(skewed)}: run chrony or ntpd on both hosts (timestamps in logs and metrics will not line up)")
    if quiet:
        fixes.append(f"no heartbeat for over {3 * interval:g}s from {', '.join(quiet)}: check the network path and that the peer daemon runs")
    if unanswered:
        fixes.append(f"nothing answers at {', '.join(unanswered)}: is a prefill daemon serving there (its bootstrap address, reachable from here)?")
    return Check(name, "WARN" if fixes else "OK", "; ".join(parts), "; ".join(fixes))


def _duration(seconds: float) -> str:
    from .tables import duration

    return duration(seconds)


# --- the command


def settings(args) -> tuple[Settings, Check]:
    """What the daemon would use: flags, then PDXFER_* variables, then --config, then defaults."""
    from ..core import config as config_mod

    env_role = os.environ.get(config_mod.ENV_PREFIX + "ROLE")
    role = args.role or env_role
    flags = {
        "role": role or "prefill", "protocol": args.protocol, "device": args.device, "host": args.host,
        "bootstrap_port": args.bootstrap_port, "http_port": args.http_port, "runtime_dir": args.runtime_dir,
        "name": args.name, "rdma_devices": args.rdma_devices,
    }
    try:
        cfg = config_mod.load(flags, file=args.config)
        check = Check("configuration", "OK", f"protocol {cfg.protocol}, device {cfg.device}, host {cfg.host}"
                      + (f", role {role}" if role else ", role not given (checking for either)"))
    except (ValueError, OSError) as exc:
        check = Check("configuration", "FAIL", f"pdxfer serve would refuse this configuration: {exc}",
                      "fix the flag, the PDXFER_* variable or the --config file it names")
        try:  # go on with the flags alone, else the defaults
            cfg = config_mod.load(flags, env={})
        except ValueError:
            cfg = config_mod.load({"role": "prefill"}, env={})
    s = Settings(role=role, protocol=cfg.protocol, device=cfg.device, host=cfg.host, bootstrap_port=cfg.bootstrap_port,
                 http_port=cfg.http_port, runtime_dir=cfg.socket_dir, name=args.name or "", rdma_devices=cfg.rdma_devices,
                 pool_bytes=args.pool_bytes, yield_cpu=cfg.yield_cpu, silence_bound=cfg.silence_bound)
    return s, check


def run_checks(args) -> tuple[Settings, list[Check]]:
    s, config_check = settings(args)
    engine, probe = check_engine()
    devices, gpu, npu = rdma_devices(), gpu_facts(), npu_facts()
    daemon_checks, live = check_daemons(args, s)
    checks = [
        config_check,
        engine,
        check_protocols(s, probe, devices, gpu, npu),
        check_engine_env(s, os.environ, installed_release()),
        check_rdma(s, devices),
        check_libraries(),
        check_cpu_yield(s),
        check_shm(s.pool_bytes),
        check_runtime_dir(s),
        check_host(s.host),
        check_port("bootstrap port", "--bootstrap-port", s.host, s.bootstrap_port, live) if s.role != "decode"
        else Check("bootstrap port", "SKIP", "decode daemons open no bootstrap port"),
        check_port("http port", "--http-port", s.host, s.http_port, live),
        check_gpu(s, gpu, probe),
        check_npu(s, npu),
        *daemon_checks,
    ]
    return s, checks


def render(s: Settings, checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"pdxfer doctor: {s.role or 'prefill or decode'} daemon, protocol {s.protocol}, device {s.device}, host {s.host}, runtime dir {s.runtime_dir}"]
    for c in checks:
        lines.append(f"{c.status:<5} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "OK":
            lines.append(f"{'':<5} {'':<{width}}  fix: {c.fix}")
    counts = {status: sum(1 for c in checks if c.status == status) for status in ("OK", "WARN", "FAIL", "SKIP")}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    return "\n".join(lines)


def cmd_doctor(args) -> int:
    from .inspection import CommandError

    try:
        s, checks = run_checks(args)
    except CommandError as exc:
        print(f"pdxfer doctor: {exc.message}", file=sys.stderr)
        return exc.exit_code
    failed = any(c.status == "FAIL" for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(s, checks))
    return 1 if failed else 0
