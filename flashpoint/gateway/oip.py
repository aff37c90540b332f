"""KServe Open Inference Protocol v2 (REST) codec: request and response bodies <-> numpy.

Pure functions, no aiohttp, so they can be fuzzed directly. Every malformed input becomes a
:class:`~flashpoint.errors.BadRequest` with a message naming the offending tensor; nothing
here allocates more than the caller's :class:`CodecLimits` allow before checking. The JSON
header itself is parsed (depth-bounded) and response bodies written by
:mod:`flashpoint.gateway.json_codec`.

Wire formats (https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/):

* JSON tensors: ``{"name", "shape", "datatype", "data"}`` with ``data`` flat or nested in
  row-major order; BYTES elements are UTF-8 strings; BF16 elements are numbers.
* Binary tensor extension: the body is a JSON header of ``Inference-Header-Content-Length``
  bytes followed by raw tensor bytes, in input order, for every input whose
  ``parameters.binary_data_size`` is set. Fixed-size types are little-endian row-major;
  BYTES elements each carry a 4-byte little-endian length prefix; BF16 is raw 2-byte bfloat16.

Internally BF16 tensors are float32 arrays holding exactly representable bfloat16 values
(:mod:`flashpoint.tensors`), and BYTES tensors are numpy object arrays of ``bytes``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashpoint.errors import BadRequest, ModelFailed
from flashpoint.gateway.json_codec import dump_json
from flashpoint.spec import DATATYPES, FunctionSpec
from flashpoint.tensors import bf16_to_f32, f32_to_bf16

# Wire dtype of each datatype (BF16 travels as uint16 bit patterns, BYTES as length-prefixed).
WIRE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
}
# Size of one element once decoded into numpy (BF16 widens to float32).
_DECODED_ITEMSIZE = {dt: (4 if dt == "BF16" else d.itemsize) for dt, d in WIRE_DTYPES.items()}
_NUMPY_TO_DATATYPE = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
# The same, keyed by the native-order dtypes themselves (other byte orders miss and take the
# by-name lookup).
_DTYPE_TO_DATATYPE = {np.dtype(n): dt for n, dt in _NUMPY_TO_DATATYPE.items()}
_INT_DATATYPES = frozenset(
    ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"))
_FLOAT_DATATYPES = frozenset(("FP16", "FP32", "FP64", "BF16"))
_MAX_NAME_CHARS = 256
_LEN_PREFIX = struct.Struct("<I")
_MAX_SHAPE_PRODUCT = 2**40


@dataclass(frozen=True)
class CodecLimits:
    """Bounds applied while decoding one request."""

    max_json_depth: int = 32
    max_tensor_bytes: int = 256 * 1024 * 1024
    max_inputs: int = 64
    max_dims: int = 8


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None = None  # None: the request-level default


@dataclass
class InferRequest:
    """A decoded ``/infer`` request."""

    id: str | None
    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    outputs: tuple[RequestedOutput, ...] | None = None  # None: every output
    binary_output: bool = False  # request-level ``binary_data_output``
    timeout_s: float | None = None  # from ``parameters.timeout`` (microseconds, as Triton)
    parameters: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Body framing


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """Split a body into its JSON header and the binary tensor bytes after it."""
    view = memoryview(body)
    if header_length is None:
        return body, view[len(body):]
    text = header_length.strip()
    # ASCII only: str.isdigit() also accepts '²' (int() then raises) and other scripts' digits.
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise BadRequest(
            f"Inference-Header-Content-Length must be a non-negative integer, got {text[:40]!r}")
    n = int(text)
    if n > len(body):
        raise BadRequest(
            f"Inference-Header-Content-Length {n} is past the end of the {len(body)}-byte body")
    return bytes(view[:n]), view[n:]


# ---------------------------------------------------------------------------------------------
# Tensors


def check_datatype(name: str, datatype: Any) -> str:
    if datatype not in DATATYPES:
        raise BadRequest(f"input {name!r}: unknown datatype {str(datatype)[:40]!r}; "
                         f"expected one of {list(DATATYPES)}")
    return str(datatype)


def check_shape(name: str, shape: Any, limits: CodecLimits) -> tuple[int, ...]:
    if not isinstance(shape, list) or not (
        # plain ints (the JSON case) in one pass in C; anything else element by element
        (_INT_ONLY.issuperset(map(type, shape)) and (not shape or min(shape) >= 0))
        or all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise BadRequest(f"input {name!r}: shape must be a list of non-negative integers")
    if len(shape) > limits.max_dims:
        raise BadRequest(f"input {name!r}: shape has {len(shape)} dims, at most "
                         f"{limits.max_dims} allowed")
    # Even an empty tensor (a 0 dim) must have a shape numpy can represent.
    size = math.prod(shape) if 0 not in shape else math.prod(max(s, 1) for s in shape)
    if size > _MAX_SHAPE_PRODUCT:
        raise BadRequest(f"input {name!r}: shape {str(shape)[:80]} is too large")
    return tuple(shape)


def element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)  # Python ints: no overflow however large the declared dims


def _charge(name: str, nbytes: int, budget: list[int], limits: CodecLimits) -> None:
    """Charge ``nbytes`` against the per-request decoded-bytes budget (a 1-element list)."""
    if nbytes > budget[0]:
        raise BadRequest(f"input {name!r}: decoded tensors would exceed the "
                         f"{limits.max_tensor_bytes}-byte limit of one request")
    budget[0] -= nbytes


_INT_ONLY = frozenset((int,))
_STR, _BOOL, _NUMBERS = frozenset((str,)), frozenset((bool,)), frozenset((int, float))
# Largest finite value of the float types a JSON number is cast to directly.
_FINITE_MAX = {"FP16": float(np.finfo(np.float16).max), "FP32": float(np.finfo(np.float32).max),
               "FP64": float(np.finfo(np.float64).max)}
# Element types no list can hide behind (a subclass of list is none of these).
_SCALARS = frozenset((int, float, bool, str, type(None), dict))


def _flatten(data: Any) -> list[Any]:
    """Row-major flatten of nested JSON lists (depth was bounded when parsing)."""
    if not isinstance(data, list):
        return [data]
    if _SCALARS.issuperset(map(type, data)) or not any(isinstance(x, list) for x in data):
        return data
    out: list[Any] = []
    for x in data:
        if isinstance(x, list):
            out.extend(_flatten(x))
        else:
            out.append(x)
    return out


def tensor_from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any,
                     limits: CodecLimits, budget: list[int]) -> np.ndarray:
    """Decode JSON ``data`` (flat or nested) into a numpy array of ``shape``."""
    count = element_count(shape)
    if datatype != "BYTES":
        _charge(name, count * _DECODED_ITEMSIZE[datatype], budget, limits)
    types = set(map(type, data)) if type(data) is list else None
    if types is not None and types <= _SCALARS:
        flat = data  # already flat (the usual case): its element types are known too
    else:
        flat = _flatten(data)
        types = set(map(type, flat))
    if len(flat) != count:
        raise BadRequest(f"input {name!r}: shape {list(shape)} needs {count} elements, "
                         f"data has {len(flat)}")
    if datatype == "BYTES":
        if not types <= _STR:
            raise BadRequest(f"input {name!r}: BYTES data must be strings")
        items = [s.encode("utf-8", "surrogatepass") for s in flat]
        _charge(name, sum(map(len, items)) + 8 * count, budget, limits)
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(shape)
    try:
        if datatype == "BOOL":
            if not types <= _BOOL:
                raise BadRequest(f"input {name!r}: BOOL data must be true/false")
            arr = np.array(flat, dtype=np.bool_)
        elif datatype in _INT_DATATYPES:
            if not types <= _INT_ONLY:
                raise BadRequest(f"input {name!r}: {datatype} data must be integers")
            arr = np.array(flat, dtype=WIRE_DTYPES[datatype])
        else:
            if not types <= _NUMBERS:
                raise BadRequest(f"input {name!r}: {datatype} data must be numbers")
            limit = _FINITE_MAX.get(datatype)
            if limit is not None and flat and -limit <= min(flat) and max(flat) <= limit:
                # Every value is within the type's range, so the cast cannot overflow: no
                # errstate to enter (a NaN fails these comparisons and takes the path below).
                return np.array(flat, dtype=WIRE_DTYPES[datatype]).reshape(shape)
            with np.errstate(over="ignore"):
                if datatype == "BF16":
                    arr = bf16_to_f32(f32_to_bf16(np.array(flat, dtype=np.float32)))
                else:
                    arr = np.array(flat, dtype=WIRE_DTYPES[datatype])
        return arr.reshape(shape)
    except (OverflowError, ValueError, TypeError) as e:
        raise BadRequest(f"input {name!r}: data does not fit {datatype}: {str(e)[:120]}") from None


def tensor_from_binary(name: str, datatype: str, shape: tuple[int, ...], raw: memoryview,
                       limits: CodecLimits, budget: list[int]) -> np.ndarray:
    """Decode one input's binary bytes (the binary tensor data extension)."""
    count = element_count(shape)
    if datatype == "BYTES":
        return _bytes_from_binary(name, shape, count, raw, limits, budget)
    wire = WIRE_DTYPES[datatype]
    expected = count * wire.itemsize
    if len(raw) != expected:
        raise BadRequest(f"input {name!r}: {datatype} shape {list(shape)} needs {expected} "
                         f"bytes, binary_data_size is {len(raw)}")
    _charge(name, count * _DECODED_ITEMSIZE[datatype], budget, limits)
    if datatype == "BOOL":
        return (np.frombuffer(raw, dtype=np.uint8) != 0).reshape(shape)
    arr = np.frombuffer(raw, dtype=wire)
    if datatype == "BF16":
        arr = bf16_to_f32(arr)
    return arr.reshape(shape)


def _bytes_from_binary(name: str, shape: tuple[int, ...], count: int, raw: memoryview,
                       limits: CodecLimits, budget: list[int]) -> np.ndarray:
    if count * 4 > len(raw):
        raise BadRequest(f"input {name!r}: BYTES shape {list(shape)} needs at least "
                         f"{count * 4} bytes, binary_data_size is {len(raw)}")
    _charge(name, len(raw) + 8 * count, budget, limits)
    items: list[bytes] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise BadRequest(f"input {name!r}: BYTES element length prefix past the data")
        (n,) = _LEN_PREFIX.unpack_from(raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise BadRequest(f"input {name!r}: BYTES element of {n} bytes past the data")
        items.append(bytes(raw[offset:offset + n]))
        offset += n
    if offset != len(raw):
        raise BadRequest(f"input {name!r}: {len(raw) - offset} bytes left over after "
                         f"{count} BYTES elements")
    out = np.empty(count, dtype=object)
    out[:] = items
    return out.reshape(shape)


def _check_name(what: str, name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_CHARS:
        raise BadRequest(f"{what} name must be a string of 1-{_MAX_NAME_CHARS} characters")
    return name


def _params(where: str, params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: parameters must be an object")
    return params


def _opt_bool(where: str, params: dict[str, Any], key: str) -> bool | None:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{where}: parameters.{key} must be a boolean")
    return value


# ---------------------------------------------------------------------------------------------
# Requests


def decode_infer_request(header: Any, binary: memoryview | bytes,
                         limits: CodecLimits) -> InferRequest:
    """Decode a parsed JSON header plus the binary bytes that followed it."""
    if not isinstance(header, dict):
        raise BadRequest("inference request must be a JSON object")
    req_id = header.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise BadRequest("'id' must be a string")
    params = _params("request", header.get("parameters"))
    binary_output = bool(_opt_bool("request", params, "binary_data_output"))
    timeout_s = _timeout_from_params(params)

    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("'inputs' must be a non-empty list")
    if len(raw_inputs) > limits.max_inputs:
        raise BadRequest(f"at most {limits.max_inputs} inputs allowed, got {len(raw_inputs)}")
    view = memoryview(binary)
    offset = 0
    budget = [limits.max_tensor_bytes]
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for entry in raw_inputs:
        if not isinstance(entry, dict):
            raise BadRequest("each input must be an object")
        name = _check_name("input", entry.get("name"))
        if name in inputs:
            raise BadRequest(f"input {name!r} given twice")
        datatype = check_datatype(name, entry.get("datatype"))
        shape = check_shape(name, entry.get("shape"), limits)
        iparams = _params(f"input {name!r}", entry.get("parameters"))
        if "shared_memory_region" in iparams:
            raise BadRequest(f"input {name!r}: shared memory is not supported")
        size = iparams.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative "
                                 f"integer")
            if "data" in entry:
                raise BadRequest(f"input {name!r}: has both 'data' and binary_data_size")
            if offset + size > len(view):
                raise BadRequest(f"input {name!r}: binary_data_size {size} runs past the "
                                 f"{len(view) - offset} binary bytes left in the body")
            arr = tensor_from_binary(name, datatype, shape, view[offset:offset + size],
                                     limits, budget)
            offset += size
        elif "data" in entry:
            arr = tensor_from_json(name, datatype, shape, entry["data"], limits, budget)
        else:
            raise BadRequest(f"input {name!r}: needs 'data' or parameters.binary_data_size")
        inputs[name] = arr
        datatypes[name] = datatype
    if offset != len(view):
        raise BadRequest(f"{len(view) - offset} unclaimed binary bytes after the inputs")
    outputs = _requested_outputs(header.get("outputs"))
    return InferRequest(req_id, inputs, datatypes, outputs, binary_output, timeout_s, params)


def _timeout_from_params(params: dict[str, Any]) -> float | None:
    value = params.get("timeout")
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
        0 < value < 1e15
    ):
        raise BadRequest("parameters.timeout must be a positive number of microseconds")
    return float(value) / 1e6


def _requested_outputs(raw: Any) -> tuple[RequestedOutput, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > 1024:
        raise BadRequest("'outputs' must be a list")
    seen: set[str] = set()
    out = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise BadRequest("each requested output must be an object")
        name = _check_name("output", entry.get("name"))
        if name in seen:
            raise BadRequest(f"output {name!r} requested twice")
        seen.add(name)
        oparams = _params(f"output {name!r}", entry.get("parameters"))
        if "shared_memory_region" in oparams:
            raise BadRequest(f"output {name!r}: shared memory is not supported")
        out.append(RequestedOutput(name, _opt_bool(f"output {name!r}", oparams, "binary_data")))
    return tuple(out)


def check_requested_outputs(requested: tuple[RequestedOutput, ...] | None,
                            available: Iterable[str]) -> None:
    """Every requested output must be one the model produces."""
    if requested is None:
        return
    names = list(available)
    for r in requested:
        if r.name not in names:
            raise BadRequest(f"unknown output {r.name!r}; the model's outputs are {names}")


# ---------------------------------------------------------------------------------------------
# Responses


def datatype_of(name: str, arr: np.ndarray, declared: str | None = None) -> str:
    """The OIP datatype of an output: the declared one, else derived from the numpy dtype."""
    if declared is not None:
        return declared
    dt = _DTYPE_TO_DATATYPE.get(arr.dtype)  # dtype.name is a slow Python property
    if dt is not None:
        return dt
    if arr.dtype == object or arr.dtype.kind in "SU":
        return "BYTES"
    dt = _NUMPY_TO_DATATYPE.get(arr.dtype.name)
    if dt is None:
        raise ModelFailed(f"output {name!r} has unsupported dtype {arr.dtype}")
    return dt


def _as_wire(name: str, arr: np.ndarray, datatype: str) -> np.ndarray:
    """A C-contiguous little-endian array in the wire dtype (BF16 -> uint16 bits)."""
    if datatype != "BF16":
        wire = WIRE_DTYPES[datatype]
        if type(arr) is np.ndarray and arr.dtype == wire and arr.flags.c_contiguous:
            return arr  # the usual output: nothing to cast, so no errstate to enter
    try:
        with np.errstate(all="ignore"):
            if datatype == "BF16":
                return f32_to_bf16(np.asarray(arr, dtype=np.float32))
            return np.ascontiguousarray(arr, dtype=WIRE_DTYPES[datatype])
    except (TypeError, ValueError, OverflowError) as e:
        raise ModelFailed(f"output {name!r} cannot be encoded as {datatype}: {e}") from None


def bytes_items(arr: np.ndarray) -> list[bytes]:
    items = []
    for x in np.asarray(arr).ravel():
        if isinstance(x, (bytes, bytearray, memoryview)):
            items.append(bytes(x))
        elif isinstance(x, str):
            items.append(x.encode())
        else:
            items.append(str(x).encode())
    return items


def tensor_to_binary(name: str, arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(_LEN_PREFIX.pack(len(b)) + b for b in bytes_items(arr))
    return _as_wire(name, arr, datatype).tobytes()


def tensor_to_json_data(name: str, arr: np.ndarray, datatype: str) -> list[Any] | None:
    """Flat JSON data of an output, or None when it cannot be JSON (non-UTF-8 BYTES)."""
    if datatype == "BYTES":
        try:
            return [b.decode("utf-8") for b in bytes_items(arr)]
        except UnicodeDecodeError:
            return None
    wire = _as_wire(name, arr, datatype)
    if datatype == "BF16":
        return bf16_to_f32(wire).ravel().tolist()
    return wire.ravel().tolist()


def encode_infer_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: Mapping[str, np.ndarray],
    declared: Mapping[str, str],
    requested: tuple[RequestedOutput, ...] | None,
    binary_output: bool,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """Build a response body; returns ``(body, header_length)``.

    ``header_length`` is None for a pure JSON body, else the JSON header's size for the
    ``Inference-Header-Content-Length`` response header. ``declared`` maps output names to
    the function spec's datatypes. Non-UTF-8 BYTES outputs are always sent binary.
    """
    check_requested_outputs(requested, outputs)
    selected = (
        [(r.name, binary_output if r.binary is None else r.binary) for r in requested]
        if requested is not None else [(n, binary_output) for n in outputs]
    )
    entries = []
    blobs: list[bytes] = []
    for name, binary in selected:
        arr = np.asarray(outputs[name])
        datatype = datatype_of(name, arr, declared.get(name))
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        data = None if binary else tensor_to_json_data(name, arr, datatype)
        if data is None:
            blob = tensor_to_binary(name, arr, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = data
        entries.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        body["id"] = request_id
    if parameters:
        body["parameters"] = dict(parameters)
    body["outputs"] = entries
    head = dump_json(body)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


# ---------------------------------------------------------------------------------------------
# Metadata


def server_metadata(version: str) -> dict[str, Any]:
    return {"name": "flashpoint", "version": version, "extensions": ["binary_tensor_data"]}


def model_metadata(spec: FunctionSpec) -> dict[str, Any]:
    """``GET /v2/models/{name}``: the function's tensor signature (-1 = any size)."""
    return {
        "name": spec.name,
        "versions": [spec.model_version],
        "platform": "pytorch",
        "inputs": [t.to_dict() for t in spec.inputs],
        "outputs": [t.to_dict() for t in spec.outputs],
    }
