"""PROTEAN Fig. 7 on fake GPUs: a best-effort model switch makes the controller reconfigure
MIG GPUs from (4g,2g,1g) to (4g,3g) while strict and best-effort requests keep being served
with zero failures.

A host with two fake A100-40GB GPUs in MIG mode (``[host] fake_gpus``; workers compute on
the CPU), both set to (4g,2g,1g) over the host's ``apply_mig`` RPC as the experiment's
initial geometry. ``[controller] mig_reconfigure`` is on. Closed-loop clients call a strict
function and a best-effort function ``be-a`` (batches of 2 rows, 2 GB each: with 0.4 to 7
batches per GPU they take 5-95% of [1g,2g]'s 15 GB, so (4g,2g,1g) stays); then the
best-effort clients switch to ``be-b`` (30 GB per batch: from half a batch per GPU on, more
than [1g,2g] holds at T_high, so Alg. 2 wants (4g,3g), as after the DPN 92 switch of Fig. 7).
After the wait limit the controller drains one GPU (30% of two, at least one at once),
moving its replicas to the other GPU, applies (4g,3g), puts the new slices into service,
then does the other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import assert_exited

pytestmark = pytest.mark.timeout(240)
BODY = {"inputs": {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}}
SMALL, BIG = ["1g.5gb", "2g.10gb", "4g.20gb"], ["3g.20gb", "4g.20gb"]


class Clients:
    """Closed-loop clients of one request class; the function they call can be switched."""

    def __init__(self, session: aiohttp.ClientSession, url: str, function: str, n: int,
                 request_class: str) -> None:
        self.session, self.url, self.function = session, url, function
        self.headers = {"X-Request-Class": request_class}
        self.served: dict[str, int] = {}
        self.failures: list[Any] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._run()) for _ in range(n)]

    async def _run(self) -> None:
        for _ in range(1_000_000):  # bounded; ends when stopped
            if self._stop.is_set():
                return
            fn = self.function
            try:
                async with self.session.post(f"{self.url}/v1/functions/{fn}/invoke",
                                             json=BODY, headers=self.headers) as r:
                    body = await r.json()
            except aiohttp.ClientError as exc:  # a dropped connection is a failure too
                self.failures.append((fn, time.monotonic(), repr(exc)))
                continue
            if r.status != 200 or not body.get("outputs"):
                self.failures.append((fn, r.status, body))
            else:
                self.served[fn] = self.served.get(fn, 0) + 1

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 30)


def _geometry(host: Any, gpu_index: int) -> list[str]:
    return sorted(d.mig_profile for d in host.devices if d.gpu_index == gpu_index)


async def test_be_model_switch_reconfigures_gpus_to_4g_3g_without_failures(make_cluster: ClusterFactory,
        tmp_path):
    run_dir = Path(f"/tmp/fpr-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    cfg = cluster_config(tmp_path, fake_gpus=["A100-40GB", "A100-40GB"], fake_gpu_mig=True,
                         sharing_dir=str(run_dir), warm_pool_size=3)
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, mig_reconfigure=True, mig_interval_s=0.5, mig_wait_limit=3))
    c = await make_cluster(config=cfg)
    host = c.hosts[0]
    pids = [w.proc.pid for w in host.workers.values()]
    strict = be = None
    s = aiohttp.ClientSession()
    try:
        conn = c.controller.hosts[host.host_id].conn
        for i in (0, 1):  # the experiment's initial geometry (PROTEAN §6.1.1)
            await conn.call("apply_mig", {"gpu_index": i, "geometry": ["4g", "2g", "1g"]},
                            timeout_s=30)
        await wait_for("six slices at the controller", lambda: len(
            c.controller.state.hosts[host.host_id].devices) == 6, 10)
        url = c.controller.url
        mig = c.controller.mig
        assert mig is not None
        # BE batches of two rows (a worker waits up to 20 ms for the second). The mean
        # BE queue the controller sees depends on this VM's load (1 to 4 batches per GPU
        # here), so the footprints are chosen to decide the same way over that range.
        be_batch = {"max_batch_size": 2, "batch_wait_ms": 20.0}
        for name, extra in (("strict", {}),
                            ("be-a", {**be_batch, "batch_memory_bytes": 2 * 10**9}),
                            ("be-b", {**be_batch, "batch_memory_bytes": 30 * 10**9})):
            spec = {"name": name, "model": "noop", "min_replicas": 1, "max_replicas": 1,
                    **extra}
            async with s.post(f"{url}/v1/functions", json=spec) as r:
                assert r.status == 201, await r.text()
        await wait_for("three warm replicas", lambda: sum(
            r.phase == "warm" for r in c.controller.state.replicas.values()) == 3, 90)
        strict = Clients(s, url, "strict", 2, "strict")
        be = Clients(s, url, "be-a", 8, "best_effort")
        await wait_for("be-a is the BE model", lambda: mig.mig.be_model == "be-a", 20)
        await asyncio.sleep(3.0)  # six decisions: (4g,2g,1g) fits be-a, nothing changes
        assert mig.mig.counters.decided == 0, mig.status()
        assert set(map(tuple, mig.status()["targets"].values())) == {("4g", "2g", "1g")}
        assert [_geometry(host, 0), _geometry(host, 1)] == [SMALL, SMALL]
        before = dict(be.served)
        be_a_batches = mig.status()["be_batches_per_gpu"]
        old = {r.replica_id: r.device_id for r in c.controller.state.replicas.values()}
        t_switch = time.monotonic()
        be.function = "be-b"  # the BE model switch
        await wait_for("both GPUs at (4g,3g)", lambda: mig.mig.counters.applied == 2
                       and not mig.busy(), 120, lambda: mig.status())
        took = time.monotonic() - t_switch
        assert [_geometry(host, 0), _geometry(host, 1)] == [BIG, BIG]
        # every function is served from the new slices, and keeps serving
        devices = {d.device_id for d in host.devices}
        await wait_for("all three warm on new slices", lambda: sum(
            r.phase == "warm" and r.device_id in devices
            for r in c.controller.state.replicas.values()) == 3, 60)
        served_mid = (dict(strict.served), dict(be.served))
        # every replica was moved: none of the old ones (all on old slices) is left
        assert len(old) == 3 and not set(old) & set(c.controller.state.replicas)
        assert not c.controller.state.blocked
        await asyncio.sleep(1.0)
        await strict.stop()
        await be.stop()
        status = mig.status()
        assert strict.failures == [] and be.failures == [], (strict.failures[:3],
                                                              be.failures[:3])
        assert status["failed"] == {} and status["decided"] == 2 and status["be_model"] == "be-b"
        assert sorted(h["gpu"] for h in status["history"]) == [0, 1]
        assert sum(h["moved"] for h in status["history"]) >= 3  # each replica moved at least once
        assert before.get("be-a", 0) > 0 and be.served["be-b"] > 0
        assert strict.served["strict"] > served_mid[0]["strict"]  # still served after
        assert be.served["be-b"] > served_mid[1]["be-b"]
        print(f"\nreconfigured 2 GPUs to (4g,3g) {took:.1f} s after the BE switch; served "
              f"strict {strict.served['strict']}, be-a {be.served.get('be-a', 0)}, "
              f"be-b {be.served['be-b']}; failures 0; BE batches per GPU: be-a "
              f"{be_a_batches}, be-b {status['be_batches_per_gpu']}; per GPU: "
              f"{status['history']}")
    finally:
        for clients in (strict, be):
            if clients is not None and not clients.stopped:
                await clients.stop()
        await s.close()
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert_exited(pids)  # leak check: the warm pool's workers exited
