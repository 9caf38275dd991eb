"""The package layout spells the pipeline: every import runs from a later stage to an earlier one.

The order is the flow of a run: configuration primitives, the catalog of models and chips,
the cost model, workloads, speculation, the scenario, the simulator (whose records and result
type flow one way, into analysis), analysis of records, the searches built on both,
calibration, and the command line on top. ``errors`` and ``compiled`` (how hot paths call
numba kernels) are below everything. A module may import its own subpackage or any earlier one, never a later one:
the cost model knows nothing of SimPy, the scheduler nothing of YAML, and the CLI stays thin.
"""
from __future__ import annotations

import ast
from pathlib import Path

import llmsim

LAYERS = ["errors", "compiled", "config", "catalog", "cost", "workload", "speculation", "scenario", "sim", "analysis",
          "search", "calibration", "report", "cli"]
PACKAGE = Path(llmsim.__file__).parent


def _layer(module: str) -> str | None:
    """The layer of an absolute module name inside llmsim, or None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llmsim" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every llmsim module a file imports (at any depth of the file), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (use absolute llmsim.* imports)"
            if node.module and node.module.split(".")[0] == "llmsim":
                if node.module == "llmsim":
                    found += [(node.lineno, f"llmsim.{alias.name}") for alias in node.names]
                else:
                    found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("llmsim.")]
    return found


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert (subpackages | modules) - {"hardware_profiles"} == set(LAYERS), \
        "add the new subpackage or top-level module to LAYERS, in pipeline order"


def test_imports_run_one_way():
    back_edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _layer("llmsim." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if own is None or own == "__init__":
            continue                      # llmsim/__init__.py is the public API: it may import anything
        for line, module in _imports(path):
            target = _layer(module)
            if target is None or target == "hardware_profiles":
                continue
            if LAYERS.index(target) > LAYERS.index(own):
                back_edges.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({own}) imports {module} ({target})")
    assert not back_edges, "imports against the pipeline:\n" + "\n".join(back_edges)


def test_the_checker_sees_a_back_edge(tmp_path):
    """The walk finds imports at any depth, including inside functions."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from llmsim.cli.main import main\n")
    assert _imports(source) == [(2, "llmsim.cli.main")]


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` (node -> the nodes it imports), or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target] if target in path else [node, target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_checker_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_modules_of_a_subpackage_import_each_other_one_way():
    """Inside a subpackage too the imports form no circle, type-checking imports included: each module
    can be read knowing only those below it."""
    cycles = []
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        edges = {}
        for path in package.glob("*.py"):
            own = f"llmsim.{package.name}.{path.stem}"
            edges[own] = {module for _, module in _imports(path) if module.startswith(f"llmsim.{package.name}.")}
        found = _cycle(edges)
        if found:
            cycles.append(" -> ".join(found))
    assert not cycles, "imports in a circle:\n" + "\n".join(cycles)


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the non-llmsim packages a file imports (at any depth of the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
    return names - {"llmsim"}


def test_only_the_command_line_draws_progress_bars():
    """Domain code reports progress through a Progress object its caller passes in; the bar is the CLI's."""
    drawing = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
               if "tqdm" in _third_party_imports(path) and path.relative_to(PACKAGE).parts[0] != "cli"]
    assert not drawing, "modules below the command line import tqdm: " + ", ".join(drawing)
