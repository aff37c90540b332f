"""The native ``/v1`` API: manage functions and invoke them with JSON tensors.

    POST   /v1/functions                 admin   FunctionSpec -> 201 FunctionInfo
    GET    /v1/functions                 invoke  [FunctionInfo, ...]
    GET    /v1/functions/{name}          invoke  FunctionInfo | 404
    DELETE /v1/functions/{name}          admin   {"deleted": name}
    POST   /v1/functions/{name}/invoke   invoke  {"inputs": {x: {data, shape, datatype}},
                                                   "timeout_s"?, "store_outputs"?}
                                                   -> outputs + timings (+ stored)
    GET    /v1/status                    invoke  backend.cluster_status()
    GET    /healthz                      none    {"status": "ok"} | 503
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from aiohttp import web

from flashpoint.audit import AuditAction
from flashpoint.errors import BadRequest, FunctionNotFound, PayloadTooLarge
from flashpoint.gateway import json_codec, oip
from flashpoint.gateway.admission import effective_timeout_s
from flashpoint.gateway.auth import Role
from flashpoint.gateway.body import body_if_complete, read_body
from flashpoint.gateway.context import (
    OFFLOAD_BYTES,
    GatewayContext,
    audited,
    json_response,
    maybe_gzip,
    parse_json_body,
    request_class,
    request_id,
)
from flashpoint.gateway.kaas import decode_store_outputs, namespace, store_outputs
from flashpoint.spec import FunctionSpec


def _register_action(ctx: GatewayContext, spec: FunctionSpec) -> tuple[AuditAction, dict[str, Any]]:
    """What registering ``spec`` does, for the audit log: a new function, a roll-out (its
    model version or canary split changes) or another update of its spec."""
    details: dict[str, Any] = {"model": spec.model, "model_version": spec.model_version,
                               "canary_pct": spec.canary_pct}
    try:
        before = ctx.function(spec.name).spec
    except FunctionNotFound:
        return AuditAction.REGISTER, details
    details["previous_version"] = before.model_version
    if (before.model, before.model_version, before.canary_pct) != (
            spec.model, spec.model_version, spec.canary_pct):
        return AuditAction.ROLLOUT, details
    return AuditAction.UPDATE, details


_INVOKE_KEYS = frozenset(("inputs", "text", "image", "timeout_s", "store_outputs",
                          "request_class"))
_CONVENIENCE_KEYS = ("text", "image")  # {"text": ...} / {"image": base64}: one BYTES input
MAX_CONVENIENCE_ITEMS = 1024
_TENSOR_KEYS = frozenset(("data", "shape", "datatype"))


def decode_native_inputs(body: Any, limits: oip.CodecLimits) -> tuple[dict[str, np.ndarray],
                                                                        float | None]:
    """``{"inputs": {name: {data, shape, datatype}}, "timeout_s"?}`` -> arrays, timeout."""
    if not isinstance(body, dict):
        raise BadRequest("invoke body must be a JSON object")
    if not _INVOKE_KEYS.issuperset(body):
        unknown = set(body) - _INVOKE_KEYS
        raise BadRequest(f"unknown invoke fields {sorted(unknown)}; allowed: "
                         f"{sorted(_INVOKE_KEYS)}")
    timeout_s = body.get("timeout_s")
    if timeout_s is not None and (
        not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
        or not 0 < timeout_s <= 86400
    ):
        raise BadRequest("timeout_s must be a number in (0, 86400]")
    given = [k for k in ("inputs", *_CONVENIENCE_KEYS) if k in body]
    if len(given) != 1:
        raise BadRequest("give exactly one of 'inputs' (tensors), 'text' or 'image'")
    if given[0] != "inputs":
        return ({given[0]: _convenience(given[0], body[given[0]], limits)},
                float(timeout_s) if timeout_s is not None else None)
    raw = body.get("inputs")
    if not isinstance(raw, dict) or not raw:
        raise BadRequest("'inputs' must be a non-empty object of name -> tensor")
    if len(raw) > limits.max_inputs:
        raise BadRequest(f"at most {limits.max_inputs} inputs allowed, got {len(raw)}")
    budget = [limits.max_tensor_bytes]
    inputs: dict[str, np.ndarray] = {}
    for name, t in raw.items():
        if not name or len(name) > 256:
            raise BadRequest("input names must be 1-256 characters")
        if not isinstance(t, dict):
            raise BadRequest(f"input {name!r} must be an object with data, shape, datatype")
        if not _TENSOR_KEYS.issuperset(t) or "data" not in t:
            raise BadRequest(f"input {name!r} needs exactly the fields data, shape, datatype")
        datatype = oip.check_datatype(name, t.get("datatype"))
        shape = oip.check_shape(name, t.get("shape"), limits)
        inputs[name] = oip.tensor_from_json(name, datatype, shape, t["data"], limits, budget)
    return inputs, (float(timeout_s) if timeout_s is not None else None)


def _convenience(key: str, value: Any, limits: oip.CodecLimits) -> np.ndarray:
    """``"text": str | [str]`` (UTF-8) or ``"image": base64 | [base64]`` as the model's
    one ``BYTES [n]`` input of that name."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str) for v in items):
        raise BadRequest(f"'{key}' must be a string or a non-empty list of strings")
    if len(items) > MAX_CONVENIENCE_ITEMS:
        raise BadRequest(f"'{key}': at most {MAX_CONVENIENCE_ITEMS} items")
    out = np.empty(len(items), dtype=object)
    total = 0
    for i, v in enumerate(items):
        if key == "text":
            b = v.encode("utf-8", "surrogatepass")
        else:
            try:
                b = base64.b64decode(v, validate=True)
            except (ValueError, TypeError):
                raise BadRequest(f"'image' item {i} is not base64") from None
        total += len(b)
        if total > limits.max_tensor_bytes:
            raise PayloadTooLarge(f"'{key}' is over {limits.max_tensor_bytes} bytes")
        out[i] = b
    return out


def encode_native_outputs(outputs: dict[str, np.ndarray],
                          declared: dict[str, str]) -> dict[str, Any]:
    """Outputs as ``{name: {data (flat), shape, datatype}}``.

    BYTES outputs are UTF-8 strings; when any element is not UTF-8 the tensor's data is a
    list of base64 strings instead and it carries ``"encoding": "base64"``.
    """
    out: dict[str, Any] = {}
    for name, value in outputs.items():
        arr = np.asarray(value)
        datatype = oip.datatype_of(name, arr, declared.get(name))
        entry: dict[str, Any] = {"shape": list(arr.shape), "datatype": datatype}
        data = oip.tensor_to_json_data(name, arr, datatype)
        if data is None:
            data = [base64.b64encode(b).decode() for b in oip.bytes_items(arr)]
            entry["encoding"] = "base64"
        entry["data"] = data
        out[name] = entry
    return out


class NativeRoutes:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    def route_defs(self) -> list[web.RouteDef]:
        return [
            # First: the router tries resources under a prefix in order, and this is the hot
            # one (no other pattern here can match its paths, so order changes no answer).
            web.post("/v1/functions/{name}/invoke", self.invoke),
            web.post("/v1/functions", self.register),
            web.get("/v1/functions", self.list_functions),
            web.get("/v1/functions/{name}", self.get_function),
            web.delete("/v1/functions/{name}", self.delete_function),
            web.get("/v1/status", self.status),
            web.get("/healthz", self.healthz),
        ]

    async def register(self, request: web.Request) -> web.Response:
        principal = self.ctx.require(request, Role.ADMIN)
        body = await parse_json_body(self.ctx, await read_body(request, self.ctx.config))
        try:
            spec = FunctionSpec.from_dict(body)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"invalid function spec: {str(e)[:200]}") from None
        action, details = _register_action(self.ctx, spec)
        with audited(self.ctx.audit, request, action, principal, spec.name, details):
            info = await self.ctx.backend.register_function(spec)
        return json_response(info.to_dict(), status=201)

    async def list_functions(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response([info.to_dict() for info in self.ctx.backend.list_functions()])

    async def get_function(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response(self.ctx.function(request.match_info["name"]).to_dict())

    async def delete_function(self, request: web.Request) -> web.Response:
        principal = self.ctx.require(request, Role.ADMIN)
        name = request.match_info["name"]
        self.ctx.function(name)  # 404 for unknown names, before touching the backend
        with audited(self.ctx.audit, request, AuditAction.DELETE, principal, name, {}):
            await self.ctx.backend.delete_function(name)
        return json_response({"deleted": name})

    async def invoke(self, request: web.Request) -> web.Response:
        # The hot path, kept flat: the small-body cases of read_body / parse_json_body /
        # maybe_gzip run inline (no coroutine each), large ones go through those helpers.
        ctx = self.ctx
        config = ctx.config
        principal = ctx.require(request, Role.INVOKE)
        spec = ctx.spec(request.match_info["name"])
        raw = body_if_complete(request, config)
        if raw is None:
            raw = await read_body(request, config)
        if raw and len(raw) < OFFLOAD_BYTES:
            body = json_codec.load_json(raw, config.max_json_depth)
            inputs, req_timeout_s = decode_native_inputs(body, ctx.limits)
        else:
            body = await parse_json_body(ctx, raw)
            inputs, req_timeout_s = await asyncio.to_thread(decode_native_inputs, body,
                                                            ctx.limits)
        # Chaining into KaaS: outputs go to the object store under these keys (gateway/kaas.py).
        to_store = decode_store_outputs(body) if "store_outputs" in body else None
        if to_store and ctx.kaas is None:
            raise BadRequest("store_outputs needs the object store, which is not enabled")
        cls = request_class(request, body.get("request_class"))
        rid = request_id(request)
        timeout_s = effective_timeout_s(req_timeout_s, spec.timeout_s, config)
        result = await ctx.admission.invoke(ctx.backend, ctx.caller(request, principal),
                                            spec.name, inputs, request_id=rid,
                                            timeout_s=timeout_s, request_class=cls)
        declared = {t.name: t.datatype for t in spec.outputs} if spec.outputs else {}
        outputs = result.outputs
        stored = {}
        if to_store:
            stored = await store_outputs(ctx.kaas, outputs, to_store, namespace(principal))
            outputs = {k: v for k, v in outputs.items() if k not in to_store}
        payload = {
            "outputs": encode_native_outputs(outputs, declared),
            "timings_s": result.timings_s,
            "replica_id": result.replica_id,
            "cold": result.cold,
            "cold_start_source": result.cold_start_source,
            "request_id": rid,
        }
        if stored:
            payload["stored"] = stored
        encoded = json_codec.dump_json(payload)
        if len(encoded) < config.response_compression_min_bytes:
            return web.Response(body=encoded, content_type="application/json")
        resp = web.Response(status=200, content_type="application/json")
        resp.body = await maybe_gzip(request, resp, encoded,
                                     config.response_compression_min_bytes)
        return resp

    async def status(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response(self.ctx.backend.cluster_status())

    async def healthz(self, request: web.Request) -> web.Response:
        live = self.ctx.backend.is_live()
        return json_response({"status": "ok" if live else "unhealthy"},
                             status=200 if live else 503)
