"""flashpoint.policy, flashpoint.partition and flashpoint.sim stay pure: no asyncio,
networking, torch, NVML, RPC or actors (STYLE.md, the import rule). The simulator may reuse
policy/, partition/ and the state classes, never rpc/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import flashpoint
import flashpoint.partition
import flashpoint.policy
import flashpoint.sim

POLICY_DIR = Path(flashpoint.policy.__file__).parent
FORBIDDEN = ("asyncio", "aiohttp", "torch", "pynvml", "flashpoint.rpc", "flashpoint.actors")
MODULES = sorted(POLICY_DIR.glob("*.py"))
PARTITION_DIR = Path(flashpoint.partition.__file__).parent
PARTITION_MODULES = sorted(PARTITION_DIR.glob("*.py"))
SIM_DIR = Path(flashpoint.sim.__file__).parent
SIM_MODULES = sorted(SIM_DIR.rglob("*.py"))


# The simulator drives the controller's pure state class and its rate meter (STYLE §1, §11),
# never the actors' I/O modules. "flashpoint.actors" itself is a namespace package (no
# __init__), so naming it runs nothing.
SIM_ALLOWED = ("flashpoint.actors", "flashpoint.actors.controller_state",
               "flashpoint.actors.controller_messages", "flashpoint.actors.rates")
ACTORS_DIR = Path(flashpoint.__file__).parent / "actors"


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


@pytest.mark.parametrize("name", ["controller_state.py", "controller_messages.py", "rates.py"])
def test_actor_modules_the_simulator_uses_are_pure(name):
    """What the simulator may import from actors/ must itself keep the policy rule (and
    import nothing else from actors/ than those modules)."""
    path = ACTORS_DIR / name
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, "flashpoint.actors") if _forbidden(m, SIM_ALLOWED)]
    assert bad == [], f"{name} imports {bad}"


@pytest.mark.parametrize("package", ["flashpoint.partition", "flashpoint.sim",
                                     "flashpoint.sim.cluster", "flashpoint.sim.experiments"])
def test_import_pulls_in_nothing_forbidden(package):
    """Transitively too: importing the package loads no forbidden module (numpy is fine);
    the simulator's state classes are the only actors/ modules it loads."""
    allowed = SIM_ALLOWED if package.startswith("flashpoint.sim") else ()
    code = (f"import sys, {package}\n"
            f"bad = [m for m in sys.modules if m not in {allowed!r} and "
            f"any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("src,bad", [
    ("import asyncio", True), ("import torch.nn as nn", True), ("from aiohttp import web", True),
    ("from flashpoint import rpc", True), ("from flashpoint.actors.dispatch import Dispatcher", True),
    ("from ..actors import batcher", True), ("import pynvml", True),
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
    ("from flashpoint.actors import controller_state as cs", False),
    ("from flashpoint.actors.rates import RateMeter", False),
    ("from flashpoint.actors.controller import Controller", True),
    ("from flashpoint.actors import dispatch", True), ("from ..actors import host", True),
])
def test_checker_resolves_the_simulators_imports(src, bad):
    found = [m for m in _imports(ast.parse(src), "flashpoint.sim")
             if _forbidden(m, SIM_ALLOWED)]
    assert bool(found) == bad
