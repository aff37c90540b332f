"""What every gateway handler shares: the backend, config, auth, admission and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from flashpoint.audit import AuditAction, AuditLog
from flashpoint.config import GatewayConfig
from flashpoint.errors import BadRequest, FlashpointError, FunctionNotFound
from flashpoint.gateway.admission import Admission
from flashpoint.gateway.auth import ApiKeyAuth, Principal, Role
from flashpoint.gateway.backend import FunctionInfo, InvokeBackend
from flashpoint.gateway.json_codec import load_json
from flashpoint.gateway.metrics import GatewayMetrics
from flashpoint.gateway.oip import CodecLimits
from flashpoint.ids import new_id
from flashpoint.spec import FunctionSpec

# Large encodes and decodes leave the event loop (STYLE 13).
OFFLOAD_BYTES = 1024 * 1024

_RequestKey: Any = getattr(web, "RequestKey", None)
REQUEST_ID: Any = _RequestKey("flashpoint_request_id", str) if _RequestKey else "fp_request_id"


@dataclass
class GatewayContext:
    backend: InvokeBackend
    config: GatewayConfig
    auth: ApiKeyAuth
    metrics: GatewayMetrics
    admission: Admission
    limits: CodecLimits
    resources: set[web.AbstractResource] = field(default_factory=set)
    kaas: Any = None  # a kaas.service.KaasBackend when KaaS and the object store are on
    audit: AuditLog = field(default_factory=AuditLog)

    @classmethod
    def create(cls, backend: InvokeBackend, config: GatewayConfig,
               metrics: GatewayMetrics | None = None) -> GatewayContext:
        limits = CodecLimits(max_json_depth=config.max_json_depth,
                             max_tensor_bytes=config.max_tensor_bytes,
                             max_inputs=config.max_inputs, max_dims=config.max_dims)
        return cls(backend, config, ApiKeyAuth(config.api_keys), metrics or GatewayMetrics(),
                   Admission(config), limits, audit=AuditLog(config.audit_log_path))

    def owns(self, request: web.Request) -> bool:
        """Gateway routes, plus unmatched paths (rendered as JSON 404/405)."""
        info = request.match_info
        return info.http_exception is not None or info.route.resource in self.resources

    def require(self, request: web.Request, role: Role) -> Principal:
        return self.auth.require(request.headers.get("Authorization"), role)

    def caller(self, request: web.Request, principal: Principal) -> str:
        """The rate-limit bucket: the key fingerprint, or the peer address without auth."""
        if self.auth.enabled:
            return principal.name
        return f"peer:{request.remote or 'unknown'}"

    def function(self, name: str) -> FunctionInfo:
        """The backend's view of a function; names that cannot exist are simply not found."""
        if len(name) > 256:
            raise FunctionNotFound(f"function {name[:64]!r}... not found")
        return self.backend.get_function(name)

    def spec(self, name: str) -> FunctionSpec:
        """A function's spec (the invoke paths need nothing more)."""
        if len(name) > 256:
            raise FunctionNotFound(f"function {name[:64]!r}... not found")
        return self.backend.function_spec(name)


def request_id(request: web.Request) -> str:
    try:
        return request[REQUEST_ID]
    except KeyError:
        return new_id("req")


@contextlib.contextmanager
def audited(audit: AuditLog, request: web.Request, action: AuditAction, principal: Principal,
            target: str, details: dict[str, Any]) -> Iterator[None]:
    """Record an admin action with how it ended (its error's code when it raised)."""
    outcome = "ok"
    try:
        yield
    except FlashpointError as e:
        outcome = e.code
        raise
    except Exception:
        outcome = "internal"
        raise
    finally:
        audit.record(action, principal.name, target, outcome=outcome,
                     request_id=request_id(request), **details)


def json_response(obj: Any, status: int = 200) -> web.Response:
    body = json.dumps(obj, separators=(",", ":"), default=str).encode()
    return web.Response(body=body, status=status, content_type="application/json")


async def parse_json_body(ctx: GatewayContext, body: bytes) -> Any:
    if not body:
        raise BadRequest("request body is empty; expected JSON")
    if len(body) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(load_json, body, ctx.config.max_json_depth)
    return load_json(body, ctx.config.max_json_depth)


async def maybe_gzip(request: web.Request, resp: web.Response, body: bytes,
                     min_bytes: int) -> bytes:
    """Gzip ``body`` when the client accepts it and it is large enough; sets the header."""
    if len(body) < min_bytes:  # the common case: decided before parsing any header
        return body
    accept = request.headers.get("Accept-Encoding", "")
    if not any(part.split(";")[0].strip().lower() == "gzip" for part in accept.split(",")):
        return body
    resp.headers["Content-Encoding"] = "gzip"
    if len(body) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(gzip.compress, body, 5)
    return gzip.compress(body, 5)


REQUEST_CLASS_HEADER = "X-Request-Class"
REQUEST_CLASSES = ("strict", "best_effort")


def request_class(request: web.Request, stated: Any = None) -> str:
    """The request's class: ``stated`` (the body's ``request_class``, or KServe's
    ``parameters.request_class``), else the ``X-Request-Class`` header, else strict."""
    header = request.headers.get(REQUEST_CLASS_HEADER)
    if stated is not None and header is not None and stated != header:
        raise BadRequest(f"request_class {stated!r:.40} and the {REQUEST_CLASS_HEADER} header "
                         f"{header!r:.40} disagree")
    value = stated if stated is not None else header
    if value is None:
        return "strict"
    if value not in REQUEST_CLASSES:
        raise BadRequest(f"request_class must be one of {list(REQUEST_CLASSES)}, "
                         f"not {value!r:.40}")
    return str(value)

