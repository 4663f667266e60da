"""Which path the bytes take, decided without touching hardware: the transfer-engine
protocol name, which pool kinds suit it, how aux travels (A2), and the order of
start-up steps (D1). The daemon asks these functions; tests check them directly,
since the GPU, NVLink and Ascend paths cannot run on a CPU-only host.
"""

from __future__ import annotations

import enum
from typing import Mapping

from .errors import Unsupported

# pdxfer's protocol names -> the transfer engine's. HIXL is Ascend's direct
# transport; the engine exposes it under its Ascend protocol.
ENGINE_PROTOCOL = {
    "tcp": "tcp",
    "rdma": "rdma",
    "nvlink": "nvlink",
    "intranode_nvlink": "nvlink_intra",
    "ascend": "ascend",
    "hixl": "ascend",
}

# Which memory each protocol can move.
POOL_KINDS = {
    "tcp": ("shm", "cuda_ipc"),
    "rdma": ("shm", "cuda_ipc"),
    "nvlink": ("cuda_ipc",),
    "intranode_nvlink": ("cuda_ipc",),
    "ascend": ("npu_ipc",),
    "hixl": ("npu_ipc",),
}

# The transfer engine's TCP settings, read from its environment when it starts.
TCP_LANES_ENV = "MC_TCP_LANES_PER_PEER"  # connections per peer, each carrying one write at a time
TCP_LEGACY_PROTO_ENV = "MC_TCP_PROTO"  # "1": unacknowledged writes
MAX_TCP_LANES = 16  # the engine's own limit
MAX_TCP_ENGINES = 8
# The engine's first release whose tcp writes complete only once the destination
# acknowledged them; the writer speaks that framing only to a target that does too.
ACKED_TCP_SINCE = (0, 3, 12)

# The device a pool kind needs bound in the daemon.
POOL_DEVICE = {"shm": "cpu", "cuda_ipc": "cuda", "npu_ipc": "npu"}


class AuxPath(str, enum.Enum):
    TCP = "tcp"  # aux bytes ride the bootstrap channel
    TRANSFER_ENGINE = "transfer_engine"  # aux bytes are written like KV, then the stamp is verified


def choose_aux_path(protocol: str, choice: str) -> AuxPath:
    """A2: explicit choice wins; otherwise TCP for tcp and both NVLink flavours (whose
    asynchronous completion does not prove the bytes are visible), the transfer
    engine for RDMA and Ascend."""
    if choice != "auto":
        return AuxPath(choice)
    if protocol in ("rdma", "ascend", "hixl"):
        return AuxPath.TRANSFER_ENGINE
    return AuxPath.TCP


def inline_kv_limit(pool_kind: str, configured: int) -> int:
    """What a decode daemon offers to take inside aux records: only a host pool can
    be written by the daemon itself."""
    return configured if pool_kind == "shm" else 0


def send_kv_inline(aux_path: AuxPath, pool_kind: str, configured: int, peer_limit: int, nbytes: int) -> bool:
    """Whether a room's KV rides its aux record. For a few pages one message beats a
    write per page: each write costs both engines' threads a wake-up and a reply,
    which is what bounds small rooms. Only where the record goes over TCP anyway, and
    the daemon can read its pool (host memory), as for what it takes (inline_kv_limit)."""
    return aux_path is AuxPath.TCP and 0 < nbytes <= min(inline_kv_limit(pool_kind, configured), peer_limit)


def check_tcp_framing(protocol: str, env: Mapping[str, str]) -> None:
    """A3 holds over tcp only because the engine reports a write done once the
    destination acknowledged it; MC_TCP_PROTO=1 makes it report writes done when they
    leave the socket buffer, so an aux record could arrive before its KV. Refused."""
    if protocol == "tcp" and env.get(TCP_LEGACY_PROTO_ENV) == "1":
        raise Unsupported(
            f"{TCP_LEGACY_PROTO_ENV}=1 is set: the transfer engine would report tcp writes done before they land, "
            "and an aux record could overtake its KV; unset it"
        )


def engine_env(protocol: str, lanes: int, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the transfer engine must start with, given the daemon's own
    (refused as check_tcp_framing says). ``lanes`` (0: the engine's default) sets how
    many writes to a peer are in flight at once: each waits for its acknowledgement,
    so on a busy host more lanes keep the wire full."""
    check_tcp_framing(protocol, env)
    return {TCP_LANES_ENV: str(lanes)} if lanes and protocol == "tcp" else {}


def engine_count(protocol: str, tcp_engines: int) -> int:
    """Transfer engines a daemon runs. Over tcp each engine moves every byte on one
    thread of its own, which bounds what one engine carries (two raw engine pairs on
    this project's 2-core box moved ~1.25x the bytes of one), so a daemon runs
    ``tcp_engines`` and spreads writes over them. The other protocols' transports
    have worker threads of their own, and registering memory with several engines
    would pin it several times: one engine."""
    return max(1, tcp_engines) if protocol == "tcp" else 1


def stripes(engines: int, sessions: int) -> list[tuple[int, int]]:
    """How writes to a peer spread: (our engine, the peer's session) pairs, taken in
    turn, one write each. Every engine and every session of the peer is used, and
    equal counts pair engine i with session i, one thread at each end per pair."""
    if engines < 1 or sessions < 1:
        raise ValueError(f"stripes need an engine and a peer session (have {engines} and {sessions})")
    return [(j % engines, j % sessions) for j in range(max(engines, sessions))]


def release_numbers(version: str) -> tuple[int, ...] | None:
    """The leading numbers of a package version ("0.3.13.post1" -> (0, 3, 13)); None
    when it has none (unknown)."""
    numbers = []
    for part in version.strip().split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
        if digits < len(part):  # "12rc1": the release numbers end with 12
            break
    return tuple(numbers) or None


def check_engine_release(protocol: str, version: str, whose: str) -> None:
    """A3 over tcp needs both engines to acknowledge writes at the destination (see
    check_tcp_framing); a writer reports writes done on sending them when either side
    predates that. Refuse a release known to predate it; an unknown one passes."""
    numbers = release_numbers(version)
    if protocol == "tcp" and numbers is not None and numbers < ACKED_TCP_SINCE:
        since = ".".join(map(str, ACKED_TCP_SINCE))
        raise Unsupported(
            f"{whose} transfer engine is {version}: before {since} it reports a tcp write done when it is sent, not when "
            f"it has landed, so an aux record could overtake its KV; install mooncake-transfer-engine {since} or later"
        )


def device_kind(device: str) -> str:
    return device.split(":", 1)[0]


def check_pool(protocol: str, device: str, pool_kind: str) -> None:
    """Refuse a pool this daemon cannot move, saying what would be needed."""
    if pool_kind not in POOL_KINDS[protocol]:
        suits = ", ".join(POOL_KINDS[protocol])
        raise Unsupported(f"protocol {protocol} cannot move {pool_kind} pools (it moves: {suits})")
    need = POOL_DEVICE[pool_kind]
    if need != "cpu" and device_kind(device) != need:
        raise Unsupported(f"{pool_kind} pools need the daemon started with --device {need}:N (it has {device})")


def startup_steps(device: str) -> list[str]:
    """D1: the device context is bound before any transport is initialised; the
    engine endpoint opens last, so no engine can register before the transport exists."""
    steps = [] if device_kind(device) == "cpu" else ["bind_device"]
    return steps + ["init_transport", "open_bootstrap", "open_engine_endpoint"]
