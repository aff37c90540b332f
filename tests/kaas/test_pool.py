"""The executor pool with real in-process executors: routing, errors, deadlines."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from flashpoint import errors
from flashpoint.kaas.service import local_service
from flashpoint.kaas.spec import KaasRequest

from .helpers import chain_request


def _service(policy: str, n: int = 2, **kw):
    svc = local_service(n, policy=policy, capacity_bytes=1 << 20, **kw)
    for k in ("wa", "wb"):
        svc.store.put(k, np.full((4, 4), 0.5, np.float32).tobytes())
    return svc


async def _call(svc, client: str, key: str, rid: str):
    plan = svc.plan(KaasRequest.from_dict(chain_request(w_key=key)))
    return await svc.invoke(plan, client=client, request_id=rid, timeout_s=10)


async def test_affinity_keeps_clients_on_their_warm_executor():
    svc = _service("affinity")
    try:
        first = {c: (await _call(svc, c, k, f"{c}0")).executor_id
                 for c, k in (("A", "wa"), ("B", "wb"))}
        for i in range(5):
            ra, rb = await asyncio.gather(_call(svc, "A", "wa", f"a{i}"),
                                          _call(svc, "B", "wb", f"b{i}"))
            assert ra.executor_id == first["A"] and rb.executor_id == first["B"]
            assert ra.cache["misses"] == 0 and rb.cache["misses"] == 0
    finally:
        await svc.close()


async def test_exclusive_restarts_when_clients_outnumber_executors():
    svc = _service("exclusive", n=1)
    try:
        await _call(svc, "A", "wa", "a0")
        await _call(svc, "A", "wa", "a1")
        handle = svc.pool.handles[0]
        assert handle.restarts == 1  # the first owner's cold start only
        r = await _call(svc, "B", "wb", "b0")  # A owns the only executor, B has none: taken
        assert handle.restarts == 2 and r.cache["hits"] == 0
    finally:
        await svc.close()


async def test_errors_reach_the_caller_and_the_pool_survives():
    svc = _service("round_robin")
    try:
        with pytest.raises(errors.ObjectNotFound):
            svc.plan(KaasRequest.from_dict(chain_request(w_key="missing")))
        plan = svc.plan(KaasRequest.from_dict(chain_request(w_key="wa", out_key="o")))
        await svc.invoke(plan, client="A", request_id="1")
        other = svc.plan(KaasRequest.from_dict(
            chain_request(x=np.ones((4, 4), np.float32), w_key="wa", out_key="o")))
        with pytest.raises(errors.ObjectExists):
            await svc.invoke(other, client="A", request_id="2")
        assert (await _call(svc, "A", "wa", "3")).outputs["y"].shape == (4, 4)
    finally:
        await svc.close()


async def test_too_large_for_any_executor_is_413():
    svc = _service("affinity")
    with pytest.raises(errors.BufferCacheFull) as info:
        svc.plan(KaasRequest.from_dict(chain_request(n=512, w_key="wa")))
    assert info.value.http_status == 413


async def test_deadline_while_queued():
    svc = _service("affinity", n=1, link_bytes_per_s=64 / 0.3)  # each miss: 0.3 s
    try:
        slow = asyncio.create_task(_call(svc, "A", "wa", "slow"))
        await asyncio.sleep(0.05)
        plan = svc.plan(KaasRequest.from_dict(chain_request(w_key="wb")))
        with pytest.raises(errors.DeadlineExceeded):
            await svc.invoke(plan, client="B", request_id="late", timeout_s=0.05)
        await slow
        assert svc.pool._pending == []  # the timed-out request left the queue
    finally:
        await svc.close()
