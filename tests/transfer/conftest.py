"""Fixtures for data-plane tests: a synthetic blob with real chunk hashes, in-process
DataPlaneServers on 127.0.0.1, real ``node serve`` subprocesses (stopped by PID), a leak
check, and a guard that fails any test in which a chunk is marked without matching its hash."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.dataplane import DataPlaneServer
from flashpoint.transfer.node import DirSegmentProvider, make_synthetic
from flashpoint.transfer.plan import Endpoint, FaultPlan
from flashpoint.transfer.segment import Segment

SECRET = secrets.token_hex(32).encode()  # per run: node processes refuse weak secrets
SECRET_ENV = "FP_TRANSFER_TEST_SECRET"
CHUNK = 64 * 1024


@dataclass
class Blob:
    path: Path
    manifest: Manifest
    data: bytes
    manifest_path: Path


def make_blob(directory: Path, size_bytes: int = 3 * 1024 * 1024, chunk_size: int = CHUNK,
              seed: int = 1) -> Blob:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"blob-{seed}"
    mpath = directory / f"blob-{seed}.json"
    manifest = make_synthetic(path, mpath, size_bytes=size_bytes, chunk_size=chunk_size, seed=seed)
    return Blob(path, manifest, path.read_bytes(), mpath)


@pytest.fixture
def blob(tmp_path: Path) -> Blob:
    return make_blob(tmp_path / "src")


@pytest.fixture(autouse=True)
def marks_only_verified(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every Segment.mark in-process must be of bytes that match the manifest."""
    bad: list[tuple[str, int]] = []
    real_mark = Segment.mark

    def checked_mark(self: Segment, index: int) -> None:
        digest = hashlib.sha256(self.chunk_view(index)).hexdigest()
        if digest != self.manifest.chunk_sha256[index]:
            bad.append((str(self.path), index))
        real_mark(self, index)

    monkeypatch.setattr(Segment, "mark", checked_mark)
    yield bad
    assert bad == [], f"unverified chunks were marked: {bad}"


class Cluster:
    """In-process data-plane servers, each with its own directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: dict[str, DataPlaneServer] = {}
        self.providers: dict[str, DirSegmentProvider] = {}
        self.endpoints: dict[str, Endpoint] = {}

    async def add(self, host_id: str, *, fault: FaultPlan | None = None, seed: Blob | None = None,
                  secret: bytes = SECRET, **kw: Any) -> Endpoint:
        provider = DirSegmentProvider(self.root / host_id)
        if seed is not None:
            provider.add_complete(seed.path, seed.manifest)
        server = DataPlaneServer(provider, secret, host_id=host_id, fault=fault, **kw)
        self.servers[host_id] = server
        self.providers[host_id] = provider
        self.endpoints[host_id] = ep = await server.start()
        return ep

    def data(self, host_id: str, blob: Blob) -> bytes:
        return (self.root / host_id / f"{blob.manifest.name}@{blob.manifest.version}").read_bytes()

    def complete_on_disk(self, host_id: str, blob: Blob) -> bool:
        key = f"{blob.manifest.name}@{blob.manifest.version}"
        return (self.root / host_id / f"{key}.json").exists()

    async def close(self) -> None:
        for s in self.servers.values():
            await s.stop()
        for p in self.providers.values():
            p.close()


def leaked_tasks() -> list[asyncio.Task[Any]]:
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()
            and t.get_name().startswith("dp-")]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path / "nodes")
    try:
        yield c
    finally:
        await c.close()
    await asyncio.sleep(0)
    assert [t.get_name() for t in leaked_tasks()] == []


class NodeProcess:
    """``python -m flashpoint.transfer.node serve`` as a real process, stopped by PID."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: Endpoint) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.endpoint = endpoint

    def kill(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
        await self.proc.wait()


def node_env() -> dict[str, str]:
    env = dict(os.environ)
    env[SECRET_ENV] = SECRET.decode()
    env["FLASHPOINT_LOG_LEVEL"] = "WARNING"
    return env


async def start_node(directory: Path, host_id: str, *extra: str) -> NodeProcess:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flashpoint.transfer.node", "serve", "--listen", "127.0.0.1",
        "--port", "0", "--dir", str(directory), "--host-id", host_id, "--secret-env", SECRET_ENV,
        *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=node_env())
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 15.0)
        event = json.loads(line)
        assert event["event"] == "listening", event
    except BaseException:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return NodeProcess(proc, Endpoint(host_id, event["addr"], event["port"]))


@pytest.fixture
async def nodes() -> AsyncIterator[list[NodeProcess]]:
    """Processes appended here are stopped (by PID) however the test ends."""
    started: list[NodeProcess] = []
    try:
        yield started
    finally:
        for n in started:
            await n.stop()


async def wait_until(pred: Any, timeout_s: float, what: str, interval_s: float = 0.01) -> None:
    """Poll ``pred()`` (sync or async); fail naming ``what`` if it never holds."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                v = pred()
                if asyncio.iscoroutine(v):
                    v = await v
                if v:
                    return
                await asyncio.sleep(interval_s)
    except TimeoutError:
        raise AssertionError(f"never reached within {timeout_s}s: {what}") from None
