"""The architecture, checked: no import cycle among the project's modules, counting every import (at module
level, under ``TYPE_CHECKING`` and inside functions: each is a dependency a maintainer holds in mind), and no
module over 500 lines except the declared tables (none today). See docs/architecture.md for the layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each importable package lives (django_celery_guardrails is django_app/ once installed).
PACKAGES = {"celery_guardrails": ROOT / "celery_guardrails", "django_celery_guardrails": ROOT / "django_app"}
#: Modules allowed over MAX_LINES: declared tables, read as data (a literal, not logic).
TABLES: frozenset[str] = frozenset()
MAX_LINES = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Import:
    """One import statement of ``module``: the module it names and where (``line``)."""

    module: str
    target: str
    line: int


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (a package is its ``__init__``)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every project module ``name`` imports, wherever the statement is."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known_prefix(alias.name, known)
                if target:
                    yield Import(module=name, target=target, line=node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            for alias in node.names:
                target = _known_prefix(f"{base}.{alias.name}", known) or _known_prefix(base, known)
                if target:
                    yield Import(module=name, target=target, line=node.lineno)


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    parts = name.split(".")
    parent = parts if is_package else parts[:-1]
    parent = parent[: len(parent) - (level - 1)]
    return ".".join([*parent, module] if module else parent)


def _known_prefix(dotted: str, known: dict[str, Path]) -> str | None:
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for found in imports(name, path, known):
            # A package's own __init__ importing its submodules is how a package re-exports: not a dependency of
            # the submodule on the package. The reverse (a submodule importing its package's __init__) is one.
            if found.target != name:
                edges[name].add(found.target)
    return edges


def test_no_module_imports_its_way_back_to_itself() -> None:
    # Given every import of every module of the core and the Django app (type-only and inside functions too)
    found = cycles(graph())
    # Then no module reaches itself again: the layers are a DAG
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_the_core_imports_nothing_of_the_django_app() -> None:
    # Given every import of every module of the core (type-only and inside functions too)
    known = modules()
    core = {name: path for name, path in known.items() if name.partition(".")[0] == "celery_guardrails"}
    # Then none names the Django app: the app registers its store, sink, outbox and beat rows with the core as
    # it is ready (django_app/apps.py), so the core runs, and is read, without it
    found = [
        f"{name}:{each.line} imports {each.target}"
        for name, path in core.items()
        for each in imports(name, path, known)
        if each.target.partition(".")[0] == "django_celery_guardrails"
    ]
    assert found == []


def test_no_module_is_over_500_lines_except_declared_tables() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert {name: n for name, n in long.items() if name not in TABLES} == {}


def test_the_cycle_finder_finds_a_cycle_through_a_type_only_import() -> None:
    # Given a graph where a runs to b at module level and b back to a under TYPE_CHECKING (an edge like any other)
    found = cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()})
    # Then the cycle is a and b, and c is in none
    assert found == [["a", "b"]]


def test_every_import_counts_type_only_inside_functions_and_relative(tmp_path: Path) -> None:
    # Given a module importing at module level, under TYPE_CHECKING, inside a function and relatively
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.low\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.high import Thing\n"
        "def f():\n"
        "    from . import side\n"
        "    import json\n"
    )
    known = {name: source for name in ("pkg", "pkg.mod", "pkg.low", "pkg.high", "pkg.side")}
    # When its imports are read
    found = {(i.target, i.line) for i in imports("pkg.mod", source, known)}
    # Then each project module it names is a dependency, wherever the statement is (json is not the project's)
    assert found == {("pkg.low", 2), ("pkg.high", 4), ("pkg.side", 6)}
