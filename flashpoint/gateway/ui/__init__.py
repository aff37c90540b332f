"""The operator's dashboard: a static page at ``/ui`` and the JSON it polls.

    GET /ui, /ui/                 none    the page (a static shell: it holds no data)
    GET /ui/static/{name}         none    its script and style sheet (shipped in the package)
    GET /v1/ui/auth               none    {"key_required": bool}: whether to ask for a key
    GET /v1/ui/state              invoke  every view's data (gateway/ui/view.py)

The page keeps no secret in the served files: on a cluster with API keys (``/v1/ui/auth``
says so, as any 401's ``WWW-Authenticate`` would) the page asks for a key, keeps it in ``sessionStorage`` and
sends it as every API client does (``Authorization: Bearer``). Every asset is a file of this
package (no CDN: clusters often have no internet), served with a strict Content-Security-
Policy (own origin only, no inline script).
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from flashpoint.gateway.auth import Role
from flashpoint.gateway.context import GatewayContext, json_response
from flashpoint.gateway.ui.view import ui_state

# name -> content type; only these files are served (no path from the URL reaches the disk).
ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def load_assets() -> dict[str, bytes]:
    """The page's files, read once from the installed package."""
    root = resources.files(__package__) / "static"
    return {name: (root / name).read_bytes() for name in ASSETS}


class UiRoutes:
    """The dashboard's routes on a gateway (the controller's own API or ``flashpoint
    gateway``): the data comes from ``ctx.backend.cluster_status()`` either way."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx
        self._assets = load_assets()

    def route_defs(self) -> list[web.RouteDef]:
        return [
            web.get("/ui", self.page),
            web.get("/ui/", self.page),
            web.get("/ui/static/{name}", self.asset),
            web.get("/v1/ui/auth", self.auth),
            web.get("/v1/ui/state", self.state),
        ]

    def _file(self, name: str) -> web.Response:
        resp = web.Response(body=self._assets[name], content_type=ASSETS[name],
                            charset="utf-8")
        resp.headers.update(_SECURITY_HEADERS)
        return resp

    async def page(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS or name == "index.html":
            raise web.HTTPNotFound()
        return self._file(name)

    async def auth(self, request: web.Request) -> web.Response:
        # Asked before any data call, so an open page never draws a 401 (a console error).
        return json_response({"key_required": self.ctx.auth.enabled})

    async def state(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        resp = json_response(ui_state(self.ctx.backend.cluster_status()))
        resp.headers["Cache-Control"] = "no-store"
        return resp
