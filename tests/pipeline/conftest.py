"""Fixtures for pipeline tests: bert/resnet tiny published into a tmp LocalStore (once per
session), real stage processes on 127.0.0.1 (stopped by PID however a test ends), and
in-process StageServers with a leak check."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashpoint.models import zoo
from flashpoint.models.publish import load_module
from flashpoint.models.sources import publish
from flashpoint.registry.local import LocalStore
from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.plan import Endpoint

SECRET = secrets.token_hex(32).encode()  # per run: stage processes refuse weak secrets
SECRET_ENV = "FP_PIPELINE_TEST_SECRET"


@dataclass
class Published:
    name: str
    manifest: Manifest
    manifest_path: Path
    blob_path: Path
    module: Any  # the unpartitioned model, over a private copy of the blob

    def inputs(self, batch: int, seed: int) -> dict[str, np.ndarray]:
        return zoo.example_inputs(self.name, self.manifest.config, batch, seed=seed)

    def reference(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return zoo.run_example(self.module, inputs).numpy()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Published]:
    root = tmp_path_factory.mktemp("pipeline-store")
    store = LocalStore(root / "store")
    out = {}
    for name in ("bert", "resnet"):
        manifest = asyncio.run(publish(store, name, "tiny"))
        mpath = root / f"{name}.json"
        mpath.write_text(manifest.to_json())
        blob = store.blob_path(manifest.name, manifest.version)
        module = load_module(manifest, bytearray(blob.read_bytes()))
        out[name] = Published(name, manifest, mpath, blob, module)
    return out


class StageProcess:
    """``python -m flashpoint.pipeline.stage`` as a real process, stopped by PID; its
    ``{"event": "request"}`` lines are collected in ``records``."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: Endpoint) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.endpoint = endpoint
        self.records: list[dict[str, Any]] = []
        self._reader: asyncio.Task[None] | None = None

    def start_reading(self) -> None:
        self._reader = asyncio.create_task(self._read(), name=f"test-stage-out-{self.pid}")

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            if event.get("event") == "request":
                self.records.append(event)

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # already reaped, returncode not yet set
                pass

    async def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a paused stage must wake to exit
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            self.signal(signal.SIGKILL)
        await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


def stage_env() -> dict[str, str]:
    env = dict(os.environ)
    env[SECRET_ENV] = SECRET.decode()
    env["FLASHPOINT_LOG_LEVEL"] = "WARNING"
    return env


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


async def start_stage(model: Published, first: int, last: int, *, stage_id: str,
                      next_hop: Endpoint | None = None,
                      listen: socket.socket | None = None) -> StageProcess:
    """One stage process; with ``listen``, it serves that (inherited) listening socket."""
    args = ["--manifest", str(model.manifest_path), "--blob", str(model.blob_path),
            "--first", str(first), "--last", str(last), "--stage-id", stage_id,
            "--secret-env", SECRET_ENV, "--events"]
    args += (["--listen-fd", str(listen.fileno())] if listen is not None
             else ["--listen", "127.0.0.1", "--port", "0"])
    if next_hop is not None:
        args += ["--next", f"{next_hop.host_id}:{next_hop.addr}:{next_hop.port}"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flashpoint.pipeline.stage", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=stage_env(),
        pass_fds=[listen.fileno()] if listen is not None else [])
    try:
        assert proc.stdout is not None
        # a bound on a hang, not a speed claim: importing torch alone takes 5-9 s on a loaded
        # 2-CPU machine, and the stage then builds its layers
        line = await asyncio.wait_for(proc.stdout.readline(), 60.0)
        event = json.loads(line)
        assert event["event"] == "listening", event
    except BaseException:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    stage = StageProcess(proc, Endpoint(stage_id, event["addr"], event["port"]))
    stage.start_reading()
    return stage


@pytest.fixture
async def stages() -> AsyncIterator[list[StageProcess]]:
    """Stage processes appended here are stopped (by PID) however the test ends."""
    started: list[StageProcess] = []
    try:
        yield started
    finally:
        await asyncio.gather(*(s.stop() for s in started))


async def start_pipeline(model: Published, ranges: Sequence[tuple[int, int]],
                         started: list[StageProcess]) -> list[StageProcess]:
    """Stages for ``ranges`` (first stage first), all started at once: their listening
    sockets are bound here first, so every stage knows its next hop from the start. Each
    is appended to ``started`` (stopped by the fixture) as soon as it runs."""
    socks = [listening_socket() for _ in ranges]
    try:
        endpoints = [Endpoint(f"s{k}", *sock.getsockname()[:2]) for k, sock in enumerate(socks)]

        async def one(k: int) -> StageProcess:
            first, last = ranges[k]
            s = await start_stage(model, first, last, stage_id=f"s{k}", listen=socks[k],
                                  next_hop=endpoints[k + 1] if k + 1 < len(ranges) else None)
            started.append(s)
            assert s.endpoint == endpoints[k]
            return s

        return list(await asyncio.gather(*(one(k) for k in range(len(ranges)))))
    finally:
        for sock in socks:  # the stages hold their own copies
            sock.close()


def pipe_tasks() -> list[str]:
    me = asyncio.current_task()
    return sorted(t.get_name() for t in asyncio.all_tasks()
                  if t is not me and not t.done() and t.get_name().startswith("pipe-"))


async def wait_until(pred: Any, timeout_s: float, what: str, interval_s: float = 0.01) -> None:
    """Poll ``pred()``; fail naming ``what`` if it never holds."""
    try:
        async with asyncio.timeout(timeout_s):
            while not pred():
                await asyncio.sleep(interval_s)
    except TimeoutError:
        raise AssertionError(f"never reached within {timeout_s}s: {what}") from None


def assert_one_at_a_time(records: Sequence[Any], stage: str) -> None:
    """A stage started request n+1 only after it had forwarded request n."""
    def get(r: Any, k: str) -> Any:
        return r[k] if isinstance(r, dict) else getattr(r, k)

    ordered = sorted(records, key=lambda r: get(r, "started_s"))
    for a, b in zip(ordered, ordered[1:], strict=False):
        assert get(b, "started_s") >= get(a, "forwarded_s"), (
            f"{stage} started trace {get(b, 'trace_id')} before forwarding {get(a, 'trace_id')}")
