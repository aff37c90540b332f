"""Activation frames: stage tensors as raw bytes behind fixed binary headers (no pickle).

One frame, all integers big-endian::

    HEAD   32 B   magic "FPA1" | version u8 | kind u8 | count u16
                  | request_id u64 | trace_id u64 | body_bytes u64
    TABLE  count x 80 B, one entry per tensor:
                  dtype u8 | ndim u8 | reserved u16 (0) | reserved u32 (0) | nbytes u64
                  | shape: 8 x u64 (dims past ndim are 0)
    DATA   the tensors' C-contiguous bytes in table order; each starts at a multiple of
           ALIGN_BYTES from the start of DATA (zero padding between them)

``body_bytes`` = len(TABLE) + len(DATA), so a reader knows the whole size after 32 bytes,
checks it against its limit, and then reads TABLE and DATA with exact reads. DATA lands in
one fresh ``bytearray`` and tensors are views over it (``torch.frombuffer`` /
``np.frombuffer``), writable and aligned. Encoding copies nothing: it returns a list of
buffers (header bytes and memoryviews of the tensors) for one ``sendmsg``.

``kind`` is REQUEST (towards the last stage), RESULT (back towards the client) or ERROR
(back towards the client; count 0, DATA = a JSON error ``{"code", "message", "details"}``
rebuilt into the same typed error). ``request_id`` is link-local: each stage renumbers the
requests it forwards and maps replies back. ``trace_id`` is set by the client and never
changes, so one request can be followed through every stage's logs.

BF16 has no numpy dtype: it travels as its 16-bit patterns; numpy decoding gives the
``uint16`` bits (``tensors_numpy``), torch decoding gives ``torch.bfloat16``.

BYTES (OIP's strings: a numpy ``object`` array of ``bytes``) travels as its items in C
order, each a u32 length and its bytes; ``nbytes`` is their total (at least 4 per item).
It decodes to an ``object`` array in both decodings (torch has no such dtype): it is what
a served model's first stage takes (text) and its last stage returns (labels).

Everything here is pure (no I/O, no event loop); torch is used only when the caller passes
or asks for torch tensors, so a numpy-only client never imports it.
"""

from __future__ import annotations

import enum
import json
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashpoint.errors import FlashpointError, FrameTooLarge, ProtocolError, from_wire

MAGIC = b"FPA1"
VERSION = 1
HEAD = struct.Struct("!4sBBHQQQ")
ENTRY = struct.Struct("!BBHIQ8Q")
MAX_DIMS = 8
MAX_TENSORS = 64
MAX_DIM = 1 << 48
ALIGN_BYTES = 64
MAX_FRAME_BYTES = 1 << 30  # default limit on body_bytes; stages and clients may set their own
MAX_ERROR_BYTES = 64 * 1024
MAX_ERROR_DEPTH = 32  # JSON nesting of an ERROR body (to_wire() recurses through details)


class FrameKind(enum.IntEnum):
    REQUEST = 1
    RESULT = 2
    ERROR = 3


class DType(enum.IntEnum):
    """Wire dtype codes (stable: never renumber)."""

    BOOL = 1
    UINT8 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    INT64 = 6
    FLOAT16 = 7
    BFLOAT16 = 8
    FLOAT32 = 9
    FLOAT64 = 10
    UINT16 = 11
    UINT32 = 12
    UINT64 = 13
    BYTES = 14  # variable-length items: u32 length + bytes each (see the module docstring)


# numpy dtype each code decodes to (BF16: its raw uint16 bit patterns)
NUMPY_DTYPE: dict[DType, np.dtype] = {
    DType.BOOL: np.dtype(np.bool_), DType.UINT8: np.dtype(np.uint8), DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16), DType.INT32: np.dtype(np.int32), DType.INT64: np.dtype(np.int64),
    DType.FLOAT16: np.dtype(np.float16), DType.BFLOAT16: np.dtype(np.uint16),
    DType.FLOAT32: np.dtype(np.float32), DType.FLOAT64: np.dtype(np.float64),
    DType.UINT16: np.dtype(np.uint16), DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64),
}
_FROM_NUMPY: dict[str, DType] = {
    dt.name: code for code, dt in NUMPY_DTYPE.items() if code is not DType.BFLOAT16
}
_FROM_NUMPY["bfloat16"] = DType.BFLOAT16  # ml_dtypes.bfloat16 arrays
_TORCH_NAMES: dict[DType, str] = {
    DType.BOOL: "bool", DType.UINT8: "uint8", DType.INT8: "int8", DType.INT16: "int16",
    DType.INT32: "int32", DType.INT64: "int64", DType.FLOAT16: "float16",
    DType.BFLOAT16: "bfloat16", DType.FLOAT32: "float32", DType.FLOAT64: "float64",
    DType.UINT16: "uint16", DType.UINT32: "uint32", DType.UINT64: "uint64",
}


def itemsize(code: DType) -> int:
    return NUMPY_DTYPE[code].itemsize


_U32 = struct.Struct("!I")


def _bytes_items(a: np.ndarray) -> memoryview:
    """An object array's items (bytes, or str as UTF-8) in C order, length-prefixed."""
    parts: list[bytes] = []
    for item in a.reshape(-1):
        raw = item.encode() if isinstance(item, str) else item
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"a BYTES tensor holds a {type(item).__name__}")
        raw = bytes(raw)
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return memoryview(b"".join(parts))


def _decode_bytes(data: Any, head: TensorHead) -> np.ndarray:
    """A BYTES tensor's items as an ``object`` array; ProtocolError if they do not fill
    exactly its ``nbytes``."""
    mv = memoryview(data)[head.offset:head.offset + head.nbytes]
    out = np.empty(head.numel, dtype=object)
    pos = 0
    for i in range(head.numel):
        if pos + 4 > len(mv):
            raise ProtocolError("BYTES tensor items run past its bytes")
        (n,) = _U32.unpack_from(mv, pos)
        pos += 4
        if pos + n > len(mv):
            raise ProtocolError("BYTES tensor items run past its bytes")
        out[i] = bytes(mv[pos:pos + n])
        pos += n
    if pos != len(mv):
        raise ProtocolError(f"BYTES tensor has {len(mv) - pos} bytes past its last item")
    return out.reshape(head.shape)


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class FrameHead:
    kind: FrameKind
    count: int
    request_id: int
    trace_id: int
    body_bytes: int

    @property
    def table_bytes(self) -> int:
        return self.count * ENTRY.size

    @property
    def data_bytes(self) -> int:
        return self.body_bytes - self.table_bytes


@dataclass(frozen=True)
class TensorHead:
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # within DATA

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


# -- encoding ------------------------------------------------------------------------------


def _torch_tensor(x: Any) -> Any:
    """``x`` if it is a torch tensor (torch is only looked up if already imported)."""
    torch = sys.modules.get("torch")
    return x if torch is not None and isinstance(x, torch.Tensor) else None


def tensor_bytes(x: Any) -> tuple[DType, tuple[int, ...], memoryview]:
    """A tensor's wire dtype, shape and raw C-order bytes, without copying when it is
    already contiguous on CPU (a GPU tensor is copied to host memory)."""
    t = _torch_tensor(x)
    if t is not None:
        name = str(t.dtype).removeprefix("torch.")
        code = next((c for c, n in _TORCH_NAMES.items() if n == name), None)
        if code is None:
            raise ProtocolError(f"dtype {t.dtype} cannot travel in an activation frame")
        torch = sys.modules["torch"]
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        shape = tuple(int(s) for s in t.shape)
        flat = t.contiguous().reshape(-1)
        raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        return code, shape, memoryview(raw.numpy())
    a = np.asarray(x)
    if a.dtype == object:
        return DType.BYTES, tuple(int(s) for s in a.shape), _bytes_items(a)
    code = _FROM_NUMPY.get(a.dtype.name)
    if code is None:
        raise ProtocolError(f"dtype {a.dtype} cannot travel in an activation frame")
    shape = tuple(int(s) for s in a.shape)
    flat = np.ascontiguousarray(a).reshape(-1)
    return code, shape, memoryview(flat.view(np.uint8)).cast("B")


def encode_frame(kind: FrameKind, request_id: int, trace_id: int,
                 tensors: Sequence[Any]) -> list[bytes | memoryview]:
    """Buffers of one REQUEST or RESULT frame (for ``sendmsg``); the tensors' memory is
    referenced, not copied, so keep them unchanged until the frame is sent."""
    if kind is FrameKind.ERROR:
        raise ValueError("use encode_error for ERROR frames")
    if len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(tensors)} tensors in one frame, over the limit {MAX_TENSORS}")
    entries: list[bytes] = []
    data: list[bytes | memoryview] = []
    pos = 0
    for x in tensors:
        code, shape, raw = tensor_bytes(x)
        if len(shape) > MAX_DIMS:
            raise ProtocolError(f"tensor of {len(shape)} dims, over the limit {MAX_DIMS}")
        start = align_up(pos)
        if start > pos:
            data.append(bytes(start - pos))
        entries.append(ENTRY.pack(code, len(shape), 0, 0, len(raw),
                                  *shape, *([0] * (MAX_DIMS - len(shape)))))
        data.append(raw)
        pos = start + len(raw)
    table = b"".join(entries)
    head = HEAD.pack(MAGIC, VERSION, kind, len(tensors), request_id, trace_id, len(table) + pos)
    return [head + table, *data]


def encode_error(request_id: int, trace_id: int, error: FlashpointError) -> list[bytes | memoryview]:
    """One ERROR frame carrying ``error`` (its wire form as JSON, capped at MAX_ERROR_BYTES)."""
    body = json.dumps(error.to_wire(), default=str).encode()
    if len(body) > MAX_ERROR_BYTES:
        wire = {"code": error.code, "message": error.message[:1000], "details": {}}
        body = json.dumps(wire, default=str).encode()[:MAX_ERROR_BYTES]
    return [HEAD.pack(MAGIC, VERSION, FrameKind.ERROR, 0, request_id, trace_id, len(body)) + body]


def relabel(head: FrameHead, table: bytes, data: bytes | bytearray | memoryview,
            request_id: int) -> list[bytes | memoryview]:
    """A received frame's buffers under another link-local request id (a stage relays
    results and errors back without decoding them)."""
    new = HEAD.pack(MAGIC, VERSION, head.kind, head.count, request_id, head.trace_id,
                    head.body_bytes)
    return [new + table, memoryview(data)]


def set_request_id(buffers: list[bytes | memoryview], request_id: int) -> list[bytes | memoryview]:
    """The same frame (as returned by the encoders) under another link-local request id."""
    first = bytes(buffers[0])
    magic, version, kind, count, _, trace_id, body_bytes = HEAD.unpack_from(first)
    head = HEAD.pack(magic, version, kind, count, request_id, trace_id, body_bytes)
    return [head + first[HEAD.size:], *buffers[1:]]


# -- decoding ------------------------------------------------------------------------------


def parse_head(buf: bytes | bytearray | memoryview, *,
               max_frame_bytes: int = MAX_FRAME_BYTES) -> FrameHead:
    """Validate the 32-byte HEAD. ProtocolError when malformed, FrameTooLarge when the body
    is over ``max_frame_bytes``."""
    if len(buf) != HEAD.size:
        raise ProtocolError(f"frame head is {len(buf)} bytes, expected {HEAD.size}")
    magic, version, kind, count, request_id, trace_id, body_bytes = HEAD.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"not an activation frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"activation frame version {version} unsupported (want {VERSION})")
    try:
        k = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if count > MAX_TENSORS:
        raise ProtocolError(f"{count} tensors in one frame, over the limit {MAX_TENSORS}")
    if k is FrameKind.ERROR:
        if count:
            raise ProtocolError("an ERROR frame carries no tensors")
        if body_bytes > MAX_ERROR_BYTES:
            raise ProtocolError(f"ERROR body of {body_bytes} bytes over {MAX_ERROR_BYTES}")
    if body_bytes > max_frame_bytes:
        raise FrameTooLarge(f"activation frame of {body_bytes} bytes over the limit {max_frame_bytes}")
    if body_bytes < count * ENTRY.size:
        raise ProtocolError(f"frame body of {body_bytes} bytes cannot hold {count} tensor entries")
    return FrameHead(k, count, request_id, trace_id, body_bytes)


def parse_table(head: FrameHead, buf: bytes | bytearray | memoryview) -> tuple[TensorHead, ...]:
    """Validate the tensor table against the head: every entry well-formed, ``nbytes`` equal
    to its shape times its item size, and DATA exactly as long as the aligned tensors."""
    if len(buf) != head.table_bytes:
        raise ProtocolError(f"tensor table is {len(buf)} bytes, expected {head.table_bytes}")
    out: list[TensorHead] = []
    pos = 0
    for i in range(head.count):
        code, ndim, r16, r32, nbytes, *dims = ENTRY.unpack_from(buf, i * ENTRY.size)
        try:
            dtype = DType(code)
        except ValueError:
            raise ProtocolError(f"tensor {i}: unknown dtype code {code}") from None
        if ndim > MAX_DIMS:
            raise ProtocolError(f"tensor {i}: {ndim} dims, over the limit {MAX_DIMS}")
        if r16 or r32 or any(dims[ndim:]):
            raise ProtocolError(f"tensor {i}: reserved fields must be zero")
        shape = tuple(dims[:ndim])
        if any(d > MAX_DIM for d in shape):
            raise ProtocolError(f"tensor {i}: dimension over {MAX_DIM}")
        # An empty tensor has numel 0 whatever its other dims, but numpy and torch still
        # multiply those (refusing past 2**63), so they are bounded as a whole as well.
        if math.prod(max(d, 1) for d in shape) > MAX_DIM:
            raise ProtocolError(f"tensor {i}: shape {shape} too large")
        numel = 1
        for d in shape:
            numel *= d
        if dtype is DType.BYTES:
            if nbytes < 4 * numel:
                raise ProtocolError(f"tensor {i}: {nbytes} bytes cannot hold {numel} BYTES items")
        elif nbytes != numel * itemsize(dtype):
            raise ProtocolError(f"tensor {i}: {nbytes} bytes do not match shape {shape} of {dtype.name}")
        start = align_up(pos)
        out.append(TensorHead(dtype, shape, nbytes, start))
        pos = start + nbytes
        if pos > head.data_bytes:
            raise ProtocolError(f"tensor {i} runs past the end of the frame body")
    if pos != head.data_bytes:
        raise ProtocolError(f"frame body has {head.data_bytes - pos} bytes past its last tensor")
    return tuple(out)


@dataclass
class Frame:
    """A received frame: its head, the raw and parsed tensor table, and DATA."""

    head: FrameHead
    table_raw: bytes
    table: tuple[TensorHead, ...]
    data: bytearray | memoryview

    def tensors_numpy(self) -> list[np.ndarray]:
        """Views over DATA (writable when DATA is a bytearray); BF16 as uint16 bits."""
        out = []
        for t in self.table:
            if t.dtype is DType.BYTES:
                out.append(_decode_bytes(self.data, t))
                continue
            dt = NUMPY_DTYPE[t.dtype]
            if t.numel == 0:
                out.append(np.empty(t.shape, dtype=dt))
            else:
                out.append(np.frombuffer(self.data, dtype=dt, count=t.numel, offset=t.offset)
                           .reshape(t.shape))
        return out

    def tensors_torch(self) -> list[Any]:
        """Views over DATA as torch tensors (BF16 as ``torch.bfloat16``; BYTES as an
        ``object`` array)."""
        import torch

        out: list[Any] = []
        for t in self.table:
            if t.dtype is DType.BYTES:
                out.append(_decode_bytes(self.data, t))
                continue
            dt = getattr(torch, _TORCH_NAMES[t.dtype])
            if t.numel == 0:
                out.append(torch.empty(t.shape, dtype=dt))
            else:
                out.append(torch.frombuffer(self.data, dtype=dt, count=t.numel, offset=t.offset)
                           .reshape(t.shape))
        return out

    def error(self) -> FlashpointError:
        """The typed error an ERROR frame carries."""
        if self.head.kind is not FrameKind.ERROR:
            raise ValueError("not an ERROR frame")
        try:
            wire = json.loads(bytes(self.data))
        except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting: RecursionError
            return ProtocolError("malformed ERROR frame body", trace_id=self.head.trace_id)
        if _json_depth(wire) > MAX_ERROR_DEPTH:
            return ProtocolError(f"ERROR frame body nested deeper than {MAX_ERROR_DEPTH} levels",
                                 trace_id=self.head.trace_id)
        return from_wire(wire)

    def relabel(self, request_id: int) -> list[bytes | memoryview]:
        return relabel(self.head, self.table_raw, self.data, request_id)


def _json_depth(obj: Any) -> int:
    """Nesting depth of parsed JSON (iterative: the input may be deep)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1)
                         for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def decode_frame(buf: bytes | bytearray | memoryview, *,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """A whole frame from one buffer (tests, tools); exactly one frame, nothing after it.
    DATA is copied into a fresh bytearray, so the tensors are writable."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEAD.size:
        raise ProtocolError(f"truncated frame: {len(mv)} bytes, a head alone is {HEAD.size}")
    head = parse_head(mv[:HEAD.size], max_frame_bytes=max_frame_bytes)
    if len(mv) != HEAD.size + head.body_bytes:
        raise ProtocolError(f"frame is {len(mv)} bytes, its head says {HEAD.size + head.body_bytes}")
    table_raw = bytes(mv[HEAD.size:HEAD.size + head.table_bytes])
    table = parse_table(head, table_raw) if head.kind is not FrameKind.ERROR else ()
    return Frame(head, table_raw, table, bytearray(mv[HEAD.size + head.table_bytes:]))
