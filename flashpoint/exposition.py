"""Prometheus exposition for every Flashpoint process.

Metrics live in two kinds of registry: the process-wide default one (the controller's
request and SLO counters, RPC, the model cache, token managers, MIG reconfiguration) and a
gateway's private one (private so several gateways can share a test process). A scrape of
any ``/metrics`` renders all the registries the process owns, so what the code counts is
what an operator sees. Host managers, which serve no HTTP otherwise, get a small endpoint of
their own (``[host] metrics_listen``); its ``extra`` hook adds, per scrape, collectors
gathered from other processes (a host's workers' replica counters, host/replica_metrics.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from flashpoint.errors import BadRequest
from flashpoint.log import get_logger

log = get_logger("flashpoint.exposition")

# Per-scrape collectors: objects with ``collect()`` yielding metric families.
ExtraCollectors = Callable[[], Awaitable[Sequence[Any]]]


def render(registries: Sequence[CollectorRegistry]) -> web.Response:
    """One text exposition of ``registries``, in order."""
    resp = web.Response(body=b"".join(generate_latest(r) for r in registries))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


def parse_listen(value: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise BadRequest(f"metrics_listen must be 'host:port', got {value!r:.80}")
    return host, int(port)


class MetricsEndpoint:
    """``GET /metrics`` with the process registry, on its own port.

    ``extra``, if given, is awaited on every scrape for collectors rendered after the
    registries (in a registry of their own, for that scrape only); if it raises, the scrape
    still answers with the registries (the hook's failure is logged). With ``keys``, a
    scrape must carry one of them as ``Authorization: Bearer <key>`` (401 otherwise).
    """

    def __init__(self, listen: str,
                 registries: Sequence[CollectorRegistry] = (REGISTRY,),
                 extra: ExtraCollectors | None = None,
                 keys: Collection[str] | None = None) -> None:
        self._keys = frozenset(keys) if keys else None
        self._host, self._port = parse_listen(listen)
        self._registries = tuple(registries)
        self._extra = extra
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        assert self._keys is not None
        return scheme.lower() == "bearer" and any(
            hmac.compare_digest(key.encode(), k.encode()) for k in self._keys)

    async def start(self) -> str:
        """Start serving; returns the base URL (``http://host:port``)."""
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self._host}:{port}"
        return self.url

    async def _handle(self, request: web.Request) -> web.Response:
        if self._keys is not None and not self._authorized(request):
            return web.json_response({"error": "this /metrics needs an API key (Bearer)",
                                      "code": "unauthorized"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        if self._extra is None:
            return render(self._registries)
        scrape = CollectorRegistry(auto_describe=False)
        try:
            for collector in await self._extra():
                scrape.register(collector)
        except Exception as exc:  # never fail the scrape of what this process counts itself
            log.warning("metrics_extra_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            scrape = CollectorRegistry(auto_describe=False)
        return render((*self._registries, scrape))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
