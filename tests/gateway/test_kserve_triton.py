"""The KServe v2 routes driven by the real ``tritonclient.http`` client."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from flashpoint.gateway import GatewayConfig

from .conftest import ADMIN_KEY, INVOKE_KEY, FakeBackend, ServerFactory, ThreadedServer


@pytest.fixture
def client(server: ThreadedServer):
    c = httpclient.InferenceServerClient(server.hostport, network_timeout=10.0,
                                         connection_timeout=5.0)
    yield c
    c.close()


def _infer_identity(client, arrays: dict[str, np.ndarray], datatypes: dict[str, str], *,
                    binary_in: bool, binary_out: bool, **kwargs):
    inputs = []
    for name, arr in arrays.items():
        inp = httpclient.InferInput(name, list(arr.shape), datatypes[name])
        inp.set_data_from_numpy(arr, binary_data=binary_in)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(f"{n}_out", binary_data=binary_out)
               for n in arrays]
    return client.infer("identity", inputs, outputs=outputs, **kwargs)


def test_server_live_ready_metadata(client, backend: FakeBackend):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "flashpoint"
    assert "binary_tensor_data" in meta["extensions"]
    backend.ready = False
    assert not client.is_server_ready()
    assert not client.is_model_ready("double")
    backend.live = False
    assert not client.is_server_live()


def test_model_metadata_and_ready(client):
    meta = client.get_model_metadata("double")
    assert meta["name"] == "double"
    assert meta["versions"] == ["3"]
    assert meta["platform"] == "pytorch"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, -1]}]
    assert client.get_model_metadata("double", model_version="3")["name"] == "double"
    assert client.is_model_ready("double")
    assert client.is_model_ready("double", model_version="3")
    assert not client.is_model_ready("double", model_version="7")
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException) as ei:
        client.get_model_metadata("double", model_version="7")
    assert ei.value.status() == "404"


CASES = [
    ("FP32", np.arange(6, dtype=np.float32).reshape(2, 3) / 3),
    ("FP16", np.array([[0.5, -1.25, 65504.0]], dtype=np.float16)),
    ("FP64", np.array([[1e300, -2.5, 3.0]], dtype=np.float64)),
    ("INT64", np.array([[2**62, -(2**62), 7]], dtype=np.int64)),
    ("INT32", np.array([[-5, 0, 5]], dtype=np.int32)),
    ("INT8", np.array([[-128, 0, 127]], dtype=np.int8)),
    ("UINT8", np.array([[0, 200, 255]], dtype=np.uint8)),
    ("UINT64", np.array([[2**64 - 1, 0, 1]], dtype=np.uint64)),
    ("BOOL", np.array([[True, False, True]], dtype=np.bool_)),
    ("BYTES", np.array([[b"hello", b"", "wörld".encode()]], dtype=np.object_)),
]


@pytest.mark.parametrize("binary_in,binary_out", [(False, False), (True, True), (True, False),
                                                  (False, True)])
def test_infer_datatypes_round_trip(client, binary_in: bool, binary_out: bool):
    arrays = {f"in_{dt.lower()}": arr for dt, arr in CASES}
    datatypes = {f"in_{dt.lower()}": dt for dt, _ in CASES}
    result = _infer_identity(client, arrays, datatypes, binary_in=binary_in,
                             binary_out=binary_out, request_id="my-id")
    assert result.get_response()["id"] == "my-id"
    for name, arr in arrays.items():
        out = result.as_numpy(f"{name}_out")
        assert out is not None, name
        assert out.shape == arr.shape, name
        if arr.dtype == object:
            # JSON BYTES come back as str (tritonclient keeps the JSON strings).
            got = [x.encode() if isinstance(x, str) else bytes(x) for x in out.ravel()]
            assert got == [bytes(x) for x in arr.ravel()]
        else:
            assert out.dtype == arr.dtype, name
            np.testing.assert_array_equal(out, arr)
        meta = result.get_output(f"{name}_out")
        assert meta["datatype"] == datatypes[name]
        assert ("binary_data_size" in meta.get("parameters", {})) == binary_out


def test_infer_default_all_outputs_binary(client):
    x = np.ones((2, 2), dtype=np.float32)
    inp = httpclient.InferInput("x", [2, 2], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    # No requested outputs: tritonclient asks for binary_data_output on every output.
    result = client.infer("double", [inp])
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    assert "binary_data_size" in result.get_output("y")["parameters"]


def test_infer_bf16_binary(client):
    x = np.array([1.5, -2.0, 3.140625, 1e10], dtype=ml_dtypes.bfloat16)
    inp = httpclient.InferInput("x", [4], "BF16")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("y", binary_data=True)
    result = client.infer("half", [inp], outputs=[out])
    y = result.as_numpy("y")
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32) * 2)
    # JSON output of a BF16 tensor is plain numbers.
    result = client.infer("half", [inp], outputs=[httpclient.InferRequestedOutput(
        "y", binary_data=False)])
    assert result.get_output("y")["data"] == [3.0, -4.0, 6.28125, pytest.approx(2e10, rel=1e-2)]


@pytest.mark.parametrize("auto_decompress", [False, True])
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_request_and_response_compression(make_server: ServerFactory, algorithm: str,
                                                auto_decompress: bool):
    """Inflated by the gateway (RUNNER_KWARGS) or by aiohttp (its default runner)."""
    client = httpclient.InferenceServerClient(
        make_server(auto_decompress=auto_decompress).hostport)
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    inp = httpclient.InferInput("x", [64, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("y", binary_data=True)
    result = client.infer("double", [inp], outputs=[out],
                          request_compression_algorithm=algorithm,
                          response_compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    client.close()


@pytest.mark.parametrize("auto_decompress", [False, True])
def test_infer_json_compressed(make_server: ServerFactory, auto_decompress: bool):
    srv = make_server(auto_decompress=auto_decompress)
    c = httpclient.InferenceServerClient(srv.hostport)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        inp = httpclient.InferInput("x", [3, 4], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        for algorithm in ("gzip", "deflate"):
            result = c.infer("double", [inp], outputs=[httpclient.InferRequestedOutput("y")],
                             request_compression_algorithm=algorithm)
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    finally:
        c.close()


def test_infer_versioned_route(client):
    x = np.ones((1, 2), dtype=np.float32)
    inp = httpclient.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("double", [inp], model_version="3")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    with pytest.raises(InferenceServerException) as ei:
        client.infer("double", [inp], model_version="4")
    assert ei.value.status() == "404"


def test_unknown_model_is_404(client):
    inp = httpclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
    with pytest.raises(InferenceServerException) as ei:
        client.infer("nope", [inp])
    assert ei.value.status() == "404"
    assert "nope" in ei.value.message()
    with pytest.raises(InferenceServerException) as ei:
        client.get_model_metadata("nope")
    assert ei.value.status() == "404"


def test_unknown_requested_output_is_400(client):
    inp = httpclient.InferInput("x", [1, 1], "FP32")
    inp.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    with pytest.raises(InferenceServerException) as ei:
        client.infer("double", [inp], outputs=[httpclient.InferRequestedOutput("nope")])
    assert ei.value.status() == "400"
    assert "unknown output 'nope'" in ei.value.message()
    # Undeclared outputs are checked after the call, against what the model returned.
    with pytest.raises(InferenceServerException) as ei:
        client.infer("identity", [inp], outputs=[httpclient.InferRequestedOutput("nope")])
    assert ei.value.status() == "400"


def test_overloaded_and_deadline_errors(client):
    inp = httpclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
    with pytest.raises(InferenceServerException) as ei:
        client.infer("busy", [inp])
    assert ei.value.status() == "429"
    with pytest.raises(InferenceServerException) as ei:
        client.infer("slow", [inp])
    assert ei.value.status() == "504"
    with pytest.raises(InferenceServerException) as ei:
        client.infer("crash", [inp])
    assert ei.value.status() == "500"
    assert "secret" not in ei.value.message()


def test_request_timeout_parameter_is_microseconds(client, backend: FakeBackend):
    inp = httpclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
    client.infer("identity", [inp], timeout=2_500_000)
    assert backend.calls[-1]["timeout_s"] == pytest.approx(2.5)


def test_auth_with_triton_headers(auth_server: ThreadedServer):
    c = httpclient.InferenceServerClient(auth_server.hostport)
    try:
        assert c.is_server_live()  # health needs no key
        with pytest.raises(InferenceServerException) as ei:
            c.get_model_metadata("double")
        assert ei.value.status() == "401"
        inp = httpclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        for key in (INVOKE_KEY, ADMIN_KEY):
            r = c.infer("double", [inp], headers={"Authorization": f"Bearer {key}"})
            assert r.as_numpy("y").tolist() == [[2.0]]
        with pytest.raises(InferenceServerException) as ei:
            c.infer("double", [inp], headers={"Authorization": "Bearer wrong-key-123"})
        assert ei.value.status() == "401"
    finally:
        c.close()


def test_inflight_cap_and_rate_limit(make_server: ServerFactory):
    srv = make_server(GatewayConfig(rate_limit_rps=0.5, rate_limit_burst=2))
    c = httpclient.InferenceServerClient(srv.hostport)
    try:
        inp = httpclient.InferInput("x", [1], "FP32")
        inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
        c.infer("identity", [inp])
        c.infer("identity", [inp])
        with pytest.raises(InferenceServerException) as ei:
            c.infer("identity", [inp])
        assert ei.value.status() == "429"
    finally:
        c.close()


def test_model_whose_starts_fail_is_not_ready(client, server: ThreadedServer,
                                               backend: FakeBackend):
    """A function that cannot serve (its replicas keep failing to start) answers its OIP
    ready route with 400 and the reason, as Triton answers for a model that is not ready;
    the others stay ready."""
    import json
    import urllib.request

    reason = {"code": "model_load_failed", "message": "module tensor 'extra' has no weights",
              "error_code": "registry_error", "failed_starts": 3, "since": 1.0}
    backend.not_ready["double"] = reason
    assert not client.is_model_ready("double")
    assert not client.is_model_ready("double", model_version="3")
    assert client.is_model_ready("identity")
    try:
        urllib.request.urlopen(f"{server.url}/v2/models/double/ready", timeout=5)
        raise AssertionError("ready answered 2xx")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert json.loads(e.read()) == {"name": "double", "ready": False, "reason": reason}
    backend.not_ready.clear()
    assert client.is_model_ready("double")
