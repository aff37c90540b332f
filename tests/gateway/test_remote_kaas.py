"""KaaS through a stand-alone gateway, both halves without a network: the controller's
``gw_kaas_*`` / ``gw_object_*`` handlers over an in-process KaaS service, and what the
gateway's ``RemoteKaas`` sends and retries (tests/cluster/test_kaas.py runs them over RPC);
and the gateway backend's count of calls held while no controller answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kaas.helpers import chain_request

from flashpoint.controller.gateway_service import GatewayService
from flashpoint.errors import (
    BadRequest,
    ConnectFailed,
    KaasUnavailable,
    ObjectNotFound,
    PayloadTooLarge,
    PeerLost,
    ProtocolError,
    UnknownKernel,
)
from flashpoint.gateway.remote_kaas import RemoteKaas
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.remote import FRAME_BUDGET_BYTES
from flashpoint.kaas.service import local_service
from flashpoint.kaas.spec import KaasRequest
from flashpoint.messages.base import to_payload
from flashpoint.messages.gateway_controller import GATEWAY_RPC_VERSION, KaasInvokeReply

W = np.arange(16, dtype=np.float32).reshape(4, 4) / 8
V = GATEWAY_RPC_VERSION


@pytest.fixture
def handlers():
    svc = local_service(1, capacity_bytes=64 << 10)
    return GatewayService(backend=None, kaas=svc).handlers()  # type: ignore[arg-type]


async def test_the_controller_runs_a_forwarded_request_against_its_store(handlers) -> None:
    assert await handlers["gw_object_put"](None, {"v": V, "key": "w", "data": W.tobytes()}) \
        == {"v": V}
    got = await handlers["gw_object_get"](None, {"v": V, "key": "w"})
    assert got["data"] == W.tobytes()
    req = KaasRequest.from_dict(chain_request(4, out_key="out")).to_dict()
    reply = await handlers["gw_kaas_invoke"](None, {"v": V, "request": req, "client": "c",
                                                    "request_id": "r1", "timeout_s": 30})
    result = KaasResult.from_wire(reply["result"])
    x = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    t = x @ W
    y = np.frombuffer((await handlers["gw_object_get"](None, {"v": V, "key": "out"}))["data"],
                      np.float32).reshape(4, 4)
    assert result.stored == {"y": "out"} and np.allclose(y, np.maximum(t, 0) + t, atol=1e-6)
    status = (await handlers["gw_kaas_status"](None, {"v": V}))["status"]
    assert len(status["executors"]) == 1 and "torch.matmul" in status["kernels"]


@pytest.mark.parametrize("method,payload,error", [
    ("gw_kaas_invoke", {"v": V, "request": "x", "client": "c", "request_id": "r"}, ProtocolError),
    ("gw_kaas_invoke", {"v": V, "request": {}, "client": "c", "request_id": "r"}, BadRequest),
    ("gw_kaas_invoke", {"v": V, "request": chain_request(4, w_key="nope"), "client": "c",
                        "request_id": "r"}, ObjectNotFound),  # the store check is here
    ("gw_kaas_invoke", {"v": V, "request": chain_request(4), "client": "c",
                        "request_id": "r", "timeout_s": -1}, ProtocolError),
    ("gw_kaas_invoke", {"v": V, "request": chain_request(4), "client": "",
                        "request_id": "r"}, ProtocolError),
    ("gw_kaas_status", {"v": V + 1}, BadRequest),
    ("gw_object_put", {"v": V, "key": "a b", "data": b"x"}, BadRequest),
    ("gw_object_put", {"v": V, "key": "k", "data": b""}, BadRequest),
    ("gw_object_put", {"v": V, "key": "k", "data": "text"}, BadRequest),
    ("gw_object_put", {"v": V, "key": "k", "data": b"x" * ((64 << 10) + 1)}, PayloadTooLarge),
    ("gw_object_get", {"v": V, "key": "absent"}, ObjectNotFound),
    ("gw_object_get", {"v": V}, ProtocolError),
])
async def test_bad_forwarded_calls_fail_typed(handlers, method, payload, error) -> None:
    await handlers["gw_object_put"](None, {"v": V, "key": "w", "data": W.tobytes()})
    with pytest.raises(error):
        await handlers[method](None, payload)


async def test_an_object_over_one_frame_is_refused_by_name() -> None:
    svc = local_service(1, capacity_bytes=64 << 20)
    svc.store.put("big", b"\0" * (FRAME_BUDGET_BYTES + 1))  # through the controller's API
    h = GatewayService(backend=None, kaas=svc).handlers()  # type: ignore[arg-type]
    with pytest.raises(PayloadTooLarge, match="'big'.*controller's API"):
        await h["gw_object_get"](None, {"v": V, "key": "big"})


async def test_a_controller_without_kaas_answers_unavailable() -> None:
    h = GatewayService(backend=None).handlers()  # type: ignore[arg-type]
    with pytest.raises(KaasUnavailable):
        await h["gw_object_get"](None, {"v": V, "key": "k"})


class _Recorder:
    """Stands in for RemoteBackend: records each call and answers it."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.calls: list[tuple[str, dict[str, Any], Any]] = []

    def cluster_status(self) -> dict[str, Any]:
        return self.status

    async def call_retrying(self, method: str, msg: Any, reply: Any, timeout_s: float,
                            retry_on: Any, trace: str | None = None) -> Any:
        self.calls.append((method, to_payload(msg), retry_on))
        if method == "gw_kaas_invoke":
            return KaasInvokeReply(result=KaasResult(executor_id="e").to_wire())
        return reply(**({"data": b"d"} if "data" in reply.__struct_fields__ else {}),
                     **({"status": {}} if "status" in reply.__struct_fields__ else {}))


async def test_a_graph_that_stores_an_output_is_resent_only_if_it_never_left() -> None:
    rec = _Recorder({})
    kaas = RemoteKaas(rec)  # type: ignore[arg-type]
    for out_key in (None, "k"):
        plan = kaas.plan(KaasRequest.from_dict(chain_request(4, out_key=out_key)))
        assert (await kaas.invoke(plan, client="c", request_id="r")).executor_id == "e"
    (_, inline, retry_inline), (_, stored, retry_stored) = rec.calls
    assert KaasRequest.from_dict(stored["request"]) == KaasRequest.from_dict(
        chain_request(4, out_key="k"))
    assert retry_inline(PeerLost("x")) and retry_inline(ConnectFailed("x"))
    assert retry_stored(ConnectFailed("x")) and not retry_stored(PeerLost("x"))


async def test_the_gateway_checks_the_graph_and_the_frame_bound() -> None:
    kaas = RemoteKaas(_Recorder({"kaas": {"max_buffer_bytes": 1 << 40}}))  # type: ignore[arg-type]
    assert kaas.max_buffer_bytes == FRAME_BUDGET_BYTES  # one frame, whatever the controller
    with pytest.raises(UnknownKernel):
        bad = chain_request(4)
        bad["kernels"][0]["kernel"] = "fft"
        kaas.plan(KaasRequest.from_dict(bad))
    with pytest.raises(PayloadTooLarge):
        await kaas.put_object("k", b"\0" * (FRAME_BUDGET_BYTES + 1))
    small = RemoteKaas(_Recorder({"kaas": {"max_buffer_bytes": 1024}}))  # type: ignore[arg-type]
    assert small.max_buffer_bytes == 1024
    assert await small.get_object("k") == b"d"


async def test_a_call_with_no_controller_is_held_then_times_out() -> None:
    import socket

    from flashpoint.errors import DeadlineExceeded
    from flashpoint.gateway.remote import RemoteBackend
    from flashpoint.messages.gateway_controller import FunctionsReply, FunctionsRequest

    with socket.socket() as sock:  # a port nothing listens on once this block ends
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = RemoteBackend(f"ws://127.0.0.1:{port}/rpc", secret=b"s" * 32)
    await backend.start()
    try:
        with pytest.raises(DeadlineExceeded):
            await backend.call_retrying("gw_functions", FunctionsRequest(), FunctionsReply, 0.3,
                                        lambda e: True)
        status = backend.cluster_status()["gateway"]
        assert status["held"] == 1 and status["controller_connected"] is False
    finally:
        await backend.stop()
