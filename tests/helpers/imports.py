"""The package's import graph, read from the source (every import statement, deferred ones too)."""

from __future__ import annotations

import ast
import pathlib

from helpers.paths import REPO

PACKAGE = pathlib.Path(REPO) / "lumen_jax"


def module_files() -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module in lumen_jax/ (packages by their __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """{module: modules of ours it imports}, every import statement counted (deferred ones too)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def package_of(module: str) -> str:
    """The room a module lives in: `lumen_jax.plan.cost` -> `plan`; a top-level module is its own."""
    return module.split(".")[1] if module.count(".") else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: packages it imports}, from a module graph."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None
