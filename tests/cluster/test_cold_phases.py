"""A scale from zero accounts for every millisecond: its phases add up to the wall time."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from flashpoint.actors.cold_timings import COLD_PHASES, phases_sum_s
from flashpoint.models import zoo
from flashpoint.spec import FunctionSpec

from .conftest import wait_for

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
        assert abs(total - wall) <= 0.05 * wall, (
            f"phases sum to {total * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms: "
            + ", ".join(f"{k}={res.timings_s[k] * 1e3:.1f}" for k in COLD_PHASES))
