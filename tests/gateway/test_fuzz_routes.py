"""Hypothesis drives random JSON-ish bodies at the inference routes: never a 5xx, never a hang."""

from __future__ import annotations

import http.client
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import ThreadedServer
from .test_oip import infer_bodies, json_values

_PATHS = ["/v2/models/double/infer", "/v2/models/identity/infer",
          "/v2/models/identity/versions/1/infer", "/v1/functions/identity/invoke",
          "/v1/functions"]

_native_bodies = st.fixed_dictionaries(
    {"inputs": st.dictionaries(st.sampled_from(["x", "y", ""]), st.fixed_dictionaries(
        {"data": json_values, "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
         "datatype": st.sampled_from(["FP32", "INT8", "BYTES", "BOOL", "BF16", "??"])}),
        max_size=3) | json_values},
    optional={"timeout_s": json_values}) | json_values


def _post(conn: http.client.HTTPConnection, path: str, body: bytes,
          headers: dict[str, str]) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    if resp.getheader("Connection", "").lower() == "close":
        conn.close()
    return resp.status, data


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(_PATHS),
       body=infer_bodies | _native_bodies,
       tail=st.binary(max_size=48),
       header_length=st.none() | st.integers(-5, 400).map(str) | st.text(
           st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=4),
       encoding=st.sampled_from([None, None, None, "gzip", "deflate", "br"]))
def test_fuzz_infer_routes_never_5xx(server: ThreadedServer, path, body, tail, header_length,
                                     encoding):
    raw = json.dumps(body).encode() + tail
    headers = {"Content-Type": "application/json"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = header_length
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        status, data = _post(conn, path, raw, headers)
    finally:
        conn.close()
    assert status < 500, (status, data[:300])
    if status >= 400:
        err = json.loads(data)
        assert err["error"] and err["code"]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(_PATHS), raw=st.binary(max_size=200))
def test_fuzz_raw_bytes_never_5xx(server: ThreadedServer, path, raw):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        status, data = _post(conn, path, raw, {})
    finally:
        conn.close()
    assert status < 500, (status, data[:300])
