"""The Python client's bodies and error mapping, against a recording aiohttp app (no
cluster): tensors keep their datatypes and shapes both ways, text and image bodies, error
answers become the typed error of their code, and ``import flashpoint`` stays cheap."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from flashpoint.client import AsyncClient, decode_outputs, encode_inputs, error_from_body
from flashpoint.errors import (
    BadRequest,
    DeadlineExceeded,
    FunctionNotFound,
    NoCapacity,
    Overloaded,
    ProtocolError,
    RemoteError,
    Unavailable,
)


def test_encode_inputs_keeps_datatypes_and_shapes() -> None:
    body = encode_inputs({
        "i": np.arange(6, dtype=np.int64).reshape(2, 3), "h": np.ones((1, 2), np.float16),
        "b": np.array([[True, False]]), "s": np.array([b"ab", b"c"], dtype=object),
        "u": np.array(["x", "y"]),
    })
    assert body["i"] == {"data": [0, 1, 2, 3, 4, 5], "shape": [2, 3], "datatype": "INT64"}
    assert body["h"]["datatype"] == "FP16" and body["b"]["datatype"] == "BOOL"
    assert body["s"] == {"data": ["ab", "c"], "shape": [2], "datatype": "BYTES"}
    assert body["u"]["data"] == ["x", "y"]
    with pytest.raises(BadRequest):
        encode_inputs({"c": np.ones(2, np.complex64)})
    with pytest.raises(BadRequest):
        encode_inputs({"s": np.array([b"\xff"], dtype=object)})


def test_decode_outputs() -> None:
    out = decode_outputs({
        "y": {"data": [1, 2, 3, 4], "shape": [2, 2], "datatype": "INT32"},
        "f": {"data": [0.5], "shape": [1, 1], "datatype": "BF16"},
        "t": {"data": ["hi"], "shape": [1], "datatype": "BYTES"},
        "raw": {"data": [base64.b64encode(b"\xff\x00").decode()], "shape": [1],
                "datatype": "BYTES", "encoding": "base64"},
    })
    assert out["y"].dtype == np.int32 and out["y"].shape == (2, 2)
    assert out["f"].dtype == np.float32 and out["t"][0] == b"hi" and out["raw"][0] == b"\xff\x00"
    with pytest.raises(ProtocolError):
        decode_outputs({"y": {"data": [1, 2, 3], "shape": [2, 2], "datatype": "INT32"}})


def test_error_from_body() -> None:
    err = error_from_body(404, {"error": "function 'f' is not registered",
                                "code": "function_not_found", "request_id": "r1"})
    assert isinstance(err, FunctionNotFound) and err.message == "function 'f' is not registered"
    err = error_from_body(429, {"error": "slow down", "code": "overloaded"}, "3")
    assert isinstance(err, Overloaded) and err.retry_after_s == 3.0
    err = error_from_body(503, {"error": "full", "code": "no_capacity",
                                "details": {"retry_after_s": 2.5}}, "3")
    assert isinstance(err, NoCapacity) and err.retry_after_s == 2.5
    assert isinstance(error_from_body(500, {"error": "?", "code": "brand_new"}), RemoteError)
    assert isinstance(error_from_body(502, "<html>bad gateway</html>"), Unavailable)
    assert isinstance(error_from_body(504, None), DeadlineExceeded)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[Any]]]:
    seen: list[Any] = []

    async def invoke(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"outputs": {"y": {"data": [7], "shape": [1, 1],
                                                    "datatype": "INT64"}},
                                  "cold": True, "timings_s": {"total": 0.25}})

    async def slow(request: web.Request) -> web.Response:
        import asyncio

        await asyncio.sleep(5)
        return web.json_response({})

    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_post("/v1/functions/{name}/invoke", invoke)
    app.router.add_get("/v1/status", slow)
    app.router.add_get("/v1/functions", not_json)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()


async def test_invoke_bodies(recorder: tuple[str, list[Any]]) -> None:
    url, seen = recorder
    async with AsyncClient(url, timeout_s=1.0) as fp:
        r = await fp.invoke("f", {"x": np.zeros((1, 1), np.float32)}, request_class="best_effort",
                            timeout_s=3)
        assert r.outputs["y"].dtype == np.int64 and r.cold and r.timings_s == {"total": 0.25}
        await fp.invoke("f", text=["a", "b"])
        await fp.invoke("f", image=b"\x89PNG")
        assert seen == [
            {"inputs": {"x": {"data": [0.0], "shape": [1, 1], "datatype": "FP32"}},
             "request_class": "best_effort", "timeout_s": 3},
            {"text": ["a", "b"]},
            {"image": base64.b64encode(b"\x89PNG").decode()},
        ]
        with pytest.raises(BadRequest):
            await fp.invoke("f", {"x": np.zeros(1)}, text="both")
        with pytest.raises(BadRequest):
            await fp.invoke("f")
        with pytest.raises(DeadlineExceeded):  # every call has a deadline
            await fp.status()
        with pytest.raises(ProtocolError):
            await fp.functions()


def test_import_flashpoint_is_cheap() -> None:
    code = ("import sys, flashpoint; heavy = [m for m in ('torch', 'numpy', 'aiohttp') "
            "if m in sys.modules]; assert not heavy, heavy; "
            "from flashpoint import Client, AsyncClient; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
