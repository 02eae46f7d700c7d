"""The package's shape: no import circles, the build does not import the planner, and the Layout
section of docs/ARCHITECTURE.md lists every module of the tree (and nothing that is gone)."""

from __future__ import annotations

import pathlib

from helpers.imports import find_cycle, import_graph, module_files

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_find_cycle_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_build_of_a_run_does_not_import_the_planner():
    graph = import_graph(module_files())
    seen, todo = set(), ["lumen_jax.train.build"]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert not {m for m in seen if m.startswith("lumen_jax.plan")}, sorted(m for m in seen if m.startswith("lumen_jax.plan"))


def layout_modules(text: str) -> set[str]:
    """The module files a page's Layout section lists: `dir/` lines, then `  name.py` lines under them."""
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


def test_architecture_layout_lists_every_module():
    listed = layout_modules((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    tree = tree_modules()
    assert not tree - listed, f"modules docs/ARCHITECTURE.md's Layout section does not list: {sorted(tree - listed)}"
    assert not listed - tree, f"docs/ARCHITECTURE.md's Layout section lists modules that are gone: {sorted(listed - tree)}"


def test_layout_reader_sees_a_missing_line():
    text = "## Layout\n\n```\nlumen_jax/train/   x\n  cli.py   y\nlumen_jax/lower.py  z\n```\n"
    assert layout_modules(text) == {"lumen_jax/train/cli.py", "lumen_jax/lower.py"}
