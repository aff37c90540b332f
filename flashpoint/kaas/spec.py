"""KaaS requests (version 1): a graph of kernels over named buffers, as plain data.

A request (a kTask, KaaS §3) names kernels from a registered library, the buffers they read
and write in argument order, pass-by-value literals, and for raw kernels a launch shape.
Buffers are of three kinds:

* ``input``: an object-store ``key`` or inline ``data`` (a JSON list, or base64 of the raw
  little-endian C-order bytes under ``b64``). Inputs are immutable: no kernel may write one,
  which is what lets an executor keep them cached across requests.
* ``output``: written by a kernel; stored under ``key`` when one is given (objects are
  immutable, so a second request writing other bytes there is a 409), else returned inline.
* ``intermediate``: described by dtype and shape (or only ``size_bytes``, read as uint8);
  its contents never leave the executor.

An output or intermediate may declare ``fill`` (a number): it is set to that value before the
first kernel of every request. That is how an iterative kernel updates a buffer in place
(Jacobi's ``x``): the paper leaves the initial contents of such buffers unsaid; here reading
a buffer that nothing wrote and nothing filled is an error (``read_before_write``).

Only dataclasses and parsing live here (no torch): the gateway validates without a device.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from flashpoint.errors import BadRequest, BufferMismatch, InvalidKernelGraph, PayloadTooLarge

SPEC_VERSION = 1

# Element sizes of the dtypes a buffer may have (numpy / torch names).
DTYPE_BYTES: dict[str, int] = {"float16": 2, "float32": 4, "float64": 8, "int32": 4,
                               "int64": 8, "uint8": 1}
# Literal types, after the authors' struct codes (i, q, f, d).
LITERAL_TYPES = ("i32", "i64", "f32", "f64")

MAX_KERNELS = 1024
MAX_BUFFERS = 1024
MAX_ITERS = 100_000
# Kernel launches per request (kernels x n_iters): an executor cannot be interrupted inside
# a request, so the work one request may ask for is bounded up front.
MAX_LAUNCHES = 1_000_000
MAX_DIMS = 8
MAX_LITERALS = 64
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
KEY_RE = re.compile(r"^[A-Za-z0-9_.:/=+-]{1,256}$")


class BufferKind(StrEnum):
    INPUT = "input"
    OUTPUT = "output"
    INTERMEDIATE = "intermediate"


def check_key(key: Any) -> str:
    """An object-store key: 1-256 characters of ``[A-Za-z0-9_.:/=+-]``."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise BadRequest(f"invalid object key {str(key)[:64]!r}: 1-256 characters of "
                         "letters, digits and _.:/=+-")
    return key


MAX_TTL_S = 366 * 86400.0


def check_ttl(ttl_s: Any) -> float | None:
    """An object's optional time to live: a number of seconds in (0, one year]."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) \
            or not 0 < ttl_s <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:.0f}]")
    return float(ttl_s)


def check_object(data: Any, max_bytes: int) -> bytes:
    """An object's bytes as a writer sent them: 1 to ``max_bytes`` bytes."""
    if not isinstance(data, bytes) or not data:
        raise BadRequest("an object needs at least one byte")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"objects are at most {max_bytes} bytes")
    return data


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise InvalidKernelGraph(f"{what} {str(value)[:64]!r} must be 1-128 characters of "
                                 "letters, digits and _.:-")
    return value


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidKernelGraph(f"{what} must be an integer in [{lo}, {hi}]")
    return value


def _fields(d: Any, what: str, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise InvalidKernelGraph(f"{what} must be an object")
    unknown = set(d) - allowed
    if unknown:
        raise InvalidKernelGraph(f"unknown {what} fields {sorted(unknown)}; allowed: "
                                 f"{sorted(allowed)}")
    return d


@dataclass(frozen=True)
class BufferSpec:
    """One named buffer; ``inline`` holds an inline input's raw bytes."""

    name: str
    kind: BufferKind
    dtype: str
    shape: tuple[int, ...]
    key: str | None = None
    inline: bytes | None = field(default=None, repr=False)
    fill: float | None = None

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def array(self) -> np.ndarray:
        """An inline input's data as a read-only array."""
        assert self.inline is not None
        return np.frombuffer(self.inline, dtype=self.dtype).reshape(self.shape)

    _KEYS = frozenset(("name", "kind", "dtype", "shape", "size_bytes", "key", "data", "b64",
                       "fill"))

    @classmethod
    def from_dict(cls, d: Any, max_bytes: int) -> BufferSpec:
        d = _fields(d, "buffer", cls._KEYS)
        name = _name(d.get("name"), "buffer name")
        try:
            kind = BufferKind(d.get("kind"))
        except ValueError:
            raise InvalidKernelGraph(f"buffer {name!r}: kind must be one of "
                                     f"{[k.value for k in BufferKind]}") from None
        size = d.get("size_bytes")
        if size is not None:
            size = _int(size, f"buffer {name!r} size_bytes", 1, 1 << 62)
            if size > max_bytes:
                raise PayloadTooLarge(f"buffer {name!r} of {size} bytes is over the "
                                      f"{max_bytes}-byte limit", buffer=name)
        dtype = d.get("dtype")
        shape_raw = d.get("shape")
        if dtype is None and shape_raw is None and size is not None:
            # Described by its size only (the paper's temporaries): bytes.
            dtype, shape_raw = "uint8", [size]
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise BufferMismatch(f"buffer {name!r}: dtype must be one of {sorted(DTYPE_BYTES)}",
                                 buffer=name)
        if (not isinstance(shape_raw, list) or not 0 < len(shape_raw) <= MAX_DIMS
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                       for s in shape_raw)):
            raise BufferMismatch(f"buffer {name!r}: shape must be a list of 1-{MAX_DIMS} "
                                 "positive integers", buffer=name)
        shape = tuple(shape_raw)
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if nbytes > max_bytes:
            raise PayloadTooLarge(f"buffer {name!r} of {nbytes} bytes is over the "
                                  f"{max_bytes}-byte limit", buffer=name)
        if size is not None and size != nbytes:
            raise BufferMismatch(f"buffer {name!r}: size_bytes {size} != {nbytes} "
                                 f"({dtype} {list(shape)})", buffer=name)
        key = d.get("key")
        if key is not None:
            key = check_key(key)
        fill = d.get("fill")
        if fill is not None and (isinstance(fill, bool) or not isinstance(fill, (int, float))):
            raise InvalidKernelGraph(f"buffer {name!r}: fill must be a number")
        has_data = "data" in d or "b64" in d
        if kind is BufferKind.INPUT:
            if (key is None) == (not has_data) or ("data" in d and "b64" in d):
                raise InvalidKernelGraph(f"input {name!r} needs exactly one of key, data, b64")
            if fill is not None:
                raise InvalidKernelGraph(f"input {name!r} cannot have a fill")
        elif has_data:
            raise InvalidKernelGraph(f"{kind.value} {name!r} cannot carry data")
        elif kind is BufferKind.INTERMEDIATE and key is not None:
            raise InvalidKernelGraph(f"intermediate {name!r} cannot have a key")
        inline = _inline(name, d, dtype, shape, nbytes) if has_data else None
        return cls(name, kind, dtype, shape, key, inline,
                   float(fill) if fill is not None else None)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind.value, "dtype": self.dtype,
                             "shape": list(self.shape)}
        if self.key is not None:
            d["key"] = self.key
        if self.inline is not None:
            d["b64"] = base64.b64encode(self.inline).decode()
        if self.fill is not None:
            d["fill"] = self.fill
        return d


def _inline(name: str, d: dict[str, Any], dtype: str, shape: tuple[int, ...],
            nbytes: int) -> bytes:
    if "b64" in d:
        raw = d["b64"]
        if not isinstance(raw, str):
            raise BufferMismatch(f"input {name!r}: b64 must be a string", buffer=name)
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise BufferMismatch(f"input {name!r}: b64 is not valid base64",
                                 buffer=name) from None
        if len(data) != nbytes:
            raise BufferMismatch(f"input {name!r}: {len(data)} bytes of data for {dtype} "
                                 f"{list(shape)} ({nbytes} bytes)", buffer=name)
        return data
    try:
        arr = np.asarray(d["data"], dtype=np.float64 if dtype.startswith("float") else None)
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise ValueError("not numeric")
    except (ValueError, TypeError, OverflowError):
        raise BufferMismatch(f"input {name!r}: data must be a (nested) list of numbers",
                             buffer=name) from None
    arr = _cast_values(name, arr, dtype)
    if arr.size != math.prod(shape):
        raise BufferMismatch(f"input {name!r}: {arr.size} values for shape {list(shape)}",
                             buffer=name)
    # Executors read buffers in the host's byte order; every supported host is little-endian.
    return np.ascontiguousarray(arr.reshape(shape), dtype=dtype).tobytes()


def _cast_values(name: str, arr: np.ndarray, dtype: str) -> np.ndarray:
    """Cast inline values to the buffer's dtype with the gateway's rules for tensors.

    Integer buffers take integers within the type's range, never a float (it would be
    truncated) or a value that would wrap. Float buffers round as IEEE does, so a value past
    the type's largest finite one becomes an infinity, as it does at the OIP gateway.
    """
    if dtype.startswith("float"):
        with np.errstate(over="ignore"):
            return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise BufferMismatch(f"input {name!r}: {dtype} data must be integers", buffer=name)
    info = np.iinfo(dtype)
    if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
        raise BufferMismatch(f"input {name!r}: data does not fit {dtype} "
                             f"[{info.min}, {info.max}]", buffer=name)
    return arr.astype(dtype)


@dataclass(frozen=True)
class Literal:
    """A pass-by-value kernel argument (KaaS §4.1.3); argument order is part of the spec."""

    dtype: str
    value: int | float

    @classmethod
    def from_any(cls, v: Any, where: str) -> Literal:
        if isinstance(v, bool):
            raise InvalidKernelGraph(f"{where}: literals are numbers, not booleans")
        if isinstance(v, int):
            if not -(2**63) <= v < 2**63:
                raise InvalidKernelGraph(f"{where}: literal {v} does not fit i64")
            return cls("i64", v)
        if isinstance(v, float):
            return cls("f64", v)
        d = _fields(v, f"{where} literal", frozenset(("dtype", "value")))
        dtype, value = d.get("dtype"), d.get("value")
        if dtype not in LITERAL_TYPES:
            raise InvalidKernelGraph(f"{where}: literal dtype must be one of {LITERAL_TYPES}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                dtype.startswith("i") and not isinstance(value, int)):
            raise InvalidKernelGraph(f"{where}: literal value does not fit {dtype}")
        bits = int(dtype[1:])
        if dtype.startswith("i") and not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
            raise InvalidKernelGraph(f"{where}: literal {value} does not fit {dtype}")
        return cls(dtype, value)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "value": self.value}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel launch: ``inputs`` and ``outputs`` are buffer names in argument order.

    A buffer may be both an input and an output of the same kernel (updated in place, the
    authors' "io" arguments). ``grid``/``block``/``shared_bytes`` are the launch shape of
    raw (CuPy/PTX, Triton) kernels; library operators ignore them.
    """

    name: str
    kernel: str
    library: str = "torch"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    literals: tuple[Literal, ...] = ()
    grid: tuple[int, ...] | None = None
    block: tuple[int, ...] | None = None
    shared_bytes: int = 0

    _KEYS = frozenset(("name", "kernel", "library", "inputs", "outputs", "literals", "grid",
                       "block", "shared_bytes"))

    @classmethod
    def from_dict(cls, d: Any, index: int) -> KernelSpec:
        d = _fields(d, "kernel", cls._KEYS)
        name = _name(d.get("name", f"k{index}"), "kernel name")
        kernel = _name(d.get("kernel"), f"kernel {name!r}: kernel")
        library = _name(d.get("library", "torch"), f"kernel {name!r}: library")
        args: dict[str, tuple[str, ...]] = {}
        for part in ("inputs", "outputs"):
            raw = d.get(part, [])
            if not isinstance(raw, list) or len(raw) > 64:
                raise InvalidKernelGraph(f"kernel {name!r}: {part} must be a list of at most "
                                         "64 buffer names")
            args[part] = tuple(_name(b, f"kernel {name!r}: buffer") for b in raw)
        if not args["outputs"]:
            # A kernel with no outputs has no effect (kernels have no side effects, §3).
            raise InvalidKernelGraph(f"kernel {name!r} writes no buffer")
        lits = d.get("literals", [])
        if not isinstance(lits, list) or len(lits) > MAX_LITERALS:
            raise InvalidKernelGraph(f"kernel {name!r}: literals must be a list of at most "
                                     f"{MAX_LITERALS}")
        literals = tuple(Literal.from_any(v, f"kernel {name!r}") for v in lits)
        launch: dict[str, tuple[int, ...] | None] = {}
        for part in ("grid", "block"):
            raw = d.get(part)
            if raw is not None:
                if not isinstance(raw, list) or not 1 <= len(raw) <= 3:
                    raise InvalidKernelGraph(f"kernel {name!r}: {part} must be 1-3 integers")
                raw = tuple(_int(v, f"kernel {name!r} {part}", 1, 2**31 - 1) for v in raw)
            launch[part] = raw
        shared = _int(d.get("shared_bytes", 0), f"kernel {name!r} shared_bytes", 0, 1 << 20)
        return cls(name, kernel, library, args["inputs"], args["outputs"], literals,
                   launch["grid"], launch["block"], shared)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kernel": self.kernel, "library": self.library,
                             "inputs": list(self.inputs), "outputs": list(self.outputs)}
        if self.literals:
            d["literals"] = [lit.to_dict() for lit in self.literals]
        if self.grid is not None:
            d["grid"] = list(self.grid)
        if self.block is not None:
            d["block"] = list(self.block)
        if self.shared_bytes:
            d["shared_bytes"] = self.shared_bytes
        return d


@dataclass(frozen=True)
class KaasRequest:
    """A kTask: kernels, the buffers they use, and a fixed iteration count (§3.2)."""

    kernels: tuple[KernelSpec, ...]
    buffers: tuple[BufferSpec, ...]
    n_iters: int = 1
    version: int = SPEC_VERSION

    _KEYS = frozenset(("version", "kernels", "buffers", "n_iters"))

    @classmethod
    def from_dict(cls, d: Any, *, max_buffer_bytes: int = 1 << 31) -> KaasRequest:
        """Parse and check the request's form; :func:`plan_graph` checks its meaning."""
        if not isinstance(d, dict):
            raise InvalidKernelGraph("a KaaS request must be a JSON object")
        d = _fields(d, "request", cls._KEYS)
        version = d.get("version", SPEC_VERSION)
        if version != SPEC_VERSION:
            raise InvalidKernelGraph(f"unsupported KaaS request version {version!r}; this "
                                     f"server speaks {SPEC_VERSION}")
        kernels, buffers = d.get("kernels"), d.get("buffers")
        if not isinstance(kernels, list) or not 0 < len(kernels) <= MAX_KERNELS:
            raise InvalidKernelGraph(f"kernels must be a list of 1-{MAX_KERNELS} kernels")
        if not isinstance(buffers, list) or not 0 < len(buffers) <= MAX_BUFFERS:
            raise InvalidKernelGraph(f"buffers must be a list of 1-{MAX_BUFFERS} buffers")
        n_iters = _int(d.get("n_iters", 1), "n_iters", 1, MAX_ITERS)
        if n_iters * len(kernels) > MAX_LAUNCHES:
            raise InvalidKernelGraph(f"{len(kernels)} kernels x {n_iters} iterations is over "
                                     f"the {MAX_LAUNCHES}-launch limit")
        return cls(tuple(KernelSpec.from_dict(k, i) for i, k in enumerate(kernels)),
                   tuple(BufferSpec.from_dict(b, max_buffer_bytes) for b in buffers),
                   n_iters, version)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "n_iters": self.n_iters,
                "kernels": [k.to_dict() for k in self.kernels],
                "buffers": [b.to_dict() for b in self.buffers]}

    @property
    def total_bytes(self) -> int:
        return sum(b.size_bytes for b in self.buffers)
