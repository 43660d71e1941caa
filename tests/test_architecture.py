"""The packages keep to the imports their docstrings allow, and no modules import each other in
a circle.

Each package's ``__init__`` docstring (and each top-level module's docstring) ends with a
``May import:`` line naming the units it may import besides itself. A unit is a package with
such a line, or a top-level module with one; a module belongs to the nearest unit above it.
Every import counts: at the top, under ``if TYPE_CHECKING:``, inside functions.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "aiowsync"
TOP = "aiowsync"
MAX_TOP_LEVEL = 8
MAX_LINES = 450


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def _modules() -> dict[str, Module]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = [TOP, *path.relative_to(SRC).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = Module(".".join(parts), path, is_package)
    return found


MODULES = _modules()
# Compiled modules (their stubs name them) can be imported, and import nothing.
EXTENSIONS = {
    ".".join([TOP, *p.relative_to(SRC).with_suffix("").parts]) for p in SRC.rglob("*.pyi")
}


def _rule(module: Module) -> set[str] | None:
    """The units a module's docstring allows, or None if it states no rule."""
    doc = ast.get_docstring(ast.parse(module.path.read_text())) or ""
    match = re.search(r"May import:\s*(.+?)(?:\.\s*$|\.\n)", doc, re.S | re.M)
    if match is None:
        return None
    text = " ".join(match.group(1).split())
    if text == "nothing of aiowsync":
        return set()
    if text == "anything of aiowsync":
        return {"*"}
    return {name.strip() for name in text.split(",")}


RULES = {name: rule for name, m in MODULES.items() if (rule := _rule(m)) is not None}


def _unit(name: str) -> str:
    """The nearest unit at or above ``name``."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in RULES:
            return candidate
        parts.pop()
    raise AssertionError(f"{name} belongs to no unit with a 'May import:' rule")


def _known(name: str) -> str | None:
    """``name`` as a module of ours (the longest known prefix), if it is one."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES or candidate in EXTENSIONS:
            return candidate
        parts.pop()
    return None


def _imports(module: Module) -> Iterator[tuple[int, str]]:
    """(line, module of ours) for every import in ``module``, wherever it stands."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(ast.parse(module.path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == TOP:
                    yield node.lineno, _known(alias.name) or alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != TOP:
                continue
            for alias in node.names:
                # ``from package import module`` imports the module.
                yield node.lineno, _known(f"{target}.{alias.name}") or _known(target) or target


EDGES = {
    name: {(line, target) for line, target in _imports(m) if target != name}
    for name, m in MODULES.items()
}


def test_every_package_states_its_rule() -> None:
    packages = [m.name for m in MODULES.values() if m.is_package]
    assert [p for p in packages if p not in RULES] == []
    for unit, rule in RULES.items():
        unknown = sorted(r for r in rule - {"*"} if r != TOP and r not in RULES)
        assert unknown == [], f"{unit} allows units that do not exist: {unknown}"


def test_imports_keep_to_the_rules() -> None:
    broken = []
    for name, edges in EDGES.items():
        unit = _unit(name)
        allowed = RULES[unit]
        for line, target in sorted(edges):
            if target not in MODULES and target not in EXTENSIONS:
                broken.append(f"{name}:{line} imports {target}, which does not exist")
                continue
            theirs = _unit(target) if target in MODULES else _unit(target.rpartition(".")[0])
            if theirs == unit or "*" in allowed or theirs in allowed:
                continue
            broken.append(f"{name}:{line} imports {target} ({theirs}), not allowed in {unit}")
    assert broken == []


def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    graph = {n: sorted({t for _, t in e if t in MODULES}) for n, e in EDGES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert _circles() == []


def test_the_top_level_stays_small() -> None:
    top = sorted(
        p.name
        for p in SRC.iterdir()
        if (p.suffix in (".py", ".c") or p.name.endswith(".so")) and p.name != "__init__.py"
    )
    assert len(top) <= MAX_TOP_LEVEL, top


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_no_module_is_over_the_size_limit(module: str) -> None:
    lines = MODULES[module].path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{module}: {lines} lines (limit {MAX_LINES})"


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The AST pass finds imports under TYPE_CHECKING, in functions and relative ones."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .._util import text\n"
        "if TYPE_CHECKING:\n"
        "    from .._sending.engine import SenderCore\n"
        "def f():\n"
        "    import aiowsync._copy.engine\n"
    )
    probe = Module("aiowsync._planes.probe", path, is_package=False)
    assert {t for _, t in _imports(probe)} == {
        "aiowsync._util.text",
        "aiowsync._sending.engine",
        "aiowsync._copy.engine",
    }
