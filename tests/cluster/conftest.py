"""A real local cluster per test: controller + host managers in this loop, worker processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashpoint.cluster import LocalCluster
from flashpoint.config import ClusterConfig, load_config
from flashpoint.models import zoo
from flashpoint.models.sources import publish
from flashpoint.registry import make_store


def cluster_config(tmp_path: Path, **host: object) -> ClusterConfig:
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache"), **host},
    }).with_home(tmp_path)


async def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0,
                   state: Callable[[], Any] | None = None) -> None:
    """Wait for ``cond``; on timeout say which condition was not reached (and ``state()``,
    what was reached instead, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}"
                         + (f"; state: {state()}" if state is not None else ""))


async def start_noop_cluster(cfg: ClusterConfig, hosts: int = 1) -> LocalCluster:
    """A started LocalCluster of ``hosts`` hosts over ``cfg``'s registry, with the tiny
    no-op model published as ``noop@1``; the caller stops it."""
    store = make_store(cfg)
    await publish(store, "noop", "tiny", "1", model_name="noop")
    c = LocalCluster(cfg, hosts=hosts, store=store)
    await asyncio.wait_for(c.start(), 90)
    return c


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    await publish(store, "bert", "tiny", "1", model_name="bert")
    await publish(store, "noop", "tiny", "1", model_name="noop")
    c = LocalCluster(cfg, hosts=2, store=store)
    await asyncio.wait_for(c.start(), 90)
    pids = [w.proc.pid for h in c.hosts for w in h.workers.values()]
    try:
        yield c
    finally:
        await asyncio.wait_for(c.stop(), 60)
        # Leak check: every worker process this cluster started has exited.
        for pid in pids:
            status = Path(f"/proc/{pid}/status")
            assert not status.exists() or "zombie" in status.read_text().lower(), f"worker {pid} leaked"


class BertLoad:
    """Closed-loop HTTP clients invoking a tiny-BERT function until stopped, each output
    checked against ``reference``; what failed (a non-200 body, or "wrong output") is kept."""

    def __init__(self, session: Any, url: str, function: str, manifest: Any, reference: Any,
                 clients: int = 4) -> None:
        self.session, self.url, self.function = session, url, function
        self.manifest, self.reference = manifest, reference
        self.failures: list[Any] = []
        self.served = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(1000 * i)) for i in range(clients)]

    async def _client(self, seed: int) -> None:
        for i in range(100_000):  # bounded; ends when stopped
            if self._stop.is_set():
                return
            x = zoo.example_inputs("bert", self.manifest.config, 1, seed=seed + i)
            body = {"inputs": {"input_ids": {"data": x["input_ids"].ravel().tolist(),
                                             "shape": list(x["input_ids"].shape),
                                             "datatype": "INT64"}}}
            async with self.session.post(f"{self.url}/v1/functions/{self.function}/invoke",
                                         json=body) as r:
                out = await r.json()
            if r.status != 200:
                self.failures.append(out)
                continue
            got = out["outputs"]["logits"]
            logits = np.asarray(got["data"], np.float32).reshape(got["shape"])
            if not np.allclose(logits, zoo.run_example(self.reference, x).numpy(),
                               rtol=1e-4, atol=1e-5):
                self.failures.append("wrong output")
            self.served += 1

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)
