"""HTTP gateway: the native ``/v1`` API and the KServe v2 Open Inference Protocol.

Public API::

    make_app(backend, config) -> aiohttp.web.Application
    add_routes(app, backend, config, registry=None) -> GatewayContext
    web.AppRunner(app, **RUNNER_KWARGS)   # the gateway inflates request bodies itself
    GatewayConfig, InvokeBackend, InvokeResult, FunctionInfo
"""

from flashpoint.config import GatewayConfig
from flashpoint.gateway.app import GATEWAY, RUNNER_KWARGS, add_routes, make_app
from flashpoint.gateway.backend import FunctionInfo, InvokeBackend, InvokeResult

__all__ = [
    "GATEWAY", "RUNNER_KWARGS", "FunctionInfo", "GatewayConfig", "InvokeBackend", "InvokeResult",
    "add_routes", "make_app",
]
