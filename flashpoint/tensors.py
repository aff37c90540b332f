"""Tensors on the control wire: numpy arrays as ``{"dtype", "shape", "data"}`` msgpack maps.

Inference inputs and outputs are small enough to ride RPC frames (the frame limit bounds
them); model weights and stage activations never do — they use the data plane.
BF16 has no numpy dtype: it travels as its raw 16-bit patterns with dtype ``"bfloat16"`` and
decodes to float32 (exact), so nothing downstream needs a bf16 numpy type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashpoint.errors import BadRequest

_ALLOWED = {
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "object",
}
MAX_DIMS = 8
# Native-order dtypes only: a dtype of another byte order misses and is named by numpy.
_DTYPE_NAMES = {np.dtype(n): n for n in _ALLOWED if n != "object"}
_NUMPY_DTYPES = {n: np.dtype(n) for n in _ALLOWED}
_INT_ONLY = frozenset((int,))

# The numpy dtype each OIP datatype has once decoded (what models and the controller see):
# BF16 widens to float32, BYTES is an object array of bytes.
DECODED_DTYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.float32), "BYTES": np.dtype(object),
}
MAX_ELEMENTS = 1 << 31
_BF16_DECODED = np.dtype(np.float32)  # BF16 decodes to float32 (exact)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bit patterns (uint16) to float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    # Rounding would carry a NaN's payload into the exponent; keep it a quiet NaN instead.
    return np.where(nan, ((u >> 16) | np.uint32(0x0040)).astype(np.uint16), out).reshape(np.shape(values))


def encode_tensor(arr: np.ndarray | EncodedTensor) -> dict[str, Any]:
    """A numpy array as a msgpack-friendly map. Object arrays hold bytes (OIP BYTES).
    An :class:`EncodedTensor` is already one: its wire form goes on as it came."""
    if arr.__class__ is EncodedTensor:
        return arr.wire  # type: ignore[union-attr]
    if arr.dtype == object:
        return {"dtype": "object", "shape": list(arr.shape),
                "items": [bytes(x) if not isinstance(x, str) else x.encode() for x in arr.ravel()]}
    a = np.ascontiguousarray(arr)
    # dtype.name is a slow Python property: the usual dtypes' names come from a dict.
    name = _DTYPE_NAMES.get(a.dtype)
    if name is None:
        if not a.dtype.isnative:
            # The name carries no byte order and the receiver reads native bytes: a
            # big-endian array (a model that loaded one) is swapped here, not misread there.
            a = a.astype(a.dtype.newbyteorder("="))
        name = a.dtype.name
    return {"dtype": name, "shape": list(arr.shape), "data": a.tobytes()}


class EncodedTensor:
    """A tensor still in its wire form, its header checked (:func:`check_encoded`).

    What a forwarder (the controller serving a stand-alone gateway) holds instead of an
    array: ``shape``, ``dtype`` (the decoded dtype, as :data:`DECODED_DTYPE` names it) and
    ``ndim`` answer input validation like an array's would, and :func:`encode_tensor` returns
    ``wire`` as it came, so the bytes go on to the worker without a decode and a re-encode.
    """

    __slots__ = ("wire", "shape", "dtype")

    def __init__(self, wire: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.wire = wire
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def decode(self) -> np.ndarray:
        """The array itself (for a consumer that needs the values)."""
        return decode_tensor(self.wire)


def _check_header(d: Any) -> tuple[str, list[int], int]:
    """``(dtype name, shape, element count)`` of a wire tensor; every size check of
    :func:`decode_tensor` that needs no data (the data's length is checked by the callers)."""
    if not isinstance(d, dict):
        raise BadRequest("tensor must be a map")
    dtype, shape = d.get("dtype"), d.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not (
        # type, not isinstance: a bool is an int. One pass in C over the types.
        _INT_ONLY.issuperset(map(type, shape)) and (not shape or min(shape) >= 0)
    ):
        raise BadRequest("tensor shape must be a list of at most 8 non-negative ints")
    count = 1
    spread = 1  # the product of the non-zero dimensions
    for s in shape:
        count *= s
        spread *= s or 1
    # The non-zero dimensions too: a zero-size tensor with huge other dimensions has count 0
    # but still cannot be shaped by numpy (it checks the product of the others).
    if count > MAX_ELEMENTS or spread > MAX_ELEMENTS:
        raise BadRequest(f"tensor shape {shape} is over the limit of {MAX_ELEMENTS} elements")
    if not isinstance(dtype, str):
        raise BadRequest("tensor dtype must be a string")
    if dtype != "bfloat16" and dtype not in _ALLOWED:
        raise BadRequest(f"unsupported tensor dtype {dtype!r}")
    return dtype, shape, count


def _check_size(d: dict[str, Any], dtype: str, count: int) -> Any:
    """The tensor's payload (``items`` for BYTES, ``data`` otherwise), its size checked."""
    if dtype == "object":
        items = d.get("items")
        if not isinstance(items, list) or len(items) != count:
            raise BadRequest("BYTES tensor item count does not match its shape")
        return items
    raw = d.get("data")
    if dtype == "bfloat16":
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != count * 2:
            raise BadRequest("bfloat16 tensor byte size does not match its shape")
        return raw
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != count * _NUMPY_DTYPES[dtype].itemsize:
        raise BadRequest("tensor byte size does not match its shape and dtype")
    return raw


def decode_tensor(d: Any) -> np.ndarray:
    """Inverse of :func:`encode_tensor`; malformed input is a BadRequest, never a crash."""
    dtype, shape, count = _check_header(d)
    data = _check_size(d, dtype, count)
    if dtype == "object":
        out = np.empty(count, dtype=object)
        out[:] = [bytes(x) if isinstance(x, (bytes, bytearray)) else str(x).encode() for x in data]
        return out.reshape(shape)
    if dtype == "bfloat16":
        return bf16_to_f32(np.frombuffer(data, dtype=np.uint16)).reshape(shape)
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)


def check_encoded(d: Any) -> EncodedTensor:
    """``d`` checked as :func:`decode_tensor` checks it, without decoding its data."""
    dtype, shape, count = _check_header(d)
    data = _check_size(d, dtype, count)
    # Rebuilt, not forwarded as it came: no stray keys travel on. A BYTES tensor's items may
    # be str on the wire (decode turns them into bytes), so it is decoded and re-encoded:
    # the worker receives exactly what a decoding controller would have sent.
    wire = ({"dtype": dtype, "shape": shape, "data": data} if dtype != "object"
            else encode_tensor(decode_tensor(d)))
    return EncodedTensor(wire, tuple(shape),
                         _BF16_DECODED if dtype == "bfloat16" else _NUMPY_DTYPES[dtype])


def encode_tensors(tensors: dict[str, np.ndarray] | dict[str, EncodedTensor]) -> dict[str, Any]:
    return {name: encode_tensor(a) for name, a in tensors.items()}


def decode_tensors(d: Any) -> dict[str, np.ndarray]:
    if not isinstance(d, dict) or len(d) > 64:
        raise BadRequest("tensors must be a map of at most 64 entries")
    return {str(k): decode_tensor(v) for k, v in d.items()}


def check_encoded_tensors(d: Any) -> dict[str, EncodedTensor]:
    """:func:`decode_tensors`'s checks, the data left encoded (see :class:`EncodedTensor`)."""
    if not isinstance(d, dict) or len(d) > 64:
        raise BadRequest("tensors must be a map of at most 64 entries")
    return {str(k): check_encoded(v) for k, v in d.items()}
