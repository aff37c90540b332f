"""Where cold starts get model bytes, on a real local cluster: registry first, then a peer's RAM."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from pathlib import Path

import aiohttp
import pytest

from flashpoint.models.sources import publish
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

pytestmark = pytest.mark.timeout(180)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_second_host_gets_the_model_from_the_first_hosts_ram(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    # One device per host with room for one replica, so the second replica must go elsewhere.
    cfg = cluster_config(tmp_path, device_memory_bytes=100 << 20, worker_memory_bytes=64 << 20)
    store = make_store(cfg)
    manifest = await publish(store, "bert", "tiny", "1", model_name="bert")
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=90)
    url = c.controller.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/functions", json={
                "name": "f", "model": "bert", "min_replicas": 1}) as r:
            assert r.status == 201, await r.text()

        async def replicas() -> list[dict]:
            async with s.get(f"{url}/v1/status") as r:
                return (await r.json())["replicas"]

        await wait_for("first replica warm", lambda: any(
            r.phase == "warm" for r in c.controller.state.replicas.values()), 60)
        (first,) = await replicas()
        assert first["source"] == "registry"
        await wait_for("first host reports the model cached", lambda: any(
            "bert@1" in h.cached_models for h in c.controller.state.hosts.values()), 10)

        async with s.post(f"{url}/v1/functions", json={
                "name": "f", "model": "bert", "min_replicas": 2}) as r:
            assert r.status in (200, 201), await r.text()
        await wait_for("two replicas warm", lambda: sum(
            r.phase == "warm" for r in c.controller.state.replicas.values()) == 2, 60)
        reps = await replicas()
    by_host = {r["host_id"]: r for r in reps}
    assert len(by_host) == 2
    second = next(r for r in reps if r["host_id"] != first["host_id"])
    assert second["source"] == f"chain:{first['host_id']}"
    blob = store.blob_path("bert", "1")
    for h in c.hosts:
        entry = h.cache.get("bert@1")
        assert entry is not None and entry.complete
        assert _sha(entry.path) == _sha(blob)
    assert manifest.blob_size == blob.stat().st_size


async def test_a_stage_starts_as_soon_as_its_own_bytes_are_in(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    """Execute-while-load: a stage replica is warm while later layers are still arriving."""
    from flashpoint.registry.local import LocalStore
    from flashpoint.registry.manifest import byte_range_for_layers
    from flashpoint.spec import FunctionSpec

    class SlowTail(LocalStore):
        """The registry serves bytes past the first stage slowly."""

        stage_end = 0

        async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
            if start >= self.stage_end:
                await asyncio.sleep(0.5)
            return await super().read_range(name, version, start, end)

    cfg = cluster_config(tmp_path, registry_span_bytes=64 * 1024)  # one chunk per GET
    # The stage is deployed behind the controller's back: it must not stop it as unknown at
    # the next heartbeat (that raced the stage's warm-up and made this test flaky).
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller,
                                                                  stop_unknown_replicas=False))
    store = SlowTail(cfg.registry.root)
    manifest = await publish(store, "bert", "tiny", "1", 64 * 1024, model_name="bert")
    start, end = byte_range_for_layers(manifest, 0, 0)
    store.stage_end = end
    assert manifest.blob_size - end > 10 * 64 * 1024  # a tail of slow chunks
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    host = c.hosts[0]
    spec = FunctionSpec(name="stage-fn", model="bert")
    await c.controller.hosts["host0"].conn.call("deploy_replica", {
        "replica_id": "stage-1", "device_id": "cpu:0", "spec": spec.to_dict(),
        "manifest_json": manifest.to_json(), "stage": [0, 0]}, timeout_s=10)
    await wait_for("stage replica warm", lambda: (rt := host.replicas.get("stage-1")) is not None
                   and rt.worker is not None and rt.worker.warm, 30)
    entry = host.cache.entry("bert@1")
    assert entry is not None and not entry.complete, "the whole model arrived first"
    assert entry.segment.valid_bytes >= end - start
    await wait_for("the rest of the model", lambda: host.cache.get("bert@1") is not None, 60)
    assert _sha(host.cache.get("bert@1").path) == _sha(store.blob_path("bert", "1"))
