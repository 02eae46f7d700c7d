"""The package's shape: no import circles, the build does not import the planner, and README's
Layout section lists every module of the tree (and nothing that is gone)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lumen_jax"


def _module_files() -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module in lumen_jax/ (packages by their __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
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


def test_find_cycle_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph(_module_files()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_build_of_a_run_does_not_import_the_planner():
    graph = import_graph(_module_files())
    seen, todo = set(), ["lumen_jax.train.build"]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert not {m for m in seen if m.startswith("lumen_jax.plan")}, sorted(m for m in seen if m.startswith("lumen_jax.plan"))


def readme_modules(text: str) -> set[str]:
    """The module files README's Layout section lists: `dir/` lines, then `  name.py` lines under them."""
    block = text.split("## Layout\n", 1)[1].split("```\n", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines():
        word = line.split()[0] if line.strip() else ""
        if not line.startswith(" "):
            folder = word if word.endswith("/") else ""
            if word.endswith(".py"):
                listed.add(word)
        elif word.endswith(".py"):
            listed.add(folder + word)
    return listed


def tree_modules() -> set[str]:
    """Every module file of lumen_jax/ and kernels/ but the packages' __init__.py."""
    return {str(p.relative_to(ROOT)) for top in ("lumen_jax", "kernels") for p in (ROOT / top).rglob("*.py")
            if p.name != "__init__.py"}


def test_readme_layout_lists_every_module():
    listed = readme_modules((ROOT / "README.md").read_text(encoding="utf-8"))
    tree = tree_modules()
    assert not tree - listed, f"modules README's Layout section does not list: {sorted(tree - listed)}"
    assert not listed - tree, f"README's Layout section lists modules that are gone: {sorted(listed - tree)}"


def test_readme_layout_reader_sees_a_missing_line():
    text = "## Layout\n\n```\nlumen_jax/train/   x\n  cli.py   y\nlumen_jax/lower.py  z\n```\n"
    assert readme_modules(text) == {"lumen_jax/train/cli.py", "lumen_jax/lower.py"}
