"""Bad input on every route: always a 4xx JSON error with a code, never a 500 or a hang."""

from __future__ import annotations

import functools
import gzip
import json
import zlib

import aiohttp
import pytest

from flashpoint.gateway import GatewayConfig

from .conftest import ServerFactory, ThreadedServer

INFER = "/v2/models/double/infer"
INVOKE = "/v1/functions/double/invoke"


def _t(**kw):
    t = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}
    t.update(kw)
    return {"inputs": [t]}


def _bin_header(size, **kw):
    t = {"name": "x", "shape": [1, 2], "datatype": "FP32",
         "parameters": {"binary_data_size": size}}
    t.update(kw)
    return json.dumps({"inputs": [t]}).encode()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def _expect_4xx(s: aiohttp.ClientSession, method: str, path: str, *, status=None,
                      code=None, **kw) -> dict:
    async with s.request(method, path, **kw) as r:
        text = await r.text()
        assert 400 <= r.status < 500, (path, r.status, text)
        if status is not None:
            assert r.status == status, (path, r.status, text)
        assert r.headers["Content-Type"].startswith("application/json"), text
        err = json.loads(text)
        assert isinstance(err["error"], str) and err["error"]
        assert isinstance(err["code"], str) and err["code"]
        if code is not None:
            assert err["code"] == code, err
        assert "Traceback" not in text
        return err


JSON_INFER_CASES = [
    (b"{", "malformed JSON"),
    (b"", "empty"),
    (b"\xff\xfe", "malformed JSON"),
    (b"[]", "JSON object"),
    (b"null", "JSON object"),
    (json.dumps({"inputs": {}}).encode(), "non-empty list"),
    (json.dumps({"inputs": []}).encode(), "non-empty list"),
    (json.dumps({"inputs": [1]}).encode(), "object"),
    (json.dumps(_t(name=None)).encode(), "name"),
    (json.dumps(_t(name=5)).encode(), "name"),
    (json.dumps(_t(datatype="FP8")).encode(), "unknown datatype"),
    (json.dumps(_t(datatype=None)).encode(), "unknown datatype"),
    (json.dumps(_t(shape=[-1, 2])).encode(), "non-negative"),
    (json.dumps(_t(shape="1,2")).encode(), "shape"),
    (json.dumps(_t(shape=[True, 2])).encode(), "shape"),
    (json.dumps(_t(shape=[1.0, 2])).encode(), "shape"),
    (json.dumps(_t(shape=[1] * 9, data=[1])).encode(), "dims"),
    (json.dumps(_t(data=[1, 2, 3])).encode(), "needs 2 elements"),
    (json.dumps(_t(data=["a", "b"])).encode(), "numbers"),
    (json.dumps(_t(data=[True, False])).encode(), "numbers"),
    (json.dumps(_t(data=[None, 1])).encode(), "numbers"),
    (json.dumps(_t(data={"a": 1})).encode(), "elements"),
    (json.dumps(_t(data=[1, 10**400])).encode(), "does not fit"),
    (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1'
     + b"0" * 5000 + b"]}]}", "malformed JSON"),  # past Python's int digit limit
    (json.dumps(_t(datatype="FP32", data=[1, 1e39])).encode(), None),  # inf is allowed
    (json.dumps(_t(datatype="UINT8", data=[1, 300])).encode(), "does not fit"),
    (json.dumps(_t(datatype="INT8", data=[1, -129])).encode(), "does not fit"),
    (json.dumps(_t(datatype="UINT64", data=[1, -1])).encode(), "does not fit"),
    (json.dumps(_t(datatype="INT64", data=[1, 2**64])).encode(), "does not fit"),
    (json.dumps(_t(datatype="INT64", data=[1, 2.5])).encode(), "integers"),
    (json.dumps(_t(datatype="BOOL", data=[1, 0])).encode(), "true/false"),
    (json.dumps(_t(datatype="BYTES", data=[1, 2])).encode(), "strings"),
    (json.dumps(_t(shape=[2**20, 2**19], data=[])).encode(), "limit"),
    (json.dumps(_t(shape=[2**40, 2**40], data=[])).encode(), "too large"),
    (json.dumps(_t(datatype="BYTES", shape=[2**40], data=[])).encode(), "elements"),
    (json.dumps(_t(shape=[0, 2**62], data=[])).encode(), "too large"),
    (json.dumps(_t(shape=[0, 2**70], data=[])).encode(), "too large"),
    (json.dumps(_t(datatype="BYTES", shape=[0, 2**62], data=[])).encode(), "too large"),
    (json.dumps(_t(parameters=[])).encode(), "parameters"),
    (json.dumps(_t(parameters={"shared_memory_region": "r"})).encode(), "shared memory"),
    (json.dumps(_t(parameters={"binary_data_size": 8})).encode(), "both"),
    (json.dumps({"inputs": [_t()["inputs"][0], _t()["inputs"][0]]}).encode(), "twice"),
    (json.dumps({"inputs": [_t(name=f"i{i}")["inputs"][0] for i in range(80)]}).encode(),
     "at most"),
    (json.dumps({**_t(), "id": 5}).encode(), "'id'"),
    (json.dumps({**_t(), "parameters": 3}).encode(), "parameters"),
    (json.dumps({**_t(), "parameters": {"binary_data_output": "yes"}}).encode(), "boolean"),
    (json.dumps({**_t(), "parameters": {"timeout": -5}}).encode(), "timeout"),
    (json.dumps({**_t(), "parameters": {"timeout": True}}).encode(), "timeout"),
    (json.dumps({**_t(), "outputs": "y"}).encode(), "'outputs'"),
    (json.dumps({**_t(), "outputs": [{"name": "y"}, {"name": "y"}]}).encode(), "twice"),
    (json.dumps({**_t(), "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]})
     .encode(), "boolean"),
    (json.dumps({**_t(), "outputs": [{"name": "zz"}]}).encode(), "unknown output"),
    (json.dumps({**_t(), "pad": _nested(40).decode()}).encode(), None),  # a string: fine
    (b'{"inputs": ' + _nested(40) + b"}", "nested deeper"),
    (b'{"inputs": ' + _nested(100_000) + b"}", "nested deeper"),
]


@pytest.mark.parametrize("body,fragment", JSON_INFER_CASES)
async def test_infer_bad_json(server: ThreadedServer, body: bytes, fragment: str | None):
    async with aiohttp.ClientSession(server.url) as s:
        async with s.post(INFER, data=body) as r:
            if fragment is None and r.status == 200:
                return
        err = await _expect_4xx(s, "POST", INFER, data=body, status=400)
        if fragment:
            assert fragment in err["error"], err


BINARY_CASES = [
    # (json header, binary bytes, header-length header override, expected fragment)
    (_bin_header(8), b"\0" * 8, "-1", "non-negative integer"),
    (_bin_header(8), b"\0" * 8, "abc", "non-negative integer"),
    (_bin_header(8), b"\0" * 8, "1e3", "non-negative integer"),
    (_bin_header(8), b"\0" * 8, "99999999999999999999999", "non-negative integer"),
    (_bin_header(8), b"\0" * 8, "100000", "past the end"),
    (_bin_header(8), b"\0" * 8, "0", "empty"),
    (_bin_header(8), b"\0" * 8, "5", "malformed JSON"),
    (_bin_header(-1), b"", None, "binary_data_size"),
    (_bin_header("8"), b"\0" * 8, None, "binary_data_size"),
    (_bin_header(True), b"\0" * 8, None, "binary_data_size"),
    (_bin_header(16), b"\0" * 8, None, "runs past"),
    (_bin_header(4), b"\0" * 4, None, "needs 8 bytes"),
    (_bin_header(8), b"\0" * 12, None, "unclaimed"),
    (_bin_header(2**62), b"\0" * 8, None, "runs past"),
    (_bin_header(8, shape=[2**15, 2**15]), b"\0" * 8, None, "needs"),
    (_bin_header(0, shape=[0, 2**62]), b"", None, "too large"),
    (_bin_header(0, datatype="BYTES", shape=[2**21, 0, 2**20]), b"", None, "too large"),
    (_bin_header(8, datatype="BYTES", shape=[1]), b"\xff\xff\xff\x7f" + b"\0" * 4, None,
     "past the data"),
    (_bin_header(8, datatype="BYTES", shape=[1]), b"\x01\0\0\0abcd", None, "left over"),
    (_bin_header(4, datatype="BYTES", shape=[3]), b"\0" * 4, None, "at least 12"),
    (_bin_header(3, datatype="BYTES", shape=[1]), b"\0" * 3, None, "at least 4"),
    (_bin_header(8, datatype="BYTES", shape=[2**40]), b"\0" * 8, None, "at least"),
    (_bin_header(3, datatype="BF16", shape=[2]), b"\0" * 3, None, "needs 4 bytes"),
]


@pytest.mark.parametrize("header,binary,length,fragment", BINARY_CASES)
async def test_infer_bad_binary(server: ThreadedServer, header, binary, length, fragment):
    headers = {"Inference-Header-Content-Length": length if length is not None
               else str(len(header))}
    async with aiohttp.ClientSession(server.url) as s:
        err = await _expect_4xx(s, "POST", INFER, data=header + binary, headers=headers,
                                status=400)
    assert fragment in err["error"], err


INVOKE_CASES = [
    (b"{", "malformed JSON"),
    (b"", "empty"),
    (b"[1]", "JSON object"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [1], "datatype": "FP32"}},
                 "extra": 1}).encode(), "unknown invoke fields"),
    (json.dumps({"inputs": []}).encode(), "non-empty object"),
    (json.dumps({"inputs": {}}).encode(), "non-empty object"),
    (json.dumps({"inputs": {"x": [1, 2]}}).encode(), "must be an object"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [1]}}}).encode(), "unknown datatype"),
    (json.dumps({"inputs": {"x": {"shape": [1], "datatype": "FP32"}}}).encode(), "exactly"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [2], "datatype": "FP32"}}}).encode(),
     "needs 2 elements"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [1], "datatype": "complex"}}})
     .encode(), "unknown datatype"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [1], "datatype": "FP32"}},
                 "timeout_s": -1}).encode(), "timeout_s"),
    (json.dumps({"inputs": {"x": {"data": [1], "shape": [1], "datatype": "FP32"}},
                 "timeout_s": "5"}).encode(), "timeout_s"),
    (json.dumps({"inputs": {"x": {"data": [], "shape": [2**20, 2**20], "datatype": "FP64"}}})
     .encode(), "limit"),
    (json.dumps({"inputs": {"x": {"data": [], "shape": [2**50, 2**50], "datatype": "FP64"}}})
     .encode(), "too large"),
    (b'{"inputs": ' + _nested(50) + b"}", "nested deeper"),
]


@pytest.mark.parametrize("body,fragment", INVOKE_CASES)
async def test_invoke_bad_json(server: ThreadedServer, body: bytes, fragment: str):
    async with aiohttp.ClientSession(server.url) as s:
        err = await _expect_4xx(s, "POST", INVOKE, data=body, status=400)
    assert fragment in err["error"], err


REGISTER_CASES = [
    b"{", b"[]", b"null", b'"x"',
    json.dumps({"name": "a"}).encode(),
    json.dumps({"name": 5, "model": "m"}).encode(),
    json.dumps({"name": "a", "model": "m", "max_batch_size": "8"}).encode(),
    json.dumps({"name": "a", "model": "m", "max_batch_size": True}).encode(),
    json.dumps({"name": "a", "model": "m", "max_batch_size": 10**6}).encode(),
    json.dumps({"name": "a", "model": "m", "timeout_s": -1}).encode(),
    json.dumps({"name": "a", "model": "m", "inputs": "x"}).encode(),
    json.dumps({"name": "a", "model": "m", "inputs": [{"name": "x"}]}).encode(),
    json.dumps({"name": "a", "model": "m", "inputs": [{"name": "x", "datatype": "FP8",
                                                       "shape": [1]}]}).encode(),
    json.dumps({"name": "A B", "model": "m"}).encode(),
    json.dumps({"name": "a", "model": "m", "model_version": "../x"}).encode(),
    b'{"name": ' + _nested(60) + b"}",
]


@pytest.mark.parametrize("body", REGISTER_CASES)
async def test_register_bad_json(server: ThreadedServer, body: bytes):
    async with aiohttp.ClientSession(server.url) as s:
        await _expect_4xx(s, "POST", "/v1/functions", data=body, status=400)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/functions/%2e%2e"),
    ("GET", "/v1/functions/" + "a" * 5000),
    ("DELETE", "/v1/functions/..%2fetc"),
    ("POST", "/v1/functions/nope/invoke"),
    ("GET", "/v2/models/nope"),
    ("GET", "/v2/models/nope/ready"),
    ("GET", "/v2/models/double/versions/..%2f/ready"),
    ("GET", "/v2/models/double/versions/" + "9" * 3000),
    ("POST", "/v2/models/nope/infer"),
    ("POST", "/v2/models/double/versions/9/infer"),
    ("GET", "/v3/anything"),
])
async def test_unknown_names_are_404(server: ThreadedServer, method: str, path: str):
    async with aiohttp.ClientSession(server.url) as s:
        await _expect_4xx(s, method, path, status=404, data=b"{}")


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2/models/double/infer"), ("PUT", "/v2/models/double"), ("POST", "/healthz"),
    ("PATCH", "/v1/functions/double"), ("POST", "/v1/status"),
])
async def test_wrong_method_is_405(server: ThreadedServer, method: str, path: str):
    async with aiohttp.ClientSession(server.url) as s:
        await _expect_4xx(s, method, path, status=405, code="method_not_allowed")


@pytest.mark.parametrize("path", [INFER, INVOKE, "/v1/functions"])
async def test_oversized_body_is_413(server: ThreadedServer, path: str):
    big = b"{" + b" " * (2 << 20) + b"}"  # over the 1 MiB fixture limit

    async def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    async with aiohttp.ClientSession(server.url) as s:
        await _expect_4xx(s, "POST", path, data=big, status=413, code="too_large")
        # Chunked (no Content-Length): the streamed read stops at the cap.
        await _expect_4xx(s, "POST", path, data=chunks(), status=413, code="too_large")


@functools.cache
def _bomb(encoding: str) -> bytes:
    payload = b'{"inputs": "' + b"A" * (64 << 20) + b'"}'  # 64 MiB inflated, ~64 KiB sent
    return gzip.compress(payload, 9) if encoding == "gzip" else zlib.compress(payload, 9)


@pytest.mark.parametrize("auto_decompress", [True, False])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_zip_bomb_is_413(make_server: ServerFactory, auto_decompress: bool,
                               encoding: str):
    cfg = GatewayConfig(max_body_bytes=1 << 20, max_decompressed_bytes=1 << 20)
    srv = make_server(cfg, auto_decompress=auto_decompress)
    bomb = _bomb(encoding)
    assert len(bomb) < (1 << 20)
    async with aiohttp.ClientSession(srv.url) as s:
        for path in (INFER, INVOKE):
            await _expect_4xx(s, "POST", path, data=bomb, status=413,
                              headers={"Content-Encoding": encoding})


@pytest.mark.parametrize("auto_decompress", [True, False])
async def test_corrupt_compression_is_400(make_server: ServerFactory, auto_decompress: bool):
    srv = make_server(auto_decompress=auto_decompress)
    good = gzip.compress(json.dumps(_t()).encode())
    async with aiohttp.ClientSession(srv.url) as s:
        for body, enc in ((b"\x1f\x8bnot gzip at all", "gzip"), (good[:-10], "gzip"),
                          (b"{}", "br"), (b"x\x9cgarbage", "deflate"), (b"[]", "deflate")):
            headers = {"Content-Encoding": enc}
            if auto_decompress:
                # aiohttp's parser may refuse it (plain-text 400) before the gateway runs.
                async with s.post(INFER, data=body, headers=headers) as r:
                    assert r.status == 400, (body, enc)
            else:
                await _expect_4xx(s, "POST", INFER, data=body, headers=headers, status=400)
        async with s.post(INFER, data=good, headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 200, await r.text()
