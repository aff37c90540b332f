"""Gateway <-> controller messages: versions refused by name on both sides, and a forwarded
invocation's tensors checked from their headers and passed on encoded (the same bytes object
the frame carried reaches the worker's frame), with the same verdicts as decoding them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flashpoint.controller.gateway_service import GatewayService
from flashpoint.errors import BadRequest, ProtocolError, Unavailable
from flashpoint.gateway.backend import InvokeResult
from flashpoint.messages.base import to_payload
from flashpoint.messages.gateway_controller import (
    GATEWAY_RPC_VERSION,
    FunctionsReply,
    InvokeReply,
    InvokeRequest,
    decode,
)
from flashpoint.rpc import frames
from flashpoint.tensors import (
    EncodedTensor,
    check_encoded,
    decode_tensor,
    encode_tensor,
    encode_tensors,
    f32_to_bf16,
)


class _Recorder:
    """The controller's InvokeBackend, reduced to recording what it was handed."""

    def __init__(self) -> None:
        self.inputs: dict[str, Any] = {}
        self.request_class = ""

    async def invoke(self, name: str, inputs: Any, *, request_id: str,
                     timeout_s: float | None = None, request_class: str = "strict"
                     ) -> InvokeResult:
        self.inputs, self.request_class = inputs, request_class
        return InvokeResult({"y": np.arange(3, dtype=np.int64)}, {"total": 0.5}, "r-1", True,
                            "host-ram")


def _through_frames(payload: dict[str, Any]) -> dict[str, Any]:
    wire = frames.encode(frames.Request(id=1, method="gw_invoke", payload=payload, timeout_s=5))
    return frames.decode(wire).payload  # type: ignore[no-any-return]


async def test_forwarded_tensors_stay_encoded_from_frame_to_frame() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    sent = to_payload(InvokeRequest(name="f", inputs=encode_tensors({"x": x}), request_id="q",
                                    timeout_s=5.0, request_class="best_effort"))
    payload = _through_frames(sent)
    backend = _Recorder()
    reply = await GatewayService(backend).handlers()["gw_invoke"](None, payload)  # type: ignore[arg-type]
    got = backend.inputs["x"]
    assert isinstance(got, EncodedTensor) and backend.request_class == "best_effort"
    assert got.shape == (3, 4) and got.ndim == 2 and got.dtype == np.dtype(np.float32)
    # The worker's frame gets the very bytes object the gateway's frame brought: no copy.
    assert encode_tensor(got)["data"] is payload["inputs"]["x"]["data"]
    np.testing.assert_array_equal(decode_tensor(encode_tensors(backend.inputs)["x"]), x)
    back = decode(InvokeReply, _through_frames(reply), method="gw_invoke", reply=True)
    np.testing.assert_array_equal(decode_tensor(back.outputs["y"]), np.arange(3))
    assert (back.replica_id, back.cold, back.cold_start_source) == ("r-1", True, "host-ram")


def _samples() -> list[np.ndarray]:
    return [np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros((1, 0), np.float16),
            np.array([[True, False]]), np.array([b"ab", b"c"], dtype=object).reshape(1, 2)]


@pytest.mark.parametrize("arr", _samples(), ids=lambda a: str(a.dtype))
def test_a_checked_tensor_answers_as_the_decoded_array_would(arr: np.ndarray) -> None:
    wire = encode_tensor(arr)
    checked, decoded = check_encoded(wire), decode_tensor(wire)
    assert checked.shape == decoded.shape and checked.dtype == decoded.dtype
    np.testing.assert_array_equal(decode_tensor(encode_tensor(checked)), arr)


def test_bf16_is_checked_as_the_float32_it_decodes_to() -> None:
    values = np.array([[1.5, -2.0, 3.25]], dtype=np.float32)
    wire = {"dtype": "bfloat16", "shape": [1, 3], "data": f32_to_bf16(values).tobytes()}
    checked = check_encoded(wire)
    assert checked.dtype == np.dtype(np.float32) and checked.shape == (1, 3)
    np.testing.assert_array_equal(decode_tensor(encode_tensor(checked)), values)


@pytest.mark.parametrize("wire", [
    "x", {"dtype": "float32", "shape": [2], "data": b"\0" * 4},
    {"dtype": "float32", "shape": [True], "data": b""},
    {"dtype": "complex64", "shape": [1], "data": b"\0" * 8},
    {"dtype": "float32", "shape": [1] * 9, "data": b"\0" * 4},
    {"dtype": "object", "shape": [2], "items": [b"a"]},
    {"dtype": "bfloat16", "shape": [2], "data": b"\0" * 2}, {"dtype": 3, "shape": [1], "data": b""},
    {"dtype": "float32", "shape": [1 << 32, 0], "data": b""},
])
def test_a_bad_header_is_refused_as_decoding_refuses_it(wire: Any) -> None:
    with pytest.raises(BadRequest):
        decode_tensor(wire)
    with pytest.raises(BadRequest):
        check_encoded(wire)


async def test_each_side_refuses_the_other_version_by_name() -> None:
    handlers = GatewayService(_Recorder()).handlers()  # type: ignore[arg-type]
    request = to_payload(InvokeRequest(name="f", inputs={}, request_id="q"))
    for v in (GATEWAY_RPC_VERSION + 1, None):
        with pytest.raises(BadRequest, match="gateway protocol version"):
            await handlers["gw_invoke"](None, {**request, "v": v})
    newer = {"v": GATEWAY_RPC_VERSION + 1, "functions": [], "ready": True, "fresh": 1}
    with pytest.raises(Unavailable, match="controller speaks gateway protocol 2"):
        decode(FunctionsReply, newer, method="gw_functions", reply=True)
    # The right version with a field this side does not know: a ProtocolError naming it.
    with pytest.raises(ProtocolError, match="fresh"):
        decode(FunctionsReply, {**newer, "v": GATEWAY_RPC_VERSION}, method="gw_functions",
               reply=True)
    with pytest.raises(ProtocolError, match="request_class"):
        await handlers["gw_invoke"](None, {**request, "request_class": "vip"})
