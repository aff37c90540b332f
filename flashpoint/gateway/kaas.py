"""Kernel-as-a-Service routes and the object store over HTTP.

    POST /v1/kaas/invoke        invoke  KaasRequest fields + "client"?, "timeout_s"?,
                                        "output_encoding"? ("list" | "b64")
                                        -> outputs (inline or stored keys), timings, cache
    GET  /v1/kaas/status        invoke  pool policy, queue, executors' cache hits/misses/
                                        evictions and use, registered kernels
    PUT  /v1/objects/{key}      invoke  raw bytes, ?ttl_s= -> 201 {"key", "size_bytes"}
                                        (immutable: other bytes under a key are 409; a full
                                        store or API-key quota is 413)
    GET  /v1/objects/{key}      invoke  raw bytes | 404
    DELETE /v1/objects/{key}    invoke  204 | 404 (the key may then hold other bytes)

Object keys live in the caller's namespace (``kaas/store.py``): every key a caller names
(object routes, KaaS buffers, ``store_outputs``) is stored as ``t-<hash of its API key>/key``,
so another API key can neither read nor overwrite it; callers only ever see their own keys.

Host functions chain into kernel graphs through the object store: the native invoke takes
``"store_outputs": {output_name: key}`` and puts those outputs there (returned under
``stored`` with their dtype and shape instead of inline), and a KaaS input names that key.
No new concept is needed on either side; immutability makes the chained value cacheable.

Fairness is per client: the authenticated caller (API key fingerprint, or peer address
without auth), optionally narrowed by a ``client`` label so one caller's functions can be
scheduled as different clients (the paper equates client and function, digest §5.10) —
a label can never make a caller share another caller's fair share.

The routes only see the ``KaasBackend`` protocol: the controller mounts them over its
pool of executors on workers (``controller/kaas_pool.py``; ``[controller] kaas_workers``, 0 =
invocations answer 503 ``kaas_unavailable``); a stand-alone gateway over RPC to that pool
(``gateway/remote_kaas.py``); tests mount an in-process ``kaas.service.local_service``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import re
from typing import Any

import numpy as np
from aiohttp import web

from flashpoint.errors import BadRequest
from flashpoint.gateway.admission import effective_timeout_s
from flashpoint.gateway.auth import Principal, Role
from flashpoint.gateway.body import read_body
from flashpoint.gateway.context import (
    OFFLOAD_BYTES,
    GatewayContext,
    json_response,
    parse_json_body,
    request_id,
)
from flashpoint.kaas.backend import KaasBackend
from flashpoint.kaas.spec import DTYPE_BYTES, KaasRequest, check_key, check_object, check_ttl
from flashpoint.kaas.store import scoped_key, tenant_namespace, unscoped_key

_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_EXTRA_KEYS = ("client", "timeout_s", "output_encoding")


def decode_store_outputs(body: Any) -> dict[str, str]:
    """The native invoke's optional ``store_outputs``: ``{output name: object key}``."""
    raw = body.get("store_outputs") if isinstance(body, dict) else None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw or len(raw) > 64:
        raise BadRequest("store_outputs must be an object of 1-64 output name -> key")
    for name, key in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise BadRequest("store_outputs names must be 1-256 characters")
        check_key(key)
    return dict(raw)


def namespace(principal: Principal) -> str:
    """The object-store namespace of the caller's API key."""
    return tenant_namespace(principal.name)


def scoped_request(req: KaasRequest, ns: str) -> KaasRequest:
    """``req`` with every object key moved into namespace ``ns``."""
    return dataclasses.replace(req, buffers=tuple(
        dataclasses.replace(b, key=scoped_key(ns, b.key)) if b.key is not None else b
        for b in req.buffers))


async def store_outputs(kaas: KaasBackend, outputs: dict[str, np.ndarray],
                        keys: dict[str, str], ns: str) -> dict[str, dict[str, Any]]:
    """Put the named outputs into KaaS's object store, in namespace ``ns``; returns
    ``{name: {key, dtype, shape}}`` with the caller's keys."""
    missing = sorted(set(keys) - set(outputs))
    if missing:
        raise BadRequest(f"store_outputs names outputs the function did not produce: "
                         f"{missing}; it produced {sorted(outputs)}")
    stored: dict[str, dict[str, Any]] = {}
    for name, key in keys.items():
        arr = np.ascontiguousarray(outputs[name])
        if arr.dtype.name not in DTYPE_BYTES:
            raise BadRequest(f"output {name!r} of dtype {arr.dtype} cannot be stored; "
                             f"storable: {sorted(DTYPE_BYTES)}")
        await kaas.put_object(scoped_key(ns, key), arr.tobytes())  # ObjectExists (409)
        stored[name] = {"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape)}
    return stored


def _encode(arr: np.ndarray, encoding: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"dtype": arr.dtype.name, "shape": list(arr.shape)}
    if encoding == "b64":
        entry["b64"] = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()
    else:
        entry["data"] = arr.reshape(-1).tolist()
    return entry


class KaasRoutes:
    def __init__(self, ctx: GatewayContext, kaas: KaasBackend) -> None:
        self.ctx = ctx
        self.kaas = kaas

    def route_defs(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/kaas/invoke", self.invoke),
            web.get("/v1/kaas/status", self.status),
            web.put("/v1/objects/{key:.+}", self.put_object),
            web.get("/v1/objects/{key:.+}", self.get_object),
            web.delete("/v1/objects/{key:.+}", self.delete_object),
        ]

    def _parse(self, body: Any) -> tuple[KaasRequest, dict[str, Any]]:
        if not isinstance(body, dict):
            raise BadRequest("a KaaS invoke body must be a JSON object")
        body = dict(body)
        extra = {k: body.pop(k) for k in _EXTRA_KEYS if k in body}
        req = KaasRequest.from_dict(body, max_buffer_bytes=self.kaas.max_buffer_bytes)
        return req, extra

    async def invoke(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        principal = ctx.require(request, Role.INVOKE)
        raw = await read_body(request, ctx.config)
        body = await parse_json_body(ctx, raw)
        if len(raw) >= OFFLOAD_BYTES:
            req, extra = await asyncio.to_thread(self._parse, body)
        else:
            req, extra = self._parse(body)
        client = ctx.caller(request, principal)
        label = extra.get("client")
        if label is not None:
            if not isinstance(label, str) or not _LABEL_RE.match(label):
                raise BadRequest("client must be 1-64 characters of letters, digits and _.:-")
            client = f"{client}/{label}"
        req_timeout = extra.get("timeout_s")
        if req_timeout is not None and (isinstance(req_timeout, bool) or not isinstance(
                req_timeout, (int, float)) or not 0 < req_timeout <= 86400):
            raise BadRequest("timeout_s must be a number in (0, 86400]")
        encoding = extra.get("output_encoding", "list")
        if encoding not in ("list", "b64"):
            raise BadRequest("output_encoding must be 'list' or 'b64'")
        ns = namespace(principal)
        plan = self.kaas.plan(scoped_request(req, ns))
        rid = request_id(request)
        timeout_s = effective_timeout_s(req_timeout, None, ctx.config)
        # The same admission as function invocations: per-caller rate limit, in-flight cap.
        result = await ctx.admission.run(
            ctx.caller(request, principal), "the KaaS pool",
            lambda: self.kaas.invoke(plan, client=client, request_id=rid, timeout_s=timeout_s),
            timeout_s=timeout_s)
        outputs: dict[str, Any] = {name: {"key": unscoped_key(ns, key)}
                                   for name, key in result.stored.items()}
        for name, arr in result.outputs.items():
            outputs[name] = _encode(arr, encoding)
        return json_response({"outputs": outputs, "timings_s": result.timings_s,
                              "cache": result.cache, "executor_id": result.executor_id,
                              "request_id": rid})

    async def status(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response(await self.kaas.fetch_status())

    async def put_object(self, request: web.Request) -> web.Response:
        principal = self.ctx.require(request, Role.INVOKE)
        key = check_key(request.match_info["key"])
        ttl_s = _query_ttl(request.query.get("ttl_s"))
        data = check_object(await read_body(request, self.ctx.config),
                            self.kaas.max_buffer_bytes)
        await self.kaas.put_object(scoped_key(namespace(principal), key), data, ttl_s=ttl_s)
        return json_response({"key": key, "size_bytes": len(data)}, status=201)

    async def get_object(self, request: web.Request) -> web.Response:
        principal = self.ctx.require(request, Role.INVOKE)
        key = scoped_key(namespace(principal), check_key(request.match_info["key"]))
        return web.Response(body=await self.kaas.get_object(key),
                            content_type="application/octet-stream")

    async def delete_object(self, request: web.Request) -> web.Response:
        principal = self.ctx.require(request, Role.INVOKE)
        key = scoped_key(namespace(principal), check_key(request.match_info["key"]))
        await self.kaas.delete_object(key)
        return web.Response(status=204)


def _query_ttl(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest("ttl_s must be a number of seconds") from None
    return check_ttl(value)
