"""The documents say what the code is: the module table of docs/code.md names every
module of the package and nothing else, the files its reading path sends a reader to exist, the
protocol's version in proto/PROTOCOL.md is the code's, the changelog beside
PROTOCOL_VERSION has one line for every version up to it, and every page and section of
docs/ that the code, the tests and the documents cite exists. Pure: files only."""

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
    (`roles/prefill/service.py`, `writer.py`); a folder (`tools/bench/`) stands for all in it. Bold
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


CODE_MAP = ROOT / "docs" / "code.md"


def test_the_module_table_names_every_module_and_only_those():
    named = module_table(CODE_MAP.read_text())
    assert "tools/bench/" in named and "roles/prefill/writer.py" in named and "loop.py" in named, sorted(named)
    missing = sorted(m for m in modules() if not covered(m, named))
    assert not missing, f"docs/code.md, The code: no row for {missing}"
    gone = sorted(entry for entry in named if not (PACKAGE / entry).exists())
    assert not gone, f"docs/code.md, The code: {gone} are not in pdxfer/"


def test_the_module_table_reader_sees_a_module_left_out():
    """The check above could pass by reading nothing: a table without a row fails it."""
    code_map = CODE_MAP.read_text()
    row = next(line for line in code_map.splitlines() if line.startswith("| `core/stamp.py` |"))
    named = module_table(code_map.replace(row + "\n", ""))
    assert not covered("core/stamp.py", named) and covered("core/plan.py", named)


def test_the_reading_path_names_files_that_exist():
    """Paths under pdxfer/ unless they start at the repository's root (tests/, proto/,
    examples/); adapters/ is being written (issues 28 and 29)."""
    text = section(CODE_MAP.read_text(), "### Reading path")
    paths = {p for p in re.findall(r"`([\w/.]+)`", text) if "/" in p or p.endswith(".py")}
    assert len(paths) > 15, paths
    def where(path: str) -> Path:
        return ROOT / path if path.split("/", 1)[0] in ("tests", "proto", "examples") else PACKAGE / path.removeprefix("pdxfer/")

    missing = sorted(p for p in paths - {"adapters/"} if not where(p).exists())
    assert not missing, f"docs/code.md, Reading path: {missing} do not exist"


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


# --- citations of docs/: `docs/engines.md §A4`, `docs/engines.md §A2, A3, C4`, `§A6-A8`

CITING = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".json"}
CITATION = re.compile(r"docs/([\w/.-]+?\.md)(?:\s+§([A-Z]\d+[a-z]?(?:(?:, ?|-)[A-Z]\d+[a-z]?)*))?")
SECTION_ID = re.compile(r"^#+ ([A-Z]\d+[a-z]?) ", re.M)


def citing_files() -> list[Path]:
    """The repository's own text files (not virtual environments, caches or build output)."""
    out = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(part.startswith(".") or part.endswith(".egg-info") or part == "__pycache__" for part in parts):
            continue
        if path.is_file() and (path.suffix in CITING or path.name in ("Makefile", "Dockerfile")):
            out.append(path)
    return out


def citations(text: str) -> list[tuple[str, list[str]]]:
    """(page under docs/, the section ids cited with it) for each citation in ``text``; a
    citation wrapped over comment lines counts as one."""
    flat = re.sub(r"\n[ \t]*(?:#+|//)?[ \t]*", " ", text)
    return [(page, re.split(r", ?|-", ids) if ids else []) for page, ids in CITATION.findall(flat)]


def missing_citations(files: dict[str, str]) -> list[str]:
    """Each citation of a docs/ page or section that does not exist, as 'FILE: docs/PAGE §ID'."""
    missing = []
    for name, text in files.items():
        for page, ids in citations(text):
            target = ROOT / "docs" / page
            if not target.is_file():
                missing.append(f"{name}: docs/{page}")
                continue
            have = set(SECTION_ID.findall(target.read_text()))
            missing += [f"{name}: docs/{page} §{i}" for i in ids if i not in have]
    return missing


def test_every_docs_page_and_section_cited_exists():
    # Not this file: its reader test cites missing sections on purpose.
    files = {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in citing_files() if p != Path(__file__)}
    cited = [c for text in files.values() for c in citations(text)]
    assert sum(1 for page, ids in cited if page == "engines.md" and ids) > 40, cited  # the adapters, tests and deploy cite it
    assert not missing_citations(files), missing_citations(files)
    # ENGINES.md was a research note outside the repository: docs/engines.md holds what the code relies on.
    stale = sorted(name for name, text in files.items() if "ENGINES.md" in text)
    assert not stale, f"cite docs/engines.md, not ENGINES.md: {stale}"


def test_the_citation_reader_sees_a_missing_page_or_section():
    """The check above could pass by reading nothing: these must be reported."""
    text = '"""Legs (docs/engines.md §A4, Z9), wrapped (docs/engines.md\n    # §A6-Z7); docs/nowhere.md."""'
    assert citations(text) == [("engines.md", ["A4", "Z9"]), ("engines.md", ["A6", "Z7"]), ("nowhere.md", [])]
    assert missing_citations({"x.py": text}) == ["x.py: docs/engines.md §Z9", "x.py: docs/engines.md §Z7", "x.py: docs/nowhere.md"]
