"""/v1/kaas/invoke and /v1/objects over a real socket, and chaining a host function's output
into a kernel graph through the object store."""

from __future__ import annotations

import base64

import aiohttp
import numpy as np
import pytest
from kaas.helpers import buf, chain_request, kern

from flashpoint.gateway import GatewayConfig, make_app
from flashpoint.kaas.service import local_service
from flashpoint.kaas.store import scoped_key, tenant_namespace

from .conftest import INVOKE_KEY, FakeBackend, ThreadedServer

W = np.arange(16, dtype=np.float32).reshape(4, 4) / 8
W_KEY = scoped_key(tenant_namespace("anonymous"), "w")  # "w" of a caller without auth


@pytest.fixture
def kaas():
    svc = local_service(2, capacity_bytes=64 << 10)
    svc.store.put(W_KEY, W.tobytes())
    return svc


@pytest.fixture
def kaas_server(backend: FakeBackend, kaas):
    cfg = GatewayConfig(deadline_grace_s=0.1, max_body_bytes=1 << 20)
    server = ThreadedServer(make_app(backend, cfg, kaas=kaas), auto_decompress=False).start()
    yield server
    server.stop()


def expected(x: np.ndarray) -> np.ndarray:
    t = x @ W
    return np.maximum(t, 0) + t


async def test_invoke_inline_and_stored_outputs(kaas_server: ThreadedServer, kaas):
    d = chain_request()
    x = np.asarray(d["buffers"][0]["data"], np.float32)
    async with aiohttp.ClientSession(kaas_server.url) as s:
        async with s.post("/v1/kaas/invoke", json={**d, "client": "fn1"}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        y = out["outputs"]["y"]
        assert y["dtype"] == "float32" and y["shape"] == [4, 4]
        assert np.allclose(np.reshape(y["data"], (4, 4)), expected(x))
        assert set(out["timings_s"]) >= {"resident", "kernels", "d2h", "total", "queue"}
        assert out["cache"]["misses"] == 3 and out["executor_id"].startswith("exec-")
        async with s.post("/v1/kaas/invoke", json={**d, "client": "fn1",
                                                   "output_encoding": "b64"}) as r:
            out = await r.json()
        assert out["cache"]["hits"] == 3  # affinity: same executor, warm
        raw = base64.b64decode(out["outputs"]["y"]["b64"])
        assert np.allclose(np.frombuffer(raw, np.float32).reshape(4, 4), expected(x))
        stored = chain_request(out_key="result-1")
        async with s.post("/v1/kaas/invoke", json=stored) as r:
            assert (await r.json())["outputs"] == {"y": {"key": "result-1"}}
        async with s.get("/v1/kaas/status") as r:
            status = await r.json()
        assert status["policy"] == "affinity" and "torch.matmul" in status["kernels"]
        caches = [e["cache"] for e in status["executors"]]
        # the third call (another client: its own intermediates) hit only w
        assert sum(c["hits"] for c in caches) == 4 and sum(c["misses"] for c in caches) == 5
        async with s.get("/v1/objects/result-1") as r:
            assert r.status == 200
            assert np.allclose(np.frombuffer(await r.read(), np.float32).reshape(4, 4),
                               expected(x))


async def test_objects_put_get_immutable(kaas_server: ThreadedServer):
    async with aiohttp.ClientSession(kaas_server.url) as s:
        async with s.put("/v1/objects/ns/a.bin", data=b"12345678") as r:
            assert r.status == 201 and (await r.json())["size_bytes"] == 8
        async with s.put("/v1/objects/ns/a.bin", data=b"12345678") as r:
            assert r.status == 201  # same bytes: idempotent
        async with s.put("/v1/objects/ns/a.bin", data=b"other!!!") as r:
            assert r.status == 409 and (await r.json())["code"] == "object_exists"
        async with s.get("/v1/objects/ns/a.bin") as r:
            assert await r.read() == b"12345678"
        async with s.get("/v1/objects/nope") as r:
            assert r.status == 404 and (await r.json())["code"] == "object_not_found"
        async with s.put("/v1/objects/bad%20key", data=b"x") as r:
            assert r.status == 400


async def test_chain_host_function_into_kernel_graph(kaas_server: ThreadedServer,
                                                     backend: FakeBackend):
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    body = {"inputs": {"x": {"data": x.tolist(), "shape": [4, 4], "datatype": "FP32"}},
            "store_outputs": {"y": "fn-out/1"}}
    async with aiohttp.ClientSession(kaas_server.url) as s:
        async with s.post("/v1/functions/double/invoke", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert out["outputs"] == {}
        assert out["stored"] == {"y": {"key": "fn-out/1", "dtype": "float32", "shape": [4, 4]}}
        graph = {"kernels": [kern("matmul", ["y", "w"], ["z"])],
                 "buffers": [buf("y", "input", [4, 4], key="fn-out/1"),
                             buf("w", "input", [4, 4], key="w"), buf("z", "output", [4, 4])]}
        async with s.post("/v1/kaas/invoke", json=graph) as r:
            assert r.status == 200, await r.text()
            z = np.reshape((await r.json())["outputs"]["z"]["data"], (4, 4))
        assert np.allclose(z, (x * 2) @ W)
        body["store_outputs"] = {"nope": "k2"}
        async with s.post("/v1/functions/double/invoke", json=body) as r:
            assert r.status == 400 and "nope" in (await r.json())["error"]


def _bad(**changes) -> dict:
    d = chain_request()
    d.update(changes)
    return d


@pytest.mark.parametrize("body,status,code", [
    (_bad(kernels=[kern("fft", ["x"], ["y"])]), 400, "unknown_kernel"),
    (_bad(kernels=[kern("relu", ["ghost"], ["y"])]), 400, "undefined_buffer"),
    ({"kernels": [kern("relu", ["t"], ["y"])],
      "buffers": [buf("t", "intermediate", [2]), buf("y", "output", [2])]}, 400,
     "read_before_write"),
    ({"kernels": [kern("relu", ["b"], ["a"]), kern("relu", ["a"], ["b"]),
                  kern("copy", ["a"], ["y"])],
      "buffers": [buf("a", "intermediate", [2]), buf("b", "intermediate", [2]),
                  buf("y", "output", [2])]}, 400, "kernel_graph_cycle"),
    (chain_request(x=np.ones((4, 4), np.float32), w_key="missing"), 404, "object_not_found"),
    (_bad(buffers=[buf("x", "input", [2, 2], data=[1, 2, 3])]), 400, "buffer_mismatch"),
    (chain_request(n=128), 413, "buffer_cache_full"),  # over the 64 KiB executor cache
    (_bad(buffers=[{"name": "huge", "kind": "intermediate", "size_bytes": 1 << 40}]), 413,
     "too_large"),
    (_bad(buffers=[buf("huge", "intermediate", [1 << 20, 1 << 20])]), 413, "too_large"),
    (_bad(timeout_s="soon"), 400, "bad_request"),
    (_bad(client="no spaces"), 400, "bad_request"),
    ([1, 2], 400, "bad_request"),
    (_bad(kernels="all"), 400, "invalid_kernel_graph"),
    (_bad(n_iters=100_001), 400, "invalid_kernel_graph"),
])
async def test_bad_requests(kaas_server: ThreadedServer, kaas, body, status, code):
    if code == "buffer_cache_full":
        kaas.store.put(W_KEY, W.tobytes())  # present, so the size is what fails
    async with aiohttp.ClientSession(kaas_server.url) as s:
        async with s.post("/v1/kaas/invoke", json=body) as r:
            text = await r.text()
            assert r.status == status, text
            assert (await r.json())["code"] == code


async def test_body_over_limit_and_not_json(kaas_server: ThreadedServer):
    async with aiohttp.ClientSession(kaas_server.url) as s:
        async with s.post("/v1/kaas/invoke", data=b"x" * (2 << 20)) as r:
            assert r.status == 413 and (await r.json())["code"] == "too_large"
        async with s.post("/v1/kaas/invoke", data=b"{not json") as r:
            assert r.status == 400


async def test_invoke_role_required(backend: FakeBackend, kaas):
    cfg = GatewayConfig(api_keys={INVOKE_KEY: "invoke"})
    server = ThreadedServer(make_app(backend, cfg, kaas=kaas), auto_decompress=False).start()
    try:
        async with aiohttp.ClientSession(server.url) as s:
            async with s.post("/v1/kaas/invoke", json=chain_request()) as r:
                assert r.status == 401
            auth = {"Authorization": f"Bearer {INVOKE_KEY}"}
            # This key's own "w" (the fixture's is the anonymous caller's).
            async with s.put("/v1/objects/w", data=W.tobytes(), headers=auth) as r:
                assert r.status == 201
            async with s.post("/v1/kaas/invoke", json=chain_request(), headers=auth) as r:
                assert r.status == 200
    finally:
        server.stop()


async def test_routes_absent_without_kaas(server: ThreadedServer):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post("/v1/kaas/invoke", json=chain_request()) as r:
            assert r.status == 404
        body = {"inputs": {"x": {"data": [1.0], "shape": [1, 1], "datatype": "FP32"}},
                "store_outputs": {"y": "k"}}
        async with s.post("/v1/functions/double/invoke", json=body) as r:
            assert r.status == 400


async def test_rate_limit_applies_to_kaas(backend: FakeBackend, kaas):
    cfg = GatewayConfig(rate_limit_rps=0.001, rate_limit_burst=1)
    server = ThreadedServer(make_app(backend, cfg, kaas=kaas), auto_decompress=False).start()
    try:
        async with aiohttp.ClientSession(server.url) as s:
            async with s.post("/v1/kaas/invoke", json=chain_request()) as r:
                assert r.status == 200
            async with s.post("/v1/kaas/invoke", json=chain_request()) as r:
                assert r.status == 429 and (await r.json())["code"] == "overloaded"
    finally:
        server.stop()
