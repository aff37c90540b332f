"""flashpoint.sim stays pure: no asyncio, aiohttp, torch, NVML, RPC or actors (STYLE.md, the
import rule). It may reuse policy/, partition/ and the state classes, never rpc/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import flashpoint.sim

SIM_DIR = Path(flashpoint.sim.__file__).parent
FORBIDDEN = ("asyncio", "aiohttp", "torch", "pynvml", "flashpoint.rpc", "flashpoint.actors")
MODULES = sorted(SIM_DIR.rglob("*.py"))


def _forbidden(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


def _package_of(path: Path) -> str:
    # engine.py and __init__.py both live in (and resolve relative imports against) their dir.
    rel = path.relative_to(SIM_DIR).parent
    return ".".join(["flashpoint", "sim", *rel.parts])


def _imports(tree: ast.AST, package: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
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


def test_sim_modules_found():
    assert {"__init__.py", "engine.py", "network.py"} <= {p.name for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SIM_DIR)))
def test_sim_module_imports_are_pure(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imports(tree, _package_of(path)) if _forbidden(m)]
    assert bad == [], f"{path.name} imports {bad}"


def test_sim_import_pulls_in_nothing_forbidden():
    """Transitively too: importing the simulator loads no forbidden module."""
    code = ("import sys, flashpoint.sim\n"
            f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("src,bad", [
    ("import asyncio", True), ("import torch.nn as nn", True), ("from aiohttp import web", True),
    ("from flashpoint import rpc", True), ("from flashpoint.actors.dispatch import Dispatcher", True),
    ("from ..actors import batcher", True), ("from ..rpc.client import Client", True),
    ("import pynvml", True), ("__import__('asyncio')", True),
    ("from flashpoint.sim import engine", False), ("import heapq", False),
    ("import asyncio_extras", False), ("from . import engine", False),
    ("from ..policy import autoscale", False),
])
def test_checker_itself(src, bad):
    found = [m for m in _imports(ast.parse(src), "flashpoint.sim") if _forbidden(m)]
    assert bool(found) == bad
