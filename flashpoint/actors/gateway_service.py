"""The controller's RPC face for stand-alone gateways (``flashpoint gateway``).

A gateway process holds no cluster state: it forwards every API call here over the cluster's
authenticated RPC and keeps only a cached copy of the function table, so it can keep
accepting requests while the controller restarts (and retry them once it is back).
Messages, one per method (versioned by the ``v`` field; a gateway refuses a reply of
another version):

- ``gw_invoke``   {v, name, inputs (encoded tensors), request_id, timeout_s, request_class}
                  -> {v, outputs, timings_s, replica_id, cold, cold_start_source}
- ``gw_functions`` {v} -> {v, functions: [FunctionInfo dict], ready, status}
- ``gw_register`` {v, spec} -> {v, info}
- ``gw_delete``   {v, name} -> {v}

Errors travel as the controller's typed errors (the RPC layer re-raises them intact).
"""

from __future__ import annotations

from typing import Any, Protocol

from flashpoint.errors import BadRequest
from flashpoint.gateway.backend import FunctionInfo, InvokeResult
from flashpoint.gateway.remote import GATEWAY_RPC_VERSION, result_to_wire
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


def _text(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key!r} must be a non-empty string")
    return value


class GatewayService:
    """RPC handlers that serve gateways from the controller (its ``InvokeBackend``)."""

    def __init__(self, backend: _Backend) -> None:
        self._backend = backend

    def handlers(self) -> dict[str, Any]:
        return {"gw_invoke": self._invoke, "gw_functions": self._functions,
                "gw_register": self._register, "gw_delete": self._delete}

    async def _invoke(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        _check_version(payload)
        timeout_s = payload.get("timeout_s")
        if timeout_s is not None and (not isinstance(timeout_s, (int, float))
                                      or isinstance(timeout_s, bool) or not timeout_s > 0):
            raise BadRequest("timeout_s must be a positive number")
        cls = payload.get("request_class", RequestClass.STRICT)
        if cls not in tuple(RequestClass):
            raise BadRequest(f"request_class must be one of {[c.value for c in RequestClass]}")
        result = await self._backend.invoke(
            _text(payload, "name"), decode_tensors(payload.get("inputs")),
            request_id=_text(payload, "request_id"),
            timeout_s=float(timeout_s) if timeout_s is not None else None, request_class=cls)
        return result_to_wire(result)

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
