"""A stand-alone gateway process's backend in front of a real local cluster: the same API,
errors forwarded as the controller gave them, and requests riding out a lost controller."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import numpy as np
import pytest
import tritonclient.http as triton

from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def gateway(cluster):
    cfg = cluster.config
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, controller_url=cluster.controller.rpc_url, refresh_s=0.1))
    gw = await asyncio.wait_for(StandaloneGateway.start(cfg, port=0), 30)
    try:
        yield gw
    finally:
        await asyncio.wait_for(gw.stop(), 30)


async def test_the_api_through_a_standalone_gateway(cluster, gateway) -> None:
    url = gateway.url
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = {"inputs": {"x": {"data": x.ravel().tolist(), "shape": [2, 3], "datatype": "FP32"}}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/functions", json={"name": "nf", "model": "noop"}) as r:
            assert r.status == 201, await r.text()
        async with s.get(f"{url}/v1/functions/nf") as r:  # known at once through this gateway
            assert r.status == 200 and (await r.json())["spec"]["model"] == "noop"
        async with s.post(f"{url}/v1/functions/nf/invoke", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        np.testing.assert_allclose(np.asarray(out["outputs"]["y"]["data"]).reshape(2, 3), x)
        assert out["cold"] is True and out["replica_id"]
        async with s.post(f"{url}/v1/functions/nope/invoke", json=body) as r:
            assert r.status == 404 and (await r.json())["code"] == "function_not_found"
        bad = {"inputs": {"x": {"data": [1.0], "shape": [2, 3], "datatype": "FP32"}}}
        async with s.post(f"{url}/v1/functions/nf/invoke", json=bad) as r:
            assert r.status == 400 and (await r.json())["code"] == "bad_request"
        wrong = {"inputs": {"x": {"data": [1, 2], "shape": [1, 2], "datatype": "INT64"}}}
        async with s.post(f"{url}/v1/functions/nf/invoke", json=wrong) as r:
            # decided by the controller (the function's signature), forwarded as it is
            assert r.status == 400 and "FP32" in (await r.json())["error"]
        async with s.get(f"{url}/v1/status") as r:
            status = await r.json()
            assert status["gateway"]["controller_connected"] is True and status["hosts"]
    await wait_for("the function table refreshed with a warm replica",
                   lambda: gateway.backend.get_function("nf").replicas_warm >= 1, 20)

    def kserve() -> np.ndarray:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        try:
            assert client.is_server_ready() and client.is_model_ready("nf")
            inp = triton.InferInput("x", [2, 3], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            res = client.infer("nf", [inp], outputs=[triton.InferRequestedOutput("y", binary_data=True)])
            return res.as_numpy("y")
        finally:
            client.close()

    np.testing.assert_allclose(await asyncio.to_thread(kserve), x)
    async with aiohttp.ClientSession() as s:
        async with s.delete(f"{url}/v1/functions/nf") as r:
            assert r.status == 200
        async with s.get(f"{url}/v1/functions/nf") as r:
            assert r.status == 404


async def test_requests_wait_out_a_lost_controller_connection(cluster, gateway) -> None:
    """The gateway's connection to the controller drops (as when the controller restarts):
    requests in flight are re-sent once it is back, and under load none fails."""
    ctl = cluster.controller
    await ctl.register_function(FunctionSpec(name="keep", model="noop", min_replicas=1))
    await wait_for("a warm replica", lambda: ctl.get_function("keep").replicas_warm == 1)
    await wait_for("the gateway knows the function",
                   lambda: "keep" in {i.spec.name for i in gateway.backend.list_functions()}, 10)
    x = np.ones((1, 2), np.float32)
    body = {"inputs": {"x": {"data": [1.0, 1.0], "shape": [1, 2], "datatype": "FP32"}}}

    async def call(s: aiohttp.ClientSession) -> int:
        async with s.post(f"{gateway.url}/v1/functions/keep/invoke", json=body) as r:
            out = await r.json()
            assert r.status == 200, out
            np.testing.assert_allclose(out["outputs"]["y"]["data"], x.ravel())
            return r.status

    async def drop() -> None:
        conn = gateway.backend.connection
        if conn is not None:
            await conn.close()

    async with aiohttp.ClientSession() as s:
        # Held in the controller's queue, then the connection they came on dies.
        rid = ctl.state.replicas_of("keep")[0].replica_id
        ctl.dispatcher.stop_accepting(rid)
        held = [asyncio.ensure_future(call(s)) for _ in range(4)]
        await wait_for("4 requests queued", lambda: ctl.dispatcher.queued("keep") == 4, 10)
        await drop()
        await wait_for("the 4 re-sent and queued again",
                       lambda: gateway.backend.retries >= 4 and ctl.dispatcher.queued("keep") == 4,
                       10)
        ctl.dispatcher.add_replica(rid, "keep", 64)  # accepting again
        assert await asyncio.wait_for(call(s), 10) == 200  # (its arrival pumps the queue)
        assert await asyncio.wait_for(asyncio.gather(*held), 10) == [200] * 4

        statuses: list[int] = []

        async def client() -> None:
            for _ in range(40):
                statuses.append(await call(s))

        load = asyncio.gather(*(client() for _ in range(4)))
        for _ in range(3):  # drop it a few times more under load
            await asyncio.sleep(0.15)
            await drop()
        await asyncio.wait_for(load, 60)
    assert statuses == [200] * 160
