"""``pdxfer top``: a live view of one daemon, redrawn in place every --interval.

Each refresh asks the admin API for the daemon's info (room and slot counts,
counters, queue depths), its rooms and its peers. Throughput is the change of the
daemon's counters between two refreshes divided by the change of its uptime, both
read in the same reply, so a slow terminal or a late refresh does not skew it; the
first refresh shows averages since the daemon started.
"""

from __future__ import annotations

import json
import sys
import time

from . import tables
from .inspection import AdminClient, peers_table, plain, rooms_table
from .protocol import AdminInfo, AdminPeers, AdminRooms, InfoReply, PeerInfo, RoomInfo

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
RATES = (("bytes_moved", "bytes/s"), ("blocks_submitted", "blocks/s"), ("rooms_succeeded", "succeeded/s"), ("rooms_failed", "failed/s"))
LIVE_ROOMS_SHOWN = 10


def rates(previous: dict[str, float] | None, current: dict[str, float], seconds: float) -> dict[str, float]:
    """Per-second change of every counter over ``seconds``; from zero without ``previous``."""
    base = previous or {}
    if seconds <= 0:
        return {name: 0.0 for name in current}
    return {name: max(0.0, (value - base.get(name, 0.0)) / seconds) for name, value in current.items()}


def _counts(title: str, counts: dict[str, int | float]) -> str:
    return f"{title:<11}" + "   ".join(f"{name} {int(n)}" for name, n in counts.items())


def frame(info: InfoReply, rooms: list[RoomInfo], peers: list[PeerInfo], rate: dict[str, float], over: float | None) -> str:
    """One screen of ``pdxfer top``; ``over`` is the refresh interval, None for since start."""
    ready = "ready" if info.ready else "NOT READY: " + "; ".join(info.not_ready)
    live = [r for r in rooms if not r.state.terminal]
    c = info.counters
    lines = [
        f"pdxfer top - {info.role.value} daemon {info.name!r} (incarnation {info.incarnation}), up {tables.duration(info.uptime)}, "
        f"{ready}{', DRAINING' if info.draining else ''}   {tables.clock(info.wall)}",
        _counts("rooms", info.rooms),
        _counts("slots", info.slots) if info.slots else f"{'slots':<11}no aux buffer registered",
        f"{'throughput':<11}{tables.rate(rate.get('bytes_moved', 0.0))}   {rate.get('blocks_submitted', 0.0):.0f} blocks/s   "
        f"{rate.get('rooms_succeeded', 0.0):.1f} rooms/s succeeded   {rate.get('rooms_failed', 0.0):.1f} rooms/s failed   "
        + (f"(last {tables.duration(over)})" if over is not None else "(average since start)"),
        f"{'totals':<11}{tables.size(c.get('bytes_moved', 0))} moved in {int(c.get('blocks_submitted', 0))} blocks; "
        f"{int(c.get('rooms_succeeded', 0))} rooms succeeded, {int(c.get('rooms_failed', 0))} failed; "
        f"{int(c.get('failed_writes', 0))} failed writes, {int(c.get('transport_stalls', 0))} stalls, "
        f"{int(c.get('transport_resets', 0))} transport resets",
        _counts("queues", info.queues),
        _counts("failures", dict(sorted(info.failures.items()))) if info.failures else f"{'failures':<11}none",
        "",
        f"peers ({len(peers)})",
        peers_table(peers, indent="  ") if peers else "  none",
        "",
        f"oldest live rooms ({min(len(live), LIVE_ROOMS_SHOWN)} of {len(live)})",
        rooms_table(live[:LIVE_ROOMS_SHOWN], width=48, indent="  ") if live else "  none",
    ]
    return "\n".join(lines)


def snapshot(info: InfoReply, rooms: list[RoomInfo], peers: list[PeerInfo], rate: dict[str, float], over: float | None) -> dict:
    """What --json prints per refresh: one JSON object per line."""
    return {
        "info": {k: v for k, v in plain(info).items() if k not in ("req", "config")},
        "rates": rate,
        "rates_over": over,  # seconds; null: averages since the daemon started
        "peers": [plain(p) for p in peers],
        "live_rooms": [plain(r) for r in rooms if not r.state.terminal],
    }


def run_top(args, admin: AdminClient) -> int:
    iterations = 1 if args.once else args.iterations
    redraw = sys.stdout.isatty() and not args.json
    previous: InfoReply | None = None
    shown = 0
    try:
        while True:
            started = time.monotonic()
            info = admin.call(AdminInfo)
            rooms = admin.call(AdminRooms).rooms
            peers = admin.call(AdminPeers).peers
            if previous is None or previous.incarnation != info.incarnation:  # first, or the daemon restarted
                rate, over = rates(None, info.counters, info.uptime), None
            else:
                over = info.uptime - previous.uptime
                rate = rates(previous.counters, info.counters, over)
            previous = info
            if args.json:
                print(json.dumps(snapshot(info, rooms, peers, rate, over)), flush=True)
            else:
                text = frame(info, rooms, peers, rate, over)
                sys.stdout.write((CLEAR + text + "\n") if redraw else (text + "\n\n" if iterations != 1 else text + "\n"))
                sys.stdout.flush()
            shown += 1
            if iterations and shown >= iterations:
                return 0
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
