"""The gateway's one middleware: request ids, JSON errors, and request metrics.

* The request id comes from a well-formed ``X-Request-Id`` header or is generated; it is bound
  into structlog's context for the request and echoed in the response header.
* :class:`FlashpointError` becomes ``{"error", "code", "request_id", ...}`` with the error's
  HTTP status, ``Retry-After`` for retryable errors and ``WWW-Authenticate`` for 401.
* aiohttp's own ``HTTPException`` (unknown route 404, wrong method 405) is rendered the same way.
* Anything else is logged with its traceback and answered with a generic 500.

Requests for routes the gateway did not add (the controller's RPC endpoint on the same app)
pass through untouched.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import structlog
from aiohttp import web

from flashpoint import tracing
from flashpoint.errors import FlashpointError, RetryableError
from flashpoint.gateway.context import REQUEST_ID, GatewayContext, json_response
from flashpoint.ids import new_id
from flashpoint.log import get_logger

log = get_logger(__name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 408: "request_timeout", 413: "too_large",
               415: "unsupported_media_type", 429: "overloaded", 503: "unavailable"}


def request_id_from(header: str | None) -> str:
    if header and _REQUEST_ID_RE.match(header):
        return header
    return new_id("req")


def route_label(request: web.Request) -> str:
    info = request.match_info
    if info.http_exception is not None:
        return "unmatched"
    resource = info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def error_response(err: FlashpointError, request_id: str) -> web.Response:
    body: dict[str, Any] = {"error": err.message, "code": err.code, "request_id": request_id}
    details = err.to_wire()["details"]
    if details:
        body["details"] = details
    resp = json_response(body, status=err.http_status)
    if isinstance(err, RetryableError):
        resp.headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if err.http_status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="flashpoint"'
    return resp


def _http_error_response(exc: web.HTTPException, request_id: str) -> web.Response:
    code = _HTTP_CODES.get(exc.status, f"http_{exc.status}")
    message = exc.reason if exc.status != 404 else "no such route"
    resp = json_response({"error": message, "code": code, "request_id": request_id},
                         status=exc.status)
    for header in ("Allow", "Retry-After"):
        if header in exc.headers:
            resp.headers[header] = exc.headers[header]
    return resp


def make_middleware(ctx: GatewayContext) -> Any:
    metrics = ctx.metrics
    bind, reset = structlog.contextvars.bind_contextvars, structlog.contextvars.reset_contextvars

    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not ctx.owns(request):
            return await handler(request)
        rid = request_id_from(request.headers.get("X-Request-Id"))
        request[REQUEST_ID] = rid
        route = route_label(request)
        start_s = time.perf_counter()
        metrics.inflight_now += 1
        # bind/reset rather than bound_contextvars(): the generator-based context manager
        # cost more than the binding itself on this per-request path.
        tokens = bind(request_id=rid)
        try:
            # The handler is awaited here rather than in a helper coroutine: one frame less
            # on every request. _error_response renders what it raised.
            resp = await (handler(request) if tracing.tracer is None  # OpenTelemetry off
                          else tracing.http_span(request, route, rid, handler(request)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            resp = _error_response(request, exc, rid)
        finally:
            reset(**tokens)
            metrics.inflight_now -= 1
        resp.headers["X-Request-Id"] = rid
        if _body_left_unread(request):
            # Rejected before the body was consumed (413, corrupt encoding): the rest of it is
            # still on the wire, so this connection cannot carry another request.
            resp.force_close()
        metrics.observe(route, request.method, resp.status, time.perf_counter() - start_s)
        return resp

    return gateway_middleware


def _body_left_unread(request: web.Request) -> bool:
    try:
        return request.can_read_body
    except Exception:  # a payload that failed mid-stream
        return True


def _error_response(request: web.Request, exc: Exception, rid: str) -> web.StreamResponse:
    """What a handler raised, as the response: typed errors and aiohttp's HTTP errors as
    JSON with their status; anything else logged with its traceback, a generic 500.
    Called from the except clause that caught ``exc`` (log.exception reads it from there)."""
    if isinstance(exc, FlashpointError):
        if exc.http_status >= 500:
            log.warning("request_failed", code=exc.code, error=exc.message,
                        path=request.path, method=request.method)
        return error_response(exc, rid)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            return exc
        return _http_error_response(exc, rid)
    log.exception("unhandled_error", path=request.path, method=request.method)
    return json_response({"error": "internal server error", "code": "internal",
                          "request_id": rid}, status=500)
