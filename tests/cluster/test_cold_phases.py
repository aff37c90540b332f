"""A scale from zero accounts for every millisecond: its phases add up to the wall time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpoint.controller.cold_timings import COLD_PHASES, phases_sum_s
from flashpoint.models import zoo
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import ClusterFactory, wait_for

pytestmark = pytest.mark.timeout(180)


def _reference(inputs: np.ndarray) -> np.ndarray:
    module, _ = zoo.build("bert", "tiny")
    module.eval()
    with torch.inference_mode():
        return module(torch.from_numpy(inputs)).numpy()


async def test_cold_start_phases_are_present_and_sum_to_the_wall(cluster) -> None:
    ctl = cluster.controller
    await ctl.register_function(FunctionSpec(name="cold-fn", model="bert", keep_alive_s=0.3))
    ids = (np.arange(1, 17, dtype=np.int64).reshape(2, 8) % 50)
    expected = _reference(ids)
    for attempt in range(2):  # from the registry, then from this host's RAM
        await wait_for("scaled to zero", lambda: not ctl.state.replicas_of("cold-fn"), 20)
        await asyncio.gather(*(h.wait_pool_ready(60) for h in cluster.hosts))
        t = time.perf_counter()
        res = await asyncio.wait_for(
            ctl.invoke("cold-fn", {"input_ids": ids}, request_id=f"cold-{attempt}"), 60)
        wall = time.perf_counter() - t
        assert res.cold
        np.testing.assert_allclose(res.outputs["logits"], expected, rtol=1e-4, atol=1e-5)
        missing = [k for k in COLD_PHASES if k not in res.timings_s]
        assert not missing, f"phases missing: {missing} in {res.timings_s}"
        assert all(res.timings_s[k] >= 0 for k in COLD_PHASES), res.timings_s
        # The earlier keys are still there.
        for k in ("fetch", "load", "to_device", "first_inference", "queue", "total", "inference"):
            assert k in res.timings_s, k
        total = phases_sum_s(res.timings_s)
        shown = ", ".join(f"{k}={res.timings_s[k] * 1e3:.1f}" for k in COLD_PHASES)
        # The phases partition the controller's own span of the request (arrival to reply),
        # to the clock's rounding: nothing is counted twice or left out.
        assert abs(total - res.timings_s["total"]) <= 1e-3, (
            f"phases sum to {total * 1e3:.1f} ms, the request's span "
            f"{res.timings_s['total'] * 1e3:.1f} ms: {shown}")
        # Against this test's wall: within 5 %, or the few ms the test's own loop (shared
        # with the controller and the host) loses around the call when the OS runs other
        # processes on a loaded machine: 4-21 ms seen at load average 5-7 on 2 vCPUs, outside
        # the controller's span. This tiny model starts in ~40-80 ms, where 5 % is below a
        # scheduler quantum; bench/coldstart.py checks 5 % at bert-base size (98.8-100 %).
        assert total <= wall and wall - total <= max(0.05 * wall, 0.030), (
            f"phases sum to {total * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms: {shown}")


async def test_warm_pool_refills_once_the_new_replica_answered(make_cluster: ClusterFactory,
        tmp_path) -> None:
    """The refill waits for the cold start's first answer (the worker's replica_served),
    not for refill_hold_s: with a one-minute hold the pool is full again within seconds."""
    from flashpoint.models.sources import publish
    from flashpoint.registry import make_store
    from flashpoint.testing.harness import cluster_config

    cfg = cluster_config(tmp_path, refill_hold_s=60.0)
    store = make_store(cfg)
    await publish(store, "noop", "tiny", "1", model_name="noop")
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    try:
        host = c.hosts[0]
        assert await host.wait_pool_ready(60)
        await c.controller.register_function(FunctionSpec(name="n", model="noop"))
        x = np.arange(3, dtype=np.float32).reshape(1, 3)
        res = await asyncio.wait_for(c.controller.invoke("n", {"x": x}, request_id="r"), 60)
        assert res.cold
        np.testing.assert_allclose(res.outputs["y"], x)
        started = time.monotonic()
        assert await host.wait_pool_ready(30), f"pool {len(host.idle)}/{cfg.host.warm_pool_size}"
        assert time.monotonic() - started < 30
    finally:
        pids = [w.proc.pid for w in c.hosts[0].workers.values()]
        await asyncio.wait_for(c.stop(), 60)
        for pid in pids:
            status = Path(f"/proc/{pid}/status")
            assert not status.exists() or "zombie" in status.read_text().lower(), pid
