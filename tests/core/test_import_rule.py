"""flashpoint.policy, flashpoint.partition and flashpoint.sim stay pure: no asyncio,
networking, torch, NVML, RPC or actors (STYLE.md, the import rule). The simulator may reuse
policy/, partition/ and the state classes, never rpc/. And the floors: no import circle among
flashpoint's modules (lazy and TYPE_CHECKING imports included), and policy/ and partition/
import no higher floor than errors and ids."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import flashpoint
import flashpoint.partition
import flashpoint.policy
import flashpoint.sim

POLICY_DIR = Path(flashpoint.policy.__file__).parent
FORBIDDEN = ("asyncio", "aiohttp", "torch", "pynvml", "flashpoint.rpc",
             "flashpoint.controller", "flashpoint.host", "flashpoint.worker")
MODULES = sorted(POLICY_DIR.glob("*.py"))
PARTITION_DIR = Path(flashpoint.partition.__file__).parent
PARTITION_MODULES = sorted(PARTITION_DIR.glob("*.py"))
SIM_DIR = Path(flashpoint.sim.__file__).parent
SIM_MODULES = sorted(SIM_DIR.rglob("*.py"))


# The simulator drives the controller's pure state package (STYLE §1, §11), never the
# actors' I/O modules. "flashpoint.controller" itself is named exactly (its __init__ imports
# nothing); everything under "flashpoint.controller.state" is allowed.
SIM_ALLOWED = ("flashpoint.controller", "flashpoint.controller.state")
STATE_DIR = Path(flashpoint.__file__).parent / "controller" / "state"


def _forbidden(mod: str, allowed: tuple[str, ...] = ()) -> bool:
    if mod in allowed or any(mod.startswith(a + ".") for a in allowed[1:]):
        return False
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


def _imports(tree: ast.AST, package: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against flashpoint.policy
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]  # from flashpoint import rpc
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("__import__",
                                                                               "import_module"):
            if node.args and isinstance(node.args[0], ast.Constant):
                out.append(str(node.args[0].value))
    return out


def test_policy_modules_found():
    assert {"autoscale.py", "placement.py", "snapshot.py"} <= {p.name for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_policy_module_imports_are_pure(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, "flashpoint.policy") if _forbidden(m)]
    assert bad == [], f"{path.name} imports {bad}"


def test_partition_modules_found():
    assert {"model.py", "solver.py", "table.py", "cache.py"} <= {p.name for p in PARTITION_MODULES}


@pytest.mark.parametrize("path", PARTITION_MODULES, ids=lambda p: p.name)
def test_partition_module_imports_are_pure(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, "flashpoint.partition") if _forbidden(m)]
    assert bad == [], f"{path.name} imports {bad}"


def test_sim_modules_found():
    assert {"__init__.py", "engine.py", "network.py"} <= {p.name for p in SIM_MODULES}


@pytest.mark.parametrize("path", SIM_MODULES, ids=lambda p: str(p.relative_to(SIM_DIR)))
def test_sim_module_imports_are_pure(path):
    # a module resolves relative imports against its own directory's package
    package = ".".join(["flashpoint", "sim", *path.relative_to(SIM_DIR).parent.parts])
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, package) if _forbidden(m, SIM_ALLOWED)]
    assert bad == [], f"{path.name} imports {bad}"


def test_state_modules_found():
    assert {"__init__.py", "core.py", "events.py", "rates.py"} <= {
        p.name for p in STATE_DIR.glob("*.py")}


@pytest.mark.parametrize("path", sorted(STATE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_controller_state_modules_are_pure(path):
    """What the simulator imports from the controller must itself keep the policy rule (and
    import nothing from the controller's actor side)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, "flashpoint.controller.state") if _forbidden(m, SIM_ALLOWED)]
    assert bad == [], f"{path.name} imports {bad}"


HOST_STATE = Path(flashpoint.__file__).parent / "host" / "state.py"


def test_host_state_is_pure():
    """HostState (STYLE §1) decides without I/O: the same rule as the controller's state."""
    tree = ast.parse(HOST_STATE.read_text(), filename=str(HOST_STATE))
    bad = [m for m in _imports(tree, "flashpoint.host") if _forbidden(m)]
    assert bad == [], f"host/state.py imports {bad}"


@pytest.mark.parametrize("package", ["flashpoint.partition", "flashpoint.sim",
                                     "flashpoint.sim.cluster", "flashpoint.sim.experiments",
                                     "flashpoint.sim.report", "flashpoint.sim.reproduce"])
def test_import_pulls_in_nothing_forbidden(package):
    """Transitively too: importing the package loads no forbidden module (numpy is fine);
    the controller's state package is the only actor-side code it loads."""
    allowed = SIM_ALLOWED if package.startswith("flashpoint.sim") else ()
    code = (f"import sys, {package}\n"
            f"ok = {allowed!r}\n"
            f"bad = [m for m in sys.modules if m not in ok[:1] and "
            f"not any(m == a or m.startswith(a + '.') for a in ok[1:]) and "
            f"any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("src,bad", [
    ("import asyncio", True), ("import torch.nn as nn", True), ("from aiohttp import web", True),
    ("from flashpoint import rpc", True), ("from flashpoint.controller.dispatch import Dispatcher", True),
    ("from ..worker import batcher", True), ("import pynvml", True),
    ("from flashpoint.policy import snapshot", False), ("import math", False),
    ("import asyncio_extras", False), ("from . import snapshot", False),
])
def test_checker_itself(src, bad):
    found = [m for m in _imports(ast.parse(src), "flashpoint.policy") if _forbidden(m)]
    assert bool(found) == bad


@pytest.mark.parametrize("src,bad", [
    ("from ..rpc.client import Client", True), ("__import__('asyncio')", True),
    ("import_module('torch')", True), ("from flashpoint.sim import engine", False),
    ("import heapq", False), ("from . import engine", False),
    ("from ..policy import autoscale", False),
    ("from flashpoint.controller.state import core as cs", False),
    ("from flashpoint.controller.state.rates import RateMeter", False),
    ("from flashpoint.controller.actor import Controller", True),
    ("from flashpoint.controller import dispatch", True), ("from ..host import actor", True),
])
def test_checker_resolves_the_simulators_imports(src, bad):
    found = [m for m in _imports(ast.parse(src), "flashpoint.sim")
             if _forbidden(m, SIM_ALLOWED)]
    assert bool(found) == bad


# ------------------------------------------------------------------------------ floors
# No import circles among flashpoint's modules, counting every import: at module level, inside
# functions (a lazy import is still an arrow between floors) and under TYPE_CHECKING. A package
# is one module (its __init__); ``from pkg import sub`` is an arrow to the submodule ``sub``.
FLASHPOINT_DIR = Path(flashpoint.__file__).parent


def _module_name(path: Path, root: Path = FLASHPOINT_DIR) -> tuple[str, str]:
    """(module, the package its relative imports resolve against) of a file under ``root``."""
    parts = ["flashpoint", *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _module_arrows(tree: ast.AST, package: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("__import__",
                                                                               "import_module"):
            if node.args and isinstance(node.args[0], ast.Constant):
                out.add(str(node.args[0].value))
    return out & known


@functools.cache
def _import_graph(root: Path = FLASHPOINT_DIR) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = {mod for mod, _ in files}
    return {mod: _module_arrows(ast.parse(p.read_text(), filename=str(p)), pkg, known) - {mod}
            for (mod, pkg), p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative, so it is bounded by the graph's size)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(cycle)
    return "; ".join(f"{m} -> {sorted(graph[m] & members)}" for m in cycle)


def test_the_import_graph_sees_lazy_and_type_checking_imports():
    graph = _import_graph()
    assert len(graph) > 100
    assert "flashpoint.controller.actor" in graph["flashpoint.cli.serve"]  # inside a function
    assert "flashpoint.sim.results" in graph["flashpoint.sim.plots"]  # under TYPE_CHECKING
    assert "flashpoint.models.zoo" in graph["flashpoint.models.sources.zoo"]  # from pkg import sub


def test_no_import_cycles_among_flashpoint_modules():
    graph = _import_graph()
    cycles = _cycles(graph)
    assert cycles == [], "import circles: " + " | ".join(_describe(c, graph) for c in cycles)


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b", "d"}, "b": {"a"}, "d": {"e"}, "e": {"d"}}, [["d", "e"], ["a", "b"]]),
    ({"a": {"a"}}, []),  # a module naming itself is no circle
])
def test_cycle_finder_itself(graph, expected):
    assert sorted(_cycles(graph)) == sorted(expected)


def test_cycle_finder_reads_files(tmp_path):
    """A lazy import inside a function closes a circle too; ``from pkg import sub`` is an
    arrow to the submodule, not to the package."""
    pkg = tmp_path / "sub"
    pkg.mkdir()
    (tmp_path / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from flashpoint.sub import low\n")
    (pkg / "low.py").write_text("X = 1\n")
    (tmp_path / "a.py").write_text("from flashpoint import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n    from .sub import low\n")
    graph = _import_graph(tmp_path)  # a fresh tmp_path each run: the cache never answers
    assert graph["flashpoint.b"] == {"flashpoint.a", "flashpoint.sub.low"}
    assert _cycles(graph) == [["flashpoint.a", "flashpoint.b"]]


# The policy and planning floor stands on the bottom one only: policy/ and partition/ import
# from flashpoint nothing but errors, ids and each other (not gpu/, spec, registry, actors).
FLOOR_BELOW_POLICY = ("flashpoint.errors", "flashpoint.ids", "flashpoint.policy",
                      "flashpoint.partition")


@pytest.mark.parametrize("path", MODULES + PARTITION_MODULES,
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_policy_and_partition_import_no_higher_floor(path):
    graph = _import_graph()
    mod, _ = _module_name(path)
    bad = sorted(m for m in graph[mod]
                 if not any(m == f or m.startswith(f + ".") for f in FLOOR_BELOW_POLICY))
    assert bad == [], f"{mod} imports {bad}"
