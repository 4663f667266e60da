"""Which layer may import which (tests/test_purity.py grown into a table).

Statically, for every module: each import statement anywhere in it (inside functions and
``if TYPE_CHECKING:`` blocks too) against the table ``LAYERS``. A row names the pdxfer
modules a layer may import and the third-party libraries it may use, and for the low
layers the standard-library modules it must not. A new subpackage needs a row. Loading a
module by name (importlib) is refused outside tools: no import graph would see it. The
same walk finds import circles, between layers and between modules.

At run time, for the pure core (DESIGN: "The core is pure"): a fresh interpreter imports
it and must not load asyncio, ZMQ, the transfer engine, torch, sockets or threads. A
fresh one, since this test process has long since imported asyncio, threading and the
rest through pytest and its plugins.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pdxfer"

ANY = frozenset({"*"})
# What the pure core and the roles must not touch: I/O loops, sockets, threads, processes.
CONCURRENCY = frozenset({"asyncio", "concurrent", "multiprocessing", "selectors", "signal", "socket", "subprocess", "threading"})


@dataclass(frozen=True)
class Rule:
    """``pdxfer``: what of pdxfer a module may import, each entry relative to pdxfer:
    ``"core.*"`` the subpackage and every module in it, ``"transport"`` exactly that module
    (here the package's ``__init__``: the interface, not the modules beside it), ``"*"``
    anything. ``third_party``: the top-level names of the libraries it may import.
    ``banned_stdlib``: standard-library modules it must not import."""

    pdxfer: frozenset[str]
    third_party: frozenset[str] = frozenset()
    banned_stdlib: frozenset[str] = frozenset()


def rule(pdxfer: str = "", third_party: str = "", banned_stdlib: frozenset[str] = frozenset()) -> Rule:
    return Rule(frozenset(pdxfer.split()), frozenset(third_party.split()), banned_stdlib)


# Keys are layers (a subpackage, or a top-level module); a module's row is that of the
# longest key it falls under, so a module may have a stricter row than its layer's.
LAYERS: dict[str, Rule] = {
    # Pure: messages, tables, arithmetic. tomli is tomllib before Python 3.11.
    "core": rule("core.*", "msgspec numpy tomli", banned_stdlib=CONCURRENCY),
    # Room logic over the core. Its effects go through the port it is built with
    # (roles.ports): it makes Jobs (transport's __init__) but never sees the pump's
    # thread, an engine, a socket or host memory.
    "roles": rule("core.* roles.* transport", "msgspec numpy", banned_stdlib=CONCURRENCY),
    # Moving bytes: the interface, the engines, the pump; never a role or the daemon.
    # logs: the engine's own process (transport.engine_process) sets up logging like a daemon.
    "transport": rule("core.* transport.* host.* logs", "msgspec numpy mooncake"),
    # Messages between processes; never a role or the daemon.
    "wire": rule("core.* wire.*", "msgspec zmq"),
    # Batching, envelopes and the daemon-to-daemon channel are transport-neutral: no ZMQ.
    "wire.batch": rule(""),
    "wire.seal": rule("core.* wire.batch", "msgspec"),
    "wire.bootstrap": rule("core.* wire.batch wire.seal", "msgspec"),
    "host": rule("core.* host.*", "numpy"),
    # The shell that wires everything; its start-up checks are the doctor's (ops.hostchecks).
    "daemon": rule("core.* roles.* transport.* wire.* host.* daemon.* ops.hostchecks", "msgspec numpy zmq prometheus_client"),
    # Operator commands reach a daemon only through its admin API (core.protocol over
    # wire); the doctor asks transport.mooncake which engine is installed.
    "ops": rule("core.* wire.* host.* transport.mooncake ops.*", "msgspec zmq"),
    # The engine's library: never the daemon, a role or a transport.
    "client": rule("core.* wire.sockets wire.batch host.memory host.processes", "msgspec numpy zmq torch"),
    # Engine adapters run in the engine's process beside the client: the engine's
    # library and the pure core, never the daemon, a role or a transport; the engine
    # itself (the user's installation); and host.memory, whose naming of shared memory
    # the CPU KV an adapter moves there shares, so that the orphan sweep finds it.
    "adapters": rule("client core.* host.memory adapters.*", "sglang torch numpy msgspec"),
    # vLLM's connector: vLLM and torch too, and the engine library's shared memory
    # (host.memory), where the CPU KV cache moves so that the daemon can map it; its
    # daemon session is the adapters' one (adapters.session).
    "adapters.vllm": rule("client core.* host.memory adapters.cuda adapters.session adapters.vllm.*", "vllm torch numpy"),
    # The request params are shared with the proxy, which runs without vLLM installed:
    # `pdxfer proxy`'s face (its flags, loaded by cli) and its aiohttp server, loaded when it runs.
    "adapters.vllm.params": rule(""),
    "adapters.vllm.proxy": rule("adapters.vllm.routing"),
    "adapters.vllm.routing": rule("adapters.vllm.params", "aiohttp"),
    # The package's face: the engine's API, imported on first use.
    "__init__": rule("client core.*"),
    "__main__": rule("cli"),
    # The dispatcher: the only product module that may import tools (pdxfer demo, bench, soak).
    "cli": rule("*", "msgspec"),
    "loop": rule("", "uvloop"),
    # The log relay runs logs.py by path in an isolated interpreter (-I): the standard library only.
    "logs": rule(""),
    # Test and demonstration tooling may use anything; nothing but cli imports it.
    "tools": Rule(ANY, ANY),
}


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # a pdxfer module ("pdxfer.core.rooms") or a top-level name ("zmq")


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package at ``package``, by dotted name ("pdxfer.core.rooms")."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """What the module ``name`` imports, wherever in it, relative imports resolved. For
    ``from X import a``: X.a when that is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            else:
                base = node.module
            found += [Import(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base) for alias in node.names]
        elif isinstance(node, ast.Call) and _by_string(node):
            found.append(Import(node.lineno, "importlib.import_module"))
    return found


def _by_string(call: ast.Call) -> bool:
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return called in ("import_module", "__import__")


def layer_of(name: str, table: dict[str, Rule]) -> str | None:
    """The longest key of ``table`` that the module ``name`` falls under."""
    rest = name.split(".", 1)[1] if "." in name else "__init__"
    parts = rest.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in table:
            return key
    return None


def allowed(target: str, patterns: frozenset[str]) -> bool:
    rest = target.split(".", 1)[1] if "." in target else "__init__"
    for pattern in patterns:
        if pattern == "*" or pattern == rest:
            return True
        if pattern.endswith(".*") and (rest == pattern[:-2] or rest.startswith(pattern[:-1])):
            return True
    return False


def violations(package: Path, table: dict[str, Rule]) -> list[str]:
    """Every import of every module in ``package`` that ``table`` does not allow, and
    every module that no row covers, as 'path:line: why' lines."""
    known = modules(package)
    stdlib = sys.stdlib_module_names
    found = []
    for name, path in known.items():
        where = path.relative_to(package.parent)
        layer = layer_of(name, table)
        if layer is None:
            found.append(f"{where}: {name} is in no layer of the table: give its subpackage a row")
            continue
        row = table[layer]
        for imp in imports(name, path, known):
            top = imp.target.split(".")[0]
            if imp.target == "importlib.import_module":
                if row.third_party != ANY:
                    found.append(f"{where}:{imp.line}: {layer} loads a module by name (import_module): no import graph sees that; import it")
            elif top == package.name:
                if imp.target != name and not allowed(imp.target, row.pdxfer):
                    found.append(f"{where}:{imp.line}: {layer} imports {imp.target}")
            elif top in stdlib or top == "__future__":
                if top in row.banned_stdlib:
                    found.append(f"{where}:{imp.line}: {layer} imports {imp.target}, which its row bans")
            elif row.third_party != ANY and top not in row.third_party:
                found.append(f"{where}:{imp.line}: {layer} imports the library {top}")
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of the package at ``package`` -> the modules of it that it imports."""
    known = modules(package)
    return {name: {i.target for i in imports(name, path, known) if i.target in known and i.target != name} for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of two or more nodes
    (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between layers (a subpackage, or a top-level module)."""
    def layer(name: str) -> str:
        return name.split(".")[1] if "." in name else "__init__"

    layers: dict[str, set[str]] = {}
    for name, targets in graph.items():
        layers.setdefault(layer(name), set()).update(layer(t) for t in targets if layer(t) != layer(name))
    return layers


def test_no_import_circles():
    """The table lets a layer import its own modules freely and lets tools import
    anything, so circles are checked apart: none between layers, and none between modules."""
    graph = import_graph(PACKAGE)
    assert circles(layer_graph(graph)) == []
    assert circles(graph) == []


def test_every_import_keeps_to_its_layer():
    assert len(modules(PACKAGE)) > 50  # the walk really found the package
    assert violations(PACKAGE, LAYERS) == []


def test_the_table_catches_a_forbidden_import(tmp_path):
    """A package laid out like pdxfer, with imports the table forbids, and some it allows."""
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/rooms.py": "import asyncio\nimport msgspec\n\n\ndef later():\n    from ..daemon import server\n",
        "core/plan.py": "from . import rooms\nimport numpy\nimport zmq\n",
        "daemon/__init__.py": "",
        "daemon/server.py": "from ..core import rooms\nfrom ..roles.base import Service\n",
        "roles/__init__.py": "",
        "roles/base.py": "from ..transport import Job\nfrom ..transport import pump\nimport threading\n",
        "transport/__init__.py": "",
        "transport/pump.py": "import threading\nfrom ..roles import base\n",
        "ops/__init__.py": "",
        "ops/commands.py": "import importlib\n\n\ndef run(name):\n    return importlib.import_module(f'pdxfer.ops.{name}')\n",
        "ops/inspection.py": "from ..daemon.server import read_secret\nfrom ..tools import sim\n",
        "tools/__init__.py": "",
        "tools/sim.py": "import importlib\nfrom ..daemon import server\nimport mooncake\nimportlib.import_module('pdxfer.cli')\nfrom .. import cli\n",
        "cli.py": "def main():\n    from .tools import sim\n",
        "gadgets/__init__.py": "",
        "adapters/__init__.py": "",
        "adapters/engine.py": "import sglang\nfrom ..client import Client\nfrom ..roles import base\n",
    }
    root = tmp_path / "pdxfer"
    for relative, source in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(source)
    assert sorted(violations(root, LAYERS)) == sorted([
        "pdxfer/gadgets/__init__.py: pdxfer.gadgets is in no layer of the table: give its subpackage a row",
        "pdxfer/adapters/engine.py:3: adapters imports pdxfer.roles.base",  # an adapter speaks to the daemon as an engine
        "pdxfer/core/rooms.py:1: core imports asyncio, which its row bans",
        "pdxfer/core/rooms.py:6: core imports pdxfer.daemon.server",  # inside a function counts too
        "pdxfer/core/plan.py:3: core imports the library zmq",
        "pdxfer/roles/base.py:2: roles imports pdxfer.transport.pump",  # Job from transport/__init__ is fine
        "pdxfer/roles/base.py:3: roles imports threading, which its row bans",
        "pdxfer/transport/pump.py:2: transport imports pdxfer.roles.base",
        "pdxfer/ops/commands.py:5: ops loads a module by name (import_module): no import graph sees that; import it",
        "pdxfer/ops/inspection.py:1: ops imports pdxfer.daemon.server",
        "pdxfer/ops/inspection.py:2: ops imports pdxfer.tools.sim",
    ])
    graph = import_graph(root)
    assert circles(graph) == [["pdxfer.cli", "pdxfer.tools.sim"], ["pdxfer.core.rooms", "pdxfer.daemon.server"],
                              ["pdxfer.roles.base", "pdxfer.transport.pump"]]
    assert circles(layer_graph(graph)) == [["cli", "tools"], ["core", "daemon"], ["roles", "transport"]]


CORE = ["protocol", "errors", "config", "rooms", "slots", "plan", "staging", "stamp", "paths", "topology", "liveness", "generations"]
# socket and threading are checked too: today no stdlib or third-party dependency of
# the core (msgspec, numpy, tomllib, zlib) pulls them in. If one ever does indirectly
# (logging, for instance, imports threading), narrow this list to the first four
# and say which import did it.
FORBIDDEN = ["asyncio", "zmq", "mooncake", "torch", "socket", "threading", "uvloop"]


def loaded_after_importing(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    return set(json.loads(out.stdout))


def test_core_imports_nothing_impure():
    assert sorted(path.stem for path in (PACKAGE / "core").glob("*.py") if path.stem != "__init__") == sorted(CORE)
    loaded = loaded_after_importing([f"pdxfer.core.{m}" for m in CORE])
    assert {f"pdxfer.core.{m}" for m in CORE} <= loaded  # the check really imported them
    hits = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert hits == [], f"the pure core imported {hits}"


def test_the_check_can_fail():
    # pump is deliberately not pure (it owns a thread); seeing threading there proves
    # the subprocess check detects an impure import.
    assert "threading" in loaded_after_importing(["pdxfer.transport.pump"])


# --- composition: a role is made of parts, not mixed from classes (issue 44)


def pdxfer_classes(root: Path) -> set[str]:
    """The names of every class defined in the package."""
    return {node.name for path in root.rglob("*.py") for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def mixed_classes(root: Path, under: str, ours: set[str]) -> list[str]:
    """Classes under ``root/under`` with more than one base that is a class of the package's (typing.Protocol aside)."""
    found = []
    for path in sorted((root / under).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
                mine = [b for b in bases if b in ours and b != "Protocol"]
                if len(mine) > 1:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.name}({', '.join(mine)})")
    return found


def test_no_role_class_has_more_than_one_base_of_the_package():
    assert mixed_classes(PACKAGE, "roles", pdxfer_classes(PACKAGE)) == []


CALLBACK_NAMES = {"keep", "greeting"}


def late_assignments(root: Path, under: str) -> list[str]:
    """Assignments under ``root/under`` to an attribute of a role (anything reached through
    ``service``) or to a callback of another object (``x.on_...``, ``x.keep``, ``x.greeting``)."""
    found = []
    for path in sorted((root / under).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                chain, value = [], target.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                chain.append(value.id if isinstance(value, ast.Name) else "")
                on_role = "service" in chain
                callback = (target.attr.startswith("on_") or target.attr in CALLBACK_NAMES) and chain != ["self"]
                if on_role or callback:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_daemon_assigns_no_attribute_of_a_role_and_no_callback_after_construction():
    assert late_assignments(PACKAGE, "daemon") == []


def test_the_composition_checks_can_fail(tmp_path):
    root = tmp_path / "pdxfer"
    (root / "roles").mkdir(parents=True)
    (root / "daemon").mkdir()
    (root / "roles" / "mixed.py").write_text("class A: ...\nclass B: ...\nclass C(A, B): ...\nclass D(A): ...\n")
    (root / "daemon" / "wiring.py").write_text("def f(self, link):\n    self.service.x = 1\n    link.on_error = f\n    link.keep = f\n"
                                               "    self.on_reset = f\n")
    assert mixed_classes(root, "roles", pdxfer_classes(root)) == ["pdxfer/roles/mixed.py:3: C(A, B)"]
    assert late_assignments(root, "daemon") == ["pdxfer/daemon/wiring.py:2: self.service.x", "pdxfer/daemon/wiring.py:3: link.on_error",
                                                "pdxfer/daemon/wiring.py:4: link.keep"]
