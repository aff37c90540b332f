"""WorkerExecutorHandle over a fake connection to a real WorkerKaasRuntime (msgpack wire):
shipping on miss, the stale-held retry, outputs into the store, the forget path."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from flashpoint import errors
from flashpoint.kaas.graph import plan_graph
from flashpoint.kaas.library import default_library
from flashpoint.kaas.pool import ExecutorPool
from flashpoint.kaas.remote import WorkerExecutorHandle, WorkerKaasRuntime
from flashpoint.kaas.spec import KaasRequest
from flashpoint.kaas.store import MemoryObjectStore
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.controller_worker import KaasReset, KaasRun

from .helpers import chain_request


class FakeConn:
    """Frames through msgpack both ways, typed errors rebuilt from their wire form."""

    def __init__(self, runtime: WorkerKaasRuntime) -> None:
        self.runtime = runtime
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, method: str, payload: dict[str, Any], *, timeout_s: float,
                   trace: str | None = None) -> dict[str, Any]:
        payload = msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False)
        self.calls.append((method, payload))
        # The worker's handler edge: typed messages in, typed replies out.
        fn = {"kaas_run": lambda p: self.runtime.run(from_payload(KaasRun, p)),
              "kaas_reset": self._reset}
        try:
            reply = to_payload(await asyncio.to_thread(fn[method], payload))
        except errors.FlashpointError as e:
            raise errors.from_wire(e.to_wire()) from None
        return msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False)

    def _reset(self, payload: dict[str, Any]) -> Any:
        from_payload(KaasReset, payload)  # the edge refuses what kaas_reset does not take
        return self.runtime.reset()


W = (np.arange(16, dtype=np.float32).reshape(4, 4) - 7) / 3


@pytest.fixture
def setup() -> tuple[WorkerExecutorHandle, FakeConn, MemoryObjectStore]:
    store = MemoryObjectStore()
    store.put("w", W.tobytes())
    conn = FakeConn(WorkerKaasRuntime("k0", capacity_bytes=1 << 20))
    return WorkerExecutorHandle("k0", conn, store, capacity_bytes=1 << 20), conn, store


def _plan(**kw: Any):
    return plan_graph(KaasRequest.from_dict(chain_request(**kw)), default_library())


def _expected(d: dict) -> np.ndarray:
    t = torch.tensor(d["buffers"][0]["data"], dtype=torch.float32) @ torch.from_numpy(W)
    return (torch.relu(t) + t).numpy()


async def test_ships_inputs_once_then_hits_the_worker_cache(setup):
    handle, conn, _ = setup
    first = await handle.run(_plan(), "c")
    assert np.allclose(first.outputs["y"], _expected(chain_request()))
    assert first.cache["shipped_bytes"] == W.nbytes and first.executor_id == "k0"
    assert "obj:w" in handle.cached_keys() and handle.free_bytes() < 1 << 20
    second = await handle.run(_plan(), "c")
    assert second.cache["shipped_bytes"] == 0 and second.cache["hits"] == 3
    assert np.array_equal(second.outputs["y"], first.outputs["y"])
    assert conn.calls[1][1]["objects"] == {}
    assert handle.status()["shipped_bytes"] == W.nbytes


async def test_stale_held_set_retries_with_every_input(setup):
    handle, conn, _ = setup
    await handle.run(_plan(), "c")
    conn.runtime.executor().forget(["w"])  # the worker lost it behind the handle's back
    res = await handle.run(_plan(), "c")
    assert res.cache["shipped_bytes"] == W.nbytes and handle.retries == 1
    assert np.allclose(res.outputs["y"], _expected(chain_request()))


async def test_stored_outputs_reach_the_store_and_conflicts_are_forgotten(setup):
    handle, conn, store = setup
    res = await handle.run(_plan(out_key="y1"), "c")
    assert res.stored == {"y": "y1"} and store.exists("y1")
    assert np.allclose(np.frombuffer(store.get("y1"), np.float32).reshape(4, 4),
                       _expected(chain_request()))
    # Another writer wins key y2 first: the worker cached its own bytes under y2; the
    # handle says 409 and has the worker forget them with the next request.
    store.put("y2", np.zeros((4, 4), np.float32).tobytes())
    with pytest.raises(errors.ObjectExists):
        await handle.run(_plan(out_key="y2"), "c")
    await handle.run(_plan(), "c")
    assert conn.calls[-1][1]["forget"] == ["y2"]
    assert "obj:y2" not in conn.runtime.executor().cached_keys()


async def test_typed_errors_cross_and_restart_clears(setup):
    handle, conn, _ = setup
    x = np.ones((4, 4), np.float32)
    await handle.run(_plan(x=x, out_key="o"), "c")
    # o is cached on the worker with x's result; same key, other bytes: 409 from the store
    with pytest.raises(errors.ObjectExists):
        await handle.run(_plan(x=x * 2, out_key="o"), "c")
    await handle.restart()
    assert handle.cached_keys() == frozenset() and handle.restarts == 1


async def test_pool_over_remote_handles_comes_and_goes(setup):
    handle, _, _ = setup
    pool = ExecutorPool([], "affinity", allow_empty=True)
    try:
        waiting = asyncio.ensure_future(pool.invoke(_plan(), client="c", request_id="r1",
                                                    timeout_s=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no executor yet: it queues
        pool.add(handle)
        assert (await waiting).executor_id == "k0"
        assert handle.conn.calls[-1][1]["request_id"] == "r1"  # the causality id travels
        assert pool.remove("k0") is handle and pool.handles == []
        with pytest.raises(errors.DeadlineExceeded):
            await pool.invoke(_plan(), client="c", request_id="r2", timeout_s=0.05)
        assert pool.status()["executors"] == []
    finally:
        await pool.stop()


async def test_controller_pool_relearns_a_reconnected_worker(setup):
    from flashpoint.config import ControllerConfig
    from flashpoint.controller.kaas_pool import KaasPool

    _, conn, store = setup
    kp = KaasPool(ControllerConfig(kaas_workers=1, kaas_cache_bytes=1 << 20))
    try:
        kp.ensure("k0", conn)
        first = kp.pool.get("k0")
        kp.ensure("k0", conn)
        assert kp.pool.get("k0") is first  # same connection: same handle, same knowledge
        conn2 = FakeConn(conn.runtime)
        kp.ensure("k0", conn2)
        assert kp.pool.get("k0").conn is conn2
        kp.store.put("w", store.get("w"))
        plan = kp.plan(KaasRequest.from_dict(chain_request()))
        res = await kp.invoke(plan, client="c", request_id="r", timeout_s=10)
        assert res.executor_id == "k0" and kp.status()["executors_wanted"] == 1
        kp.replica_gone("k0")
        kp.replica_gone("k0")  # idempotent
        assert kp.pool.get("k0") is None
    finally:
        await kp.close()
    off = KaasPool(ControllerConfig())
    with pytest.raises(errors.KaasUnavailable) as info:
        off.plan(KaasRequest.from_dict(chain_request()))
    assert info.value.http_status == 503
    broken = KaasPool(ControllerConfig(kaas_workers=1), broken=lambda: "no CUDA")
    with pytest.raises(errors.KaasUnavailable, match="no CUDA"):
        broken.plan(KaasRequest.from_dict(chain_request()))


def test_frame_budget_is_a_413_up_front():
    from flashpoint.kaas.remote import check_frame_budget

    from .helpers import buf, kern

    def req(n: int, **inp: Any) -> KaasRequest:
        return KaasRequest.from_dict({"kernels": [kern("relu", ["x"], ["y"])],
                                      "buffers": [buf("x", "input", [n], **inp),
                                                  buf("y", "output", [n])]})

    check_frame_budget(req(1024, key="x"), budget_bytes=4096)
    with pytest.raises(errors.PayloadTooLarge) as info:
        check_frame_budget(req(1025, key="x"), budget_bytes=4096)
    assert info.value.http_status == 413 and info.value.details["inbound_bytes"] == 4100
    with pytest.raises(errors.PayloadTooLarge):  # inline data travels as base64
        check_frame_budget(req(800, data=[0.0] * 800), budget_bytes=4096)
