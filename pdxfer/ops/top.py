"""``pdxfer top``: a live view of one daemon, redrawn in place every --interval,
cut to fit the terminal; ``q`` quits.

Each refresh asks the admin API for the daemon's info (room and slot counts,
counters, queue depths), its rooms and its peers. Throughput is the change of the
daemon's counters between two refreshes divided by the change of its uptime, both
read in the same reply, so a slow terminal or a late refresh does not skew it; the
first refresh shows averages since the daemon started.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sys
import textwrap
import time
from typing import NamedTuple

from ..core.protocol import AdminInfo, AdminPeers, AdminRooms, InfoReply, PeerInfo, RoomInfo
from . import tables
from .inspection import AdminClient, peers_table, plain, rooms_table, run

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
ENTER, LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"  # the alternate screen, cursor hidden; and back
QUIT_KEYS = b"qQ"
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


class Section(NamedTuple):
    """A titled table on the screen: its column header line, then one line per row."""

    title: str
    columns: str  # empty: the table is empty
    rows: list[str]

    def body(self) -> list[str]:
        return [self.columns, *self.rows] if self.columns else ["  none"]


def parts(info: InfoReply, rooms: list[RoomInfo], peers: list[PeerInfo], rate: dict[str, float], over: float | None) -> tuple[list[str], list[Section]]:
    """The header lines and the tables of one screen of ``pdxfer top``; ``over`` is the
    refresh interval, None for since start."""
    ready = "ready" if info.ready else "NOT READY: " + "; ".join(info.not_ready)
    live = [r for r in rooms if not r.state.terminal]
    c = info.counters
    header = [
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
    ]
    shown = live[:LIVE_ROOMS_SHOWN]
    sections = [
        Section(f"peers ({len(peers)})", *_split(peers_table(peers, indent="  ")) if peers else ("", [])),
        Section(f"oldest live rooms ({len(shown)} of {len(live)})",
                *_split(rooms_table(shown, width=48, indent="  ")) if live else ("", [])),
    ]
    return header, sections


def _split(table: str) -> tuple[str, list[str]]:
    columns, *rows = table.split("\n")
    return columns, rows


def frame(info: InfoReply, rooms: list[RoomInfo], peers: list[PeerInfo], rate: dict[str, float], over: float | None) -> str:
    """One screen of ``pdxfer top`` in full, as written to a pipe."""
    header, sections = parts(info, rooms, peers, rate, over)
    return "\n".join(header + [line for section in sections for line in ("", section.title, *section.body())])


def fit(header: list[str], sections: list[Section], width: int, height: int) -> list[str]:
    """One screen of ``pdxfer top`` for a width x height terminal: at most ``height``
    lines of at most ``width`` characters. The header comes first, each line wrapped;
    then each section's title and as many of its lines as fit, the space shared out a
    line at a time in turn, and the rows left out counted."""
    width, height = max(width, 1), max(height, 1)
    top = [piece for line in header for piece in textwrap.wrap(line, width, subsequent_indent=" " * min(11, width - 1))]
    bodies = [section.body() for section in sections]
    spare = height - len(top) - 2 * len(sections)  # a blank line and the title of each section
    given = [0] * len(sections)
    while spare > 0 and any(n < len(body) for n, body in zip(given, bodies)):
        for i, body in enumerate(bodies):
            if spare > 0 and given[i] < len(body):
                given[i] += 1
                spare -= 1
    lines = list(top)
    for section, body, n in zip(sections, bodies, given):
        lines += ["", section.title]
        if n >= len(body):
            lines += body
        elif n:
            kept = body[: n - 1]
            hidden = len(section.rows) - max(0, len(kept) - 1)
            lines += [*kept, f"  ... {hidden} more (a taller terminal shows them)"]
    return [line[:width] for line in lines[:height]]


def snapshot(info: InfoReply, rooms: list[RoomInfo], peers: list[PeerInfo], rate: dict[str, float], over: float | None) -> dict:
    """What --json prints per refresh: one JSON object per line."""
    return {
        "info": {k: v for k, v in plain(info).items() if k not in ("req", "config")},
        "rates": rate,
        "rates_over": over,  # seconds; null: averages since the daemon started
        "peers": [plain(p) for p in peers],
        "live_rooms": [plain(r) for r in rooms if not r.state.terminal],
    }


def terminal_size() -> os.terminal_size:
    """The terminal's own size (TIOCGWINSZ on stdout), not $COLUMNS and $LINES first as
    shutil's: a shell inside tmux or screen often holds them from another window size."""
    try:
        return os.get_terminal_size(sys.stdout.fileno())
    except OSError:  # no size to ask for (a terminal that reports none)
        return shutil.get_terminal_size()


def run_top(args, admin: AdminClient) -> int:
    iterations = 1 if args.once else args.iterations
    redraw = sys.stdout.isatty() and not args.json
    keys = Keys(sys.stdin if redraw else None)
    previous: InfoReply | None = None
    shown = 0
    try:
        if redraw:
            sys.stdout.write(ENTER)
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
            elif redraw:
                size = terminal_size()
                # No newline after the last line: on the bottom row it would scroll the header away.
                sys.stdout.write(CLEAR + "\n".join(fit(*parts(info, rooms, peers, rate, over), size.columns, size.lines)))
                sys.stdout.flush()
            else:
                text = frame(info, rooms, peers, rate, over)
                sys.stdout.write(text + "\n\n" if iterations != 1 else text + "\n")
                sys.stdout.flush()
            shown += 1
            if iterations and shown >= iterations:
                return 0
            wait = max(0.0, args.interval - (time.monotonic() - started))
            if keys.quit_within(wait):
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        keys.restore()
        if redraw:
            sys.stdout.write(LEAVE)
            sys.stdout.flush()


class Keys:
    """The terminal's keys, one at a time without Enter (cbreak mode), while top runs;
    ``q`` quits. Where stdin is not a terminal there are no keys: Ctrl-C still quits."""

    def __init__(self, stream) -> None:
        self.fd = stream.fileno() if stream is not None and stream.isatty() else None
        self._saved = None
        if self.fd is not None:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)

    def quit_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as q is pressed."""
        if self.fd is None:
            time.sleep(seconds)
            return False
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and any(key in QUIT_KEYS for key in os.read(self.fd, 64)):
                return True
        return False

    def restore(self) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None


def cmd_top(args) -> int:
    return run(args, run_top)
