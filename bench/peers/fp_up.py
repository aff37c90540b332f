"""Flashpoint as a user runs it: ``flashpoint up`` in a process of its own, driven over HTTP.

The benchmark used to run a ``LocalCluster`` inside its own process, on that process's
default asyncio loop and beside the code that drives the run; a user's ``flashpoint up``
is a process of its own on uvloop (flashpoint/cli/serve.py). Here the benchmark writes a
config file, starts ``python -m flashpoint.cli --config FILE --home HOME up --hosts 1`` in a
new session (so its process group, whose id is its PID, holds its workers too), reads the
API and host-metrics URLs from its banner, and from then on speaks only HTTP to it:
``POST /v1/functions`` to register, ``GET /v1/status`` to see replicas, the host's
``/metrics`` (``flashpoint_host_workers``) to see the warm pool. Stopped by PID (SIGTERM,
which ``up`` answers by stopping its cluster), then its process group by SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from platforms import PeerError, stop_process

REPO = Path(__file__).resolve().parents[2]
BANNER_END = "Stop with Ctrl-C."  # the last line of `flashpoint up`'s banner (cli/serve.py)
START_TIMEOUT_S = 120.0


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"no TOML for {type(v).__name__}")


def to_toml(config: dict[str, Any]) -> str:
    """``config`` (top-level scalars, then one level of tables of scalars) as TOML."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for table, values in config.items():
        if isinstance(values, dict):
            lines.append(f"[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def idle_workers(metrics_text: str) -> int | None:
    """The ``flashpoint_host_workers{state="idle"}`` gauge of a host's ``/metrics`` text."""
    for line in metrics_text.splitlines():
        if line.startswith("flashpoint_host_workers{") and 'state="idle"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return None


class FlashpointUp:
    """One ``flashpoint up --hosts 1`` with ``config`` (a dict written as TOML) in ``home``."""

    def __init__(self, config: dict[str, Any], home: Path, log_path: Path) -> None:
        self.config, self.home, self.log_path = config, home, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""  # the API, from the banner
        self.host_metrics_url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        cfg_path = self.home / "flashpoint.toml"
        cfg_path.write_text(to_toml(self.config))
        env = {k: v for k, v in os.environ.items() if k != "FLASHPOINT_SECRET"}  # its own
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flashpoint.cli", "--config", str(cfg_path), "--home",
            str(self.home), "up", "--hosts", "1", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True, env=env,
            cwd=str(REPO))
        log.close()
        banner = await self._banner(timeout_s)
        self.url = next(x for x in banner if x.strip().startswith("API ")).split()[1]
        hosts = [x for x in banner if x.strip().startswith("hosts:")]
        if not hosts:
            raise PeerError(f"flashpoint up: no host metrics URL in its banner: {banner}")
        self.host_metrics_url = hosts[0].split()[-1]
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def _banner(self, timeout_s: float) -> list[str]:
        assert self.proc is not None and self.proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(lines) < 50:  # the banner is a dozen lines
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                break
            if not raw:
                break  # it exited
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            if lines[-1].strip() == BANNER_END:
                return lines
        raise PeerError(f"flashpoint up: no banner within {timeout_s}s (rc="
                        f"{self.proc.returncode}); stdout {lines}; log: {self.log_path}")

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    async def register(self, spec: dict[str, Any]) -> None:
        """``POST /v1/functions`` (a function's spec as JSON)."""
        async with self._http().post(f"{self.url}/v1/functions", json=spec) as r:
            if r.status not in (200, 201):
                raise PeerError(f"flashpoint: registering {spec['name']}: HTTP {r.status}: "
                                f"{(await r.text())[:300]}")

    async def replicas(self, function: str) -> list[dict[str, Any]]:
        """The replicas of ``function`` in ``GET /v1/status``."""
        async with self._http().get(f"{self.url}/v1/status") as r:
            status = await r.json(content_type=None)
        return [rep for rep in status["replicas"] if rep["function"] == function]

    async def wait_no_replicas(self, function: str, timeout_s: float) -> None:
        """Until ``function`` has scaled to zero."""
        deadline = time.monotonic() + timeout_s
        while await self.replicas(function):
            if time.monotonic() > deadline:
                raise TimeoutError(f"flashpoint: {function} not scaled to zero in {timeout_s}s")
            await asyncio.sleep(0.05)

    async def wait_pool_ready(self, timeout_s: float) -> None:
        """Until the host's warm pool is full (``warm_pool_size`` idle workers that said
        hello): a refill imports torch for seconds of CPU, which must not land inside a
        measurement, and a cold start then takes a pre-started worker."""
        want = int(self.config["host"]["warm_pool_size"])
        deadline = time.monotonic() + timeout_s
        seen: int | None = None
        while time.monotonic() < deadline:
            async with self._http().get(self.host_metrics_url) as r:
                seen = idle_workers(await r.text())
            if seen is not None and seen >= want:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"flashpoint: warm pool {seen}/{want} after {timeout_s}s")

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.proc is not None:
            await stop_process(self.proc, timeout_s=60.0)
