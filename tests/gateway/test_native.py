"""The native /v1 API, auth, request ids and metrics, over a real socket with aiohttp."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from flashpoint.gateway import RUNNER_KWARGS, GatewayConfig, add_routes

from .conftest import ADMIN_KEY, INVOKE_KEY, FakeBackend, ServerFactory, ThreadedServer

SPEC = {"name": "fn-a", "model": "double", "inputs": [{"name": "x", "datatype": "FP32",
                                                       "shape": [-1, 2]}]}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_function_lifecycle_and_invoke(server: ThreadedServer, backend: FakeBackend):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/functions", json=SPEC) as r:
            assert r.status == 201
            info = await r.json()
            assert info["spec"]["name"] == "fn-a" and info["ready"] is True
        async with s.get("/v1/functions") as r:
            names = [f["spec"]["name"] for f in await r.json()]
            assert "fn-a" in names and "identity" in names
        async with s.get("/v1/functions/fn-a") as r:
            assert (await r.json())["spec"]["inputs"][0]["shape"] == [-1, 2]
        body = {"inputs": {"x": {"data": [[1, 2], [3, 4.5]], "shape": [2, 2],
                                 "datatype": "FP32"}}, "timeout_s": 5}
        async with s.post("/v1/functions/fn-a/invoke", json=body,
                          headers={"X-Request-Id": "req-abc"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "req-abc"
            out = await r.json()
        assert out["outputs"]["y"] == {"data": [2.0, 4.0, 6.0, 9.0], "shape": [2, 2],
                                       "datatype": "FP32"}
        assert out["request_id"] == "req-abc" and out["replica_id"] == "rep-1"
        assert out["cold"] is False and "total" in out["timings_s"]
        assert backend.calls[-1]["request_id"] == "req-abc"
        assert backend.calls[-1]["timeout_s"] == 5
        async with s.delete("/v1/functions/fn-a") as r:
            assert r.status == 200
        async with s.get("/v1/functions/fn-a") as r:
            assert r.status == 404
            err = await r.json()
            assert err["code"] == "function_not_found" and "fn-a" in err["error"]
        async with s.delete("/v1/functions/fn-a") as r:
            assert r.status == 404


async def test_invoke_bytes_and_bool_outputs(server: ThreadedServer):
    body = {"inputs": {"s": {"data": ["a", "é"], "shape": [2], "datatype": "BYTES"},
                       "b": {"data": [True, False], "shape": [1, 2], "datatype": "BOOL"},
                       "h": {"data": [1.5], "shape": [1], "datatype": "BF16"}}}
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/functions/identity/invoke", json=body) as r:
            assert r.status == 200, await r.text()
            out = (await r.json())["outputs"]
    assert out["s_out"] == {"data": ["a", "é"], "shape": [2], "datatype": "BYTES"}
    assert out["b_out"]["data"] == [True, False]
    assert out["h_out"] == {"data": [1.5], "shape": [1], "datatype": "FP32"}


async def test_invoke_response_gzip(server: ThreadedServer):
    body = {"inputs": {"x": {"data": list(range(2000)), "shape": [1000, 2],
                             "datatype": "FP32"}}}
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/functions/double/invoke", json=body,
                          headers={"Accept-Encoding": "gzip"}) as r:
            assert r.status == 200
            assert r.headers["Content-Encoding"] == "gzip"
            out = await r.json()  # aiohttp inflates it
    assert out["outputs"]["y"]["data"][:3] == [0.0, 2.0, 4.0]


async def test_status_health_metrics(server: ThreadedServer, backend: FakeBackend):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.get("/v1/status") as r:
            assert (await r.json())["hosts"][0]["id"] == "h1"
        async with s.get("/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        backend.live = False
        async with s.get("/healthz") as r:
            assert r.status == 503
        async with s.get("/v1/functions/nope") as r:
            assert r.status == 404
        async with s.get("/metrics") as r:
            text = await r.text()
    assert r.headers["Content-Type"].startswith("text/plain")
    assert ('flashpoint_gateway_requests_total{method="GET",route="/v1/functions/{name}",'
            'status="404"} 1.0') in text
    assert "flashpoint_gateway_request_duration_seconds_bucket" in text


async def test_request_id_generated_and_bad_one_replaced(server: ThreadedServer):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.get("/healthz") as r:
            assert r.headers["X-Request-Id"].startswith("req-")
        async with s.get("/healthz", headers={"X-Request-Id": "bad id\twith spaces"}) as r:
            assert r.headers["X-Request-Id"].startswith("req-")
        async with s.get("/nope/nothing", headers={"X-Request-Id": "trace-1"}) as r:
            assert r.status == 404
            assert r.headers["X-Request-Id"] == "trace-1"
            err = await r.json()
            assert err == {"error": "no such route", "code": "not_found", "request_id": "trace-1"}
        async with s.put("/v1/functions") as r:
            assert r.status == 405
            assert (await r.json())["code"] == "method_not_allowed"
            assert "GET" in r.headers["Allow"]


@pytest.mark.parametrize("method,path,role", [
    ("POST", "/v1/functions", "admin"),
    ("DELETE", "/v1/functions/identity", "admin"),
    ("GET", "/v1/functions", "invoke"),
    ("GET", "/v1/functions/identity", "invoke"),
    ("POST", "/v1/functions/identity/invoke", "invoke"),
    ("GET", "/v1/status", "invoke"),
    ("GET", "/v2", "invoke"),
    ("GET", "/v2/models/double", "invoke"),
    ("GET", "/v2/models/double/ready", "invoke"),
    ("POST", "/v2/models/double/infer", "invoke"),
])
async def test_auth_roles(auth_server: ThreadedServer, method: str, path: str, role: str):
    body = {"inputs": {"x": {"data": [1.0], "shape": [1, 1], "datatype": "FP32"}}}
    if path == "/v1/functions":
        body = SPEC
    elif path.endswith("/infer"):
        body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    async with aiohttp.ClientSession(auth_server.url) as s:
        async def call(headers: dict[str, str]) -> tuple[int, dict]:
            async with s.request(method, path, json=body, headers=headers) as r:
                return r.status, await r.json()

        status, err = await call({})
        assert status == 401 and err["code"] == "unauthorized"
        status, err = await call(_auth("not-a-real-key"))
        assert status == 401 and err["code"] == "unauthorized"
        status, err = await call({"Authorization": f"Basic {ADMIN_KEY}"})
        assert status == 401
        status, err = await call(_auth(INVOKE_KEY))
        if role == "admin":
            assert status == 403 and err["code"] == "forbidden"
        else:
            assert status < 400, err
        status, err = await call(_auth(ADMIN_KEY))
        assert status < 400, err


async def test_health_open_with_auth(auth_server: ThreadedServer):
    async with aiohttp.ClientSession(auth_server.url) as s:
        for path in ("/healthz", "/v2/health/live", "/v2/health/ready", "/metrics"):
            async with s.get(path) as r:
                assert r.status == 200, path
        async with s.get("/v1/functions") as r:
            assert r.headers["WWW-Authenticate"].startswith("Bearer")


async def test_register_errors(server: ThreadedServer):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/functions", json={"name": "x", "model": "missing"}) as r:
            assert r.status == 404 and (await r.json())["code"] == "model_not_found"
        async with s.post("/v1/functions", json={"name": "../etc", "model": "m"}) as r:
            assert r.status == 400 and (await r.json())["code"] == "invalid_name"
        async with s.post("/v1/functions", json={"name": "x", "model": "m", "bogus": 1}) as r:
            assert r.status == 400 and "bogus" in (await r.json())["error"]


async def test_error_mapping(server: ThreadedServer):
    body = {"inputs": {"x": {"data": [1.0], "shape": [1], "datatype": "FP32"}}}
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/functions/busy/invoke", json=body) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
            err = await r.json()
            assert err["code"] == "overloaded" and err["details"]["retry_after_s"] == 2
        async with s.post("/v1/functions/slow/invoke", json=body) as r:
            assert r.status == 504 and (await r.json())["code"] == "deadline_exceeded"
        async with s.post("/v1/functions/crash/invoke", json=body) as r:
            assert r.status == 500
            err = await r.json()
            assert err["code"] == "internal" and "secret" not in await r.text()
            assert "Traceback" not in await r.text()
        async with s.post("/v1/functions/failing/invoke", json=body) as r:
            assert r.status == 500 and (await r.json())["code"] == "model_failed"
        async with s.post("/v1/functions/weird/invoke", json=body) as r:
            assert r.status == 500 and (await r.json())["code"] == "model_failed"


async def test_inflight_cap(make_server: ServerFactory):
    srv = make_server(GatewayConfig(max_inflight_requests=1, deadline_grace_s=0.3))
    body = {"inputs": {"x": {"data": [1.0], "shape": [1], "datatype": "FP32"}}}
    async with aiohttp.ClientSession(srv.url) as s:
        async def call(name: str) -> int:
            async with s.post(f"/v1/functions/{name}/invoke", json=body) as r:
                return r.status

        slow = asyncio.create_task(call("slow"))
        await asyncio.sleep(0.15)
        assert await call("identity") == 429
        assert await slow == 504
        assert await call("identity") == 200


async def test_in_flight_gauge_counts_requests_being_handled(make_server: ServerFactory):
    srv = make_server(GatewayConfig(deadline_grace_s=1.0))
    body = {"inputs": {"x": {"data": [1.0], "shape": [1], "datatype": "FP32"}}}
    gauge = "flashpoint_gateway_requests_in_flight "

    async with aiohttp.ClientSession(srv.url) as s:
        async def in_flight() -> float:
            async with s.get("/metrics") as r:
                line = next(ln for ln in (await r.text()).splitlines() if ln.startswith(gauge))
                return float(line.split()[1])

        assert await in_flight() == 1.0  # the scrape itself
        # sleepy: held until the gateway's backstop answers 504 (timeout 0.2 s + grace 1 s)
        slow = asyncio.create_task(s.post("/v1/functions/slow/invoke", json=body))
        seen = []
        for _ in range(20):  # bounded: at most ~1 s
            seen.append(await in_flight())
            if seen[-1] == 2.0:
                break
            await asyncio.sleep(0.05)
        assert seen[-1] == 2.0, seen  # the held request and the scrape
        resp = await slow
        assert resp.status == 504
        resp.release()
        assert await in_flight() == 1.0


async def test_add_routes_beside_other_routes(backend: FakeBackend):
    """Mounted on the controller's app, the gateway leaves the other routes alone."""
    async def rpc(request: web.Request) -> web.Response:
        raise web.HTTPBadRequest(text="rpc says no")

    app = web.Application()
    app.router.add_post("/rpc", rpc)
    add_routes(app, backend, GatewayConfig())
    runner = web.AppRunner(app, **RUNNER_KWARGS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession(url) as s:
            async with s.post("/rpc") as r:
                assert r.status == 400 and await r.text() == "rpc says no"
                assert "X-Request-Id" not in r.headers
            async with s.get("/v2/models/double") as r:
                assert r.status == 200 and (await r.json())["name"] == "double"
            async with s.get("/metrics") as r:
                assert 'route="/rpc"' not in await r.text()
    finally:
        await runner.cleanup()


async def test_request_class_from_body_header_or_kserve_parameters(server: ThreadedServer,
                                                                   backend: FakeBackend):
    x = {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}
    kx = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    async with aiohttp.ClientSession(server.url) as s:
        async def native(body: dict, headers: dict | None = None) -> int:
            async with s.post("/v1/functions/identity/invoke", json=body, headers=headers) as r:
                await r.read()
                return r.status

        assert await native({"inputs": x}) == 200
        assert backend.calls[-1]["request_class"] == "strict"
        assert await native({"inputs": x, "request_class": "best_effort"}) == 200
        assert backend.calls[-1]["request_class"] == "best_effort"
        assert await native({"inputs": x}, {"X-Request-Class": "best_effort"}) == 200
        assert backend.calls[-1]["request_class"] == "best_effort"
        async with s.post("/v2/models/identity/infer",
                          json={**kx, "parameters": {"request_class": "best_effort"}}) as r:
            assert r.status == 200, await r.text()
        assert backend.calls[-1]["request_class"] == "best_effort"
        calls = len(backend.calls)
        for body, headers in (({"inputs": x, "request_class": "urgent"}, None),
                              ({"inputs": x}, {"X-Request-Class": "gold"}),
                              ({"inputs": x, "request_class": "strict"},
                               {"X-Request-Class": "best_effort"})):
            async with s.post("/v1/functions/identity/invoke", json=body, headers=headers) as r:
                err = await r.json()
                assert r.status == 400 and err["code"] == "bad_request", err
                assert "request_class" in err["error"]
        async with s.post("/v2/models/identity/infer",
                          json={**kx, "parameters": {"request_class": 7}}) as r:
            assert r.status == 400
        assert len(backend.calls) == calls  # refused before reaching the backend


async def test_function_not_ready_shows_its_reason(server: ThreadedServer, backend: FakeBackend):
    reason = {"code": "model_load_failed", "message": "boom", "error_code": "registry_error",
              "failed_starts": 3, "since": 1.0, "last_failure": 2.0, "retry_in_s": 9.5}
    backend.not_ready["double"] = reason
    async with aiohttp.ClientSession(server.url) as s:
        async with s.get("/v1/functions/double") as r:
            info = await r.json()
        assert info["ready"] is False and info["reason"] == reason
        assert {"spec", "replicas_warm", "replicas_starting", "queued"} <= set(info)
        async with s.get("/v1/functions") as r:
            listed = {f["spec"]["name"]: f for f in await r.json()}
        assert listed["double"]["reason"] == reason
        assert listed["identity"]["ready"] is True and "reason" not in listed["identity"]
