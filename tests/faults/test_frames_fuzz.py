"""Fuzzing the binary decoders of the data path: pipeline activation frames and the
data-plane wire headers.

Checks:

* ``pipeline.frames.decode_frame`` on random bytes and on structured frames (random heads,
  tensor tables with any dtype code, ndim, reserved field, dimension and byte count, data
  short or long) raises only ProtocolError / FrameTooLarge; a frame it accepts yields tensors
  of exactly the declared shapes and dtypes (numpy, and torch when installed), and an ERROR
  frame's ``error()`` returns a typed error for any body, however deeply nested.
* ``transfer.wire.decode_header`` raises only ProtocolError for random bytes, msgpack values
  of the wrong type, nesting past its depth limit and headers claiming lengths they do not
  hold, without allocating for those claims; ``DataConn.recv_header`` and
  ``recv_frame_header`` over a real socket pair fail only with ProtocolError or PeerLost.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpoint.errors import FlashpointError, FrameTooLarge, PeerLost, ProtocolError
from flashpoint.pipeline import frames as pf
from flashpoint.transfer import wire

from .conftest import LoopThread

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPED = (ProtocolError, FrameTooLarge)
LIMIT = 1 << 20  # max_frame_bytes for the fuzz: small, so FrameTooLarge is reachable

# -- activation frames ------------------------------------------------------------------------

_u64 = st.integers(0, 2**64 - 1)
_dims = st.sampled_from([0, 1, 2, 3, 7, 2**20, 2**31, 2**40, pf.MAX_DIM, pf.MAX_DIM + 1, 2**63,
                         2**64 - 1]) | st.integers(0, 5)


def _mostly(draw: st.DrawFn, valid: Any, other: st.SearchStrategy[Any]) -> Any:
    """``valid`` about 15 times in 16 (hypothesis favours 0 and the bounds, not 7), so the
    decoder's later checks are reached often even though every field can be wrong."""
    return valid if draw(st.integers(0, 15)) != 7 else draw(other)


@st.composite
def table_entry(draw: st.DrawFn) -> tuple[bytes, int]:
    """One 80-byte tensor entry and the size its data claims (consistent more often than not)."""
    code = _mostly(draw, draw(st.sampled_from([int(c) for c in pf.DType])), st.integers(0, 255))
    ndim = _mostly(draw, draw(st.integers(0, pf.MAX_DIMS)), st.integers(0, 255))
    # Small tensors decode; empty ones may carry any other dims (numel stays 0); any mixes.
    mode = draw(st.sampled_from(["small", "empty", "any"]))
    dims = [draw(st.integers(0, 5) if mode == "small" else _dims)
            for _ in range(min(ndim, pf.MAX_DIMS))]
    if mode == "empty" and dims:
        dims[draw(st.integers(0, len(dims) - 1))] = 0
    dims += [draw(st.just(0) | _u64) if draw(st.integers(0, 9)) == 0 else 0
             for _ in range(pf.MAX_DIMS - len(dims))]
    numel = 1
    for d in dims[:ndim]:
        numel *= d
    if code == pf.DType.BYTES:
        item = 4 + draw(st.integers(0, 3))  # a length, and maybe a few bytes, per item
    else:
        item = pf.NUMPY_DTYPE[pf.DType(code)].itemsize if code in set(pf.DType) else 1
    nbytes = numel * item
    if nbytes >= 2**64:
        nbytes = draw(_u64)
    nbytes = _mostly(draw, nbytes, _u64)
    r16 = _mostly(draw, 0, st.integers(0, 2**16 - 1))
    r32 = _mostly(draw, 0, st.integers(0, 2**32 - 1))
    return pf.ENTRY.pack(code, ndim, r16, r32, nbytes, *dims), nbytes


@st.composite
def activation_frames(draw: st.DrawFn) -> bytes:
    kind = _mostly(draw, draw(st.sampled_from([int(k) for k in pf.FrameKind])),
                   st.integers(0, 255))
    entries = draw(st.lists(table_entry(), max_size=4))
    if kind == pf.FrameKind.ERROR:
        entries = _mostly(draw, [], st.just(entries))
    table = b"".join(e for e, _ in entries)
    pos = 0
    for _, nbytes in entries:
        pos = pf.align_up(pos) + nbytes
    # Data as the table describes it (capped: a claim of exabytes is not built), or random.
    data_len = pos if pos <= 4096 else draw(st.integers(0, 64))
    data = draw(st.binary(min_size=min(data_len, 4096), max_size=min(data_len, 4096))
                | st.binary(max_size=64))
    count = _mostly(draw, len(entries), st.integers(0, 2**16 - 1))
    body_bytes = _mostly(draw, len(table) + len(data), _u64 | st.integers(0, 400))
    head = pf.HEAD.pack(_mostly(draw, pf.MAGIC, st.binary(min_size=4, max_size=4)),
                        _mostly(draw, pf.VERSION, st.integers(0, 255)), kind, count,
                        draw(_u64), draw(_u64), body_bytes)
    tail = _mostly(draw, b"", st.binary(max_size=8))
    return head + table + data + tail


def _check_tensors(frame: pf.Frame) -> None:
    """An accepted frame's tensors have exactly the shapes and dtypes its table declares
    (BYTES items are checked when decoded: ProtocolError if they do not fill their bytes)."""
    if frame.head.kind is pf.FrameKind.ERROR:
        assert isinstance(frame.error(), FlashpointError)
        return
    try:
        arrays = frame.tensors_numpy()
    except ProtocolError:
        assert any(t.dtype is pf.DType.BYTES for t in frame.table)
        return
    assert len(arrays) == len(frame.table) == frame.head.count
    for arr, t in zip(arrays, frame.table, strict=True):
        assert arr.shape == t.shape
        if t.dtype is pf.DType.BYTES:
            assert arr.dtype == object
            assert sum(4 + len(b) for b in arr.reshape(-1)) == t.nbytes
            continue
        assert arr.dtype == pf.NUMPY_DTYPE[t.dtype]
        assert arr.nbytes == t.nbytes


@FUZZ
@given(raw=st.binary(max_size=400) | st.binary(max_size=64).map(lambda b: pf.MAGIC + b))
def test_random_bytes_are_typed_errors(raw: bytes) -> None:
    try:
        frame = pf.decode_frame(raw, max_frame_bytes=LIMIT)
    except TYPED:
        return
    _check_tensors(frame)


@FUZZ
@given(raw=activation_frames())
def test_structured_frames_are_typed_errors_or_exact(raw: bytes) -> None:
    try:
        frame = pf.decode_frame(raw, max_frame_bytes=LIMIT)
    except TYPED:
        return
    _check_tensors(frame)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=activation_frames())
def test_structured_frames_decode_to_torch(raw: bytes) -> None:
    import torch
    try:
        frame = pf.decode_frame(raw, max_frame_bytes=LIMIT)
    except TYPED:
        return
    if frame.head.kind is pf.FrameKind.ERROR:
        return
    try:
        tensors = frame.tensors_torch()
    except ProtocolError:
        assert any(t.dtype is pf.DType.BYTES for t in frame.table)
        return
    for t, ref in zip(tensors, frame.table, strict=True):
        if ref.dtype is pf.DType.BYTES:  # no torch dtype: an object array
            assert t.dtype == object and t.shape == ref.shape
            continue
        assert isinstance(t, torch.Tensor) and tuple(t.shape) == ref.shape


def test_empty_tensor_with_huge_dims_regression() -> None:
    """A zero-size tensor whose other dims multiply past 2**63 passed the table check (numel
    is 0) and then made numpy raise ValueError('array is too big') when decoded."""
    shape = (0, pf.MAX_DIM, pf.MAX_DIM)
    entry = pf.ENTRY.pack(pf.DType.FLOAT32, 3, 0, 0, 0, *shape, *([0] * 5))
    raw = pf.HEAD.pack(pf.MAGIC, pf.VERSION, pf.FrameKind.REQUEST, 1, 1, 1, len(entry)) + entry
    with pytest.raises(ProtocolError, match="too large"):
        pf.decode_frame(raw)
    # A zero-size tensor numpy can represent still decodes.
    ok = pf.ENTRY.pack(pf.DType.FLOAT32, 2, 0, 0, 0, 0, 4096, *([0] * 6))
    raw = pf.HEAD.pack(pf.MAGIC, pf.VERSION, pf.FrameKind.REQUEST, 1, 1, 1, len(ok)) + ok
    assert pf.decode_frame(raw).tensors_numpy()[0].shape == (0, 4096)


def _error_frame(body: bytes) -> bytes:
    return pf.HEAD.pack(pf.MAGIC, pf.VERSION, pf.FrameKind.ERROR, 0, 1, 2, len(body)) + body


_json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
_json = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=5), kids, max_size=3), max_leaves=12)
_details = st.dictionaries(st.sampled_from(["message", "remote_code", "code", "self", "x", ""])
                           | st.text(max_size=5), _json, max_size=3)
_wire_errors = st.fixed_dictionaries({}, optional={
    "code": st.sampled_from(["model_failed", "deadline_exceeded", "nope"]) | _json_leaf,
    "message": _json_leaf, "details": _details | _json})


@FUZZ
@given(body=st.one_of(
    _wire_errors.map(lambda e: json.dumps(e).encode()),
    _json.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 30000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 10000).map(lambda d: b'{"code": "x", "details": ' + b'{"a":' * d + b"1"
                              + b"}" * d + b"}"),
    st.binary(max_size=64)))
def test_error_frames_always_give_a_typed_error(body: bytes) -> None:
    if len(body) > pf.MAX_ERROR_BYTES:
        body = body[:pf.MAX_ERROR_BYTES]
    err = pf.decode_frame(_error_frame(body)).error()
    assert isinstance(err, FlashpointError)
    err.to_wire()  # and it can travel on (a stage relays it)


def test_deeply_nested_error_body_regression() -> None:
    """json.loads raised RecursionError (not a ValueError) out of Frame.error() for a body
    of a few thousand '[' - well under MAX_ERROR_BYTES; and details a few hundred levels
    deep decoded, then blew the stack in ``to_wire`` (it recurses) wherever they travelled."""
    err = pf.decode_frame(_error_frame(b"[" * 5000 + b"]" * 5000)).error()
    assert isinstance(err, ProtocolError)
    deep = b'{"code": "model_failed", "details": ' + b"[" * 300 + b"]" * 300 + b"}"
    err = pf.decode_frame(_error_frame(deep)).error()
    assert isinstance(err, ProtocolError) and "nested" in err.message
    fine = b'{"code": "model_failed", "message": "m", "details": {"a": [[1]]}}'
    err = pf.decode_frame(_error_frame(fine)).error()
    assert err.code == "model_failed" and err.details == {"a": [[1]]}


# -- data-plane wire headers ------------------------------------------------------------------

_mp_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                     st.text(max_size=6), st.binary(max_size=6))
_mp = st.recursive(_mp_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=4), kids, max_size=3), max_leaves=12)
_CLAIMS = [(b"\xdc", 2), (b"\xdd", 4), (b"\xde", 2), (b"\xdf", 4)]


@st.composite
def lying_headers(draw: st.DrawFn) -> bytes:
    """A map header then nested headers claiming entries the body lacks: within the body's
    length (msgpack's own default bound) at every level but the last, which may claim any."""
    levels = draw(st.integers(1, 300))
    parts = [b"\x81\xa2op"]
    for i in range(levels):
        tag, width = draw(st.sampled_from(_CLAIMS))
        n = draw(st.integers(1, 2 * levels)) if i + 1 < levels else draw(
            st.integers(0, 2 ** (8 * width) - 1))
        parts.append(tag + n.to_bytes(width, "big"))
    return b"".join(parts) + draw(st.binary(max_size=8))


def _nested_header(depth: int) -> bytes:
    return b"\x81\xa2op" + b"\x91" * depth + b"\xc0"


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError):
        return b"\xc1"  # never-used byte: malformed


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=200), _mp.map(_pack),
                      st.dictionaries(st.text(max_size=4), _mp, max_size=4).map(_pack),
                      st.integers(0, 1200).map(_nested_header), lying_headers()))
def test_decode_header_is_typed_and_bounded(body: bytes) -> None:
    tracemalloc.start()
    try:
        try:
            header = wire.decode_header(body)
        except ProtocolError:
            header = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * 1024 + 128 * len(body), (peak, len(body))
    if header is not None:
        assert isinstance(header, dict)


def test_header_depth_limit_is_exact() -> None:
    """The header map is level 1, so MAX_HEADER_DEPTH - 1 arrays under it decode; one more
    is refused (msgpack alone would accept about 1000 levels)."""
    assert isinstance(wire.decode_header(_nested_header(wire.MAX_HEADER_DEPTH - 1))["op"], list)
    with pytest.raises(ProtocolError, match="nested"):
        wire.decode_header(_nested_header(wire.MAX_HEADER_DEPTH))


async def _recv_over_socketpair(raw: bytes, frame_header: bool) -> Any:
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = wire.DataConn(a, "fuzz-peer")
    try:
        b.sendall(raw)
        b.shutdown(socket.SHUT_WR)  # EOF after the bytes: a short read must fail, not wait
        if frame_header:
            return await conn.recv_frame_header(timeout_s=5.0)
        return await conn.recv_header(timeout_s=5.0)
    finally:
        conn.close()
        b.close()


@FUZZ
@given(body=st.binary(max_size=64) | _mp.map(_pack) | lying_headers(),
       length=st.none() | st.integers(0, 2**32 - 1) | st.sampled_from(
           [0, wire.MAX_HEADER_BYTES, wire.MAX_HEADER_BYTES + 1, 2**32 - 1]),
       cut=st.integers(0, 8))
def test_recv_header_over_a_socket(loop_thread: LoopThread, body: bytes, length: int | None,
                                   cut: int) -> None:
    """A length prefix (true, or any u32) and a body, possibly cut short."""
    raw = struct.pack("!I", len(body) if length is None else length) + body
    raw = raw[:len(raw) - cut] if cut < len(raw) else raw
    try:
        header = loop_thread.run(_recv_over_socketpair(raw, frame_header=False))
    except (ProtocolError, PeerLost):
        return
    assert isinstance(header, dict)


@settings(max_examples=50, deadline=None)
@given(raw=st.binary(max_size=40))
def test_recv_frame_header_over_a_socket(loop_thread: LoopThread, raw: bytes) -> None:
    try:
        index, offset, length, flags = loop_thread.run(_recv_over_socketpair(raw, True))
    except PeerLost:
        assert len(raw) < wire.FRAME.size
        return
    assert (index, offset, length, flags) == wire.FRAME.unpack(raw[:wire.FRAME.size])
