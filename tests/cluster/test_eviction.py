"""A spot host evicted under load (issue 6, item 1): the notice (a file trigger) starts a
drain — no new placements there, a replacement host (spot first, else on-demand) from the
provider, a replacement replica elsewhere, the evicted host's model pushed to a peer — and
every request sent during it gets its answer. The cost meter counts spot and on-demand."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from flashpoint.models.publish import load_module
from flashpoint.models.sources import publish
from flashpoint.registry.local import LocalStore
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import BertLoad

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("spot_available", [True, False], ids=["spot", "no-spot"])
async def test_eviction_under_load_loses_no_request(make_cluster: ClusterFactory, tmp_path: Path,
                                                    spot_available: bool) -> None:
    cfg = cluster_config(tmp_path)
    store = LocalStore(cfg.registry.root)
    manifest = await publish(store, "bert", "tiny", "1", model_name="bert")
    reference = load_module(manifest, bytearray(store.blob_path("bert", "1").read_bytes()))
    c = await make_cluster(hosts=0, models=(), config=cfg, store=store, start_timeout_s=60)
    # Read only when a replacement host is needed (after the eviction), so set after start.
    c.local.provider.spot_available = spot_available
    notice = tmp_path / "evict-host1"
    try:
        # host0: on-demand, RAM but no device that fits the model (a cache peer);
        # host1: a spot VM watching for its eviction notice. Replacements get the default
        # (roomy) device.
        await c.add_host(kind="ondemand", device_memory_bytes=1 << 20)
        await c.add_host(kind="spot", spot_notice=f"file:{notice}", spot_poll_interval_s=0.1)
        url = c.controller.url
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/functions", json={
                    "name": "ev-fn", "model": "bert", "min_replicas": 1, "max_replicas": 1,
                    "keep_alive_s": 300}) as r:
                assert r.status == 201, await r.text()
            await wait_for("a warm replica on host1", lambda: [
                r.host_id for r in c.controller.state.replicas.values() if r.phase == "warm"
            ] == ["host1"], 60)

            load = BertLoad(s, url, "ev-fn", manifest, reference)
            await asyncio.sleep(1.0)
            # The eviction notice: host1 goes in 15 s.
            notice.write_text(json.dumps({"action": "terminate", "seconds": 15}))
            await wait_for("host1 draining", lambda: c.controller.state.hosts["host1"].draining, 10)
            await wait_for("a replacement host", lambda: len(c.controller.replacements) == 1, 60)
            repl = c.controller.replacements[0]
            assert repl["kind"] == ("spot" if spot_available else "ondemand"), repl
            new_host = repl["host_id"]
            # Two warm replicas again, none on host1; host1 leaves at its deadline.
            try:
                await wait_for("the replica moved to the new host", lambda: [
                    r.host_id for r in c.controller.state.replicas.values()
                    if r.phase == "warm"] == [new_host], 60)
            except AssertionError as exc:
                st = c.controller.cluster_status()
                hosts = [(h["host_id"], h["alive"], h["draining"]) for h in st["hosts"]]
                raise AssertionError(f"{exc}: {st['replicas']} {st['scaling']} {hosts}") from None
            evicted = next(h for h in c.hosts if h.host_id == "host1")
            await asyncio.wait_for(evicted.evicted.wait(), 30)
            await asyncio.sleep(1.0)  # requests keep flowing after the host is gone
            await load.stop()
            assert not load.failures, load.failures[:3]
            assert load.served > 20
            # Warm state survived the eviction: host1 pushed the model into host0's RAM, and
            # the new host holds it too.
            for host_id in ("host0", new_host):
                host = next(h for h in c.hosts if h.host_id == host_id)
                assert host.cache.get("bert@1") is not None, host_id
            async with s.get(f"{url}/v1/status") as r:
                status = await r.json()
            cost = status["cost"]
            assert cost["spot_hours"] > 0 and cost["ondemand_hours"] > 0
            assert cost["saved_usd"] > 0
            host1 = next(h for h in status["hosts"] if h["host_id"] == "host1")
            assert host1["draining"]
    finally:
        await asyncio.wait_for(c.stop(), 30)
