"""The servers of the peer benchmark: starting, driving and stopping each platform.

Each peer runs in its own venv as a child process started in a new session, so stopping it
means its own PID and, for the helpers it spawned (Ray's raylet and workers, BentoML's
worker processes), its process group, whose id is that same PID. What escapes the group
(a daemonised Ray process) is still inside the run's network namespace, which
``netns.LoopbackNamespace`` sweeps by PID on exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STOP_TIMEOUT_S = 30.0


class PeerError(RuntimeError):
    """A peer did not start, or refused a command; the run records it and goes on."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float = STOP_TIMEOUT_S
                       ) -> None:
    """SIGTERM the process by PID, wait, then SIGKILL its process group (pgid == its PID: it
    was started with ``start_new_session``)."""
    if proc.returncode is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            pass
    try:  # helpers it left behind in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        await asyncio.wait_for(proc.wait(), timeout_s)


@dataclass
class RayServe:
    """A Ray Serve driver (``ray_app.py`` in the Ray venv) spoken to over stdin/stdout."""

    python: Path
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    port: int = 0
    version: str = ""

    async def start(self, timeout_s: float = 240.0) -> None:
        self.port = free_port()
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = await asyncio.create_subprocess_exec(
            str(self.python), str(HERE / "ray_app.py"), "--port", str(self.port),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        log.close()
        ready = await self._reply(timeout_s)
        self.version = ready.get("ray", "")

    async def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"ray driver: no reply within {timeout_s}s (log: {self.log_path})")
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                continue
            if not line:
                raise PeerError(f"ray driver exited (rc={self.proc.returncode}); "
                                f"log: {self.log_path}")
            text = line.decode(errors="replace").strip()
            if text.startswith("@@ "):
                reply = json.loads(text[3:])
                if not reply.get("ok"):
                    raise PeerError(f"ray driver: {reply.get('error')}")
                return reply

    async def command(self, timeout_s: float = 300.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**cmd, "timeout_s": timeout_s}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._reply(timeout_s + 10)

    def url(self, app: str) -> str:
        return f"http://127.0.0.1:{self.port}/{app}"

    async def wait_replicas(self, app: str, want: int, timeout_s: float) -> float:
        """Poll until ``app`` has ``want`` running replicas; seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if (await self.command(app=app, cmd="replicas", timeout_s=30))["replicas"] == want:
                return time.monotonic() - t0
            await asyncio.sleep(0.2)
        raise PeerError(f"ray: {app} did not reach {want} replicas within {timeout_s}s")

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                await self.command(cmd="shutdown", timeout_s=60)
            except (PeerError, OSError, ConnectionError):
                pass
        await stop_process(self.proc)


@dataclass
class BentoServer:
    """One ``bentoml serve`` of ``bento_app:Peer`` in the BentoML venv."""

    python: Path
    log_path: Path
    home: Path
    models: tuple[str, ...]
    model_dir: Path
    workers: int | None = None
    batch: bool = False
    proc: asyncio.subprocess.Process | None = None
    port: int = 0
    started_wall: float = 0.0

    async def start(self) -> None:
        """Start the server (returns at once; :func:`load.first_success` waits for it)."""
        self.port = free_port()
        env = {**os.environ, "BENTOML_HOME": str(self.home), "BENTOML_DO_NOT_TRACK": "true",
               "BENCH_MODELS": ",".join(self.models), "BENCH_MODEL_DIR": str(self.model_dir),
               "BENCH_BATCH": "1" if self.batch else "0"}
        env.pop("BENCH_WORKERS", None)
        if self.workers:
            env["BENCH_WORKERS"] = str(self.workers)
        bentoml = self.python.parent / "bentoml"
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.started_wall = time.time()
        self.proc = await asyncio.create_subprocess_exec(
            str(bentoml), "serve", "bento_app:Peer", "--host", "127.0.0.1", "--port",
            str(self.port), "--working-dir", str(HERE), stdin=asyncio.subprocess.DEVNULL,
            stdout=log, stderr=log, start_new_session=True, env=env)
        log.close()

    def url(self, endpoint: str) -> str:
        return f"http://127.0.0.1:{self.port}/{endpoint}"

    async def stop(self) -> None:
        if self.proc is not None:
            await stop_process(self.proc)
