"""A real local cluster per test: controller + host managers in this loop, worker processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from flashpoint.cli import make_store
from flashpoint.cluster import LocalCluster
from flashpoint.config import ClusterConfig, load_config
from flashpoint.models.publish import publish


def cluster_config(tmp_path: Path, **host: object) -> ClusterConfig:
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache"), **host},
    }).with_home(tmp_path)


async def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for ``cond``; on timeout say which condition was not reached."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")


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
