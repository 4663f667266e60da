"""What ``pdxfer doctor`` checks on the host itself: the transfer engine and the
protocols it can serve here, RDMA devices, libraries, /dev/shm, the runtime
directory, ports, and GPUs or NPUs. Each check returns a Check (OK, WARN, FAIL or
SKIP, what was found, how to fix it); the facts they judge are gathered by small
functions, so the judgement can be tested with facts of another host."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

from ..host.memory import SHM_DIR, available_memory, find_orphans, mapped_after_unlink

SOCKET_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL
ENGINE_PROBE = """
import json
import mooncake.engine as m
engine = m.TransferEngine()
rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
flags = {k: bool(getattr(m, k)) for k in dir(m) if k.startswith("SUPPORT_")}
print(json.dumps({"rc": rc, "port": engine.get_rpc_port() if rc == 0 else 0, "flags": flags}))
"""


@dataclass
class Check:
    name: str
    status: str  # OK, WARN, FAIL, SKIP
    detail: str
    fix: str = ""


@dataclass
class Settings:
    role: str | None
    protocol: str
    device: str
    host: str
    bootstrap_port: int
    http_port: int
    runtime_dir: str
    name: str
    rdma_devices: str
    pool_bytes: int
    yield_cpu: bool = False
    silence_bound: float = 5.0  # Config.silence_bound


def _size(n: float) -> str:
    from .tables import size

    return size(n)


# --- the transfer engine and what it can serve here


def engine_version() -> str:
    from ..transport.mooncake import installed_engine

    found = installed_engine()
    return " ".join(found) if found else "mooncake (version unknown)"


def check_engine(timeout: float = 30.0) -> tuple[Check, dict]:
    """Import the engine and initialise one over tcp on 127.0.0.1, in a child process
    (a broken build can crash or hang; this process must still report)."""
    env = {**os.environ, "GLOG_minloglevel": "2"}
    try:
        out = subprocess.run([sys.executable, "-c", ENGINE_PROBE], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Check("transfer engine", "FAIL", f"initialising a TransferEngine over tcp on 127.0.0.1 did not finish within {timeout:g}s",
                     "run the probe by hand to see where it hangs: python -c 'import mooncake.engine'"), {}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        error = next((line for line in reversed(out.stderr.splitlines()) if "Error" in line), out.stderr.strip()[-300:] or f"exit code {out.returncode}")
        return Check("transfer engine", "FAIL", f"cannot import or start mooncake.engine: {error}", _engine_fix(error)), {}
    probe = json.loads(lines[-1])
    if probe["rc"] != 0:
        errors = [line for line in out.stderr.splitlines() if line.startswith("E")][-2:]
        return Check("transfer engine", "FAIL", f"{engine_version()} imports, but initialize(tcp on 127.0.0.1) returned {probe['rc']}: {' / '.join(errors) or 'no error line'}",
                     "check that 127.0.0.1 is up and that the engine may open TCP ports (it listens on a free port)"), probe
    return Check("transfer engine", "OK", f"{engine_version()} imports; a TransferEngine initialised tcp on 127.0.0.1 (RPC port {probe['port']})"), probe


def _engine_fix(error: str) -> str:
    if "libibverbs" in error or "libnuma" in error:
        return "apt-get install libibverbs1 libnuma1: the transfer engine links against both, even for tcp"
    if "cuda" in error.lower():
        return "this is the CUDA build on a host without CUDA: pip install mooncake-transfer-engine-non-cuda instead (make deps picks the right one)"
    return f"{engine_install_command()} (make deps picks the right build)"


def cuda_host() -> bool:
    """Whether the transfer engine's CUDA build can import here: a driver (nvidia-smi)
    and libcudart, as the Makefile judges it."""
    return bool(shutil.which("nvidia-smi") and ctypes.util.find_library("cudart"))


def engine_install_command() -> str:
    """The command that installs the transfer engine build this host can import: the
    wheel itself, which any environment can install (pdxfer's extras mooncake and
    mooncake-cpu carry only it, and pdxfer installs from its checkout, not from a
    package index)."""
    from ..transport.mooncake import ENGINE_WHEELS

    cuda, cpu = ENGINE_WHEELS
    return f"pip install {cuda if cuda_host() else cpu}"


def check_engine_installed() -> Check:
    """Is the transfer engine there at all, and a build this host can import (without
    importing it: a daemon imports it later, where its child process may run it)?"""
    import importlib.util

    from ..transport.mooncake import ENGINE_WHEELS, installed_engine

    try:
        found = importlib.util.find_spec("mooncake") is not None
    except ImportError:
        found = False
    where = "this host has CUDA" if cuda_host() else "this host has no CUDA (no nvidia-smi or libcudart)"
    if not found:
        return Check("transfer engine", "FAIL", f"the Mooncake transfer engine is not installed for {sys.executable}",
                     f"{engine_install_command()} ({where}); pdxfer alone installs no transfer engine")
    wheel = installed_engine()
    if wheel is not None and wheel[0] == ENGINE_WHEELS[0] and not cuda_host():  # the CUDA build
        return Check("transfer engine", "FAIL", f"the transfer engine installed is the CUDA build ({' '.join(wheel)}), which does not "
                     "import on a host without CUDA, and this one has no nvidia-smi or libcudart",
                     f"pip uninstall -y {wheel[0]} && {engine_install_command()}")
    return Check("transfer engine", "OK", "the mooncake package is installed")


def rdma_devices() -> dict[str, list[str]]:
    """Device -> port states ('1: ACTIVE', ...) from /sys/class/infiniband."""
    found = {}
    for path in sorted(glob.glob("/sys/class/infiniband/*")):
        states = []
        for port in sorted(glob.glob(os.path.join(path, "ports", "*"))):
            try:
                with open(os.path.join(port, "state")) as fh:
                    states.append(f"port {os.path.basename(port)} {fh.read().strip().split(':')[-1].strip()}")
            except OSError:
                states.append(f"port {os.path.basename(port)} unknown")
        found[os.path.basename(path)] = states
    return found


def check_rdma(s: Settings, devices: dict[str, list[str]]) -> Check:
    needed = s.protocol == "rdma"
    if not devices:
        if needed:
            return Check("rdma devices", "FAIL", "none under /sys/class/infiniband, and --protocol is rdma",
                         "install the NIC's RDMA driver and rdma-core (ibv_devices lists what the kernel sees), or use --protocol tcp")
        return Check("rdma devices", "OK", f"none under /sys/class/infiniband (not needed for --protocol {s.protocol})")
    text = "; ".join(f"{name} ({', '.join(states) or 'no ports'})" for name, states in devices.items())
    if needed:
        wanted = [d.strip() for d in s.rdma_devices.split(",") if d.strip()]
        missing = [d for d in wanted if d not in devices]
        if missing:
            return Check("rdma devices", "FAIL", f"--rdma-devices names {', '.join(missing)}, not on this host; present: {text}",
                         f"set --rdma-devices to some of: {', '.join(devices)}")
        active = [n for n, states in devices.items() if any(st.endswith("ACTIVE") for st in states) and (not wanted or n in wanted)]
        if not active:
            return Check("rdma devices", "FAIL", f"no port is ACTIVE: {text}", "check the cable and the switch port; ibstat shows link state")
    return Check("rdma devices", "OK", text)


def check_protocols(s: Settings, probe: dict, devices: dict, gpu: dict, npu: dict) -> Check:
    flags = probe.get("flags", {})
    if not probe or probe.get("rc") != 0:
        return Check("protocols", "FAIL", "none: the transfer engine did not start (see above)", "fix the transfer engine first")
    cuda_missing = [why for ok, why in (
        (flags.get("SUPPORT_CUDA"), "this engine build has no CUDA support"),
        (gpu["cudart"], "no libcudart"),
        (gpu["count"] > 0, "no GPU visible"),
    ) if not ok]
    ascend_missing = [why for ok, why in ((npu["acl"], "no libascendcl (CANN)"), (npu["devices"], "no /dev/davinciN")) if not ok]
    reasons = {
        "tcp": [],
        "rdma": [] if devices else ["no RDMA devices under /sys/class/infiniband"],
        "nvlink": cuda_missing,
        "intranode_nvlink": cuda_missing + ([] if flags.get("SUPPORT_INTRA_NVLINK") else ["engine built without intra-node NVLink"]),
        "ascend": ascend_missing,
        "hixl": ascend_missing,
    }
    usable = [p for p, why in reasons.items() if not why]
    unusable = "; ".join(f"{p} ({', '.join(why)})" for p, why in reasons.items() if why)
    detail = f"usable here: {', '.join(usable)}" + (f"; not here: {unusable}" if unusable else "")
    if s.protocol not in usable:
        return Check("protocols", "FAIL", f"--protocol {s.protocol} cannot run here. {detail}",
                     f"provide what {s.protocol} lacks ({', '.join(reasons[s.protocol])}), or use one of: {', '.join(usable)}")
    return Check("protocols", "OK", f"{detail} (asked for {s.protocol})")


def check_engine_env(s: Settings, env, release: str) -> Check:
    """What would break A3 over tcp: the engine's unacknowledged framing asked for in
    the environment, or an engine release from before acknowledged writes."""
    from ..core.errors import Unsupported
    from ..core.paths import TCP_LEGACY_PROTO_ENV, check_engine_release, check_tcp_framing

    try:
        check_tcp_framing(s.protocol, env)
    except Unsupported as exc:
        return Check("engine settings", "FAIL", exc.message, f"unset {TCP_LEGACY_PROTO_ENV} (the daemon refuses to start with it)")
    try:
        check_engine_release(s.protocol, release, "this host's")
    except Unsupported as exc:
        return Check("engine settings", "FAIL", exc.message, "pip install -U mooncake-transfer-engine-non-cuda (or the CUDA build); make deps pins one")
    proto = f"{TCP_LEGACY_PROTO_ENV} {'is not set' if TCP_LEGACY_PROTO_ENV not in env else 'is ' + repr(env[TCP_LEGACY_PROTO_ENV])}"
    return Check("engine settings", "OK", f"{proto}; engine release {release or 'unknown'}")


# --- host resources


def check_cpu_yield(s: Settings) -> Check:
    """Can a daemon here give the cores to its transfer engine's threads (--yield-cpu)?"""
    from ..host import cpu_yield

    if not s.yield_cpu:
        return Check("cpu yield", "SKIP", "not asked for (--yield-cpu): the daemon's threads keep the normal policy")
    why = cpu_yield.why_not(True, s.silence_bound)
    if why:
        advice = "; with CAP_SYS_NICE they would yield the cores to the transfer engine" if "CAP_SYS_NICE" in why else ""
        return Check("cpu yield", "OK", f"daemons here keep the normal policy for their own threads: {why}{advice}")
    return Check("cpu yield", "OK", "daemons here run their own threads under SCHED_IDLE once the transfer engine has started, "
                 "and can take the cores back (CAP_SYS_NICE or RLIMIT_NICE)")


def check_libraries() -> Check:
    libs = {"libibverbs1": ctypes.util.find_library("ibverbs"), "libnuma1": ctypes.util.find_library("numa")}
    missing = [pkg for pkg, path in libs.items() if not path]
    if missing:
        return Check("system libraries", "FAIL", f"missing: {', '.join(missing)}",
                     f"apt-get install {' '.join(missing)} (the transfer engine links against libibverbs and libnuma, even for tcp)")
    return Check("system libraries", "OK", ", ".join(f"{path}" for path in libs.values()))


def check_shm(need: int, path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check("shared memory", "FAIL", f"{path}: {exc.strerror}", "CPU pools live in /dev/shm: mount a tmpfs there")
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    available = available_memory()
    pools = [os.path.join(path, n) for n in os.listdir(path) if n.startswith("pdxfer-")]
    used = sum(os.path.getsize(p) for p in pools if os.path.isfile(p))
    orphans = find_orphans() if path == SHM_DIR else {}
    orphaned = (f" ({len(orphans)} of them, {_size(sum(orphans.values()))}, left by engines that exited: "
                "the next pool made here removes them)") if orphans else ""
    # Pools whose names are gone but which a daemon still maps hold memory no listing shows.
    held = mapped_after_unlink() if path == SHM_DIR else {}
    unlinked = ("; still mapped though removed from the listing (pools of engines that exited, freed when a new engine "
                "registers its pools with that daemon or the daemon stops): "
                + ", ".join(f"{_size(n)} by pid {pid}" for pid, n in sorted(held.items()))) if held else ""
    detail = (f"{path}: {_size(free)} free of {_size(total)}"
              f"{'' if available is None else f', {_size(available)} of memory available'}; "
              f"{len(pools)} pdxfer pool(s) use {_size(used)}{orphaned}{unlinked}; engines need about {_size(need)} (--pool-bytes)")
    if free < need:
        return Check("shared memory", "FAIL", detail,
                     "give /dev/shm more room: docker run --shm-size=SIZE; in Kubernetes an emptyDir with medium: Memory "
                     "and a sizeLimit mounted at /dev/shm (deploy/k8s/base/worker.yaml does this)")
    if available is not None and available < need:  # tmpfs pages are RAM: pools this big would meet the OOM killer
        return Check("shared memory", "FAIL", detail, "free memory on this host, or give the engines smaller pools (--pool-bytes)")
    return Check("shared memory", "OK", detail)


def check_runtime_dir(s: Settings) -> Check:
    path = s.runtime_dir
    names = [s.name] if s.name else [s.role] if s.role else ["prefill", "decode"]
    longest = max((os.path.join(path, f"{n}.engine.sock") for n in names), key=len)
    return check_socket_dir("runtime dir", "--runtime-dir", path, longest)


def check_socket_dir(what: str, flag: str, path: str, longest: str) -> Check:
    """A directory the daemon's ipc sockets go in (``longest``: the longest of their
    paths), named by ``flag``: the paths must fit sun_path, and the directory must be
    ours and owner-only, or creatable. An existing directory is never chmod-ed: it may
    be shared (/tmp), and changing its mode would lock its other users out."""
    if len(longest.encode()) > SOCKET_PATH_MAX:
        return Check(what, "FAIL", f"socket path {longest} is {len(longest.encode())} bytes; ipc socket paths hold {SOCKET_PATH_MAX}",
                     f"choose a shorter {flag}" + (" (or --name)" if flag == "--runtime-dir" else ""))
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return Check(what, "FAIL", f"{path} cannot be created: {parent} is not a directory", f"choose another {flag}")
        if os.access(parent, os.W_OK | os.X_OK):
            return Check(what, "OK", f"{path} does not exist yet; the daemon creates it owner-only (0700)")
        return Check(what, "FAIL", f"{path} does not exist and {parent} is not writable by uid {os.getuid()}",
                     f"create it for the daemon's user (install -d -m 700 DIR) or choose {flag}")
    if not os.path.isdir(path):
        return Check(what, "FAIL", f"{path} is not a directory", f"choose another {flag}")
    st = os.stat(path)
    mode = st.st_mode & 0o777
    if st.st_uid != os.getuid():
        return Check(what, "FAIL", f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})",
                     f"run the daemon as that user, or choose a {flag} of its own (pdxfer creates a missing one owner-only)")
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(what, "FAIL", f"{path} (mode {mode:04o}) is not writable", f"chmod 700 {path}")
    if mode & 0o077:
        return Check(what, "FAIL", f"{path} has mode {mode:04o}: other users could reach the daemon's sockets in it, "
                     "and pdxfer does not change the mode of a directory it did not create",
                     f"choose a {flag} of its own (pdxfer creates a missing one owner-only), or chmod 700 {path} if nothing else uses it")
    return Check(what, "OK", f"{path}, owner-only ({mode:04o}), socket paths fit ({len(longest.encode())} of {SOCKET_PATH_MAX} bytes)")


def check_host(host: str) -> Check:
    """--host must resolve to one address of this machine: the daemon binds it, and tells
    peers and routers to reach it there (so 0.0.0.0, every address, reaches nobody)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return Check("host", "FAIL", f"--host {host} does not resolve: {exc.strerror}",
                     "give --host an address of this host (ip -brief address) or a name that resolves to one")
    family, _, _, _, address = infos[0]
    if ipaddress.ip_address(address[0]).is_unspecified:
        return Check("host", "FAIL", f"--host {host} is every address of this machine, not one a peer can reach: the daemon "
                     "advertises --host to peers and routers as its bootstrap and transfer-engine address",
                     "give the address peers reach this host at (ip -brief address; in Kubernetes the pod's IP, "
                     "PDXFER_HOST from status.podIP); the daemon binds only that address")
    with socket.socket(family) as sock:
        try:
            sock.bind((address[0], 0))
        except OSError as exc:
            return Check("host", "FAIL", f"--host {host} ({address[0]}) is not an address of this machine: {exc.strerror}",
                         "use an address of one of this host's interfaces (ip -brief address)")
    return Check("host", "OK", f"{host} ({address[0]}) is an address of this machine")


def port_holder(port: int) -> str:
    """Which process listens on TCP ``port``, as the OS says (/proc/net/tcp*, then the
    process whose file descriptors hold that socket); "" where it cannot be seen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return ""
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target in inodes:
                pid = fd_dir.split("/")[2]
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        command = " ".join(fh.read().decode(errors="replace").replace("\0", " ").split())
                except OSError:
                    command = ""
                return f"pid {pid}" + (f" ({command[:120]})" if command else "")
    return ""


def check_port(what: str, flag: str, host: str, port: int, live: dict[int, str]) -> Check:
    if port == 0:
        note = "the daemon binds any free port and prints it in its ready line" if flag == "--bootstrap-port" else "off: no /metrics, /healthz or /readyz (set it for Prometheus and Kubernetes probes)"
        return Check(what, "OK", f"{flag} 0: {note}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon's listeners do
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                if port in live:
                    return Check(what, "OK", f"{host}:{port} is in use by the running {live[port]}")
                holder = port_holder(port)
                named = f"{holder} holds it" if holder else f"ss -ltnp 'sport = :{port}' names the process"
                return Check(what, "FAIL", f"{host}:{port} is in use by another process", f"stop it, or choose another {flag} ({named})")
            if exc.errno == errno.EADDRNOTAVAIL:
                return Check(what, "FAIL", f"--host {host} is not an address of this machine", "use an address of one of this host's interfaces (ip -brief address)")
            if exc.errno == errno.EACCES:
                return Check(what, "FAIL", f"port {port} needs privileges to bind", f"choose {flag} above 1023, or grant CAP_NET_BIND_SERVICE")
            if isinstance(exc, socket.gaierror):
                unresolved = check_host(host)
                return Check(what, "FAIL", unresolved.detail, unresolved.fix)
            return Check(what, "FAIL", f"cannot bind {host}:{port}: {exc.strerror}", f"choose another {flag} or --host")
    return Check(what, "OK", f"{host}:{port} is free")


# --- accelerators


def gpu_facts() -> dict:
    facts = {"cudart": ctypes.util.find_library("cudart"), "count": 0, "error": "", "smi": shutil.which("nvidia-smi") or "",
             "nodes": sorted(glob.glob("/dev/nvidia[0-9]*"))}
    if facts["cudart"]:
        try:
            lib = ctypes.CDLL(facts["cudart"])
            count = ctypes.c_int(0)
            rc = lib.cudaGetDeviceCount(ctypes.byref(count))
            if rc == 0:
                facts["count"] = count.value
            else:
                lib.cudaGetErrorString.restype = ctypes.c_char_p
                facts["error"] = f"cudaGetDeviceCount: error {rc}, {lib.cudaGetErrorString(rc).decode()}"
        except (OSError, AttributeError) as exc:
            facts["error"] = f"cannot load {facts['cudart']}: {exc}"
    return facts


def npu_facts() -> dict:
    return {"acl": ctypes.util.find_library("ascendcl"), "devices": sorted(glob.glob("/dev/davinci[0-9]*")), "smi": shutil.which("npu-smi") or ""}


def check_gpu(s: Settings, gpu: dict, probe: dict) -> Check:
    seen = (f"{gpu['count']} GPU(s) visible" if gpu["count"] else "no GPU visible") + (
        f" (libcudart: {gpu['cudart']}" + (f"; {gpu['error']}" if gpu["error"] else "") + ")" if gpu["cudart"] else " (no libcudart)"
    ) + ("" if gpu["smi"] else "; no nvidia-smi") + (f"; device nodes: {', '.join(gpu['nodes'])}" if gpu["nodes"] else "")
    if not s.device.startswith("cuda:"):
        return Check("gpu", "OK", f"{seen}; not needed for --device {s.device}")
    index = int(s.device.split(":")[1])
    if not gpu["cudart"]:
        return Check("gpu", "FAIL", f"--device {s.device} but {seen}", "install the CUDA runtime (libcudart) that matches the driver")
    if gpu["count"] <= index:
        fix = ("install or update the NVIDIA driver (the runtime needs a newer one)" if "insufficient" in gpu["error"]
               else "make the GPU visible: check CUDA_VISIBLE_DEVICES and the container's GPU resources (nvidia.com/gpu)")
        return Check("gpu", "FAIL", f"--device {s.device} but {seen}", fix)
    if probe and not probe.get("flags", {}).get("SUPPORT_CUDA"):
        return Check("gpu", "FAIL", f"{seen}, but this transfer engine build has no CUDA support, so it cannot move GPU pools",
                     "pip install mooncake-transfer-engine (the CUDA build) instead of mooncake-transfer-engine-non-cuda")
    return Check("gpu", "OK", f"{seen}; --device {s.device}")


def check_npu(s: Settings, npu: dict) -> Check:
    seen = (f"{len(npu['devices'])} NPU device node(s)" if npu["devices"] else "no /dev/davinciN") + (
        f"; libascendcl: {npu['acl']}" if npu["acl"] else "; no libascendcl (CANN)") + ("" if npu["smi"] else "; no npu-smi")
    if not s.device.startswith("npu:"):
        return Check("npu", "OK", f"{seen}; not needed for --device {s.device}")
    index = s.device.split(":")[1]
    if not npu["acl"]:
        return Check("npu", "FAIL", f"--device {s.device} but {seen}", "install Ascend CANN and source its set_env.sh so libascendcl is found")
    if f"/dev/davinci{index}" not in npu["devices"]:
        return Check("npu", "FAIL", f"--device {s.device} but {seen}", f"make /dev/davinci{index} visible (container device mounts, ASCEND_VISIBLE_DEVICES)")
    return Check("npu", "OK", f"{seen}; --device {s.device}")
