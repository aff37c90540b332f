"""Real stage processes on 127.0.0.1: bert and resnet tiny cut into 2 and 3 stages give the
unpartitioned model's outputs; a killed middle stage fails in-flight calls with a typed
error; a client without the secret is refused."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

from flashpoint.errors import AuthFailed, PeerLost
from flashpoint.pipeline.client import PipelineClient

from .conftest import SECRET, Published, assert_one_at_a_time, start_pipeline, wait_until

pytestmark = pytest.mark.timeout(40)


async def run_concurrently(model: Published, client: PipelineClient, n: int) -> None:
    inputs = [model.inputs(batch=1 + i % 3, seed=i) for i in range(n)]
    outs = await asyncio.gather(*(client.infer(x, trace_id=1000 + i) for i, x in enumerate(inputs)))
    for x, out in zip(inputs, outs, strict=True):
        want = model.reference(x)
        assert out.shape == want.shape
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


async def test_bert_two_stages(models, stages):
    bert = models["bert"]  # layers: embeddings, block, block, head
    s0, s1 = await start_pipeline(bert, [(0, 1), (2, 3)], stages)
    async with PipelineClient(s0.endpoint, SECRET, timeout_s=15) as client:
        await run_concurrently(bert, client, 6)
    await wait_until(lambda: len(s0.records) == 6 and len(s1.records) == 6, 5, "records of 6 requests")
    assert {r["outcome"] for r in s0.records} == {"forwarded"}
    assert {r["outcome"] for r in s1.records} == {"returned"}
    assert {r["trace_id"] for r in s1.records} == set(range(1000, 1006))
    assert_one_at_a_time(s0.records, "s0")
    assert_one_at_a_time(s1.records, "s1")


async def test_resnet_two_stages_and_a_client_without_the_secret(models, stages):
    resnet = models["resnet"]  # layers: stem, 4 blocks, head
    s0, _ = await start_pipeline(resnet, [(0, 2), (3, 5)], stages)
    async with PipelineClient(s0.endpoint, SECRET, timeout_s=15) as client:
        await run_concurrently(resnet, client, 4)
    async with PipelineClient(s0.endpoint, b"not-the-secret", timeout_s=5) as client:
        with pytest.raises(AuthFailed):
            await client.infer(resnet.inputs(batch=1, seed=0))
    assert len(s0.records) == 4


async def test_bert_three_stages_then_a_killed_middle_stage(models, stages):
    """Outputs of a 3-stage cut match; then the middle stage is paused while requests are
    in flight to it, and SIGKILLed: every waiting call fails with PeerLost within bounds."""
    bert = models["bert"]
    s0, s1, s2 = await start_pipeline(bert, [(0, 0), (1, 2), (3, 3)], stages)
    async with PipelineClient(s0.endpoint, SECRET, timeout_s=20) as client:
        await run_concurrently(bert, client, 5)
        for s in (s0, s1, s2):
            assert_one_at_a_time(s.records, s.endpoint.host_id)
        s1.signal(signal.SIGSTOP)
        calls = [asyncio.create_task(client.infer(bert.inputs(1, seed=i), trace_id=2000 + i))
                 for i in range(3)]
        await wait_until(lambda: sum(r["trace_id"] >= 2000 for r in s0.records) == 3, 10,
                         "s0 forwarded 3 requests to the paused s1")
        assert not any(c.done() for c in calls)
        t0 = time.monotonic()
        s1.signal(signal.SIGKILL)
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - t0 < 5.0
        assert all(isinstance(r, PeerLost) for r in results), results
        assert all(r.details.get("next_stage") == "s1" for r in results)
        # later calls fail fast too: s0 cannot reach s1 any more
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="next stage s1 lost"):
            await client.infer(bert.inputs(1, seed=9))
        assert time.monotonic() - t0 < 5.0
