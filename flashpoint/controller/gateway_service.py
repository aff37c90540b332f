"""The controller's RPC face for stand-alone gateways (``flashpoint gateway``).

A gateway process holds no cluster state: it forwards every API call here over the cluster's
authenticated RPC and keeps only a cached copy of the function table, so it can keep
accepting requests while the controller restarts (and retry them once it is back).
One message type per request and reply, versioned (``messages/gateway_controller.py``):

- ``gw_invoke``   InvokeRequest -> InvokeReply. The inputs stay encoded: their headers are
                  checked here (``tensors.check_encoded_tensors``) and their bytes go on to
                  the worker's frame as they came.
- ``gw_stream``   gw_invoke's request for a text-generation function: ``gw_chunk``
                  notifications (StreamChunkNote) back on the same connection as the tokens
                  come (gateway/streams.py), then gw_invoke's reply; cancelling the call
                  cancels the sequence
- ``gw_functions`` FunctionsRequest -> FunctionsReply
- ``gw_register`` RegisterRequest -> RegisterReply
- ``gw_delete``   DeleteRequest -> Ack
- ``gw_kaas_invoke`` KaasInvokeRequest -> KaasInvokeReply
- ``gw_kaas_status`` KaasStatusRequest -> KaasStatusReply
- ``gw_object_put`` ObjectPutRequest -> Ack
- ``gw_object_get`` ObjectKeyRequest -> ObjectGetReply
- ``gw_object_delete`` ObjectKeyRequest -> Ack

The KaaS calls exist when the controller has a KaaS backend (it always does: its object
store works even with ``kaas_workers = 0``, when invocations answer 503). The request is
parsed and planned again here, store lookups included: a gateway only checks the graph.

Errors travel as the controller's typed errors (the RPC layer re-raises them intact).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from flashpoint import tracing
from flashpoint.errors import BadRequest, KaasUnavailable, PayloadTooLarge
from flashpoint.gateway.backend import FunctionInfo, InvokeResult, StreamChunk
from flashpoint.gateway.remote import info_to_wire, result_to_wire
from flashpoint.kaas.backend import KaasBackend
from flashpoint.kaas.remote import FRAME_BUDGET_BYTES
from flashpoint.kaas.spec import KaasRequest, check_key, check_object, check_ttl
from flashpoint.messages.base import Message
from flashpoint.messages.gateway_controller import (
    Ack,
    DeleteRequest,
    FunctionsReply,
    FunctionsRequest,
    GatewayMessage,
    InvokeReply,
    InvokeRequest,
    KaasInvokeReply,
    KaasInvokeRequest,
    KaasStatusReply,
    KaasStatusRequest,
    ObjectGetReply,
    ObjectKeyRequest,
    ObjectPutRequest,
    RegisterReply,
    RegisterRequest,
    StreamChunkNote,
    decode,
    encode,
)
from flashpoint.policy.request_class import RequestClass
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import check_encoded_tensors

M = TypeVar("M", bound=GatewayMessage)


class _Backend(Protocol):
    async def invoke(self, name: str, inputs: Any, *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = RequestClass.STRICT) -> InvokeResult: ...
    async def register_function(self, spec: FunctionSpec) -> FunctionInfo: ...
    async def delete_function(self, name: str) -> None: ...
    def list_functions(self) -> list[FunctionInfo]: ...
    def cluster_status(self) -> dict[str, Any]: ...
    def is_ready(self) -> bool: ...


class GatewayService:
    """RPC handlers that serve gateways from the controller (its ``InvokeBackend``)."""

    def __init__(self, backend: _Backend, kaas: KaasBackend | None = None) -> None:
        self._backend = backend
        self._kaas = kaas

    def handlers(self) -> dict[str, Any]:
        return {"gw_invoke": _typed(InvokeRequest, self._invoke, "gw_invoke"),
                "gw_stream": _typed(InvokeRequest, self._stream, "gw_stream"),
                "gw_functions": _typed(FunctionsRequest, self._functions, "gw_functions"),
                "gw_register": _typed(RegisterRequest, self._register, "gw_register"),
                "gw_delete": _typed(DeleteRequest, self._delete, "gw_delete"),
                "gw_kaas_invoke": _typed(KaasInvokeRequest, self._kaas_invoke, "gw_kaas_invoke"),
                "gw_kaas_status": _typed(KaasStatusRequest, self._kaas_status, "gw_kaas_status"),
                "gw_object_put": _typed(ObjectPutRequest, self._object_put, "gw_object_put"),
                "gw_object_get": _typed(ObjectKeyRequest, self._object_get, "gw_object_get"),
                "gw_object_delete": _typed(ObjectKeyRequest, self._object_delete,
                                           "gw_object_delete")}

    async def _invoke(self, conn: Any, msg: InvokeRequest) -> InvokeReply:
        with tracing.remote_parent(msg.traceparent):  # a stand-alone gateway's trace
            result = await self._backend.invoke(
                msg.name, check_encoded_tensors(msg.inputs), request_id=msg.request_id,
                timeout_s=msg.timeout_s, request_class=msg.request_class)
        return result_to_wire(result)

    async def _stream(self, conn: Any, msg: InvokeRequest) -> InvokeReply:
        open_stream = getattr(self._backend, "invoke_stream", None)
        if open_stream is None:
            raise BadRequest("this controller does not stream")
        rid = msg.request_id
        stream = open_stream(msg.name, check_encoded_tensors(msg.inputs), request_id=rid,
                             timeout_s=msg.timeout_s, request_class=msg.request_class)
        try:
            async for item in stream:
                if isinstance(item, StreamChunk):
                    await conn.notify("gw_chunk", encode(StreamChunkNote(
                        request_id=rid, index=item.index, text=item.text,
                        token_id=item.token_id)), trace=rid)
                else:
                    return result_to_wire(item)
        finally:
            await stream.aclose()  # the gateway cancelled: so is the sequence
        raise BadRequest(f"request {rid}: the stream ended without an answer")

    async def _functions(self, conn: Any, msg: FunctionsRequest) -> FunctionsReply:
        return FunctionsReply(functions=[info_to_wire(i) for i in self._backend.list_functions()],
                              ready=self._backend.is_ready(),
                              status=self._backend.cluster_status())

    async def _register(self, conn: Any, msg: RegisterRequest) -> RegisterReply:
        try:
            parsed = FunctionSpec.from_dict(msg.spec)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"invalid function spec: {str(e)[:200]}") from None
        info = await self._backend.register_function(parsed)
        return RegisterReply(info=info_to_wire(info))

    async def _delete(self, conn: Any, msg: DeleteRequest) -> Ack:
        await self._backend.delete_function(msg.name)
        return Ack()

    # -- KaaS and its object store (gateway/remote_kaas.py is the other side) --------------
    def _kaas_backend(self) -> KaasBackend:
        if self._kaas is None:
            raise KaasUnavailable("this controller serves no KaaS", retry_after_s=60.0)
        return self._kaas

    async def _kaas_invoke(self, conn: Any, msg: KaasInvokeRequest) -> KaasInvokeReply:
        kaas = self._kaas_backend()
        # Inline data is decoded here (base64, numpy casts): off the event loop.
        req = await asyncio.to_thread(KaasRequest.from_dict, msg.request,
                                      max_buffer_bytes=kaas.max_buffer_bytes)
        plan = kaas.plan(req)
        result = await kaas.invoke(plan, client=msg.client, request_id=msg.request_id,
                                   timeout_s=msg.timeout_s)
        return KaasInvokeReply(result=result.to_wire())

    async def _kaas_status(self, conn: Any, msg: KaasStatusRequest) -> KaasStatusReply:
        return KaasStatusReply(status=await self._kaas_backend().fetch_status())

    async def _object_put(self, conn: Any, msg: ObjectPutRequest) -> Ack:
        kaas = self._kaas_backend()
        key = check_key(msg.key)
        await kaas.put_object(key, check_object(msg.data, kaas.max_buffer_bytes),
                              ttl_s=check_ttl(msg.ttl_s))
        return Ack()

    async def _object_delete(self, conn: Any, msg: ObjectKeyRequest) -> Ack:
        await self._kaas_backend().delete_object(check_key(msg.key))
        return Ack()

    async def _object_get(self, conn: Any, msg: ObjectKeyRequest) -> ObjectGetReply:
        kaas = self._kaas_backend()
        key = check_key(msg.key)
        data = await kaas.get_object(key)
        if len(data) > FRAME_BUDGET_BYTES:  # put through the controller's own API
            raise PayloadTooLarge(f"object {key!r} has {len(data)} bytes; a gateway carries "
                                  f"at most {FRAME_BUDGET_BYTES} in one frame: read it from "
                                  "the controller's API")
        return ObjectGetReply(data=data)


def _typed(kind: type[M], fn: Callable[[Any, M], Awaitable[Message]],
           method: str) -> Callable[[Any, Any], Awaitable[dict[str, Any]]]:
    """``fn`` for the RPC method table: the request's version checked, then its type
    (``messages.gateway_controller.decode``), the reply encoded."""

    async def typed(conn: Any, payload: Any) -> dict[str, Any]:
        return encode(await fn(conn, decode(kind, payload, method=method)))

    typed.__name__ = method
    return typed
