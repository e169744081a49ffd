"""The import structure: no cycle among the harness's modules, and a core that names no method or task.

Read from the source (every ``import`` and ``from ... import``, at module level or inside functions), so that a
cycle is caught even where it would only show at run time."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("icecache", "icecache_harness")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the harness modules it imports. ``from .x import y`` points at ``x`` (or at ``x.y`` when that is a
    module); ``from . import y`` at the sibling ``y`` only, not at the package it sits in."""
    known = modules()

    def nearest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [nearest(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in known:
                        targets.append(full)
                    elif node.module is not None or node.level == 0:
                        targets.append(nearest(base))
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_harness_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_core_names_no_method_and_no_task():
    plugins = ("icecache.methods", "icecache.tasks", "icecache_harness")
    for name, targets in import_graph().items():
        if name.startswith("icecache.core"):
            named = sorted(t for t in targets if t.startswith(plugins))
            assert not named, f"{name} imports {named}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_imports_nothing_from_the_application():
    for name, targets in import_graph().items():
        if name == "icecache" or name.startswith("icecache."):
            named = sorted(t for t in targets if t.startswith("icecache_harness"))
            assert not named, f"{name} imports {named}"
