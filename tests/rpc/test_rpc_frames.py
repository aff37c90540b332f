"""Frame codec: round trips, limits, and a fuzz of the decoder."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import FrameTooLarge, ProtocolError
from flashpoint.rpc import frames

ALL_FRAMES = [
    frames.Request(1, "ping", {"a": 1, "b": b"\x00" * 3, "c": [1.5, None, "x"]}, 2.5, "req-1"),
    frames.Request(2**62, "m", {}, 1, None),
    frames.Response(7, {"ok": True}),
    frames.Error(0, {"code": "auth_failed", "message": "no", "details": {}}),
    frames.Notify("tick", {"n": 1}, None),
    frames.Cancel(3),
    frames.Hello(1, b"n" * 32),
    frames.Proof("host-1", b"c" * 32, b"m" * 32),
    frames.Welcome("controller", b"m" * 32),
]


@pytest.mark.parametrize("frame", ALL_FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: frames.Frame) -> None:
    assert frames.decode(frames.encode(frame)) == frame


def test_encode_refuses_oversized_frame() -> None:
    with pytest.raises(FrameTooLarge) as info:
        frames.encode(frames.Request(1, "m", {"blob": b"x" * 2000}, 1.0), max_frame_bytes=1000)
    assert info.value.details["max_frame_bytes"] == 1000


def test_decode_refuses_oversized_frame() -> None:
    data = frames.encode(frames.Response(1, {"blob": b"x" * 2000}))
    with pytest.raises(FrameTooLarge):
        frames.decode(data, max_frame_bytes=1000)


def test_encode_unencodable_payload_is_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        frames.encode(frames.Response(1, {"x": object()}))


@pytest.mark.parametrize(
    "obj",
    [
        {"not": "a list"},
        [],
        [99, 1],
        [frames.REQUEST, 0, "m", {}, 1.0, None],  # id 0
        [frames.REQUEST, True, "m", {}, 1.0, None],  # bool id
        [frames.REQUEST, 1, "", {}, 1.0, None],  # empty method
        [frames.REQUEST, 1, "m", [], 1.0, None],  # payload not a map
        [frames.REQUEST, 1, "m", {}, -1.0, None],  # negative timeout
        [frames.REQUEST, 1, "m", {}, float("nan"), None],
        [frames.REQUEST, 1, "m", {}, float("inf"), None],
        [frames.RESPONSE, 1],
        [frames.ERROR, 1, "boom"],
        [frames.HELLO, 1, b"short"],
        [frames.PROOF, "x", b"c" * 32, b"short"],
    ],
)
def test_decode_rejects_malformed(obj: object) -> None:
    with pytest.raises(ProtocolError):
        frames.decode(msgpack.packb(obj, use_bin_type=True))


def test_decode_rejects_deep_nesting() -> None:
    payload: object = {}
    for _ in range(frames.MAX_DEPTH + 5):
        payload = {"x": payload}
    data = msgpack.packb([frames.RESPONSE, 1, payload], use_bin_type=True)
    with pytest.raises(ProtocolError):
        frames.decode(data)
    very_deep = b"\x91" * 5000 + b"\xc0"  # beyond msgpack's own stack
    with pytest.raises(ProtocolError):
        frames.decode(very_deep)


def test_depth_limit_is_exact() -> None:
    def frame(dicts: int) -> bytes:  # the frame array is level 1, its payload map level 2
        payload: object = {"leaf": [1, 2]}  # a list of scalars adds a level too
        for _ in range(dicts - 1):
            payload = {"x": payload, "y": "z"}
        return msgpack.packb([frames.RESPONSE, 1, payload], use_bin_type=True)

    ok = frames.decode(frame(frames.MAX_DEPTH - 2))  # the leaf list sits at MAX_DEPTH
    assert isinstance(ok, frames.Response)
    with pytest.raises(ProtocolError, match="nested deeper"):
        frames.decode(frame(frames.MAX_DEPTH - 1))


def test_decode_rejects_ext_types_and_lying_lengths() -> None:
    with pytest.raises(ProtocolError):
        frames.decode(msgpack.packb(msgpack.ExtType(5, b"abc")))
    # a bin header that claims 4 GiB
    with pytest.raises(ProtocolError):
        frames.decode(b"\xc6\xff\xff\xff\xff" + b"x" * 10)
    with pytest.raises(ProtocolError):
        frames.decode(b"\xdd\xff\xff\xff\xff")  # array32 claiming 4G items


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        frames.decode(data, max_frame_bytes=256)
    except (ProtocolError, FrameTooLarge):
        pass


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _leaves,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=5), kids, max_size=5),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_values, min_size=1, max_size=7), st.integers(min_value=0, max_value=8))
def test_fuzz_structured(fields: list[object], kind: int) -> None:
    data = msgpack.packb([kind, *fields], use_bin_type=True)
    try:
        frame = frames.decode(data)
    except (ProtocolError, FrameTooLarge):
        return
    assert frames.decode(frames.encode(frame)) == frame


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL_FRAMES), st.data())
def test_fuzz_mutated_valid_frames(frame: frames.Frame, data: st.DataObject) -> None:
    raw = bytearray(frames.encode(frame))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        raw[pos] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(raw)))
    try:
        frames.decode(bytes(raw[:cut]))
    except (ProtocolError, FrameTooLarge):
        pass
