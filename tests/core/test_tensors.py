"""Tensor wire encoding: round trips and malformed input."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.tensors import (
    MAX_DIMS,
    bf16_to_f32,
    decode_tensor,
    decode_tensors,
    encode_tensor,
    encode_tensors,
    f32_to_bf16,
)

NUMERIC = ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
           "float16", "float32", "float64"]


def _wire(d):
    """Through msgpack, as on the RPC wire."""
    return msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize("shape", [(0,), (3,), (2, 3), (1, 2, 0, 4), (2,) * MAX_DIMS])
def test_round_trip_numeric(dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.integers(0, 100, size=shape) if dtype != "bool" else rng.integers(0, 2, size=shape))
    arr = np.asarray(arr).astype(dtype)
    back = decode_tensor(_wire(encode_tensor(arr)))
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2", ">f8"])
def test_non_native_byte_order_round_trips_by_value(dtype):
    arr = np.array([[1.5, -2.0, 3.0], [4.0, 0.0, 7.0]] if "f" in dtype
                   else [[1, 2, 3], [400, 0, 7]]).astype(dtype)
    back = decode_tensor(_wire(encode_tensor(arr)))
    assert back.dtype == arr.dtype.newbyteorder("=") and back.dtype.isnative
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("dtype", ["bool", "int64", "float32"])
def test_round_trip_zero_dim(dtype):
    """BUG: encode_tensor uses np.ascontiguousarray, which promotes 0-d arrays to 1-d, so a
    scalar tensor comes back with shape (1,) instead of ()."""
    arr = np.ones((), dtype=dtype)
    enc = encode_tensor(arr)
    assert enc["shape"] == []
    back = decode_tensor(_wire(enc))
    assert back.shape == () and back.dtype == arr.dtype


def test_round_trip_non_contiguous():
    arr = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2].T
    back = decode_tensor(_wire(encode_tensor(arr)))
    np.testing.assert_array_equal(back, arr)


def test_round_trip_extreme_floats():
    arr = np.array([np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float64).max, 5e-324])
    back = decode_tensor(encode_tensor(arr))
    assert back.tobytes() == arr.tobytes()
    nan = decode_tensor(encode_tensor(np.array([np.nan], np.float32)))
    assert np.isnan(nan[0])


def test_round_trip_object_bytes():
    arr = np.array([b"hello", b"", b"\x00\xff", "text"], dtype=object).reshape(2, 2)
    back = decode_tensor(_wire(encode_tensor(arr)))
    assert back.dtype == object and back.shape == (2, 2)
    assert back.ravel().tolist() == [b"hello", b"", b"\x00\xff", b"text"]


def test_object_scalar_and_empty():
    empty = np.empty((0, 3), dtype=object)
    assert decode_tensor(encode_tensor(empty)).shape == (0, 3)
    scalar = np.empty((), dtype=object)
    scalar[()] = b"x"
    back = decode_tensor(encode_tensor(scalar))
    assert back.shape == () and back[()] == b"x"


def test_bfloat16_round_trip():
    vals = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 1e30, -1e-30, np.inf, -np.inf], np.float32)
    vals = bf16_to_f32(f32_to_bf16(vals))  # representable in bf16
    bits = f32_to_bf16(vals)
    d = {"dtype": "bfloat16", "shape": [3, 3], "data": bits.tobytes()}
    back = decode_tensor(_wire(d))
    assert back.dtype == np.float32 and back.shape == (3, 3)
    assert back.ravel().tobytes() == vals.tobytes()


def test_bf16_rounding_nearest_even():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125 -> even (1.0)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1.0078125], np.float32)
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(x)), [1.0, 1.015625, 1.0078125])


def test_bf16_nan_stays_nan():
    """BUG: f32_to_bf16 rounds by adding 0x7FFF(+1) with no NaN guard; a NaN whose payload bits
    are all set wraps around and becomes a zero."""
    bits = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000], dtype=np.uint32)
    out = bf16_to_f32(f32_to_bf16(bits.view(np.float32)))
    assert np.isnan(out).all(), out


def test_bf16_byte_size_checked():
    with pytest.raises(BadRequest):
        decode_tensor({"dtype": "bfloat16", "shape": [2], "data": b"\x00\x00"})


def test_tensors_map():
    t = {"a": np.arange(3, dtype=np.int8), "b": np.array([b"x"], dtype=object)}
    back = decode_tensors(_wire(encode_tensors(t)))
    assert set(back) == {"a", "b"}
    np.testing.assert_array_equal(back["a"], t["a"])
    with pytest.raises(BadRequest):
        decode_tensors([1])
    with pytest.raises(BadRequest):
        decode_tensors({str(i): encode_tensor(np.zeros(1)) for i in range(65)})


@pytest.mark.parametrize("d", [
    None, [], b"x", "map",
    {"dtype": "float32", "shape": [2], "data": b"\x00" * 7},
    {"dtype": "float32", "shape": [2], "data": "\x00" * 8},
    {"dtype": "float32", "shape": [2]},
    {"dtype": "float32", "shape": [-1], "data": b""},
    {"dtype": "float32", "shape": [1.0], "data": b"\x00" * 4},
    {"dtype": "float32", "shape": "2", "data": b"\x00" * 8},
    {"dtype": "float32", "shape": [1] * (MAX_DIMS + 1), "data": b"\x00" * 4},
    {"dtype": "complex64", "shape": [1], "data": b"\x00" * 8},
    {"dtype": "datetime64", "shape": [1], "data": b"\x00" * 8},
    {"dtype": "float32", "data": b"\x00" * 4},
    {"dtype": "object", "shape": [2], "items": [b"a"]},
    {"dtype": "object", "shape": [1], "items": b"a"},
    {"dtype": None, "shape": [], "data": b""},
])
def test_malformed_maps_rejected(d):
    with pytest.raises(BadRequest):
        decode_tensor(d)


@pytest.mark.parametrize("d", [
    {"dtype": [], "shape": [1], "data": b"\x00"},
    {"dtype": {"a": 1}, "shape": [1], "data": b"\x00"},
    {"dtype": "uint8", "shape": [2**70], "data": b""},
    {"dtype": "uint8", "shape": [2**32, 2**32], "data": b""},
    {"dtype": "object", "shape": [2**32, 2**32], "items": []},
    {"dtype": "bool", "shape": [False], "data": b""},  # found by the fuzz test below
    {"dtype": "uint8", "shape": [True], "data": b"\x00"},
])
def test_malformed_maps_rejected_edge(d):
    """BUG: an unhashable dtype (TypeError from ``in _ALLOWED``), a dim beyond int64
    (OverflowError from np.prod) and dims whose product wraps int64 to 0 (ValueError from
    reshape) escape as non-BadRequest exceptions."""
    with pytest.raises(BadRequest):
        decode_tensor(d)


leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                 st.text(max_size=8), st.binary(max_size=16))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
dtypes = st.one_of(st.sampled_from([*NUMERIC, "object", "bfloat16", "float128", "x"]), anything)
shapes = st.one_of(st.lists(st.one_of(st.integers(-1, 5), st.integers(2**31, 2**66)), max_size=9),
                   anything)


@settings(max_examples=200, deadline=None)
# found by this test: zero elements, but the other dimensions multiply past numpy's limit
@example(d={"dtype": "bool", "shape": [0, 2**31, 2**31, 2**31], "data": b""})
@given(d=st.one_of(
    anything,
    st.fixed_dictionaries({"dtype": dtypes, "shape": shapes},
                          optional={"data": st.one_of(st.binary(max_size=64), anything),
                                    "items": anything}),
))
def test_fuzz_decode_only_raises_bad_request(d):
    try:
        arr = decode_tensor(d)
    except BadRequest:
        return
    assert isinstance(arr, np.ndarray)


def test_zero_size_tensor_with_a_huge_dimension_is_a_bad_request():
    import pytest

    from flashpoint.errors import BadRequest
    from flashpoint.tensors import decode_tensor

    with pytest.raises(BadRequest):
        decode_tensor({"dtype": "float32", "shape": [0, 2**62, 2**62], "data": b""})
