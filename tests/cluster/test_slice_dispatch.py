"""PROTEAN's job distribution (Alg. 1) in the live dispatcher, on fake MIG GPUs.

A host with one fake A100-40GB in MIG mode (``[host] fake_gpus``; workers compute on the
CPU) set to (4g,2g,1g) over its ``apply_mig`` RPC, no CPU unit, and one function with a
replica on each slice, two credits each. Closed-loop clients send strict and best-effort
requests at once: 2 strict clients and 4 best-effort ones, so at most 2 strict and 4 BE
requests are ever outstanding. Worked out by hand from Alg. 1 (digest §2.4; one credit per
request, RDF = 7 / compute slices, no FBR profiled so η = RDF): a strict request goes to
the slice of least η with room, the 4g (1.75 against 3.5 and 7), which the two strict
requests never fill; best-effort ones first-fit into the smallest slices, the 1g and then
the 2g, whose 4 credits hold every BE request there can be. So every strict request is
answered on the 4g and every BE one on the 1g or the 2g, the 1g among them; the
controller's per-slice counts (``slices`` in ``/v1/status``, and the Prometheus counter)
say so. Routed least-loaded instead, strict requests land on the small slices too.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY

from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import assert_exited

pytestmark = pytest.mark.timeout(180)
BODY = {"inputs": {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}}
REQUESTS_PER_CLIENT = 12


async def _client(session: aiohttp.ClientSession, url: str, request_class: str,
                  failures: list[Any]) -> None:
    for _ in range(REQUESTS_PER_CLIENT):
        async with session.post(url, json=BODY, headers={"X-Request-Class": request_class},
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            body = await r.json()
            if r.status != 200 or not body.get("outputs"):
                failures.append((r.status, body))


@pytest.mark.parametrize("policy", ["protean", "least_loaded"])
async def test_strict_requests_land_on_the_4g_best_effort_fill_the_small_slices(
        make_cluster: ClusterFactory, tmp_path: Path, policy: str) -> None:
    run_dir = Path(f"/tmp/fps-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    cfg = cluster_config(tmp_path, controller={"slice_dispatch": policy},
                         fake_gpus=["A100-40GB"], fake_gpu_mig=True, cpu_devices=0,
                         sharing_dir=str(run_dir), warm_pool_size=3)
    c = await make_cluster(config=cfg)
    host = c.hosts[0]
    pids = [w.proc.pid for w in host.workers.values()]
    name = f"slice-route-{policy.replace('_', '-')}"  # its own counters (process-wide)
    s = aiohttp.ClientSession()
    try:
        conn = c.controller.hosts[host.host_id].conn
        await conn.call("apply_mig", {"gpu_index": 0, "geometry": ["4g", "2g", "1g"]},
                        timeout_s=30)
        await wait_for("three slices at the controller", lambda: len(
            c.controller.state.hosts[host.host_id].devices) == 3, 10)
        spec = {"name": name, "model": "noop", "min_replicas": 3, "max_replicas": 3,
                "replica_concurrency": 2}
        async with s.post(f"{c.controller.url}/v1/functions", json=spec) as r:
            assert r.status == 201, await r.text()
        await wait_for("three warm replicas", lambda: sum(
            r.phase == "warm" for r in c.controller.state.replicas.values()) == 3, 90)
        profiles = sorted(c.controller.state.mig_profile(r.host_id, r.device_id)
                          for r in c.controller.state.replicas.values())
        assert profiles == ["1g.5gb", "2g.10gb", "4g.20gb"]  # the premise: one per slice
        await wait_for("all three dispatchable", lambda: all(
            c.controller.dispatcher.mig_profile_of(r) for r in c.controller.state.replicas), 10)
        url = f"{c.controller.url}/v1/functions/{name}/invoke"
        failures: list[Any] = []
        await asyncio.wait_for(asyncio.gather(
            *(_client(s, url, "strict", failures) for _ in range(2)),
            *(_client(s, url, "best_effort", failures) for _ in range(4))), 120)
        assert failures == []
        async with s.get(f"{c.controller.url}/v1/status") as r:
            status = await r.json()
        served = {(e["request_class"], e["slice"]): e["served"] for e in status["slices"]
                  if e["function"] == name}
        n = REQUESTS_PER_CLIENT
        assert sum(v for (cls, _), v in served.items() if cls == "strict") == 2 * n
        assert sum(v for (cls, _), v in served.items() if cls == "best_effort") == 4 * n
        for (cls, prof), v in served.items():  # the Prometheus counter agrees
            assert REGISTRY.get_sample_value("flashpoint_slice_requests_total", {
                "function": name, "request_class": cls, "slice": prof}) == v
        strict_on = {prof for cls, prof in served if cls == "strict"}
        be_on = {prof for cls, prof in served if cls == "best_effort"}
        print(f"\n{policy}: served {served}")
        if policy == "protean":
            assert strict_on == {"4g.20gb"}, served
            assert "1g.5gb" in be_on and be_on <= {"1g.5gb", "2g.10gb"}, served
        else:  # least loaded spreads strict work over every slice with room
            assert strict_on != {"4g.20gb"}, served
    finally:
        await s.close()
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert_exited(pids)  # leak check: the warm pool's workers exited
