"""The profiler's route, mounted by the controller (it runs the trials):

    POST /v1/functions/{name}/profile   admin   ProfileRequest (+ "inputs"?) -> report

The body (``policy/profile_trials.ProfileRequest``; every field optional, ``{}`` profiles
FaST's default grid) may carry ``inputs`` in the native invoke's form, the request the trials
send; without it they are made from the function's declared inputs. The answer is the
report (every trial, the profiles), ``stored`` (the spec fields written) and ``share`` (the
share the function resolves to now). Unknown function: 404 ``function_not_found``; no host
sharing GPUs: 409 ``conflict``. Audited as ``profile``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from aiohttp import web

from flashpoint.audit import AuditAction
from flashpoint.gateway.auth import Role
from flashpoint.gateway.body import read_body
from flashpoint.gateway.context import GatewayContext, audited, json_response, parse_json_body
from flashpoint.gateway.native import decode_native_inputs
from flashpoint.policy.profile_trials import ProfileRequest


class ProfileBackend(Protocol):
    """What runs a profile (``controller/profiler.Profiler``)."""

    async def profile(self, name: str, req: ProfileRequest,
                      inputs: dict[str, np.ndarray] | None = None) -> dict[str, Any]: ...


class ProfileRoutes:
    def __init__(self, ctx: GatewayContext, backend: ProfileBackend) -> None:
        self.ctx = ctx
        self.backend = backend

    def route_defs(self) -> list[web.RouteDef]:
        return [web.post("/v1/functions/{name}/profile", self.profile)]

    async def profile(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        principal = ctx.require(request, Role.ADMIN)
        name = request.match_info["name"]
        ctx.function(name)  # 404 for unknown names, before reading the body
        raw = await read_body(request, ctx.config)
        body = await parse_json_body(ctx, raw) if raw else {}
        req = ProfileRequest.from_dict(body)
        inputs = None
        if "inputs" in body:
            inputs, _ = decode_native_inputs({"inputs": body["inputs"]}, ctx.limits)
        with audited(ctx.audit, request, AuditAction.PROFILE, principal, name,
                     {"request": req.to_dict()}):
            answer = await self.backend.profile(name, req, inputs)
        return json_response(answer)
