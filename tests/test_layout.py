"""The runtime's layout holds: subpackages import one way (the order below,
each importing only those beneath it), through each other's ``__init__``,
with no circle among modules and no module past ~500 lines; importing
``strata_runtime`` loads no subpackage ``load`` does not need (a layer split
is imported when one is asked for)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Bottom to top: each may import those before it, never those after.
ORDER = ["files", "text", "state", "models", "conversations", "speculation", "scheduling", "split"]
# Beside the subpackages, importing none of them (faults reads errors).
BESIDE = {"errors": -3, "faults": -2, "testing": -1, "quality": -1}
TOP = {"config": "split", "engine": None}  # config sits below split (a rank's follower reads it)
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The strata modules ``path`` imports (as written: a package, or a module in it)."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            modules = {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
            found |= modules if len(modules) == len(node.names) else modules | {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {f for f in found if f.split(".")[0] in ("strata_runtime", "strata_kernels", "strata_server")}


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = sorted(SRC.glob("strata_*/**/*.py"))
RUNTIME = [p for p in MODULES if p.relative_to(SRC).parts[0] == "strata_runtime"]


def _place(module: str) -> str | None:
    """The subpackage (or top-level module) of the runtime ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "strata_runtime" and len(parts) > 1 else None


def _rank(place: str | None) -> float:
    if place is None:
        return len(ORDER) + 1  # the package's own face, above everything
    if place in ORDER:
        return ORDER.index(place)
    if place in BESIDE:
        return BESIDE[place]
    if place == "config":
        return ORDER.index("split") - 0.5
    return len(ORDER)  # engine


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_run_down_and_through_each_subpackages_face(path: Path):
    here = _place(_module_name(path))
    for target in _imports(path):
        there = _place(target)
        if there is None or there == here:
            continue
        assert _rank(there) < _rank(here), (
            f"{path.relative_to(SRC)} imports {target}: {there} is not beneath {here} (order, bottom up: "
            f"{', '.join(ORDER)}, config, engine; errors, faults and testing beside)")
        if there in ORDER:
            assert target == f"strata_runtime.{there}", (
                f"{path.relative_to(SRC)} imports {target}: take it from strata_runtime.{there}, whose "
                "__init__ names what the subpackage offers")


def test_no_module_imports_itself_around_a_circle():
    def reached(target: str) -> set[str]:
        """``target`` and the packages above it: Python runs their ``__init__`` first."""
        parts = target.split(".")
        return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}

    graph = {_module_name(p): {r for t in _imports(p) if _is_module(t) for r in reached(t)} for p in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt == node or node.startswith(nxt + "."):
                continue  # a module and a package it sits in: Python imports the package first
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if state.get(nxt) is None:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_past_500_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines: split it by what its parts do"


def _loaded_after(statement: str) -> set[str]:
    code = (f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules "
            "if m.startswith(('strata_runtime', 'triton')))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


def test_each_subpackage_imports_alone_with_only_those_beneath_it():
    for i, name in enumerate(ORDER):
        subpackages = {m.split(".")[1] for m in _loaded_after(f"import strata_runtime.{name}")
                       if m.count(".") >= 1 and m.split(".")[1] in ORDER}
        assert subpackages <= set(ORDER[:i + 1]), f"importing {name} loaded {sorted(subpackages - set(ORDER[:i + 1]))}"


def test_importing_strata_runtime_loads_no_subpackage_and_load_leaves_the_split_and_triton_unloaded():
    assert _loaded_after("import strata_runtime") == {"strata_runtime", "strata_runtime.errors"}
    loaded = _loaded_after("import strata_runtime; strata_runtime.load")
    assert {f"strata_runtime.{name}" for name in ORDER[:-1]} <= loaded
    assert "strata_runtime.split" not in loaded
    assert not any(m == "triton" or m.startswith("triton.") for m in loaded)
