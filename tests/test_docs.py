"""The documents say what the code is: the README's module table names every module
of the package and nothing else, the files its reading path sends a reader to exist, the
protocol's version in proto/PROTOCOL.md is the code's, and the changelog beside
PROTOCOL_VERSION has one line for every version up to it. Pure: files only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pdxfer.core import protocol

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pdxfer"


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text[start:])]
    return text[start : start + ends[0]] if ends else text[start:]


def module_table(readme: str) -> set[str]:
    """Paths the module table under "The code" names, relative to pdxfer/: in each row's
    first cell, a path with a folder sets the folder for the bare names after it
    (`roles/base.py`, `prefill.py`); a folder (`tools/bench/`) stands for all in it. Bold
    rows are a layer's heading, not an entry."""
    named = set()
    for line in section(readme, "## The code").splitlines():
        if not line.startswith("| `") and not line.startswith("| **"):
            continue
        first = line.split(" | ", 1)[0]
        if first.startswith("| **"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", first):
            token = token.removeprefix("pdxfer/")
            if "/" in token.rstrip("/"):
                folder = token.rstrip("/").rsplit("/", 1)[0] + "/"
                named.add(token)
            elif token.endswith("/"):
                named.add(token)
            else:
                named.add(folder + token)
    return named


def modules() -> set[str]:
    """Every module of the package relative to pdxfer/; an __init__ counts only where it
    holds code (transport's is the interface), not just the subpackage's docstring."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        if path.name == "__init__.py" and all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body):
            continue
        out.add(path.relative_to(PACKAGE).as_posix())
    return out


def covered(module: str, named: set[str]) -> bool:
    return module in named or any(entry.endswith("/") and module.startswith(entry) for entry in named)


def test_the_readme_module_table_names_every_module_and_only_those():
    named = module_table((ROOT / "README.md").read_text())
    assert "tools/bench/" in named and "roles/prefill.py" in named and "loop.py" in named, sorted(named)
    missing = sorted(m for m in modules() if not covered(m, named))
    assert not missing, f"README.md, The code: no row for {missing}"
    gone = sorted(entry for entry in named if not (PACKAGE / entry).exists())
    assert not gone, f"README.md, The code: {gone} are not in pdxfer/"


def test_the_module_table_reader_sees_a_module_left_out():
    """The check above could pass by reading nothing: a table without a row fails it."""
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `core/stamp.py` |"))
    named = module_table(readme.replace(row + "\n", ""))
    assert not covered("core/stamp.py", named) and covered("core/plan.py", named)


def test_the_reading_path_names_files_that_exist():
    """Paths under pdxfer/ unless they start at the repository's root (tests/, proto/,
    examples/); adapters/ is being written (issues 28 and 29)."""
    text = section((ROOT / "README.md").read_text(), "### Reading path")
    paths = {p for p in re.findall(r"`([\w/.]+)`", text) if "/" in p or p.endswith(".py")}
    assert len(paths) > 15, paths
    def where(path: str) -> Path:
        return ROOT / path if path.split("/", 1)[0] in ("tests", "proto", "examples") else PACKAGE / path.removeprefix("pdxfer/")

    missing = sorted(p for p in paths - {"adapters/"} if not where(p).exists())
    assert not missing, f"README.md, Reading path: {missing} do not exist"


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
