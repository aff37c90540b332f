"""The controller starts a partitioned replica group on a scale-up, serves it as one
pipeline, and dissolves it into whole replicas once every stage has completed (issue 4,
item 7), with no request failing on the way. Invocations go through the HTTP gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.models import zoo
from flashpoint.models.publish import load_module
from flashpoint.models.sources import publish
from flashpoint.registry.local import LocalStore
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import serve_until_dissolved

pytestmark = pytest.mark.timeout(120)

CHUNK = 16 * 1024


class SlowStore(LocalStore):
    """Every ranged read takes ``delay_s``: the model arrives over many seconds, so stages
    serve long before completion (what a slow registry link does)."""

    delay_s = 0.0

    async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
        await asyncio.sleep(self.delay_s)
        return await super().read_range(name, version, start, end)


def _config(tmp_path: Path) -> Any:
    # One chunk per read; a stage's completion is held until its group answers, and a
    # release by timeout would come far too late for this test (stage_hold.py).
    cfg = cluster_config(tmp_path, registry_span_bytes=CHUNK, completion_hold_s=300.0)
    import dataclasses

    # A slow modelled link: the solver prefers two stages for a burst of requests.
    return dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, partition_bandwidth_bps=2e6, partition_overhead_s=0.0))


async def _invoke(s: aiohttp.ClientSession, url: str, ids: np.ndarray) -> dict[str, Any]:
    body = {"inputs": {"input_ids": {"data": ids.ravel().tolist(), "shape": list(ids.shape),
                                     "datatype": "INT64"}}}
    async with s.post(f"{url}/v1/functions/part-fn/invoke", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _logits(out: dict[str, Any]) -> np.ndarray:
    got = out["outputs"]["logits"]
    return np.asarray(got["data"], dtype=np.float32).reshape(got["shape"])


async def test_partitioned_scale_up_serves_a_pipeline_then_dissolves(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    store = SlowStore(cfg.registry.root)
    manifest = await publish(store, "bert", "tiny", "1", CHUNK, model_name="bert",
                             profile=True)
    reference = load_module(manifest, bytearray(store.blob_path("bert", "1").read_bytes()))
    store.delay_s = 0.25
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=60)
    url = c.controller.url
    async with aiohttp.ClientSession() as s:
        # Two replicas wanted from zero: one scale-up by two GPUs, and the plan splits
        # the model over them.
        spec = {"name": "part-fn", "model": "bert", "max_stages": 2, "min_replicas": 2,
                "max_replicas": 2, "replica_concurrency": 1, "keep_alive_s": 300}
        async with s.post(f"{url}/v1/functions", json=spec) as r:
            assert r.status == 201, await r.text()

        def ids(seed: int) -> np.ndarray:
            return zoo.example_inputs("bert", manifest.config, 2, seed=seed)["input_ids"]

        def expected(x: np.ndarray) -> np.ndarray:
            return zoo.run_example(reference, {"input_ids": x}).numpy()

        async def one(seed: int) -> dict[str, Any]:
            x = ids(seed)
            out = await _invoke(s, url, x)
            np.testing.assert_allclose(_logits(out), expected(x), rtol=1e-4, atol=1e-5)
            return out

        await wait_for("a group is planned", lambda: bool(c.controller.state.groups), 10)
        burst = asyncio.gather(*(one(i) for i in range(4)))
        (group,) = c.controller.state.groups.values()
        stages = [c.controller.state.replicas[r] for r in group.stages]
        assert [r.stage for r in stages] == [(0, stages[0].stage[1]),
                                             (stages[0].stage[1] + 1,
                                              len(manifest.layers) - 1)]
        assert len({r.host_id for r in stages}) == 2, "stages share a host"
        outs = await asyncio.wait_for(burst, 60)
        # The burst was served by the pipeline, before the stages completed.
        assert {o["replica_id"] for o in outs} == {group.group_id}
        assert outs[0]["cold_start_source"] == "pipeline:2"
        # A cold start's breakdown is its slowest stage's (fetch = until its range was in).
        assert outs[0]["cold"] and outs[0]["timings_s"]["fetch"] > 0, outs[0]["timings_s"]
        assert all(r.phase == ReplicaPhase.STARTING for r in stages)
        # The first answer let the stage hosts complete the model (held until then).
        assert group.answered
        key = "bert@1"
        for rep in stages:
            host = next(h for h in c.hosts if h.host_id == rep.host_id)
            await wait_for("the stage host's completion released", lambda h=host:
                           not h.stage_holds.held(key), 10)
        status = c.controller.cluster_status()
        assert status["groups"][0]["phase"] == "serving"

        # Keep requests flowing while the stages complete: none may fail.
        await serve_until_dissolved(c, group, stages, one, 4, 60)
        outs = await asyncio.gather(*(one(1000 + i) for i in range(4)))
        assert {o["replica_id"] for o in outs} <= {r.replica_id for r in stages}
        assert group.group_id not in c.controller.workers
        # The hosts' pipeline servers are gone (dissolved), the replicas stay.
        for rep in stages:
            host = next(h for h in c.hosts if h.host_id == rep.host_id)
            await wait_for("stage server dissolved", lambda h=host, r=rep:
                           h.replicas[r.replica_id].pipeline_endpoint is None, 10)
            assert host.state.replicas[rep.replica_id].whole  # HostState holds the record


async def test_a_model_without_profiles_cannot_ask_for_stages(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    store = LocalStore(cfg.registry.root)
    await publish(store, "bert", "tiny", "1", model_name="bert")  # no profile
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=60)
    async with aiohttp.ClientSession() as s:
        spec = {"name": "p", "model": "bert", "max_stages": 2}
        async with s.post(f"{c.controller.url}/v1/functions", json=spec) as r:
            assert r.status == 400
            body = await r.json()
        assert body["code"] == "bad_request" and "profile" in body["error"]
        async with s.get(f"{c.controller.url}/v1/functions/p") as r:
            assert r.status == 404  # nothing half-registered
