"""KaaS end to end on a real local cluster: the controller places a KaaS executor replica on
a worker process, /v1/kaas/invoke runs kernel graphs there, inputs ship only on a miss."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from kaas.helpers import buf, chain_request, kern

from flashpoint.config import ClusterConfig, load_config
from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.kaas import KAAS_FUNCTION
from flashpoint.kaas.store import scoped_key, tenant_namespace
from flashpoint.testing.harness import ClusterFactory, InProcessCluster, wait_for

pytestmark = pytest.mark.timeout(180)

N = 32
W = ((np.arange(N * N, dtype=np.float32).reshape(N, N) % 7) - 3) / 5


def _config(tmp_path: Path, kaas_workers: int) -> ClusterConfig:
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05,
                       "kaas_workers": kaas_workers, "kaas_cache_bytes": 16 << 20},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache")},
    }).with_home(tmp_path)


@pytest.fixture
async def kaas_cluster(make_cluster: ClusterFactory, tmp_path: Path) -> InProcessCluster:
    """One host with the no-op model (a host function to chain) and one KaaS executor;
    make_cluster stops it and checks every worker process it started has exited."""
    c = await make_cluster(config=_config(tmp_path, 1))
    # Worker processes may be spawned later (the warm pool refills after the KaaS start).
    await wait_for("a warm KaaS executor in the pool",
                   lambda: len(c.controller.kaas.pool.handles) == 1, 60)
    return c


def _expected(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(x) @ torch.from_numpy(W)
    return (torch.relu(t) + t).numpy()


async def _invoke(s: aiohttp.ClientSession, url: str, body: dict[str, Any]
                  ) -> tuple[int, dict[str, Any]]:
    async with s.post(f"{url}/v1/kaas/invoke", json=body) as r:
        return r.status, await r.json()


async def test_kernel_graphs_run_on_a_worker_process(kaas_cluster: InProcessCluster) -> None:
    ctl = kaas_cluster.controller
    url = ctl.url
    # The executor is a replica like any other: placed on a device, in the memory ledger.
    (rep,) = [r for r in ctl.state.replicas.values() if r.function == KAAS_FUNCTION]
    assert rep.device_bytes == (16 << 20) + ctl.cc.replica_overhead_bytes
    host = kaas_cluster.hosts[0]
    worker = host.replicas[rep.replica_id].worker
    assert worker is not None and worker.proc.returncode is None  # a real process
    x1 = np.random.default_rng(1).standard_normal((N, N)).astype(np.float32)
    x2 = np.random.default_rng(2).standard_normal((N, N)).astype(np.float32)
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{url}/v1/objects/w", data=W.tobytes()) as r:
            assert r.status == 201, await r.text()

        status, first = await _invoke(s, url, {**chain_request(N, x=x1), "client": "a"})
        assert status == 200, first
        y = np.asarray(first["outputs"]["y"]["data"], np.float32).reshape(N, N)
        assert np.allclose(y, _expected(x1), rtol=1e-5, atol=1e-5)
        assert first["executor_id"] == rep.replica_id
        assert first["cache"]["shipped_bytes"] == W.nbytes  # w crossed to the worker once

        # Second call, other inline input: w is in the worker's cache, nothing ships.
        status, second = await _invoke(s, url, {**chain_request(N, x=x2, out_key="y2"),
                                                "client": "a"})
        assert status == 200, second
        assert second["cache"]["shipped_bytes"] == 0 and second["cache"]["hits"] >= 1
        assert second["outputs"]["y"] == {"key": "y2"}
        async with s.get(f"{url}/v1/objects/y2") as r:  # the output came back to the store
            assert r.status == 200
            y2 = np.frombuffer(await r.read(), np.float32).reshape(N, N)
        assert np.allclose(y2, _expected(x2), rtol=1e-5, atol=1e-5)

        # The stored output is an input of the next graph, still on the worker's device.
        d = {"kernels": [kern("scale", ["y2"], ["z"], literals=[2.0])],
             "buffers": [buf("y2", "input", [N, N], key="y2"), buf("z", "output", [N, N])],
             "output_encoding": "b64"}
        status, third = await _invoke(s, url, d)
        assert status == 200, third
        assert third["cache"]["shipped_bytes"] == 0
        assert third["outputs"]["z"]["b64"]

        # Bad requests are still typed 4xx, decided before any worker is involved.
        before = ctl.kaas.pool.handles[0].requests
        status, err = await _invoke(s, url, {"kernels": [kern("nope", ["w"], ["z"])],
                                             "buffers": [buf("w", "input", [N, N], key="w"),
                                                         buf("z", "output", [N, N])]})
        assert (status, err["code"]) == (400, "unknown_kernel")
        status, err = await _invoke(s, url, chain_request(N, x=x1, w_key="missing"))
        assert (status, err["code"]) == (404, "object_not_found")
        status, err = await _invoke(s, url, {**chain_request(N, x=x1), "kernels": [
            kern("matmul", ["x", "w"], ["t"]), kern("relu", ["r"], ["t2"])]})
        assert status == 400 and err["code"] in ("undefined_buffer", "invalid_kernel_graph")
        assert ctl.kaas.pool.handles[0].requests == before

        async with s.get(f"{url}/v1/kaas/status") as r:
            st = await r.json()
        (ex,) = st["executors"]
        assert ex["executor_id"] == rep.replica_id and ex["shipped_bytes"] == W.nbytes
        assert st["executors_wanted"] == 1 and st["broken"] is None
        async with s.get(f"{url}/v1/status") as r:
            cl = await r.json()
        assert cl["kaas"] == {"executors_wanted": 1, "executors": 1, "broken": None,
                              "unplaced": "", "max_buffer_bytes": 16 << 20}
        assert [x["phase"] for x in cl["replicas"] if x["function"] == KAAS_FUNCTION] == ["warm"]


async def test_a_dead_executor_worker_is_replaced(kaas_cluster: InProcessCluster) -> None:
    ctl = kaas_cluster.controller
    url = ctl.url
    (old,) = [h.executor_id for h in ctl.kaas.pool.handles]
    worker = kaas_cluster.hosts[0].replicas[old].worker
    assert worker is not None
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{url}/v1/objects/w", data=W.tobytes()) as r:
            assert r.status == 201
        status, body = await _invoke(s, url, chain_request(N, x=W))
        assert status == 200, body
        worker.proc.kill()  # the worker process this cluster started, by its handle
        await wait_for("the dead executor left the pool",
                       lambda: old not in {h.executor_id for h in ctl.kaas.pool.handles}, 30)
        await wait_for("a replacement executor joined the pool",
                       lambda: len(ctl.kaas.pool.handles) == 1, 60)
        status, body = await _invoke(s, url, chain_request(N, x=W))
        assert status == 200, body
        assert body["executor_id"] != old
        assert body["cache"]["shipped_bytes"] == W.nbytes  # a fresh cache: w ships again
        y = np.asarray(body["outputs"]["y"]["data"], np.float32).reshape(N, N)
        assert np.allclose(y, _expected(W), rtol=1e-5, atol=1e-5)


async def test_kaas_and_objects_through_a_standalone_gateway(kaas_cluster: InProcessCluster) -> None:
    ctl = kaas_cluster.controller
    cfg = kaas_cluster.config
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, controller_url=ctl.rpc_url, refresh_s=0.1))
    gw = await asyncio.wait_for(StandaloneGateway.start(cfg, port=0), 30)
    url = gw.url
    x = np.random.default_rng(3).standard_normal((N, N)).astype(np.float32)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{url}/v1/objects/w", data=W.tobytes()) as r:
                assert r.status == 201, await r.text()
            # in the controller's store, in the namespace of a caller without auth
            assert ctl.kaas.store.get(scoped_key(tenant_namespace("anonymous"), "w")) \
                == W.tobytes()
            async with s.put(f"{url}/v1/objects/w", data=b"\x01" * 8) as r:
                assert (r.status, (await r.json())["code"]) == (409, "object_exists")

            # A host function's output goes to the store under a key (native store_outputs)
            async with s.post(f"{url}/v1/functions", json={"name": "nf", "model": "noop"}) as r:
                assert r.status == 201, await r.text()
            body = {"inputs": {"x": {"data": x.ravel().tolist(), "shape": [N, N],
                                     "datatype": "FP32"}}, "store_outputs": {"y": "from-fn"}}
            async with s.post(f"{url}/v1/functions/nf/invoke", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["stored"]["y"]["key"] == "from-fn"

            # ... and a kernel graph reads it there, with w, on the controller's executor.
            graph = {**chain_request(N, out_key="via-gw"), "client": "a"}
            graph["buffers"] = [buf("x", "input", [N, N], key="from-fn")
                                if b["name"] == "x" else b for b in graph["buffers"]]
            status, out = await _invoke(s, url, graph)
            assert status == 200, out
            assert out["outputs"]["y"] == {"key": "via-gw"}
            assert out["executor_id"] == ctl.kaas.pool.handles[0].executor_id
            async with s.get(f"{url}/v1/objects/via-gw") as r:
                assert r.status == 200
                y = np.frombuffer(await r.read(), np.float32).reshape(N, N)
            assert np.allclose(y, _expected(x), rtol=1e-5, atol=1e-5)

            # Errors keep their codes, wherever they are decided.
            before = ctl.kaas.pool.handles[0].requests
            status, err = await _invoke(s, url, {"kernels": [kern("nope", ["w"], ["z"])],
                                                 "buffers": [buf("w", "input", [N, N], key="w"),
                                                             buf("z", "output", [N, N])]})
            assert (status, err["code"]) == (400, "unknown_kernel")  # at the gateway
            status, err = await _invoke(s, url, chain_request(N, x=x, w_key="missing"))
            assert (status, err["code"]) == (404, "object_not_found")  # at the controller
            assert ctl.kaas.pool.handles[0].requests == before
            async with s.get(f"{url}/v1/objects/missing") as r:
                assert (r.status, (await r.json())["code"]) == (404, "object_not_found")
            async with s.get(f"{url}/v1/kaas/status") as r:
                st = await r.json()
            assert st["executors_wanted"] == 1 and len(st["executors"]) == 1
    finally:
        await asyncio.wait_for(gw.stop(), 30)


async def test_without_kaas_workers_invoke_is_503(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    c = await make_cluster(hosts=0, models=(), config=_config(tmp_path, 0), start_timeout_s=30)
    async with aiohttp.ClientSession() as s:
        status, err = await _invoke(s, c.controller.url, chain_request(4))
        assert (status, err["code"]) == (503, "kaas_unavailable")
        # The object store is there either way.
        async with s.put(f"{c.controller.url}/v1/objects/k", data=b"\x00" * 8) as r:
            assert r.status == 201
