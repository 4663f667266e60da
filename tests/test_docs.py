"""The documents say what the code is: the protocol's version in proto/PROTOCOL.md is
the code's, and the changelog beside PROTOCOL_VERSION has one line for every version up
to it. Pure: files only."""

from __future__ import annotations

import re
from pathlib import Path

from pdxfer.core import protocol

ROOT = Path(__file__).resolve().parents[1]


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text[start:])]
    return text[start : start + ends[0]] if ends else text[start:]


def test_protocol_md_states_the_codes_version():
    title = (ROOT / "proto" / "PROTOCOL.md").read_text().splitlines()[0]
    assert title == f"# pdxfer wire protocol, version {protocol.PROTOCOL_VERSION}", title


def test_the_changelog_beside_the_version_has_a_line_for_every_version():
    source = Path(protocol.__file__).read_text().splitlines()
    at = source.index(f"PROTOCOL_VERSION = {protocol.PROTOCOL_VERSION}")
    comment = []
    for line in reversed(source[:at]):  # the comment block right above the constant
        if not line.startswith("#"):
            break
        comment.insert(0, line)
    versions = [int(m.group(1)) for m in map(re.compile(r"# (\d+): \S").match, comment) if m]
    assert versions == list(range(1, protocol.PROTOCOL_VERSION + 1)), comment
    history = section((ROOT / "proto" / "PROTOCOL.md").read_text(), "## Version history")
    assert "pdxfer/core/protocol.py" in history and f"* {protocol.PROTOCOL_VERSION} —" in history, history[:400]
