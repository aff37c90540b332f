"""Application factory: mount the gateway's routes, middleware and metrics on an aiohttp app.

``make_app`` builds a standalone app; ``add_routes`` mounts the gateway beside other routes
(the controller's RPC endpoint) on an existing, not yet started app. The middleware only
touches the gateway's own routes and unmatched paths.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from flashpoint.config import GatewayConfig
from flashpoint.gateway.auth import Role
from flashpoint.gateway.backend import InvokeBackend
from flashpoint.gateway.context import GatewayContext
from flashpoint.gateway.kserve import KServeRoutes
from flashpoint.gateway.metrics import GatewayMetrics
from flashpoint.gateway.middleware import make_middleware
from flashpoint.gateway.native import NativeRoutes
from flashpoint.gateway.openai import OpenAIRoutes
from flashpoint.gateway.profile import ProfileBackend, ProfileRoutes
from flashpoint.gateway.ui import UiRoutes
from flashpoint.kaas.backend import KaasBackend

GATEWAY = web.AppKey("flashpoint_gateway", GatewayContext)

# Pass to ``web.AppRunner(app, **RUNNER_KWARGS)``. With aiohttp's default auto_decompress=True
# the gateway still enforces its caps (it reads the inflated stream under
# ``max_decompressed_bytes``), but a body whose compression is corrupt in its first packet is
# then refused by aiohttp's parser with a plain-text 400 the gateway never sees. With it off
# the gateway inflates bodies itself, so every error is JSON.
RUNNER_KWARGS = {"auto_decompress": False}


def add_routes(app: web.Application, backend: InvokeBackend,
               config: GatewayConfig | None = None, *,
               registry: CollectorRegistry | None = None,
               kaas: KaasBackend | None = None,
               process_registry: CollectorRegistry | None = None,
               profiler: ProfileBackend | None = None) -> GatewayContext:
    """Mount the gateway on ``app``; ``registry`` defaults to a private Prometheus registry.

    ``process_registry`` (the process-wide default one, for the controller and a stand-alone
    gateway) is rendered by ``/metrics`` after the gateway's own metrics.
    ``kaas`` (optional) enables ``/v1/kaas/invoke``, ``/v1/objects`` and the native invoke's
    ``store_outputs``. ``profiler`` (optional; the controller's) enables
    ``POST /v1/functions/{name}/profile``.
    """
    config = config or GatewayConfig()
    ctx = GatewayContext.create(backend, config, GatewayMetrics(registry))
    if process_registry is not None:
        ctx.metrics.also = (process_registry,)
    ctx.kaas = kaas
    app[GATEWAY] = ctx
    app.middlewares.append(make_middleware(ctx))
    defs = (NativeRoutes(ctx).route_defs() + KServeRoutes(ctx).route_defs()
            + OpenAIRoutes(ctx).route_defs() + UiRoutes(ctx).route_defs())
    if kaas is not None:
        from flashpoint.gateway.kaas import KaasRoutes

        defs += KaasRoutes(ctx, kaas).route_defs()
    if profiler is not None:
        defs += ProfileRoutes(ctx, profiler).route_defs()
    defs.append(web.get("/metrics", _metrics_handler(ctx)))
    for d in defs:
        route = app.router.add_route(d.method, d.path, d.handler)
        if route.resource is not None:
            ctx.resources.add(route.resource)
    return ctx


def _metrics_handler(ctx: GatewayContext) -> Any:
    """``/metrics``, behind an API key (any role) when ``metrics_require_key``."""
    if not ctx.config.metrics_require_key:
        return ctx.metrics.handle

    async def handle(request: web.Request) -> web.Response:
        ctx.require(request, Role.INVOKE)
        return await ctx.metrics.handle(request)

    return handle


def make_app(backend: InvokeBackend, config: GatewayConfig | None = None, *,
             kaas: KaasBackend | None = None,
             process_registry: CollectorRegistry | None = None) -> web.Application:
    """A standalone gateway application."""
    config = config or GatewayConfig()
    # Handlers stream bodies themselves under config limits; request.read() is never used.
    app = web.Application(client_max_size=config.max_body_bytes)
    add_routes(app, backend, config, kaas=kaas, process_registry=process_registry)
    return app
