"""Unit tests of the pure pieces: the OIP codec, decompression, auth, admission, config."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import struct
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest, Forbidden, PayloadTooLarge, Unauthorized
from flashpoint.gateway import GatewayConfig, json_codec, oip
from flashpoint.gateway.admission import TokenBucket, effective_timeout_s
from flashpoint.gateway.auth import ApiKeyAuth, Role
from flashpoint.gateway.body import decompress
from flashpoint.spec import DATATYPES
from flashpoint.tensors import bf16_to_f32, f32_to_bf16

LIMITS = oip.CodecLimits(max_json_depth=32, max_tensor_bytes=1 << 20)


def _decode(header: dict, binary: bytes = b"") -> oip.InferRequest:
    return oip.decode_infer_request(json_codec.load_json(json.dumps(header), 32), binary, LIMITS)


def test_json_nested_and_flat_data_agree():
    flat = _decode({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32",
                                "data": [1, 2, 3, 4]}]})
    nested = _decode({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32",
                                  "data": [[1, 2], [3, 4]]}]})
    np.testing.assert_array_equal(flat.inputs["x"], nested.inputs["x"])
    assert flat.inputs["x"].dtype == np.int32 and flat.datatypes == {"x": "INT32"}


def test_binary_inputs_are_consumed_in_order():
    a = np.arange(3, dtype=np.int16)
    words = [b"ab", b"", b"xyz"]
    bytes_blob = b"".join(struct.pack("<I", len(w)) + w for w in words)
    h = f32_to_bf16(np.array([1.5, -2.0], dtype=np.float32)).tobytes()
    req = _decode({
        "id": "r1",
        "inputs": [
            {"name": "a", "shape": [3], "datatype": "INT16",
             "parameters": {"binary_data_size": 6}},
            {"name": "j", "shape": [1], "datatype": "FP64", "data": [0.5]},
            {"name": "s", "shape": [3], "datatype": "BYTES",
             "parameters": {"binary_data_size": len(bytes_blob)}},
            {"name": "h", "shape": [2], "datatype": "BF16", "parameters": {"binary_data_size": 4}},
            {"name": "b", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}},
        ],
        "outputs": [{"name": "o", "parameters": {"binary_data": True}}],
        "parameters": {"binary_data_output": True, "timeout": 1500000},
    }, a.tobytes() + bytes_blob + h + b"\x00\x07")
    np.testing.assert_array_equal(req.inputs["a"], a)
    assert list(req.inputs["s"]) == words
    assert req.inputs["h"].dtype == np.float32 and req.inputs["h"].tolist() == [1.5, -2.0]
    assert req.inputs["b"].tolist() == [False, True]
    assert req.outputs == (oip.RequestedOutput("o", True),)
    assert req.binary_output and req.timeout_s == 1.5 and req.id == "r1"


def test_bf16_json_input_is_rounded_to_bf16():
    req = _decode({"inputs": [{"name": "x", "shape": [1], "datatype": "BF16",
                               "data": [1.00390625]}]})  # halfway between two bf16 values
    assert req.inputs["x"].tolist() == [1.0]


def test_split_body():
    head, rest = oip.split_body(b'{"a":1}XYZ', "7")
    assert head == b'{"a":1}' and bytes(rest) == b"XYZ"
    head, rest = oip.split_body(b"{}", None)
    assert head == b"{}" and len(rest) == 0
    for bad in ("-1", "8", "+1", "0x1", " ", "1.0"):
        with pytest.raises(BadRequest):
            oip.split_body(b"{}", bad)


def test_depth_limit():
    json_codec.load_json("[" * 32 + "]" * 32, 32)
    with pytest.raises(BadRequest, match="nested deeper"):
        json_codec.load_json("[" * 33 + "]" * 33, 32)
    with pytest.raises(BadRequest, match="nested deeper"):
        json_codec.load_json('{"a":' * 200_000 + "1" + "}" * 200_000, 32)


def test_depth_limit_whatever_the_bracket_count():
    # Few brackets: the walk is skipped; brackets inside strings only make it walk.
    assert json_codec.load_json(b'{"a": "' + b"[" * 100 + b'"}', 32) == {"a": "[" * 100}
    assert json_codec.load_json(b"[" * 3 + b"]" * 3, 3) == [[[]]]
    with pytest.raises(BadRequest, match="nested deeper"):
        json_codec.load_json(b"[" * 4 + b"]" * 4, 3)
    with pytest.raises(BadRequest, match="nested deeper"):
        json_codec.load_json(b'[[[["' + b"]" * 40 + b'"]]]]', 3)
    with pytest.raises(BadRequest, match="nested deeper"):
        json_codec.load_json('{"a":{"b":{"c":{"d":1}}}}', 3)


def test_tensor_budget_is_checked_before_allocating():
    with pytest.raises(BadRequest, match="limit"):
        _decode({"inputs": [{"name": "x", "shape": [1 << 40], "datatype": "FP64", "data": []}]})
    with pytest.raises(BadRequest, match="limit"):  # two inputs that fit alone, not together
        _decode({"inputs": [
            {"name": n, "shape": [100_000], "datatype": "FP64",
             "parameters": {"binary_data_size": 800_000}} for n in ("a", "b")
        ]}, b"\0" * 1_600_000)


def test_encode_response_json_and_binary():
    outputs = {"y": np.array([[1.0, 2.0]], dtype=np.float32),
               "s": np.array([b"ok", b"\xff\xfe"], dtype=object),
               "h": np.array([1.5], dtype=np.float32)}
    body, hlen = oip.encode_infer_response(
        model_name="m", model_version="1", request_id="q", outputs=outputs,
        declared={"h": "BF16"}, requested=None, binary_output=False)
    assert hlen is not None  # the non-UTF-8 BYTES output forces binary
    head = json.loads(body[:hlen])
    by_name = {o["name"]: o for o in head["outputs"]}
    assert by_name["y"]["data"] == [1.0, 2.0] and by_name["y"]["datatype"] == "FP32"
    assert by_name["h"] == {"name": "h", "datatype": "BF16", "shape": [1], "data": [1.5]}
    assert by_name["s"]["parameters"]["binary_data_size"] == 4 + 2 + 4 + 2
    assert body[hlen:] == b"\x02\0\0\0ok\x02\0\0\0\xff\xfe"
    assert head["id"] == "q" and head["model_name"] == "m"

    body, hlen = oip.encode_infer_response(
        model_name="m", model_version="1", request_id=None, outputs=outputs, declared={},
        requested=(oip.RequestedOutput("y"),), binary_output=False)
    assert hlen is None and [o["name"] for o in json.loads(body)["outputs"]] == ["y"]
    with pytest.raises(BadRequest, match="unknown output"):
        oip.encode_infer_response(
            model_name="m", model_version="1", request_id=None, outputs=outputs, declared={},
            requested=(oip.RequestedOutput("nope"),), binary_output=False)


# --- decompression ----------------------------------------------------------------------------

def test_decompress_round_trips_and_caps():
    data = b"hello " * 1000
    assert decompress(gzip.compress(data), "gzip", 10_000) == data
    assert decompress(zlib.compress(data), "deflate", 10_000) == data
    raw = zlib.compressobj(wbits=-15)
    assert decompress(raw.compress(data) + raw.flush(), "deflate", 10_000) == data
    with pytest.raises(PayloadTooLarge):
        decompress(gzip.compress(data), "gzip", len(data) - 1)
    assert decompress(gzip.compress(data), "gzip", len(data)) == data
    with pytest.raises(BadRequest, match="truncated"):
        decompress(gzip.compress(data)[:-12], "gzip", 10_000)
    with pytest.raises(BadRequest, match="trailing"):
        decompress(gzip.compress(data) + b"junk", "gzip", 10_000)
    with pytest.raises(BadRequest, match="unsupported"):
        decompress(data, "br", 10_000)


def test_decompress_bomb_never_allocates_past_cap():
    import tracemalloc

    bomb = gzip.compress(b"\0" * (128 << 20), 9)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            decompress(bomb, "gzip", 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# --- auth, admission, config -----------------------------------------------------------------

def test_auth_roles():
    auth = ApiKeyAuth({"admin-secret-1": "admin", "invoke-secret-1": "invoke"})
    assert auth.require("Bearer admin-secret-1", Role.ADMIN).role is Role.ADMIN
    assert auth.require("bearer  invoke-secret-1 ", Role.INVOKE).role is Role.INVOKE
    with pytest.raises(Forbidden):
        auth.require("Bearer invoke-secret-1", Role.ADMIN)
    for header in (None, "", "Bearer", "Basic admin-secret-1", "Bearer admin-secret-2"):
        with pytest.raises(Unauthorized):
            auth.require(header, Role.INVOKE)
    principal = auth.authenticate("Bearer admin-secret-1")
    assert "admin-secret" not in principal.name
    assert ApiKeyAuth({}).require(None, Role.ADMIN).role is Role.ADMIN


def test_token_bucket():
    b = TokenBucket(rate_per_s=2.0, burst=2.0, tokens=2.0, last_s=0.0)
    assert b.take(0.0) == 0.0 and b.take(0.0) == 0.0
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0


def test_effective_timeout_and_config():
    cfg = GatewayConfig(max_timeout_s=10, default_timeout_s=3)
    assert effective_timeout_s(None, 5.0, cfg) == 5.0
    assert effective_timeout_s(2.0, 5.0, cfg) == 2.0
    assert effective_timeout_s(100.0, 5.0, cfg) == 10.0
    assert effective_timeout_s(None, None, cfg) == 3.0
    with pytest.raises(BadRequest):
        GatewayConfig(api_keys={"short": "admin"})
    with pytest.raises(BadRequest):
        GatewayConfig(api_keys={"long-enough-key": "root"})
    with pytest.raises(BadRequest):
        GatewayConfig.from_dict({"max_body_bytes": 1, "nope": 2})
    assert GatewayConfig.from_dict({"max_body_bytes": 5}).max_body_bytes == 5


# --- property tests ---------------------------------------------------------------------------

_ROUND_TRIP_DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(_ROUND_TRIP_DTYPES) + ["BF16", "BYTES"]),
       st.lists(st.integers(0, 4), max_size=3), st.booleans(), st.booleans(), st.data())
def test_round_trip_any_datatype(datatype, shape, binary_in, binary_out, data):
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        items = data.draw(st.lists(st.text(max_size=5), min_size=count, max_size=count))
        arr = np.empty(count, dtype=object)
        arr[:] = [s.encode("utf-8", "surrogatepass") for s in items]
        arr = arr.reshape(shape)
    else:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        raw = rng.integers(0, 256, size=count * 8, dtype=np.uint8).tobytes()
        wire = "<u2" if datatype == "BF16" else _ROUND_TRIP_DTYPES[datatype]
        arr = np.frombuffer(raw, dtype=np.uint8 if datatype == "BOOL" else wire)[:count]
        arr = (arr % 2).astype(np.bool_) if datatype == "BOOL" else arr
        if datatype == "BF16":
            arr = bf16_to_f32(arr)
        arr = arr.reshape(shape)
    # Response codec -> request codec: what the gateway sends, it accepts back.
    body, hlen = oip.encode_infer_response(
        model_name="m", model_version="1", request_id=None, outputs={"x": arr},
        declared={"x": datatype}, requested=None, binary_output=binary_in)
    head = json.loads(body[:hlen] if hlen is not None else body)
    head["inputs"] = head.pop("outputs")
    binary = body[hlen:] if hlen is not None else b""
    req = oip.decode_infer_request(head, binary, oip.CodecLimits())
    got = req.inputs["x"]
    assert got.shape == arr.shape
    if datatype == "BYTES":
        assert list(got.ravel()) == list(arr.ravel())
    else:
        np.testing.assert_array_equal(got, arr)  # NaNs compare equal here
    del binary_out


_json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                 | st.floats(allow_nan=True) | st.text(max_size=6))
json_values = st.recursive(
    _json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=4),
    max_leaves=16)
_tensor = st.fixed_dictionaries(
    {"name": st.sampled_from(["x", "y", ""]) | json_values,
     "datatype": st.sampled_from(list(DATATYPES) + ["FP8", "fp32"]) | json_values,
     "shape": st.lists(st.integers(-2, 5) | st.integers(0, 2**70), max_size=4) | json_values,
     "data": (st.lists(st.integers(-300, 2**65) | st.floats() | st.booleans() | st.text(
         max_size=3), max_size=10) | json_values)},
    optional={"parameters": st.fixed_dictionaries(
        {}, optional={"binary_data_size": st.integers(-3, 64) | json_values,
                      "binary_data": json_values})})
infer_bodies = st.fixed_dictionaries(
    {"inputs": st.lists(_tensor, max_size=3) | json_values},
    optional={"outputs": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["y", "x_out", "zz"]) | json_values},
        optional={"parameters": st.dictionaries(st.sampled_from(["binary_data"]), json_values)}),
        max_size=3) | json_values,
        "parameters": st.dictionaries(st.sampled_from(
            ["binary_data_output", "timeout", "other"]), json_values) | json_values,
        "id": json_values}) | json_values


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(infer_bodies, st.binary(max_size=64))
def test_fuzz_decoder_only_raises_bad_request(body, binary):
    try:
        req = oip.decode_infer_request(body, binary, LIMITS)
    except BadRequest:
        return
    # Whatever decodes must also encode back (the identity model's path).
    oip.encode_infer_response(model_name="m", model_version="1", request_id=req.id,
                              outputs=req.inputs, declared=req.datatypes, requested=None,
                              binary_output=req.binary_output)


def _stdlib_load(raw: bytes) -> object:
    """What load_json gave before orjson: json.loads, errors as BadRequest messages."""
    try:
        return json.loads(raw)
    except RecursionError:
        return "BadRequest: nested deeper"
    except (ValueError, TypeError) as e:
        return f"BadRequest: malformed JSON: {str(e)[:200]}"


def _fast_load(raw: bytes) -> object:
    try:
        return json_codec.load_json(raw, 10_000)
    except BadRequest as e:
        return "BadRequest: nested deeper" if "nested deeper" in e.message else (
            f"BadRequest: {e.message}")


def _same(a: object, b: object) -> bool:
    # repr keeps int vs float and NaN (json.dumps would turn 1.0 and 1 alike into numbers)
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize("raw", [
    b"NaN", b"[Infinity, -Infinity]", b"1e400", b"[-1e400]", b"[1e-400]", b'"\\ud800"',
    b"\xef\xbb\xbf{}", "[1]".encode("utf-16"), b"18446744073709551615", b"18446744073709551616",
    b"-9223372036854775808", b"-9223372036854775809", b"[" + b"9" * 400 + b"]",
    b"[" + b"9" * 5000 + b"]", b"0.12345678901234567890123", b'{"a":1,"a":2}', b"[1,]",
    b"", b"{", b"\xff", b'"\x01"', b"[" * 2000 + b"]" * 2000, b' {"x": [1.5, -0.0, 2]} ',
])
def test_load_json_matches_the_stdlib_on_edge_cases(raw):
    assert _same(_fast_load(raw), _stdlib_load(raw))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_load_json_matches_the_stdlib(value):
    raw = json.dumps(value).encode()
    assert _same(_fast_load(raw), _stdlib_load(raw))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_dump_json_writes_the_same_values_as_the_stdlib(value):
    ours = json_codec.dump_json(value)
    theirs = json.dumps(value, separators=(",", ":"), default=str)
    assert _same(json.loads(ours), json.loads(theirs))
    if _holds_null_or_nonfinite(value):
        assert ours.decode() == theirs  # NaN/inf are written as the stdlib does, not as null


def _holds_null_or_nonfinite(value: object) -> bool:
    # Walks the value, not its text: a key or a string "NaN" is neither (a text test was).
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return True
    if isinstance(value, dict):
        return any(_holds_null_or_nonfinite(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_null_or_nonfinite(v) for v in value)
    return False


@pytest.mark.parametrize("value", [{"\x7f": False, "NaN": False}, ["null", "Infinity"]])
def test_dump_json_of_strings_that_spell_nan_or_null(value):
    ours = json_codec.dump_json(value)
    assert _same(json.loads(ours), value)


def test_dump_json_of_numpy_and_other_types_matches_the_stdlib():
    import dataclasses
    import datetime

    @dataclasses.dataclass
    class D:
        a: int = 1

    value = {"f64": np.float64(1.5), "f32": np.float32(2.5), "i64": np.int64(3), "d": D(),
             "t": datetime.datetime(2020, 1, 2), "tuple": (1, 2), 4: "int key",
             "big": 2**70, "nan": float("nan"), "bytes": b"x", "s": "\ud800"}
    theirs = json.dumps(value, separators=(",", ":"), default=str).encode()
    assert json_codec.dump_json(value) == theirs  # non-str keys, big ints, surrogates: the stdlib
    del value[4], value["big"], value["nan"], value["s"]
    theirs = json.dumps(value, separators=(",", ":"), default=str)
    assert _same(json.loads(json_codec.dump_json(value)), json.loads(theirs))


class _SlowBackend:
    """Answers after ``delay_s``, whatever the deadline (a backend that ignores it)."""

    def __init__(self, delay_s: float, enforces_deadline: bool | None) -> None:
        self.delay_s = delay_s
        if enforces_deadline is not None:
            self.enforces_deadline = enforces_deadline
        self.seen: list[float] = []

    async def invoke(self, name, inputs, *, request_id, timeout_s=None, request_class="strict"):
        self.seen.append(timeout_s)
        await asyncio.sleep(self.delay_s)
        return "done"


@pytest.mark.parametrize("flag", [None, False])
async def test_admission_backstop_cuts_a_backend_that_does_not_enforce_its_deadline(flag):
    from flashpoint.errors import DeadlineExceeded
    from flashpoint.gateway.admission import Admission

    adm = Admission(GatewayConfig(deadline_grace_s=0.05))
    backend = _SlowBackend(5.0, flag)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await adm.invoke(backend, "c", "f", {}, request_id="r", timeout_s=0.05)
    assert time.monotonic() - t0 < 2.0 and adm.inflight == 0 and backend.seen == [0.05]


async def test_admission_arms_no_backstop_for_a_backend_that_enforces_its_deadline():
    from flashpoint.errors import Overloaded
    from flashpoint.gateway.admission import Admission

    adm = Admission(GatewayConfig(deadline_grace_s=0.01, max_inflight_requests=1))
    backend = _SlowBackend(0.3, True)  # answers well after timeout + grace: nobody cuts it
    task = asyncio.ensure_future(adm.invoke(backend, "c", "f", {}, request_id="r",
                                            timeout_s=0.01))
    await asyncio.sleep(0.05)
    assert adm.inflight == 1 and not task.done()
    with pytest.raises(Overloaded):  # the in-flight cap still counts it
        await adm.invoke(backend, "c", "f", {}, request_id="r2", timeout_s=0.01)
    assert await asyncio.wait_for(task, 5.0) == "done"
    assert adm.inflight == 0 and backend.seen == [0.01]


def test_the_controller_declares_that_it_enforces_its_deadline():
    from flashpoint.controller.actor import Controller

    assert Controller.enforces_deadline is True


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
@pytest.mark.parametrize("data", [
    [1.0, float("nan"), 2.0], [2**70, 1], [65504.0, -65504.0], [3.4028234663852886e38],
    [-1e300, 0.5], [float("inf")], [70000, 1.5],
])
def test_float_data_decodes_without_warnings_and_overflows_to_inf(datatype, data):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cast's overflow warning must stay suppressed
        got = oip.tensor_from_json("x", datatype, (len(data),), data, LIMITS, [1 << 30])
    with np.errstate(over="ignore"):
        want = np.array(data, dtype=oip.WIRE_DTYPES[datatype])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)  # NaN == NaN here; overflow became inf
