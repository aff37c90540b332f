"""The KaaS object store (issue 19, item 7): per-API-key namespaces, a total and a per-key
quota (on by default), deletion and TTL (with executors' cached copies dropped), and the
built-in raw kernel's launch checked against the buffers it touches."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest
from gateway.conftest import FakeBackend, ThreadedServer
from kaas.helpers import chain_request

from flashpoint.config import ControllerConfig
from flashpoint.errors import (
    BadRequest,
    BufferMismatch,
    InvalidKernelGraph,
    ObjectNotFound,
    ObjectQuotaExceeded,
)
from flashpoint.gateway import GatewayConfig, make_app
from flashpoint.kaas.graph import plan_graph
from flashpoint.kaas.library import KernelDef, default_library
from flashpoint.kaas.raw import check_saxpy_launch
from flashpoint.kaas.service import local_service
from flashpoint.kaas.spec import KaasRequest
from flashpoint.kaas.store import MemoryObjectStore, scoped_key, tenant_namespace

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
W = np.arange(16, dtype=np.float32).reshape(4, 4) / 8


def expected(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    t = x @ w
    return np.maximum(t, 0) + t


@pytest.fixture
def kaas():
    return local_service(1, capacity_bytes=64 << 10)


@pytest.fixture
def two_keys(kaas):
    cfg = GatewayConfig(api_keys={KEY_A: "invoke", KEY_B: "invoke"}, max_body_bytes=1 << 20)
    server = ThreadedServer(make_app(FakeBackend(), cfg, kaas=kaas), auto_decompress=False)
    server.start()
    yield server
    server.stop()


async def test_one_api_key_cannot_read_or_overwrite_anothers_objects(two_keys) -> None:
    d = chain_request()
    x = np.asarray(d["buffers"][0]["data"], np.float32)
    async with aiohttp.ClientSession(two_keys.url) as s:
        async with s.put("/v1/objects/w", data=W.tobytes(), headers=A) as r:
            assert r.status == 201, await r.text()
        async with s.get("/v1/objects/w", headers=B) as r:  # not B's to read
            assert r.status == 404
        async with s.post("/v1/kaas/invoke", json=d, headers=B) as r:  # nor to compute on
            assert (r.status, (await r.json())["code"]) == (404, "object_not_found")
        w_b = np.ones((4, 4), np.float32)
        async with s.put("/v1/objects/w", data=w_b.tobytes(), headers=B) as r:
            assert r.status == 201  # B's own "w": no 409, A's is untouched
        for headers, w in ((A, W), (B, w_b)):
            async with s.get("/v1/objects/w", headers=headers) as r:
                assert await r.read() == w.tobytes()
            async with s.post("/v1/kaas/invoke", json={**d, "output_encoding": "list"},
                              headers=headers) as r:
                out = (await r.json())["outputs"]["y"]
            np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(4, 4),
                                       expected(x, w), rtol=1e-5)
        # Stored outputs come back under the caller's own key, in its namespace.
        async with s.post("/v1/kaas/invoke", json=chain_request(out_key="y1"),
                          headers=A) as r:
            assert (await r.json())["outputs"]["y"] == {"key": "y1"}
        async with s.get("/v1/objects/y1", headers=B) as r:
            assert r.status == 404
        async with s.get("/v1/objects/y1", headers=A) as r:
            assert r.status == 200


async def test_delete_frees_the_key_and_executors_forget_their_copy(two_keys) -> None:
    d = chain_request()
    x = np.asarray(d["buffers"][0]["data"], np.float32)
    async with aiohttp.ClientSession(two_keys.url) as s:
        async with s.put("/v1/objects/w", data=W.tobytes(), headers=A) as r:
            assert r.status == 201
        async with s.post("/v1/kaas/invoke", json=d, headers=A) as r:
            assert r.status == 200  # now cached on the executor
        async with s.delete("/v1/objects/w", headers=B) as r:
            assert r.status == 404  # B has no "w"
        async with s.delete("/v1/objects/w", headers=A) as r:
            assert r.status == 204
        async with s.get("/v1/objects/w", headers=A) as r:
            assert r.status == 404
        async with s.delete("/v1/objects/w", headers=A) as r:
            assert r.status == 404
        w2 = W + 1
        async with s.put("/v1/objects/w", data=w2.tobytes(), headers=A) as r:
            assert r.status == 201  # the name is free again
        async with s.post("/v1/kaas/invoke", json=d, headers=A) as r:
            out = (await r.json())["outputs"]["y"]
        # The new bytes, not the executor's cached copy of the deleted object.
        np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(4, 4),
                                   expected(x, w2), rtol=1e-5)
        async with s.put("/v1/objects/v?ttl_s=-1", data=b"x", headers=A) as r:
            assert r.status == 400


def test_quotas_per_api_key_and_in_total() -> None:
    store = MemoryObjectStore(250, tenant_quota_bytes=100)
    a, b, c = (tenant_namespace(k) for k in ("a", "b", "c"))
    store.put(scoped_key(a, "x"), b"\0" * 80)
    with pytest.raises(ObjectQuotaExceeded, match="quota"):
        store.put(scoped_key(a, "y"), b"\0" * 40)  # a's 100 bytes
    store.put(scoped_key(b, "y"), b"\0" * 90)  # b has its own quota
    with pytest.raises(ObjectQuotaExceeded, match="full"):
        store.put(scoped_key(c, "z"), b"\0" * 90)  # 170 + 90 > the store's 250
    assert store.tenant_used_bytes(a) == 80 and store.used_bytes == 170
    store.delete(scoped_key(a, "x"))
    store.put(scoped_key(a, "y"), b"\0" * 40)  # room again
    assert store.tenant_used_bytes(a) == 40


def test_quotas_and_ttl_are_on_by_default() -> None:
    from flashpoint.controller.kaas_pool import KaasPool

    cc = ControllerConfig()
    assert cc.kaas_store_bytes > 0 and cc.kaas_store_key_bytes > 0 and cc.kaas_object_ttl_s > 0
    store = KaasPool(cc).store
    assert (store.capacity_bytes, store.tenant_quota_bytes, store.default_ttl_s) == (
        cc.kaas_store_bytes, cc.kaas_store_key_bytes, cc.kaas_object_ttl_s)


def test_objects_expire_and_listeners_hear_it() -> None:
    now = [0.0]
    store = MemoryObjectStore(default_ttl_s=100.0, clock=lambda: now[0])
    heard: list[str] = []
    store.add_removal_listener(heard.extend)
    store.put("short", b"a", ttl_s=10.0)
    store.put("capped", b"b", ttl_s=1000.0)  # at most the store's 100 s
    store.put("default", b"c")
    assert store.expires_in_s("capped") == pytest.approx(100.0)
    now[0] = 11.0
    with pytest.raises(ObjectNotFound):
        store.get("short")
    assert heard == ["short"] and store.used_bytes == 2
    store.put("short", b"other bytes")  # a new object under the freed key
    now[0] = 101.0
    assert not store.exists("capped") and not store.exists("default")
    assert sorted(heard) == ["capped", "default", "short"]
    assert store.get("short") == b"other bytes"  # its own TTL runs from its put
    with pytest.raises(BadRequest):
        store.put("neg", b"x", ttl_s=0)


def test_scoped_keys_stay_within_the_key_limit() -> None:
    ns = tenant_namespace("a")
    assert scoped_key(ns, "k" * 237).endswith("k" * 237)
    with pytest.raises(BadRequest, match="at most 237"):
        scoped_key(ns, "k" * 238)


# The built-in raw kernel (saxpy: out[i] = a * x[i] + y[i] for i < n) -------------------------
def _saxpy_request(n: int, sizes: tuple[int, int, int], grid: list[int],
                   block: list[int]) -> KaasRequest:
    def b(name: str, kind: str, size: int) -> dict:
        d = {"name": name, "kind": kind, "dtype": "float32", "shape": [size]}
        if kind == "input":
            d["key"] = name  # plan_graph does not look into the store
        return d

    return KaasRequest.from_dict({"version": 1, "kernels": [{
        "name": "k", "kernel": "saxpy", "library": "cupy", "inputs": ["x", "y"],
        "outputs": ["out"], "literals": [2.0, n], "grid": grid, "block": block}],
        "buffers": [b("x", "input", sizes[0]), b("y", "input", sizes[1]),
                    b("out", "output", sizes[2])]})


@pytest.fixture
def saxpy_library():
    """The library with saxpy as raw.register_builtin declares it (no CuPy needed)."""
    lib = default_library()
    lib.register(KernelDef("cupy", "saxpy", 2, 1, ("f32", "i32"), lambda *a: None, raw=True,
                           launch_check=check_saxpy_launch))
    return lib


@pytest.mark.parametrize(("n", "sizes", "grid", "block", "error", "match"), [
    (1024, (1024, 1024, 1024), [4], [256], None, ""),
    (1000, (1024, 1024, 1000), [4], [256], None, ""),  # extra threads are guarded by i < n
    (2048, (1024, 2048, 2048), [8], [256], BufferMismatch, "past x's 1024"),
    (1024, (1024, 1024, 512), [4], [256], BufferMismatch, "past out's 512"),
    (-1, (16, 16, 16), [1], [32], BufferMismatch, "negative"),
    (1024, (1024, 1024, 1024), [2], [256], InvalidKernelGraph, "do not cover"),
    (1024, (1024, 1024, 1024), [1], [2048], InvalidKernelGraph, "over 1024"),
    (1024, (1024, 1024, 1024), [4, 2], [256], InvalidKernelGraph, "1-D"),
])
def test_saxpy_launch_is_checked_against_its_buffers(saxpy_library, n, sizes, grid, block,
                                                      error, match) -> None:
    req = _saxpy_request(n, sizes, grid, block)
    if error is None:
        plan_graph(req, saxpy_library)
    else:
        with pytest.raises(error, match=match):
            plan_graph(req, saxpy_library)


async def test_a_standalone_gateways_calls_delete_and_pass_the_ttl() -> None:
    from flashpoint.controller.gateway_service import GatewayService
    from flashpoint.messages.gateway_controller import GATEWAY_RPC_VERSION as V

    svc = local_service(1, capacity_bytes=64 << 10)
    h = GatewayService(backend=None, kaas=svc).handlers()  # type: ignore[arg-type]
    key = scoped_key(tenant_namespace("a"), "k")
    await h["gw_object_put"](None, {"v": V, "key": key, "data": b"abc", "ttl_s": 5})
    assert svc.store.expires_in_s(key) == pytest.approx(5.0, abs=1.0)
    await h["gw_object_delete"](None, {"v": V, "key": key})
    with pytest.raises(ObjectNotFound):
        await h["gw_object_delete"](None, {"v": V, "key": key})
    with pytest.raises(BadRequest):
        await h["gw_object_put"](None, {"v": V, "key": key, "data": b"abc", "ttl_s": "1"})
