"""The real ``flashpoint`` command line in a subprocess of its own, and a controller for it
to talk to (in this test's event loop, no hosts: registering, listing and status need none)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flashpoint.config import ClusterConfig, load_config

CLI_TIMEOUT_S = 120


def run_cli(*argv: str, home: Path, env: dict[str, str | None] | None = None,
            stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m flashpoint.cli --home HOME ARGV`` (``env`` on top of this process's; a
    None value unsets); subprocess.run kills it at the timeout, so none outlives the test."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("FLASHPOINT_DEBUG", "FLASHPOINT_URL", "FLASHPOINT_API_KEY")}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run([sys.executable, "-m", "flashpoint.cli", "--home", str(home), *argv],
                          stdout=subprocess.PIPE if stdout is None else stdout,
                          stderr=subprocess.PIPE, text=True, timeout=CLI_TIMEOUT_S,
                          stdin=subprocess.DEVNULL, env=full_env)


async def arun_cli(*argv: str, home: Path, env: dict[str, str | None] | None = None,
                   stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` off the event loop (the controller it talks to runs on it)."""
    return await asyncio.to_thread(run_cli, *argv, home=home, env=env, stdout=stdout)


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A failed command: non-zero exit, nothing on stdout, one line on stderr holding every
    needle, no traceback. Returns the line."""
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def refused_port() -> tuple[socket.socket, int]:
    """A port that refuses connections while the returned socket (bound, not listening)
    is open: no other process can take it meanwhile."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def controller_config(tmp_path: Path, **gateway: object) -> ClusterConfig:
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "loop_interval_s": 0.05},
        "gateway": dict(gateway),
    }).with_home(tmp_path)


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[str]:
    """A started controller with a two-layer no-op model published (and profiled, so a
    deploy may ask for pipeline stages) as ``noop@1``; its URL."""
    from flashpoint.controller.actor import Controller
    from flashpoint.models.sources import publish
    from flashpoint.registry import make_store

    cfg = controller_config(tmp_path)
    store = make_store(cfg)
    await publish(store, "noop", {"num_layers": 2}, "1", model_name="noop", profile=True)
    ctl = Controller(cfg, store)
    await asyncio.wait_for(ctl.start(), 30)
    try:
        yield ctl.url
    finally:
        await asyncio.wait_for(ctl.stop(), 30)
