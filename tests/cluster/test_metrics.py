"""What the processes count is scrapeable: the controller's /metrics renders the gateway's
and the process's registries; a host manager serves its own /metrics when configured."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from flashpoint.cli import make_store
from flashpoint.cluster import LocalCluster
from flashpoint.config import load_config
from flashpoint.errors import BadRequest
from flashpoint.models.publish import publish
from flashpoint.spec import FunctionSpec

from .conftest import cluster_config, wait_for

pytestmark = pytest.mark.timeout(180)


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


async def test_controller_and_host_metrics_are_scrapeable(tmp_path) -> None:
    cfg = cluster_config(tmp_path, metrics_listen="127.0.0.1:0")
    store = make_store(cfg)
    await publish(store, "noop", "tiny", "1", model_name="noop")
    cluster = LocalCluster(cfg, hosts=1, store=store)
    await asyncio.wait_for(cluster.start(), 90)
    try:
        ctl = cluster.controller
        await ctl.register_function(FunctionSpec(name="counted", model="noop", min_replicas=1))
        await wait_for("a warm replica", lambda: ctl.get_function("counted").replicas_warm == 1)
        x = {"x": np.ones((1, 2), np.float32)}
        for i in range(3):
            await asyncio.wait_for(ctl.invoke("counted", x, request_id=f"m{i}"), 10)
        host = cluster.hosts[0]
        assert host.metrics is not None and host.metrics.url
        async with aiohttp.ClientSession() as s:
            text = await _scrape(s, ctl.url)
            # the gateway's own registry ...
            assert "flashpoint_gateway_requests_in_flight" in text
            # ... and the controller's counters, which were invisible before
            assert 'flashpoint_requests_total{function="counted",outcome="ok"} 3.0' in text
            assert "flashpoint_rpc_calls_total" in text
            host_text = await _scrape(s, host.metrics.url)
        assert "flashpoint_cache_misses_total" in host_text  # the deploy filled the cache
        assert "flashpoint_rpc_" in host_text
    finally:
        await asyncio.wait_for(cluster.stop(), 60)
    # stopped with the host: nothing listens there any more
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.get(f"{host.metrics.url}/metrics", timeout=aiohttp.ClientTimeout(total=5))


@pytest.mark.parametrize("value", ["9101", "host:", ":9101", "h:99999", "h:port"])
def test_a_bad_metrics_listen_is_refused_at_load(value: str) -> None:
    with pytest.raises(BadRequest, match="metrics_listen"):
        load_config(overrides={"host": {"metrics_listen": value}})
