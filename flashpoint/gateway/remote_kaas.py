"""KaaS through a stand-alone gateway: a ``KaasBackend`` over RPC to the controller.

The controller keeps the object store and the executor pool (``controller/kaas_pool.py``); this
gateway forwards ``/v1/kaas/*``, ``/v1/objects/*`` and the native invoke's ``store_outputs``
with the calls of ``controller/gateway_service.py``, so a client sees the same API, errors and
codes through either front.

What is decided where: the gateway checks the graph (kernels, buffers, shapes: the typed
400s) before the request takes an admission slot; the controller parses and plans it again
with the store at hand (404 for a missing object, 413 for an executor's cache) and runs it.

Retries after a lost controller, as for function invocations (``gateway/remote.py``):
object reads, writes and status are re-sent (a write of the same bytes under the same key
is accepted again). A kernel graph is re-sent only when the controller cannot have started
it (the connection was never made), or when it stores no output: a re-run that stored an
output twice could meet its own first result and fail 409 if the kernels are not
bit-reproducible.

A limit this path adds: an object or a request moves in one RPC frame, so objects written
through here are at most ``FRAME_BUDGET_BYTES`` (15 MiB), as requests already are.
"""

from __future__ import annotations

from typing import Any

from flashpoint.errors import PayloadTooLarge
from flashpoint.gateway.remote import (
    CALL_TIMEOUT_S,
    RemoteBackend,
    connection_lost,
    never_reached,
)
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.graph import GraphPlan, plan_graph
from flashpoint.kaas.library import KernelLibrary, default_library
from flashpoint.kaas.remote import FRAME_BUDGET_BYTES
from flashpoint.kaas.spec import BufferKind, KaasRequest
from flashpoint.messages.gateway_controller import (
    Ack,
    KaasInvokeReply,
    KaasInvokeRequest,
    KaasStatusReply,
    KaasStatusRequest,
    ObjectGetReply,
    ObjectKeyRequest,
    ObjectPutRequest,
)

OBJECT_TIMEOUT_S = 30.0  # one object of up to 15 MiB over the cluster's network
DEFAULT_INVOKE_TIMEOUT_S = 60.0


class RemoteKaas:
    """The controller's KaaS, reached over ``backend``'s connection."""

    def __init__(self, backend: RemoteBackend, library: KernelLibrary | None = None) -> None:
        self._backend = backend
        self._library = library or default_library()

    @property
    def max_buffer_bytes(self) -> int:
        """The controller's bound (from its last status) within what one frame can move."""
        kaas = self._backend.cluster_status().get("kaas") or {}
        controller = kaas.get("max_buffer_bytes")
        if isinstance(controller, int) and controller > 0:
            return min(controller, FRAME_BUDGET_BYTES)
        return FRAME_BUDGET_BYTES

    def plan(self, req: KaasRequest) -> GraphPlan:
        """The graph's checks only; the controller adds the store's and the cache's."""
        return plan_graph(req, self._library)

    async def invoke(self, plan: GraphPlan, *, client: str, request_id: str,
                     timeout_s: float | None = None) -> KaasResult:
        timeout = timeout_s if timeout_s is not None else DEFAULT_INVOKE_TIMEOUT_S
        stores = any(b.kind is BufferKind.OUTPUT and b.key is not None
                     for b in plan.request.buffers)
        msg = KaasInvokeRequest(request=plan.request.to_dict(), client=client,
                                request_id=request_id, timeout_s=timeout)
        reply = await self._backend.call_retrying(
            "gw_kaas_invoke", msg, KaasInvokeReply, timeout,
            never_reached if stores else connection_lost, trace=request_id)
        return KaasResult.from_wire(reply.result)

    async def fetch_status(self) -> dict[str, Any]:
        reply = await self._backend.call_retrying(
            "gw_kaas_status", KaasStatusRequest(), KaasStatusReply, CALL_TIMEOUT_S,
            connection_lost)
        return dict(reply.status)

    async def put_object(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        if len(data) > self.max_buffer_bytes:
            raise PayloadTooLarge(f"objects are at most {self.max_buffer_bytes} bytes through "
                                  "this gateway (one RPC frame to the controller)")
        await self._backend.call_retrying(
            "gw_object_put", ObjectPutRequest(key=key, data=bytes(data), ttl_s=ttl_s), Ack,
            OBJECT_TIMEOUT_S, connection_lost)

    async def delete_object(self, key: str) -> None:
        # A re-sent delete whose first try landed answers 404: harmless for the caller.
        await self._backend.call_retrying(
            "gw_object_delete", ObjectKeyRequest(key=key), Ack, OBJECT_TIMEOUT_S,
            connection_lost)

    async def get_object(self, key: str) -> bytes:
        reply = await self._backend.call_retrying(
            "gw_object_get", ObjectKeyRequest(key=key), ObjectGetReply, OBJECT_TIMEOUT_S,
            connection_lost)
        return bytes(reply.data)
