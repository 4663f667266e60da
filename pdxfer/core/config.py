"""One frozen daemon configuration, read once at start-up.

Precedence, lowest first: the defaults below, a TOML file (``--config`` or
``PDXFER_CONFIG``), ``PDXFER_<FIELD>`` environment variables, command-line flags.
Each field's description is its ``--help`` text, so the two cannot drift.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (pyproject asks for it there)
    import tomli as tomllib

import msgspec

from .liveness import Heartbeats
from .paths import MAX_TCP_ENGINES, MAX_TCP_LANES
from .protocol import MAX_INLINE_KV_BYTES, Role
from .staging import stage_spans_below, staging_mib

ENV_PREFIX = "PDXFER_"
# Read by engines beside a daemon (their daemon's engine endpoint, pdxfer.adapters), never
# by the daemon: one environment may serve both, so load() passes over it.
ENDPOINT_ENV = ENV_PREFIX + "ENDPOINT"
INLINE_KV_BYTES = 64 * 1024  # default of inline_kv_bytes (pdxfer bench states it too)
TCP_LANES = 8  # default of tcp_lanes (pdxfer bench gives its baseline the same)
TCP_ENGINES = 2  # default of tcp_engines (pdxfer bench reports what its baseline runs)
RENEWALS_PER_TTL = 3  # the registry renews a daemon's lease this many times per registry_ttl
# fence_bound over the heartbeat bound, at least: the time to start new transfer engines
# and let live prefills move off the old ones. Its default, and over the heartbeat bound
# when that is long.
FENCE_BOUND_MARGIN = 1.0
FENCE_BOUND, FENCE_BOUND_SLACK = 15.0, 5.0

Protocol = Literal["tcp", "rdma", "nvlink", "intranode_nvlink", "ascend", "hixl"]
AuxPathChoice = Literal["auto", "tcp", "transfer_engine"]


def _doc(text: str, **limits: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **limits)


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Annotated[Role, _doc("which side this daemon serves: prefill (writes KV) or decode (receives it)")]
    name: Annotated[str, _doc("instance name, used in socket paths and logs; default: the role")] = ""
    runtime_dir: Annotated[
        str, _doc("directory for the engine and admin sockets and the name lock: created owner-only when missing; an existing one must be ours and owner-only; default: $XDG_RUNTIME_DIR/pdxfer or /tmp/pdxfer-UID")
    ] = ""
    engine_endpoint: Annotated[
        str, _doc("ZMQ endpoint engines connect to; default: ipc://RUNTIME_DIR/NAME.engine.sock (tcp:// allowed)")
    ] = ""
    admin_endpoint: Annotated[
        str, _doc("ZMQ endpoint of the admin API (pdxfer rooms/peers/slots/top); default: ipc://RUNTIME_DIR/NAME.admin.sock (tcp:// allowed)")
    ] = ""
    admin_writes: Annotated[bool, _doc("allow operator actions through the admin API (pdxfer room ID --fail, pdxfer peer P --drain)")] = False
    http_port: Annotated[
        int, _doc("TCP port for /metrics (Prometheus), /healthz and /readyz on --host; 0: off", ge=0, le=65535)
    ] = 0
    drain_timeout: Annotated[
        float, _doc("on SIGTERM: stop admitting rooms, let live ones finish for this many seconds, fail the rest, exit", ge=0)
    ] = 30.0
    registry: Annotated[
        str, _doc("etcd://host:port[/prefix]: register this daemon under a lease, find and watch peers there (decode engines may then name a prefill daemon instead of its address)")
    ] = ""
    registry_ttl: Annotated[float, _doc("seconds the registry lease outlives a daemon that stopped renewing it", ge=1)] = 5.0
    transfer_metadata: Annotated[
        str, _doc("where the transfer engine keeps segment metadata: P2PHANDSHAKE (no store) or etcd://host:port (may be the registry's etcd)")
    ] = "P2PHANDSHAKE"
    host: Annotated[str, _doc("address this daemon binds and advertises to peers and the transfer engine")] = "127.0.0.1"
    bootstrap_port: Annotated[
        int, _doc("prefill: TCP port of the bootstrap endpoint decode daemons connect to (0: any free port)", ge=0, le=65535)
    ] = 18998
    protocol: Annotated[Protocol, _doc("transfer engine protocol; the pool's memory must suit it")] = "tcp"
    rdma_devices: Annotated[str, _doc("rdma: comma-separated device filter passed to the transfer engine (empty: all)")] = ""
    device: Annotated[
        str, _doc("accelerator bound before the transport starts: cpu, cuda:N or npu:N", pattern=r"^(cpu|cuda:\d+|npu:\d+)$")
    ] = "cpu"
    transfer_engine_process: Annotated[
        Literal["auto", "child", "inline"],
        _doc("where the transfer engine runs: child (a process of its own, restarted if it dies: its ports take bytes "
             "from anyone, and bad ones can end the process that runs it), inline (in the daemon: device memory, which "
             "another process cannot map by address), or auto (child for --device cpu, else inline)"),
    ] = "auto"
    aux_path: Annotated[
        AuxPathChoice,
        _doc("how aux records travel: tcp (bootstrap channel), transfer_engine, or auto (by protocol: transfer engine for rdma/ascend/hixl, else tcp)"),
    ] = "auto"
    max_rooms: Annotated[int, _doc("rooms held at once, finished-but-unreleased included; more are refused as busy", ge=1)] = 4096
    peer_window: Annotated[
        int, _doc("transfer-engine writes in flight per peer; kept well under the engine's per-peer queue (1024 for tcp)", ge=1, le=65535)
    ] = 512
    tcp_lanes: Annotated[
        int,
        _doc("tcp: connections the transfer engine writes to each peer over, one write in flight on each, every write "
             "waiting for the destination's acknowledgement (sets the engine's MC_TCP_LANES_PER_PEER; 0: the engine's "
             "default of 4)", ge=0, le=MAX_TCP_LANES),
    ] = TCP_LANES
    tcp_engines: Annotated[
        int,
        _doc("tcp: transfer engines this daemon runs, each moving bytes on one thread of its own (what bounds one "
             "engine); a prefill spreads every peer's writes over its engines and the decode daemon's, in turn. Other "
             "protocols run one engine, whose transport has worker threads of its own", ge=1, le=MAX_TCP_ENGINES),
    ] = TCP_ENGINES
    yield_cpu: Annotated[
        bool,
        _doc("once the transfer engine has started, run this daemon's own threads (event loop, pump, ZMQ) under SCHED_IDLE "
             "so that the engine's threads get a core the moment they wake; only where the daemon can take the cores "
             "back (CAP_SYS_NICE, or RLIMIT_NICE 20), which it does while other processes starve its event loop. Off by "
             "default: beside busy engines a yielding daemon waits for a core at every hand-off"),
    ] = False
    max_message_bytes: Annotated[int, _doc("largest engine or peer message accepted, in bytes", ge=4096)] = 64 * 1024 * 1024
    engine_queue: Annotated[int, _doc("ZMQ messages queued per engine or admin socket before further ones are refused or dropped (the high-water mark); each carries up to 8 of ours, more when a sender batches more. A bootstrap connection queues up to twice max_message_bytes instead", ge=1)] = 4096
    bootstrap_timeout: Annotated[float, _doc("seconds a room may stay Bootstrapping", gt=0)] = 30.0
    waiting_timeout: Annotated[float, _doc("seconds a room may stay WaitingForInput", gt=0)] = 120.0
    transfer_timeout: Annotated[float, _doc("seconds a room may stay Transferring", gt=0)] = 30.0
    fence_timeout: Annotated[float, _doc("prefill: seconds a failed room's source slot stays quarantined when its writes never settle; both: added to transfer_timeout in the leave to write a decode daemon gives", gt=0)] = 10.0
    fence_bound: Annotated[
        Annotated[float, msgspec.Meta(gt=0)] | None,
        _doc("decode: seconds from a room's failure (or from its prefill's last word, if that came first) to its "
             "fencing, when the prefill never confirmed its writes drained: past the heartbeat bound this daemon moves its live "
             "prefills to new transfer sessions and ends the old ones (nothing sent through them can land afterwards), "
             "then those rooms' pages and slots go back to the engine. An engine must hold a failed request's pages "
             "longer than this (SGLang: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, 30 s by default). "
             f"At least {FENCE_BOUND_MARGIN:g} s above heartbeat_interval x heartbeat_misses. Default: {FENCE_BOUND:g}, "
             f"or the heartbeat bound plus {FENCE_BOUND_SLACK:g} if that is more"),
    ] = None
    stall_timeout: Annotated[
        float, _doc("seconds (plus the oldest write's size at 50 MB/s) writes to a peer may all stay pending before its transfer session is declared stalled and re-created", gt=0)
    ] = 5.0
    retention: Annotated[float, _doc("seconds a finished room the engine never released is kept", gt=0)] = 300.0
    heartbeat_interval: Annotated[float, _doc("seconds between heartbeats on every peer link", gt=0)] = 1.0
    heartbeat_misses: Annotated[
        int, _doc("heartbeats a peer may miss before it is declared dead and exactly its rooms fail", ge=1)
    ] = 5
    expect_batch_ms: Annotated[
        float, _doc("decode: how long a room's request to a prefill daemon waits for the other local ranks of its engine to expect the room too, so one request carries every rank's legs (A5); it leaves at once when they all have", ge=0)
    ] = 20.0  # ranks of one engine expected a room up to 15 ms apart on a loaded 2-core host; waiting costs nothing when they all do
    max_rooms_per_peer: Annotated[int, _doc("prefill: rooms one decode daemon may hold here at once; more are refused as busy", ge=1)] = 2048
    cluster_secret_file: Annotated[
        str, _doc("file holding the cluster secret; peers must sign every bootstrap message with it (HMAC-SHA256). Empty: no authentication")
    ] = ""
    inline_kv_bytes: Annotated[
        int,
        _doc("a room with at most this many bytes of KV sends them inside its aux record over the bootstrap channel "
             "instead of as transfer-engine writes, when both pools are host memory and aux travels over tcp; decode: "
             "the most it accepts (0: never)", ge=0, le=MAX_INLINE_KV_BYTES),
    ] = INLINE_KV_BYTES
    staging_mib: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=64 * 1024)] | None,
        _doc("MiB of shared memory for legs between ranks of different TP whose side here holds a slice of each page: "
             "decode, a leg from a prefill rank holding fewer KV heads lands in it and is copied into the pages; "
             "prefill, a chunk for a decode rank holding fewer heads is gathered into it and written from there. Runs "
             "of whole pages then stay one write each (slices take a write per page and region, head-major, or per "
             "token, token-major), where the spans are short for the transport; host-memory pools only. A leg or "
             "chunk finding no room, or /dev/shm too full to back its extent, writes between the pages. Default: 512 over tcp, 64 otherwise (core/staging.py); "
             "0: none"),
    ] = None
    staging_at_start: Annotated[
        bool,
        _doc("back the whole staging buffer with pages at start, and map them there and in the transfer engine's process, "
             "instead of unit by unit as legs first reach them: a fresh daemon's first legs then cost no page faults in "
             "the engine's threads that move the bytes (about 10 us per 4 KiB page on a busy host, 131,072 pages for 512 "
             "MiB), but the buffer holds its full size of /dev/shm from the start. Falls back to backing as used when "
             "/dev/shm cannot hold it"),
    ] = False
    stage_spans_below_kib: Annotated[
        int,
        _doc("stage (see --staging-mib) only slices whose contiguous spans are shorter than this many KiB: a slice "
             "of a head-major page is one span, of a token-major page one per token. 0: as measured for the protocol "
             "and side (over tcp: decode 128, prefill 16; 8 otherwise; core/staging.py)", ge=0, le=64 * 1024),
    ] = 0
    verify_kv: Annotated[bool, _doc("decode: ask for a CRC-32 digest of every room's KV and fail the room on a mismatch (CPU pools)")] = False
    visibility_grace: Annotated[
        float, _doc("seconds the decode side re-checks an aux stamp or KV digest that does not match yet, before failing the room", ge=0)
    ] = 0.05
    inject_faults: Annotated[
        str, _doc("TESTING ONLY: wrap the transport in a fault injector, e.g. 'delay=0.3:5,early=0.1:2,ghost=0.2:20,fail=0.01' (see pdxfer/transport/faults.py)")
    ] = ""
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _doc("log level")] = "info"
    log_format: Annotated[Literal["text", "json"], _doc("log line format")] = "text"

    def __post_init__(self) -> None:
        bound = self.heartbeat_interval * self.heartbeat_misses
        if self.fence_bound is not None and self.fence_bound < bound + FENCE_BOUND_MARGIN:
            raise ValueError(
                f"fence_bound {self.fence_bound:g}s must be at least {FENCE_BOUND_MARGIN:g}s above the heartbeat bound "
                f"({self.heartbeat_interval:g}s x {self.heartbeat_misses} misses = {bound:g}s): raise --fence-bound or lower "
                "--heartbeat-interval / --heartbeat-misses")

    @property
    def fence_seconds(self) -> float:
        """The fence bound in force (fence_bound, or its default)."""
        if self.fence_bound is not None:
            return self.fence_bound
        return max(FENCE_BOUND, self.heartbeat_interval * self.heartbeat_misses + FENCE_BOUND_SLACK)

    @property
    def stage_spans_below(self) -> int:
        """Bytes under which a slice's spans are staged (core/staging.stage_spans_below)."""
        return stage_spans_below(self.protocol, self.role.value, self.stage_spans_below_kib)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffer (core/staging.staging_mib; 0: none)."""
        return staging_mib(self.protocol, self.staging_mib) << 20

    @property
    def heartbeats(self) -> Heartbeats:
        """The heartbeat rule these settings give (liveness.py)."""
        return Heartbeats(self.heartbeat_interval, self.heartbeat_misses)

    @property
    def silence_bound(self) -> float:
        """Seconds this daemon's loop may stand still before something declares it gone:
        its peers after the heartbeat bound; with a registry, its lease when a stall starts
        just before a renewal (the lease then has registry_ttl less one renewal interval left)."""
        bound = self.heartbeats.bound
        if not self.registry:
            return bound
        return min(bound, self.registry_ttl * (1 - 1 / RENEWALS_PER_TTL))

    @property
    def instance(self) -> str:
        return self.name or self.role.value

    @property
    def socket_dir(self) -> str:
        return self.runtime_dir or default_runtime_dir(os.environ)

    @property
    def engine_address(self) -> str:
        return self.engine_endpoint or f"ipc://{self.socket_dir}/{self.instance}.engine.sock"

    @property
    def admin_address(self) -> str:
        return self.admin_endpoint or f"ipc://{self.socket_dir}/{self.instance}.admin.sock"


def default_runtime_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_RUNTIME_DIR")
    return os.path.join(base, "pdxfer") if base else f"/tmp/pdxfer-{os.getuid()}"


def fields() -> list[tuple[str, Any, str]]:
    """(name, default or msgspec.NODEFAULT, description) for every option."""
    out = []
    for f in msgspec.inspect.type_info(Config).fields:
        meta = f.type if isinstance(f.type, msgspec.inspect.Metadata) else None
        desc = (meta.extra_json_schema or {}).get("description", "") if meta else ""
        out.append((f.name, f.default, desc))
    return out


def load(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | None = None,
) -> Config:
    """Build the config from a TOML file, the environment and flags (None values in
    ``flags`` mean 'not given'; an empty environment variable is unset, as a
    ConfigMap key left blank leaves it). An invalid value is refused naming where it
    came from: the flag, the variable, or the file and line."""
    env = os.environ if env is None else env
    names = {name for name, _, _ in fields()}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # option -> where its value was given
    path = file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        for name, (value, where) in read_toml(path, names).items():
            values[name], origins[name] = value, where
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in (ENV_PREFIX + "CONFIG", ENDPOINT_ENV):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in names:
            raise ValueError(f"unknown environment variable {key} (options: {', '.join(sorted(names))})")
        if raw != "":
            values[name], origins[name] = raw, f"environment variable {key}"
    for name, value in (flags or {}).items():
        if value is not None and name in names:
            values[name], origins[name] = value, flag_of(name)
    values.setdefault("runtime_dir", default_runtime_dir(env))
    try:
        return msgspec.convert(values, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid configuration: {explain(str(exc), values, origins)}") from None


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_toml(path: str, names: set[str]) -> dict[str, tuple[Any, str]]:
    """option -> (value, 'FILE line N (KEY)') from a TOML file whose keys are options,
    spelt as in the flags (bootstrap-port) or with underscores (bootstrap_port)."""
    with open(path, "rb") as fh:
        text = fh.read().decode()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    lines = text.splitlines()

    def line_of(key: str) -> int:
        pattern = re.compile(rf"""^\s*["']?{re.escape(key)}["']?\s*[=.]""")
        return next((n for n, line in enumerate(lines, 1) if pattern.match(line)), 0)

    found: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in names or isinstance(value, dict):
            raise ValueError(f"{path} line {line_of(key)}: {key!r} is not an option (options, - or _ alike: {', '.join(sorted(names))})")
        if name in found:
            raise ValueError(f"{path} line {line_of(key)}: {key!r} sets {name} again (already set at {found[name][1]})")
        found[name] = (value, f"{path} line {line_of(key)} ({key})")
    return found


def choices(name: str) -> list[str]:
    """The valid values of an option that takes one of a few, else []."""
    info = next(f.type for f in msgspec.inspect.type_info(Config).fields if f.name == name)
    info = info.type if isinstance(info, msgspec.inspect.Metadata) else info
    if isinstance(info, msgspec.inspect.LiteralType):
        return [str(v) for v in info.values]
    if isinstance(info, msgspec.inspect.EnumType):
        return [str(m.value) for m in info.cls]
    return []


def explain(error: str, values: Mapping[str, Any], origins: Mapping[str, str]) -> str:
    """msgspec's 'Expected `int`, got `str` - at `$.bootstrap_port`' as a person would
    act on it: where the value was given, the value, what was wrong, the choices."""
    found = re.fullmatch(r"(.*) - at `\$\.(\w+)`", error)
    if found is None:
        missing = re.fullmatch(r"Object missing required field `(\w+)`", error)
        if missing:
            name = missing.group(1)
            options = f" ({' or '.join(choices(name))})" if choices(name) else ""
            return f"{name} is required: give {flag_of(name)}{options}, {ENV_PREFIX}{name.upper()} or {name} in the --config file"
        return error
    what, name = found.groups()
    what = what.replace("`", "")
    what = what[:1].lower() + what[1:]
    options = f"; choose one of: {', '.join(choices(name))}" if choices(name) else ""
    return f"{origins.get(name, name)} is {values.get(name)!r}: {what}{options}"
