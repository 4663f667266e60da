"""Text for people: durations, sizes and aligned tables, as the operator commands
(``pdxfer rooms``, ``peers``, ``slots``, ``top``, ``doctor``) print them. Pure
functions of their arguments; standard library only."""

from __future__ import annotations

import time
from typing import Sequence

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def duration(seconds: float) -> str:
    """0.0042 -> '4.2ms', 3.21 -> '3.2s', 125 -> '2m05s', 7322 -> '2h02m'; negative -> '-'."""
    if seconds < 0:
        return "-"
    if seconds < 0.01:
        return f"{seconds * 1000:.1f}ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        minutes, rest = divmod(int(seconds), 60)
        return f"{minutes}m{rest:02d}s"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m"


def ago(seconds: float) -> str:
    return f"{duration(seconds)} ago" if seconds >= 0 else "-"


def millis(ms: float, unknown: float | None = None) -> str:
    """Milliseconds, signed where it matters (clock skew); ``unknown`` prints '-'."""
    if unknown is not None and ms == unknown:
        return "-"
    if abs(ms) < 10:
        return f"{ms:.2f}ms"
    if abs(ms) < 1000:
        return f"{ms:.0f}ms"
    return f"{ms / 1000:.1f}s"


def size(n: float) -> str:
    """Bytes in binary units: 512 -> '512 B', 4096 -> '4.0 KiB'."""
    value = float(n)
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def rate(bytes_per_second: float) -> str:
    return f"{size(bytes_per_second)}/s"


def clock(wall: float) -> str:
    """A wall-clock time as local 'YYYY-MM-DD HH:MM:SS.mmm'."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall)) + f".{int(wall % 1 * 1000):03d}"


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[str] = (), indent: str = "") -> str:
    """Columns aligned under their headers; columns named in ``right`` align right.
    Trailing spaces are stripped, so the last column can be long."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if h in right else v.ljust(w) for v, w, h in zip(values, widths, headers)]
        return (indent + "  ".join(parts)).rstrip()

    return "\n".join([line(list(headers))] + [line(row) for row in cells])
