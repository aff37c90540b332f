"""What the processes count is scrapeable: the controller's /metrics renders the gateway's
and the process's registries; a host manager serves its own /metrics when configured."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashpoint.config import load_config
from flashpoint.errors import BadRequest
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import ClusterFactory, InProcessCluster, cluster_config, wait_for

pytestmark = pytest.mark.timeout(180)


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


async def _started(make_cluster: ClusterFactory, tmp_path, spec: FunctionSpec) -> InProcessCluster:
    """One host with its metrics endpoint, ``spec`` registered on the no-op model and warm."""
    cluster = await make_cluster(config=cluster_config(tmp_path, metrics_listen="127.0.0.1:0"))
    ctl = cluster.controller
    await ctl.register_function(spec)
    await wait_for("a warm replica", lambda: ctl.get_function(spec.name).replicas_warm == 1)
    return cluster


async def test_controller_and_host_metrics_are_scrapeable(make_cluster: ClusterFactory, tmp_path) -> None:
    cluster = await _started(make_cluster, tmp_path, FunctionSpec(name="counted", model="noop",
                                                    min_replicas=1))
    try:
        ctl = cluster.controller
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
            # each process's actor samples its event-loop lag (flashpoint/actor.py)
            assert "loop-lag" in ctl.task_names() and "loop-lag" in host.task_names()
            assert 'flashpoint_event_loop_lag_seconds_count{actor="controller"}' in text
            host_text = await _scrape(s, host.metrics.url)
        assert "flashpoint_cache_misses_total" in host_text  # the deploy filled the cache
        assert "flashpoint_rpc_" in host_text
        assert f'flashpoint_event_loop_lag_seconds_count{{actor="host:{host.host_id}"}}' in host_text
    finally:
        await asyncio.wait_for(cluster.stop(), 60)
    # stopped with the host: nothing listens there any more
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.get(f"{host.metrics.url}/metrics", timeout=aiohttp.ClientTimeout(total=5))


def _replica_samples(text: str, host_id: str) -> dict[str, dict[tuple[str, str], float]]:
    """Every flashpoint_replica_* sample by replica id: (name, le) -> value."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("flashpoint_replica_"):
                assert s.labels["function"] == "served" and s.labels["host"] == host_id, s.labels
                out.setdefault(s.labels["replica_id"], {})[(s.name, s.labels.get("le", ""))] = s.value
    return out


async def test_host_metrics_show_each_replicas_inference_counters(make_cluster: ClusterFactory,
        tmp_path) -> None:
    cluster = await _started(make_cluster, tmp_path, FunctionSpec(
        name="served", model="noop", min_replicas=1, max_replicas=1, batch_wait_ms=5.0))
    ctl = cluster.controller
    host = cluster.hosts[0]
    assert host.metrics is not None
    (replica_id,) = [r.replica_id for r in host.state.replicas.values()
                     if r.function == "served"]
    x = {"x": np.ones((1, 2), np.float32)}
    n = 0
    for i in range(8):  # one by one ...
        await asyncio.wait_for(ctl.invoke("served", x, request_id=f"s{i}"), 10)
        n += 1
    # ... and twelve at once, which the worker may batch
    await asyncio.wait_for(asyncio.gather(
        *(ctl.invoke("served", x, request_id=f"c{i}") for i in range(12))), 20)
    n += 12
    async with aiohttp.ClientSession() as s:
        by_replica = _replica_samples(await _scrape(s, host.metrics.url), host.host_id)
    # only the worker holding the replica shows up (not the warm pool's idle one)
    assert list(by_replica) == [replica_id]
    got = by_replica[replica_id]
    assert got[("flashpoint_replica_requests_total", "")] == n == 20
    assert got[("flashpoint_replica_failed_requests_total", "")] == 0
    batches = got[("flashpoint_replica_batches_total", "")]
    assert 1 <= batches <= n
    assert got[("flashpoint_replica_batch_size_sum", "")] == n  # one row per request
    assert got[("flashpoint_replica_batch_size_count", "")] == batches
    assert got[("flashpoint_replica_batch_size_bucket", "+Inf")] == batches
    assert got[("flashpoint_replica_run_seconds_count", "")] == batches
    assert got[("flashpoint_replica_run_seconds_sum", "")] > 0
    assert got[("flashpoint_replica_queue_seconds_count", "")] == n
    assert got[("flashpoint_replica_queued_requests", "")] == 0  # all answered


@pytest.mark.parametrize("value", ["9101", "host:", ":9101", "h:99999", "h:port"])
def test_a_bad_metrics_listen_is_refused_at_load(value: str) -> None:
    with pytest.raises(BadRequest, match="metrics_listen"):
        load_config(overrides={"host": {"metrics_listen": value}})


def _free_ports(n: int, tries: int = 50) -> int:
    """A loopback port P with P + 1 ... P + n - 1 free too (a local cluster's hosts take
    P, P + 1, ...)."""
    for _ in range(tries):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for i in range(1, n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port + i))
            except OSError:  # taken, or past 65535
                continue
        return port
    raise AssertionError(f"no {n} consecutive free ports in {tries} tries")


async def test_each_host_of_a_local_cluster_gets_its_own_metrics_port(make_cluster: ClusterFactory,
        tmp_path) -> None:
    # Two hosts in one process with one configured port: the second used to fail to bind.
    port = _free_ports(3)
    cluster = await make_cluster(
        hosts=2, config=cluster_config(tmp_path, metrics_listen=f"127.0.0.1:{port}"))
    urls = [h.metrics.url for h in cluster.hosts if h.metrics is not None]
    assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    async with aiohttp.ClientSession() as s:
        for host, url in zip(cluster.hosts, urls, strict=True):
            text = await _scrape(s, url)
            # each endpoint is its own host's: its worker gauges carry its id
            hosts = {s.labels["host"] for fam in text_string_to_metric_families(text)
                     if fam.name == "flashpoint_host_workers" for s in fam.samples}
            assert hosts == {host.host_id}
        # a host added later takes the next port
        extra = await asyncio.wait_for(cluster.add_host(), 90)
        assert extra.metrics is not None and extra.metrics.url == f"http://127.0.0.1:{port + 2}"
