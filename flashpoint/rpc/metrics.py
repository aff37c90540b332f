"""Prometheus metrics of the RPC layer, with labelled children cached off the hot path."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# fmt: off
_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)
# fmt: on
CALLS = Counter("flashpoint_rpc_calls_total", "RPC calls made, by method and outcome", ["method", "outcome"])
CALL_SECONDS = Histogram(
    "flashpoint_rpc_call_seconds",
    "RPC call latency seen by the caller",
    ["method"],
    buckets=_BUCKETS_S,
)
HANDLED = Counter(
    "flashpoint_rpc_handled_total", "RPC requests handled, by method and outcome", ["method", "outcome"]
)
CONNECTIONS = Gauge("flashpoint_rpc_connections", "Open RPC connections")

_calls: dict[tuple[str, str], object] = {}
_latency: dict[str, object] = {}
_handled: dict[tuple[str, str], object] = {}


def observe_call(method: str, outcome: str, seconds: float) -> None:
    key = (method, outcome)
    c = _calls.get(key)
    if c is None:
        c = _calls[key] = CALLS.labels(method, outcome)
    c.inc()  # type: ignore[attr-defined]
    h = _latency.get(method)
    if h is None:
        h = _latency[method] = CALL_SECONDS.labels(method)
    h.observe(seconds)  # type: ignore[attr-defined]


def observe_handled(method: str, outcome: str) -> None:
    key = (method, outcome)
    c = _handled.get(key)
    if c is None:
        c = _handled[key] = HANDLED.labels(method, outcome)
    c.inc()  # type: ignore[attr-defined]
