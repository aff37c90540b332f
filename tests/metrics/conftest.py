"""A real Prometheus (Debian's ``prometheus`` package) started by PID on loopback.

``.ci/run`` and the README's test command install it (``prometheus`` and ``promtool``); the
tests skip, saying so, where it is missing. Each Prometheus gets a random free port, a
temporary config and data directory, and is stopped by its PID at the end of the test even
when the test failed (SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
STOP_TIMEOUT_S = 10.0


def need(binary: str) -> str:
    if not os.path.exists(binary):
        pytest.skip(f"needs Debian's prometheus package ({Path(binary).name}): "
                    "apt-get install -y prometheus")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text().lower()
    except FileNotFoundError:
        return False


class Prometheus:
    """One Prometheus process scraping ``jobs`` (job name -> ``host:port`` targets)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self, jobs: dict[str, list[str]], scrape_interval_s: float = 1.0,
                    timeout_s: float = 30.0) -> None:
        need(PROMETHEUS)
        interval = f"{round(scrape_interval_s * 1000)}ms"
        cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
               "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                                  for job, targets in jobs.items()]}
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps(cfg))  # JSON is YAML
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (self.workdir / "prometheus.log").open("wb")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                PROMETHEUS, f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h", "--log.level=warn",
                stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                break
            try:
                async with self._session.get(f"{self.url}/-/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"Prometheus not ready within {timeout_s}s "
                             f"(exit {self.proc.returncode}): {self.log_tail()}")

    def log_tail(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    async def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data`` (an AssertionError when not ``success``)."""
        assert self._session is not None
        async with self._session.get(f"{self.url}/api/v1/{path}", params=params) as r:
            body = await r.json()
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    async def wait(self, what: str, check: Callable[[], Awaitable[tuple[bool, Any]]],
                   timeout_s: float = 60.0, interval_s: float = 0.5) -> Any:
        """Await ``check()`` -> ``(done, detail)`` until done (``detail`` returned), at most
        ``timeout_s``; on timeout say what was awaited and the last try's ``detail``."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, detail = await check()
            if done:
                return detail
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {detail}")
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        assert not _alive(proc.pid), f"prometheus {proc.pid} outlived the test"


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[Prometheus]:
    """A Prometheus to start with the test's targets; stopped by PID at the end."""
    need(PROMETHEUS)
    prom = Prometheus(tmp_path / "prometheus")
    prom.workdir.mkdir()
    try:
        yield prom
    finally:
        await prom.stop()
