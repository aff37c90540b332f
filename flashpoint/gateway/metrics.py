"""Prometheus metrics of the gateway and the ``/metrics`` exposition handler.

Routes are labelled by their template (``/v2/models/{name}/infer``), never the raw path, so
label cardinality stays bounded whatever clients send.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flashpoint.exposition import render

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.also: tuple[CollectorRegistry, ...] = ()  # other registries /metrics renders
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self.requests = Counter(
            "flashpoint_gateway_requests", "HTTP requests handled by the gateway",
            ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram(
            "flashpoint_gateway_request_duration_seconds",
            "Gateway request latency from first byte to response",
            ["route", "method"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        # Requests in the gateway middleware now: a plain int on the request path, read by
        # the gauge when /metrics is scraped (two locked updates a request saved).
        self.inflight_now = 0
        self.inflight = Gauge(
            "flashpoint_gateway_requests_in_flight", "Requests being handled now",
            registry=self.registry)
        self.inflight.set_function(lambda: self.inflight_now)

    def observe(self, route: str, method: str, status: int, duration_s: float) -> None:
        # Labelled children are cached: labels() costs more than the update on every request.
        # Routes are the app's own and statuses few, so the cache stays small.
        key = (route, method, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(route, method, str(status)),
                                              self.latency.labels(route, method))
        children[0].inc()
        children[1].observe(duration_s)

    async def handle(self, request: web.Request) -> web.Response:
        # The gateway's own registry, then the process's (``also``): the controller's
        # request and SLO counters, RPC and cache metrics are scraped from the same URL.
        return render((self.registry, *self.also))
