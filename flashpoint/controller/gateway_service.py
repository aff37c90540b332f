"""The controller's RPC face for stand-alone gateways (``flashpoint gateway``).

A gateway process holds no cluster state: it forwards every API call here over the cluster's
authenticated RPC and keeps only a cached copy of the function table, so it can keep
accepting requests while the controller restarts (and retry them once it is back).
Messages, one per method (versioned by the ``v`` field; a gateway refuses a reply of
another version):

- ``gw_invoke``   {v, name, inputs (encoded tensors), request_id, timeout_s, request_class,
                  traceparent (optional: the gateway's span, when traced)}
                  -> {v, outputs, timings_s, replica_id, cold, cold_start_source}
- ``gw_stream``   gw_invoke's request for a text-generation function: ``gw_chunk``
                  notifications back on the same connection as the tokens come
                  ({request_id, index, text, token_id}; gateway/streams.py), then gw_invoke's
                  reply; cancelling the call cancels the sequence
- ``gw_functions`` {v} -> {v, functions: [FunctionInfo dict], ready, status}
- ``gw_register`` {v, spec} -> {v, info}
- ``gw_delete``   {v, name} -> {v}
- ``gw_kaas_invoke`` {v, request (KaasRequest dict), client, request_id, timeout_s}
                  -> {v, result (KaasResult wire dict)}
- ``gw_kaas_status`` {v} -> {v, status}
- ``gw_object_put`` {v, key, data (bytes), ttl_s?} -> {v}
- ``gw_object_get`` {v, key} -> {v, data}
- ``gw_object_delete`` {v, key} -> {v}

The KaaS calls exist when the controller has a KaaS backend (it always does: its object
store works even with ``kaas_workers = 0``, when invocations answer 503). The request is
parsed and planned again here, store lookups included: a gateway only checks the graph.

Errors travel as the controller's typed errors (the RPC layer re-raises them intact).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from flashpoint import tracing
from flashpoint.errors import BadRequest, KaasUnavailable, PayloadTooLarge
from flashpoint.gateway.backend import FunctionInfo, InvokeResult, StreamChunk
from flashpoint.gateway.remote import GATEWAY_RPC_VERSION, result_to_wire
from flashpoint.kaas.backend import KaasBackend
from flashpoint.kaas.remote import FRAME_BUDGET_BYTES
from flashpoint.kaas.spec import KaasRequest, check_key, check_object, check_ttl
from flashpoint.policy.request_class import RequestClass
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import decode_tensors


class _Backend(Protocol):
    async def invoke(self, name: str, inputs: Any, *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = RequestClass.STRICT) -> InvokeResult: ...
    async def register_function(self, spec: FunctionSpec) -> FunctionInfo: ...
    async def delete_function(self, name: str) -> None: ...
    def list_functions(self) -> list[FunctionInfo]: ...
    def cluster_status(self) -> dict[str, Any]: ...
    def is_ready(self) -> bool: ...


def _check_version(payload: dict[str, Any]) -> None:
    if payload.get("v") != GATEWAY_RPC_VERSION:
        raise BadRequest(f"gateway protocol version {payload.get('v')!r} is not supported "
                         f"(this controller speaks {GATEWAY_RPC_VERSION})")


def _timeout(payload: dict[str, Any]) -> float | None:
    timeout_s = payload.get("timeout_s")
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise BadRequest("timeout_s must be a positive number")
    return float(timeout_s)


def _text(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key!r} must be a non-empty string")
    return value


class GatewayService:
    """RPC handlers that serve gateways from the controller (its ``InvokeBackend``)."""

    def __init__(self, backend: _Backend, kaas: KaasBackend | None = None) -> None:
        self._backend = backend
        self._kaas = kaas

    def handlers(self) -> dict[str, Any]:
        return {"gw_invoke": self._invoke, "gw_stream": self._stream, "gw_functions": self._functions,
                "gw_register": self._register, "gw_delete": self._delete,
                "gw_kaas_invoke": self._kaas_invoke, "gw_kaas_status": self._kaas_status,
                "gw_object_put": self._object_put, "gw_object_get": self._object_get,
                "gw_object_delete": self._object_delete}

    async def _invoke(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        timeout_s = _timeout(payload)
        cls = payload.get("request_class", RequestClass.STRICT)
        if cls not in tuple(RequestClass):
            raise BadRequest(f"request_class must be one of {[c.value for c in RequestClass]}")
        with tracing.remote_parent(payload):  # a stand-alone gateway's trace, when traced
            result = await self._backend.invoke(
                _text(payload, "name"), decode_tensors(payload.get("inputs")),
                request_id=_text(payload, "request_id"),
                timeout_s=timeout_s, request_class=cls)
        return result_to_wire(result)

    async def _stream(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        timeout_s = _timeout(payload)
        cls = payload.get("request_class", RequestClass.STRICT)
        if cls not in tuple(RequestClass):
            raise BadRequest(f"request_class must be one of {[c.value for c in RequestClass]}")
        open_stream = getattr(self._backend, "invoke_stream", None)
        if open_stream is None:
            raise BadRequest("this controller does not stream")
        rid = _text(payload, "request_id")
        stream = open_stream(_text(payload, "name"), decode_tensors(payload.get("inputs")),
                             request_id=rid, timeout_s=timeout_s, request_class=cls)
        try:
            async for item in stream:
                if isinstance(item, StreamChunk):
                    await conn.notify("gw_chunk", {"request_id": rid, "index": item.index,
                                                   "text": item.text,
                                                   "token_id": item.token_id}, trace=rid)
                else:
                    return result_to_wire(item)
        finally:
            await stream.aclose()  # the gateway cancelled: so is the sequence
        raise BadRequest(f"request {rid}: the stream ended without an answer")

    async def _functions(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        return {"v": GATEWAY_RPC_VERSION,
                "functions": [i.to_dict() for i in self._backend.list_functions()],
                "ready": self._backend.is_ready(), "status": self._backend.cluster_status()}

    async def _register(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        spec = payload.get("spec")
        if not isinstance(spec, dict):
            raise BadRequest("'spec' must be a function spec object")
        try:
            parsed = FunctionSpec.from_dict(spec)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"invalid function spec: {str(e)[:200]}") from None
        info = await self._backend.register_function(parsed)
        return {"v": GATEWAY_RPC_VERSION, "info": info.to_dict()}

    async def _delete(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        await self._backend.delete_function(_text(payload, "name"))
        return {"v": GATEWAY_RPC_VERSION}

    # -- KaaS and its object store (gateway/remote_kaas.py is the other side) --------------
    def _kaas_backend(self, payload: dict[str, Any]) -> KaasBackend:
        _check_version(payload)
        if self._kaas is None:
            raise KaasUnavailable("this controller serves no KaaS", retry_after_s=60.0)
        return self._kaas

    async def _kaas_invoke(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        kaas = self._kaas_backend(payload)
        body = payload.get("request")
        if not isinstance(body, dict):
            raise BadRequest("'request' must be a KaaS request object")
        timeout_s = _timeout(payload)
        # Inline data is decoded here (base64, numpy casts): off the event loop.
        req = await asyncio.to_thread(KaasRequest.from_dict, body,
                                      max_buffer_bytes=kaas.max_buffer_bytes)
        plan = kaas.plan(req)
        result = await kaas.invoke(plan, client=_text(payload, "client"),
                                   request_id=_text(payload, "request_id"), timeout_s=timeout_s)
        return {"v": GATEWAY_RPC_VERSION, "result": result.to_wire()}

    async def _kaas_status(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        kaas = self._kaas_backend(payload)
        return {"v": GATEWAY_RPC_VERSION, "status": await kaas.fetch_status()}

    async def _object_put(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        kaas = self._kaas_backend(payload)
        key = check_key(payload.get("key"))
        await kaas.put_object(key, check_object(payload.get("data"), kaas.max_buffer_bytes),
                              ttl_s=check_ttl(payload.get("ttl_s")))
        return {"v": GATEWAY_RPC_VERSION}

    async def _object_delete(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        kaas = self._kaas_backend(payload)
        await kaas.delete_object(check_key(payload.get("key")))
        return {"v": GATEWAY_RPC_VERSION}

    async def _object_get(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        kaas = self._kaas_backend(payload)
        key = check_key(payload.get("key"))
        data = await kaas.get_object(key)
        if len(data) > FRAME_BUDGET_BYTES:  # put through the controller's own API
            raise PayloadTooLarge(f"object {key!r} has {len(data)} bytes; a gateway carries "
                                  f"at most {FRAME_BUDGET_BYTES} in one frame: read it from "
                                  "the controller's API")
        return {"v": GATEWAY_RPC_VERSION, "data": data}
