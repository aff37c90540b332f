"""Activation frames: round trips for several dtypes and shapes, and malformed input."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpoint.errors import FrameTooLarge, PeerLost, ProtocolError
from flashpoint.pipeline.frames import (
    ALIGN_BYTES,
    ENTRY,
    HEAD,
    MAX_TENSORS,
    FrameKind,
    decode_frame,
    encode_error,
    encode_frame,
    set_request_id,
)

ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.arange(-3, 5, dtype=np.int64),
    np.array(2.5, dtype=np.float32),  # 0-d
    np.zeros((0, 3), dtype=np.float32),  # empty
    np.array([True, False, True]),
    np.arange(7, dtype=np.float16),
    np.arange(5, dtype=np.uint8),  # odd size: the next tensor is padded to alignment
    np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2].transpose(2, 0, 1),  # not contiguous
    np.full((1, 1, 1, 1, 1, 1, 1, 2), 7, dtype=np.int32),  # 8 dims
]


def wire(kind: FrameKind, rid: int, tid: int, tensors: list) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(kind, rid, tid, tensors))


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_numpy_round_trip_one(arr: np.ndarray):
    frame = decode_frame(wire(FrameKind.REQUEST, 7, 99, [arr]))
    assert (frame.head.kind, frame.head.request_id, frame.head.trace_id) == (FrameKind.REQUEST, 7, 99)
    (out,) = frame.tensors_numpy()
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable


def test_many_tensors_in_one_frame_are_aligned_views():
    buf = wire(FrameKind.RESULT, 1, 2, ARRAYS)
    frame = decode_frame(buf)
    assert len(frame.table) == len(ARRAYS)
    assert all(t.offset % ALIGN_BYTES == 0 for t in frame.table)
    for got, want in zip(frame.tensors_numpy(), ARRAYS, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(frame.tensors_torch(), ARRAYS, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("t", [
    torch.randn(3, 4),
    torch.randn(4, 3).t(),  # not contiguous
    torch.arange(10, dtype=torch.int64),
    torch.randn(2, 5).to(torch.bfloat16),
    torch.tensor(3.0, dtype=torch.bfloat16),  # 0-d
    torch.empty(0, 4, dtype=torch.bfloat16),
    torch.tensor([True, False]),
    torch.randn(2, 2, dtype=torch.float16),
], ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_torch_round_trip(t: torch.Tensor):
    frame = decode_frame(wire(FrameKind.REQUEST, 1, 1, [t]))
    (got,) = frame.tensors_torch()
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t)
    (bits,) = frame.tensors_numpy()
    if t.dtype == torch.bfloat16:  # numpy sees the raw 16-bit patterns
        assert bits.dtype == np.uint16
        np.testing.assert_array_equal(bits, t.contiguous().view(torch.uint16).numpy())
    else:
        np.testing.assert_array_equal(bits, t.numpy())


def test_inference_mode_outputs_encode():
    with torch.inference_mode():
        out = torch.nn.Linear(4, 3)(torch.randn(2, 4))
        buffers = encode_frame(FrameKind.RESULT, 0, 5, [out])
    (got,) = decode_frame(b"".join(bytes(b) for b in buffers)).tensors_torch()
    assert torch.equal(got, out)


def test_error_frame_carries_the_typed_error():
    err = PeerLost("stage s1 lost", stage="s0", cause="peer_lost")
    frame = decode_frame(b"".join(bytes(b) for b in encode_error(3, 4, err)))
    assert frame.head.kind is FrameKind.ERROR and frame.table == ()
    back = frame.error()
    assert isinstance(back, PeerLost) and back.message == "stage s1 lost"
    assert back.details == {"stage": "s0", "cause": "peer_lost"}


def test_request_id_is_relabelled_without_touching_the_body():
    buffers = encode_frame(FrameKind.REQUEST, 1, 42, [np.arange(3, dtype=np.int64)])
    frame = decode_frame(b"".join(bytes(b) for b in set_request_id(buffers, 9)))
    assert (frame.head.request_id, frame.head.trace_id) == (9, 42)
    again = decode_frame(b"".join(bytes(b) for b in frame.relabel(11)))
    assert again.head.request_id == 11
    np.testing.assert_array_equal(again.tensors_numpy()[0], [0, 1, 2])


def test_unsupported_inputs_are_refused():
    with pytest.raises(ProtocolError):
        encode_frame(FrameKind.REQUEST, 1, 1, [np.zeros(2, dtype=np.complex64)])
    with pytest.raises(ProtocolError):
        encode_frame(FrameKind.REQUEST, 1, 1, [np.zeros(1)] * (MAX_TENSORS + 1))
    with pytest.raises(ProtocolError):
        encode_frame(FrameKind.REQUEST, 1, 1, [np.zeros([1] * 9)])


# -- malformed frames ----------------------------------------------------------------------

GOOD = wire(FrameKind.REQUEST, 5, 6, [np.arange(6, dtype=np.float32).reshape(2, 3),
                                      np.arange(3, dtype=np.int64)])


def patch(buf: bytes, offset: int, fmt: str, *values: int | bytes) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


E0 = HEAD.size  # first table entry
BAD = {
    "magic": patch(GOOD, 0, "!4s", b"FPD1"),
    "version": patch(GOOD, 4, "!B", 2),
    "kind": patch(GOOD, 5, "!B", 9),
    "count_over_limit": patch(GOOD, 6, "!H", MAX_TENSORS + 1),
    "count_past_body": patch(GOOD, 6, "!H", 3),
    "body_bytes_short": patch(GOOD, 24, "!Q", len(GOOD) - HEAD.size - 1),
    "body_bytes_long": patch(GOOD, 24, "!Q", len(GOOD) - HEAD.size + 1),
    "dtype": patch(GOOD, E0, "!B", 200),
    "ndim": patch(GOOD, E0 + 1, "!B", 9),
    "reserved": patch(GOOD, E0 + 2, "!H", 1),
    "nbytes": patch(GOOD, E0 + 8, "!Q", 25),
    "shape_vs_nbytes": patch(GOOD, E0 + 16, "!Q", 3),
    "dim_past_ndim": patch(GOOD, E0 + 16 + 8 * 2, "!Q", 1),
    "trailing_byte": GOOD + b"\0",
    "error_with_tensors": patch(GOOD, 5, "!B", FrameKind.ERROR),
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_frames_are_protocol_errors(name: str):
    with pytest.raises(ProtocolError):
        decode_frame(BAD[name])


def test_frame_over_the_limit():
    with pytest.raises(FrameTooLarge):
        decode_frame(GOOD, max_frame_bytes=len(GOOD) - HEAD.size - 1)
    decode_frame(GOOD, max_frame_bytes=len(GOOD) - HEAD.size)


def test_error_body_that_is_not_json_is_a_protocol_error():
    body = b"\xff not json"
    buf = HEAD.pack(b"FPA1", 1, FrameKind.ERROR, 0, 1, 1, len(body)) + body
    assert isinstance(decode_frame(buf).error(), ProtocolError)


def test_every_truncation_is_a_protocol_error():
    for cut in range(len(GOOD)):
        with pytest.raises(ProtocolError):
            decode_frame(GOOD[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_frames_fail_cleanly(data: st.DataObject):
    """Flipped bytes, cuts and junk: ProtocolError/FrameTooLarge, or a frame whose tensors
    decode; never another exception."""
    buf = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    buf = buf[:data.draw(st.integers(0, len(buf)))] + data.draw(st.binary(max_size=ENTRY.size))
    try:
        frame = decode_frame(bytes(buf), max_frame_bytes=1 << 20)
    except (ProtocolError, FrameTooLarge):
        return
    if frame.head.kind is FrameKind.ERROR:
        frame.error()
    else:
        frame.tensors_numpy()
        frame.tensors_torch()


def test_client_never_imports_torch():
    code = ("import sys, flashpoint.pipeline, flashpoint.pipeline.client; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_bytes_tensors_travel_as_object_arrays():
    texts = np.array([b"hello", "caf\u00e9", b"", b"\x00\xff"], dtype=object).reshape(2, 2)
    nums = np.arange(3, dtype=np.int64)
    frame = decode_frame(wire(FrameKind.RESULT, 1, 2, [texts, nums, np.empty(0, dtype=object)]))
    got, n, empty = frame.tensors_numpy()
    assert got.dtype == object and got.shape == (2, 2)
    assert got.tolist() == [[b"hello", "caf\u00e9".encode()], [b"", b"\x00\xff"]]
    assert np.array_equal(n, nums) and empty.shape == (0,)
    t_got, t_n, _ = frame.tensors_torch()
    assert t_got.tolist() == got.tolist() and torch.equal(t_n, torch.arange(3))
    with pytest.raises(ProtocolError):
        encode_frame(FrameKind.REQUEST, 1, 1, [np.array([1.5], dtype=object)])


def test_malformed_bytes_tensors_are_protocol_errors():
    good = wire(FrameKind.REQUEST, 1, 1, [np.array([b"abc", b"de"], dtype=object)])
    nbytes_at = HEAD.size + 8
    (nbytes,) = struct.unpack_from("!Q", good, nbytes_at)
    assert nbytes == 4 + 3 + 4 + 2
    item_past_end = bytearray(good)
    data_at = HEAD.size + ENTRY.size
    struct.pack_into("!I", item_past_end, data_at, 50)
    too_many_items = patch(good, nbytes_at + 8, "!Q", 5)  # 5 lengths alone need 20 bytes
    one_item_fewer = patch(good, nbytes_at + 8, "!Q", 1)  # bytes left past the last item
    for bad in (bytes(item_past_end), too_many_items, one_item_fewer):
        with pytest.raises(ProtocolError):
            decode_frame(bad).tensors_numpy()
