"""A worker process SIGKILLed under load (issue 6, item 3): requests it held are retried on
the other replica (inference is idempotent), a replacement replica starts, and every request
sent during it gets its answer."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from flashpoint.models.publish import load_module
from flashpoint.models.sources import publish
from flashpoint.registry.local import LocalStore
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import BertLoad

pytestmark = pytest.mark.timeout(120)


async def test_killed_worker_under_load_loses_no_request(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    store = LocalStore(cfg.registry.root)
    manifest = await publish(store, "bert", "tiny", "1", model_name="bert")
    reference = load_module(manifest, bytearray(store.blob_path("bert", "1").read_bytes()))
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=60)
    url = c.controller.url
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/functions", json={
                "name": "kw-fn", "model": "bert", "min_replicas": 2, "max_replicas": 2,
                "keep_alive_s": 300}) as r:
            assert r.status == 201, await r.text()
        state = c.controller.state
        await wait_for("two warm replicas", lambda: sum(
            r.phase == "warm" for r in state.replicas.values()) == 2, 60)
        first_ids = set(state.replicas)

        load = BertLoad(s, url, "kw-fn", manifest, reference)
        await asyncio.sleep(1.0)
        # SIGKILL the worker process of one replica (by its PID).
        victim_host = c.hosts[0]
        rt = next(iter(victim_host.replicas.values()))
        assert rt.worker is not None and rt.worker.proc is not None
        os.kill(rt.worker.proc.pid, signal.SIGKILL)
        await wait_for("the killed replica forgotten", lambda: rt.replica_id not in state.replicas,
                       20)
        await wait_for("a replacement replica warm", lambda: sum(
            r.phase == "warm" for r in state.replicas.values()) == 2
            and set(state.replicas) != first_ids, 60)
        await asyncio.sleep(1.0)
        await load.stop()
        assert not load.failures, load.failures[:3]
        assert load.served > 20
        assert state.not_ready("kw-fn") is None  # a crash under load is not a failing model
