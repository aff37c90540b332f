"""KServe Open Inference Protocol v2 REST routes (what ``tritonclient.http`` speaks).

    GET  /v2                                          server metadata
    GET  /v2/health/live                              200 | 503
    GET  /v2/health/ready                             200 | 503
    GET  /v2/models/{name}[/versions/{v}]             model metadata | 404
    GET  /v2/models/{name}[/versions/{v}]/ready       200 | 400 model not ready | 404 unknown
                                                      | 503 cluster not ready
    POST /v2/models/{name}[/versions/{v}]/infer       inference (JSON or binary tensors)

A function is served as a model of the same name; its only version is the function's
``model_version`` (any other version is 404). A function is "ready" when the cluster can
serve and so can it: a replica of it is warm, or it scales from zero (a replica starts on
demand) and its last replica start did not fail. A model that is not ready answers 400, as
Triton does (``HandleModelReady``: anything but ready is ``EVHTP_RES_BADREQ``; tritonclient's
``is_model_ready`` is ``status == 200``), with ``{"name", "ready": false, "reason"}``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

import flashpoint
from flashpoint.errors import BadRequest, ModelNotFound, Unavailable
from flashpoint.gateway import json_codec, oip
from flashpoint.gateway.admission import effective_timeout_s
from flashpoint.gateway.auth import Role
from flashpoint.gateway.body import read_body
from flashpoint.gateway.context import (
    OFFLOAD_BYTES,
    GatewayContext,
    json_response,
    maybe_gzip,
    request_class,
    request_id,
)
from flashpoint.spec import FunctionSpec

HEADER_LENGTH = "Inference-Header-Content-Length"


def _decode(raw: bytes, header_length: str | None, limits: oip.CodecLimits) -> oip.InferRequest:
    head, binary = oip.split_body(raw, header_length)
    if not head:
        raise BadRequest("inference request JSON header is empty")
    return oip.decode_infer_request(json_codec.load_json(head, limits.max_json_depth), binary, limits)


class KServeRoutes:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    def route_defs(self) -> list[web.RouteDef]:
        return [
            web.get("/v2", self.server_metadata),
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2/models/{name}", self.model_metadata),
            web.get("/v2/models/{name}/versions/{version}", self.model_metadata),
            web.get("/v2/models/{name}/ready", self.model_ready),
            web.get("/v2/models/{name}/versions/{version}/ready", self.model_ready),
            web.post("/v2/models/{name}/infer", self.infer),
            web.post("/v2/models/{name}/versions/{version}/infer", self.infer),
        ]

    def _model(self, request: web.Request) -> FunctionSpec:
        name = request.match_info["name"]
        spec = self.ctx.spec(name)
        version = request.match_info.get("version")
        if version is not None and version != spec.model_version:
            raise ModelNotFound(f"model {name!r} has no version {version[:64]!r}; it serves "
                                f"version {spec.model_version!r}")
        return spec

    async def server_metadata(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response(oip.server_metadata(flashpoint.__version__))

    async def live(self, request: web.Request) -> web.Response:
        live = self.ctx.backend.is_live()
        return json_response({"live": live}, status=200 if live else 503)

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.ctx.backend.is_ready()
        return json_response({"ready": ready}, status=200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response(oip.model_metadata(self._model(request)))

    async def model_ready(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        spec = self._model(request)
        if not self.ctx.backend.is_ready():
            raise Unavailable(f"model {spec.name!r} is not ready: the cluster has no live "
                              f"host", retry_after_s=1.0)
        info = self.ctx.backend.get_function(spec.name)
        if not info.ready:
            return json_response({"name": spec.name, "ready": False, "reason": info.reason},
                                 status=400)
        return json_response({"name": spec.name, "ready": True})

    async def infer(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        principal = ctx.require(request, Role.INVOKE)
        spec = self._model(request)
        raw = await read_body(request, ctx.config)
        header_length = request.headers.get(HEADER_LENGTH)
        if len(raw) >= OFFLOAD_BYTES:
            req = await asyncio.to_thread(_decode, raw, header_length, ctx.limits)
        else:
            req = _decode(raw, header_length, ctx.limits)
        declared = {t.name: t.datatype for t in spec.outputs}
        if declared:  # fail before spending GPU time on an output that cannot exist
            oip.check_requested_outputs(req.outputs, declared)
        cls = request_class(request, req.parameters.get("request_class"))
        rid = request_id(request)
        timeout_s = effective_timeout_s(req.timeout_s, spec.timeout_s, ctx.config)
        result = await ctx.admission.invoke(ctx.backend, ctx.caller(request, principal),
                                            spec.name, req.inputs, request_id=rid,
                                            timeout_s=timeout_s, request_class=cls)
        kwargs = dict(model_name=spec.name, model_version=spec.model_version,
                      request_id=req.id, outputs=result.outputs, declared=declared,
                      requested=req.outputs, binary_output=req.binary_output)
        if sum(getattr(a, "nbytes", 0) for a in result.outputs.values()) >= OFFLOAD_BYTES:
            body, header_len = await asyncio.to_thread(lambda: oip.encode_infer_response(**kwargs))
        else:
            body, header_len = oip.encode_infer_response(**kwargs)
        resp = web.Response(status=200)
        if header_len is None:
            resp.content_type = "application/json"
        else:
            resp.content_type = "application/octet-stream"
            resp.headers[HEADER_LENGTH] = str(header_len)
        resp.body = await maybe_gzip(request, resp, body,
                                     ctx.config.response_compression_min_bytes)
        return resp
