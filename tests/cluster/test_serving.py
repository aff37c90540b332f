"""End to end: deploy a real model and invoke it through both APIs with real clients."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.http as triton

from flashpoint.errors import DeadlineExceeded
from flashpoint.models import zoo
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import wait_for

pytestmark = pytest.mark.timeout(180)


def _reference(name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    module, _ = zoo.build(name, "tiny")
    module.eval()
    with torch.inference_mode():
        return module(*[torch.from_numpy(v) for v in inputs.values()]).numpy()


async def test_bert_through_native_and_kserve_apis(cluster) -> None:
    url = cluster.controller.url
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/functions", json={"name": "bert-fn", "model": "bert"}) as r:
            assert r.status == 201, await r.text()
            info = await r.json()
        assert [t["name"] for t in info["spec"]["inputs"]] == ["input_ids"]
        ids = np.arange(1, 17, dtype=np.int64).reshape(2, 8) % 50
        body = {"inputs": {"input_ids": {"data": ids.ravel().tolist(), "shape": [2, 8],
                                         "datatype": "INT64"}}}
        async with s.post(f"{url}/v1/functions/bert-fn/invoke", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
    expected = _reference("bert", {"input_ids": ids})
    got = out["outputs"]["logits"]
    logits = np.asarray(got["data"], dtype=np.float32).reshape(got["shape"])
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    assert out["cold"] is True
    for phase in ("fetch", "load", "to_device", "first_inference", "queue", "total"):
        assert phase in out["timings_s"], phase

    def kserve(binary: bool) -> np.ndarray:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        try:
            assert client.is_server_live() and client.is_server_ready()
            assert client.is_model_ready("bert-fn")
            meta = client.get_model_metadata("bert-fn")
            assert meta["inputs"][0]["name"] == "input_ids"
            inp = triton.InferInput("input_ids", list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids, binary_data=binary)
            want = triton.InferRequestedOutput("logits", binary_data=binary)
            res = client.infer("bert-fn", [inp], outputs=[want])
            return res.as_numpy("logits")
        finally:
            client.close()

    for binary in (False, True):
        got = await asyncio.to_thread(kserve, binary)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


async def test_requests_during_scale_from_zero_are_held_then_scale_to_zero(cluster) -> None:
    ctl = cluster.controller
    await ctl.register_function(FunctionSpec(name="noop-fn", model="noop", keep_alive_s=0.5))
    assert ctl.get_function("noop-fn").replicas_warm == 0
    xs = [np.full((1, 3), i, dtype=np.float32) for i in range(12)]
    results = await asyncio.wait_for(asyncio.gather(*(
        ctl.invoke("noop-fn", {"x": x}, request_id=f"r{i}") for i, x in enumerate(xs))), 60)
    for x, res in zip(xs, results, strict=True):
        np.testing.assert_allclose(res.outputs["y"], x * 1.0)
    assert any(r.cold for r in results)
    await wait_for("scale to zero after keep-alive",
                   lambda: not ctl.state.replicas_of("noop-fn"), timeout_s=20)
    again = await asyncio.wait_for(ctl.invoke("noop-fn", {"x": xs[3]}, request_id="again"), 60)
    assert again.cold
    np.testing.assert_allclose(again.outputs["y"], xs[3])


async def test_lost_host_replicas_are_replaced(cluster) -> None:
    ctl = cluster.controller
    await ctl.register_function(FunctionSpec(name="keep", model="noop", min_replicas=1))
    await wait_for("a warm replica", lambda: ctl.get_function("keep").replicas_warm == 1)
    victim_id = ctl.state.replicas_of("keep")[0].host_id
    victim = next(h for h in cluster.hosts if h.host_id == victim_id)
    await victim.stop()
    cluster.hosts.remove(victim)
    await wait_for("replica replaced on the surviving host", lambda: any(
        r.host_id != victim_id and r.phase == "warm" for r in ctl.state.replicas_of("keep")), 60)
    await wait_for("silent host marked dead", lambda: not ctl.state.hosts[victim_id].alive, 20)
    res = await asyncio.wait_for(ctl.invoke("keep", {"x": np.ones((1, 2), np.float32)}, request_id="x"), 30)
    assert res.replica_id != "" and ctl.state.replicas[res.replica_id].host_id != victim_id


async def test_bad_requests_get_clear_errors(cluster) -> None:
    url = cluster.controller.url
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/v1/functions", json={"name": "n", "model": "noop"})
        cases = [
            ("POST", "/v1/functions", {"name": "../etc", "model": "noop"}, 400),
            ("POST", "/v1/functions", {"name": "x", "model": "missing-model"}, 404),
            ("POST", "/v1/functions/nope/invoke", {"inputs": {}}, 404),
            ("POST", "/v1/functions/n/invoke", {"inputs": {"wrong": {"data": [1.0], "shape": [1, 1],
                                                                     "datatype": "FP32"}}}, 400),
            ("POST", "/v1/functions/n/invoke", {"inputs": {"x": {"data": [1, 2], "shape": [1, 2],
                                                                 "datatype": "INT64"}}}, 400),
        ]
        for method, path, body, status in cases:
            async with s.request(method, f"{url}{path}", json=body) as r:
                assert r.status == status, (path, body, await r.text())
                err = await r.json()
                assert err["error"] and err["code"]


async def test_queued_request_past_its_deadline_or_cancelled_is_never_sent(cluster) -> None:
    ctl = cluster.controller
    await ctl.register_function(FunctionSpec(name="one", model="noop", min_replicas=1,
                                             max_replicas=1, replica_concurrency=1))
    await wait_for("a warm replica", lambda: ctl.get_function("one").replicas_warm == 1)
    x = {"x": np.ones((1, 2), np.float32)}
    rid = ctl.state.replicas_of("one")[0].replica_id
    ctl.dispatcher.stop_accepting(rid)  # hold everything in the queue
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(ctl.invoke("one", x, request_id="late", timeout_s=0.2), 5)
    assert ctl.dispatcher.queued("one") == 0  # the expired request left the queue
    task = asyncio.ensure_future(ctl.invoke("one", x, request_id="gone", timeout_s=30))
    await wait_for("request queued", lambda: ctl.dispatcher.queued("one") == 1, 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert ctl.dispatcher.queued("one") == 0  # the cancelled request left the queue
    ctl.dispatcher.add_replica(rid, "one", 1)  # accepting again
    res = await asyncio.wait_for(ctl.invoke("one", x, request_id="ok"), 10)
    np.testing.assert_allclose(res.outputs["y"], x["x"])


async def _one_replica(ctl, name: str, concurrency: int) -> tuple[str, object]:
    """Register ``name`` (no-op model, one replica) and return its warm replica's id and the
    controller's handle on its worker."""
    await ctl.register_function(FunctionSpec(name=name, model="noop", min_replicas=1,
                                             max_replicas=1, replica_concurrency=concurrency))
    await wait_for("a warm replica", lambda: ctl.get_function(name).replicas_warm == 1)
    rid = ctl.state.replicas_of(name)[0].replica_id
    return rid, ctl.workers[rid]


async def test_a_caller_cancelled_in_flight_frees_its_replica(cluster) -> None:
    # A lone request is sent from its caller's own task: cancelling the caller mid-flight
    # must still give the replica's credit back, or a replica_concurrency=1 function wedges.
    ctl = cluster.controller
    rid, handle = await _one_replica(ctl, "solo", 1)
    real, gate = handle.infer, asyncio.Event()

    async def held(ps, timeout_s):
        await gate.wait()
        return await real(ps, timeout_s)

    handle.infer = held
    x = {"x": np.ones((1, 2), np.float32)}
    task = asyncio.ensure_future(ctl.invoke("solo", x, request_id="dropped", timeout_s=30))
    await wait_for("request in flight", lambda: ctl.dispatcher.inflight_of(rid) == 1, 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert ctl.dispatcher.inflight_of(rid) == 0
    handle.infer = real
    res = await asyncio.wait_for(ctl.invoke("solo", x, request_id="next"), 10)
    np.testing.assert_allclose(res.outputs["y"], x["x"])


async def test_requests_arriving_while_others_are_in_flight_share_one_frame(cluster) -> None:
    # An idle function sends a request from the caller's task at once (lowest latency);
    # requests that arrive while it is busy wait for the end of the loop iteration and
    # travel to the replica together: one frame (and one reply frame) for all of them.
    ctl = cluster.controller
    rid, handle = await _one_replica(ctl, "busy", 16)
    real, frames = handle.infer, []

    async def recorded(ps, timeout_s):
        frames.append([p.request_id for p in ps])
        return await real(ps, timeout_s)

    handle.infer = recorded
    try:
        xs = [{"x": np.full((1, 2), i, np.float32)} for i in range(8)]
        results = await asyncio.wait_for(asyncio.gather(*(
            ctl.invoke("busy", x, request_id=f"b{i}") for i, x in enumerate(xs))), 10)
    finally:
        handle.infer = real
    for x, res in zip(xs, results, strict=True):
        np.testing.assert_allclose(res.outputs["y"], x["x"])
    assert frames == [["b0"], [f"b{i}" for i in range(1, 8)]]
    assert ctl.dispatcher.inflight_of(rid) == 0


async def test_slo_compliance_counts_strict_requests_only(cluster) -> None:
    ctl = cluster.controller
    x = {"x": np.ones((1, 2), np.float32)}
    await ctl.register_function(FunctionSpec(name="easy", model="noop", slo_ms=60_000,
                                             min_replicas=1))
    await ctl.register_function(FunctionSpec(name="hard", model="noop", slo_ms=0.001,
                                             min_replicas=1))
    await wait_for("warm replicas", lambda: all(
        ctl.get_function(f).replicas_warm >= 1 for f in ("easy", "hard")), 60)
    for fn in ("easy", "hard"):
        for i in range(3):
            await asyncio.wait_for(ctl.invoke(fn, x, request_id=f"{fn}-s{i}"), 10)
        be = await asyncio.wait_for(ctl.invoke(fn, x, request_id=f"{fn}-be",
                                               request_class="best_effort"), 10)
        np.testing.assert_allclose(be.outputs["y"], x["x"])  # served, just never counted
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{ctl.url}/v1/status") as r:
            slo = {e["function"]: e for e in (await r.json())["slo"]}
    assert (slo["easy"]["met"], slo["easy"]["missed"], slo["easy"]["compliance"]) == (3, 0, 1.0)
    assert (slo["hard"]["met"], slo["hard"]["missed"], slo["hard"]["compliance"]) == (0, 3, 0.0)
