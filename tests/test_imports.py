"""The rooms face one way: between packages no import runs both ways (the package graph has no
circle), the analytic planner imports neither the trainer nor the compiler tools, and the trainer
does not import the compiler tools."""

from __future__ import annotations

from helpers.imports import find_cycle, import_graph, module_files, package_graph


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_package_imports_one_that_imports_it_back():
    packages = package_graph(import_graph(module_files()))
    both = sorted(f"{a} <-> {b}" for a, targets in packages.items() for b in targets
                  if a < b and a in packages.get(b, set()))
    assert not both, f"packages that import each other: {both}"
    cycle = find_cycle(packages)
    assert cycle is None, "packages in a circle: " + " -> ".join(cycle)


def test_a_planted_arrow_back_is_found():
    modules = {"lumen_jax.ops.moe": {"lumen_jax.parallel.expert"}, "lumen_jax.parallel.expert": {"lumen_jax.ops.grouped"},
               "lumen_jax.ops.grouped": set(), "lumen_jax.lower": {"lumen_jax.compiler.lower"},
               "lumen_jax.compiler.lower": set()}
    packages = package_graph(modules)
    assert packages == {"ops": {"parallel"}, "parallel": {"ops"}, "lower": {"compiler"}, "compiler": set()}
    assert find_cycle(packages) == ["ops", "parallel", "ops"]


def test_the_planner_and_the_trainer_stay_below_the_compiler_tools():
    packages = package_graph(import_graph(module_files()))
    assert not _closure(packages, "plan") & {"train", "compiler"}, sorted(_closure(packages, "plan"))
    assert "compiler" not in _closure(packages, "train"), sorted(_closure(packages, "train"))
    assert {"plan", "train"} <= packages["compiler"]  # the tools build a trainer and read a plan


def test_the_model_reaches_the_mesh_only_through_the_rules():
    graph = import_graph(module_files())
    reached = {t for m, targets in graph.items() if m.startswith("lumen_jax.model") for t in targets
               if t.startswith("lumen_jax.parallel")}
    assert reached <= {"lumen_jax.parallel.rules"}, sorted(reached)
