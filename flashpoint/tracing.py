"""OpenTelemetry traces of requests and cold starts, when configured (an optional extra).

Off unless configured: with tracing off every hook is one ``is None`` test, and nothing
imports ``opentelemetry`` (``pip install 'flashpoint[otel]'`` adds the API and SDK). A
process turns it on with :func:`setup_from_env` (``flashpoint up | controller | gateway |
host`` and every worker call it) or, in tests, :func:`enable` with a provider of their own.

What is traced, one trace per request (W3C trace context throughout):

- the **gateway** (``gateway/middleware.py``): a server span per API request, a child of the
  caller's ``traceparent`` header when it sends one;
- the **controller** (:func:`trace_method` on ``Controller.invoke``): a span per invocation, a
  child of the gateway's (same task); its ``traceparent`` rides in the request's payload to
  the worker (:func:`inject`);
- the **worker** (:func:`worker_span`): a span per request it ran (queued in its batcher,
  then the model run), a child of the controller's;
- a **cold start** (:func:`cold_start`): the request that waited for a replica's start
  gets a ``flashpoint.cold_start`` span with one child per phase of its breakdown
  (controller/cold_timings.py), laid end to end as they happened, with the source tier.

Configuration (environment, so worker processes inherit it from their host):
``FLASHPOINT_TRACES_FILE=/path`` appends every finished span to that file as one JSON line
(offline debugging, and how tests read a worker's spans); ``OTEL_TRACES_EXPORTER=console``
prints them; ``OTEL_TRACES_EXPORTER=otlp`` sends them to ``OTEL_EXPORTER_OTLP_ENDPOINT``
(needs ``opentelemetry-exporter-otlp``). ``OTEL_SERVICE_NAME`` overrides the service name.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from typing import Any, TypeVar

from flashpoint.log import get_logger

log = get_logger("flashpoint.tracing")

TRACES_FILE_ENV = "FLASHPOINT_TRACES_FILE"
TRACEPARENT = "traceparent"
_T = TypeVar("_T")

# The tracer once tracing is on (None: off). Hooks read it as ``tracing.tracer``.
tracer: Any = None


def enabled() -> bool:
    return tracer is not None


def enable(provider: Any = None) -> None:
    """Turn tracing on in this process with ``provider`` (an SDK ``TracerProvider``; None:
    the global one)."""
    global tracer
    from opentelemetry import trace

    tracer = trace.get_tracer("flashpoint", tracer_provider=provider)


def disable() -> None:
    """Turn tracing off again (tests)."""
    global tracer
    tracer = None


def setup_from_env(service_name: str) -> bool:
    """Configure tracing from the environment (module docstring); True when it is on. A
    missing SDK or exporter is logged and leaves tracing off: never fatal."""
    path = os.environ.get(TRACES_FILE_ENV, "")
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not path and exporter_name in ("", "none"):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing_unavailable", reason="opentelemetry-sdk is not installed "
                    "(pip install 'flashpoint[otel]')")
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if path:
        # Synchronous: a span is in the file once it ended (a worker may exit any time).
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    if exporter_name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("tracing_exporter_unavailable", exporter="otlp",
                        reason="pip install opentelemetry-exporter-otlp")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    enable(provider)
    log.info("tracing_enabled", service=name, file=path or None, exporter=exporter_name or None)
    return True


class JsonLinesExporter:
    """A ``SpanExporter`` appending each span as one JSON line (ids in hex)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_dict(s)) + "\n" for s in spans]
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def span_dict(span: Any) -> dict[str, Any]:
    """A finished SDK span as plain data: name, hex trace/span/parent ids, times, attributes."""
    ctx = span.get_span_context()
    return {"name": span.name, "trace_id": f"{ctx.trace_id:032x}",
            "span_id": f"{ctx.span_id:016x}",
            "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
            "start_ns": span.start_time, "end_ns": span.end_time,
            "service": span.resource.attributes.get("service.name", ""),
            "attributes": dict(span.attributes or {})}


# -- hooks -----------------------------------------------------------------------------
def trace_method(obj: Any, method: str, name: str,
                 attrs: Callable[..., Mapping[str, Any]] | None = None) -> None:
    """With tracing on, make ``obj.<method>`` (a coroutine method) run each call inside a
    span ``name``, the current span while it runs (``attrs(*args, **kwargs)``: its
    attributes). With tracing off it does nothing: the method stays the plain one, so the
    hot path pays nothing. Call it before anything binds the method (the actor's start)."""
    if tracer is None:
        return
    fn: Callable[..., Coroutine[Any, Any, Any]] = getattr(obj, method)

    async def in_span(*args: Any, **kwargs: Any) -> Any:
        with tracer.start_as_current_span(
                name, attributes=attrs(*args, **kwargs) if attrs else None):
            return await fn(*args, **kwargs)

    in_span.__name__, in_span.__doc__ = fn.__name__, fn.__doc__
    setattr(obj, method, in_span)  # an instance attribute shadows the class's method


async def http_span(request: Any, route: str, request_id: str,
                    handler: Awaitable[_T]) -> _T:
    """Await ``handler`` (the gateway's route handler) inside a server span, a child of the
    request's ``traceparent`` header when it has one."""
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    parent = propagate.extract(request.headers)
    with tracer.start_as_current_span(
            f"{request.method} {route}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route,
                        "flashpoint.request_id": request_id}) as span:
        resp = await handler
        status = getattr(resp, "status", None)
        if status is not None:
            span.set_attribute("http.response.status_code", int(status))
        return resp


def inject(carrier: MutableMapping[str, Any]) -> None:
    """Put the current span's ``traceparent`` into ``carrier`` (a request payload)."""
    if tracer is not None:
        from opentelemetry import propagate

        propagate.inject(carrier)


def traceparent() -> str:
    """The current span's ``traceparent`` ("" with tracing off): what a typed request
    message carries to the next process."""
    if tracer is None:
        return ""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get(TRACEPARENT, "")


@contextlib.contextmanager
def remote_parent(traceparent: str) -> Iterator[None]:
    """Within it, the current trace context is ``traceparent``'s (a request a stand-alone
    gateway forwarded over RPC); a no-op with tracing off or no traceparent."""
    if tracer is None or not traceparent:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract({TRACEPARENT: traceparent}))
    try:
        yield
    finally:
        context.detach(token)


def worker_span(traceparent: str, request_id: str, timings_s: Mapping[str, float]) -> None:
    """A span for one request a worker ran, a child of ``traceparent`` (the controller's
    span): it ends now and began ``batch_wait + inference`` seconds ago (the batcher's
    timings). Nothing with tracing off or no traceparent."""
    if tracer is None or not traceparent:
        return
    from opentelemetry import propagate

    wait_s = float(timings_s.get("batch_wait", 0.0))
    run_s = float(timings_s.get("inference", 0.0))
    end_ns = time.time_ns()
    start_ns = end_ns - int((wait_s + run_s) * 1e9)
    parent = propagate.extract({TRACEPARENT: traceparent})
    attrs = {"flashpoint.request_id": request_id,
             "flashpoint.batch_wait_s": wait_s, "flashpoint.inference_s": run_s}
    if "batch_rows" in timings_s:
        attrs["flashpoint.batch_rows"] = float(timings_s["batch_rows"])
    span = tracer.start_span("flashpoint.worker.infer", context=parent, start_time=start_ns,
                             attributes=attrs)
    span.end(end_time=end_ns)


def cold_start(replica_id: str, function: str, source: str, tier: str,
               timings_s: Mapping[str, float], phases: Sequence[str]) -> None:
    """The cold start a request waited for, as spans under the current one: a
    ``flashpoint.cold_start`` span from its arrival to its answer (``timings_s["total"]``)
    and one child per phase of ``phases`` present in ``timings_s``, end to end in order."""
    if tracer is None or "total" not in timings_s:
        return
    end_ns = time.time_ns()
    at = start_ns = end_ns - int(float(timings_s["total"]) * 1e9)
    attrs = {"flashpoint.replica_id": replica_id, "flashpoint.function": function,
             "flashpoint.source": source, "flashpoint.tier": tier}
    root = tracer.start_span("flashpoint.cold_start", start_time=start_ns, attributes=attrs)
    from opentelemetry import trace

    ctx = trace.set_span_in_context(root)
    for phase in phases:
        if phase not in timings_s:
            continue
        step = int(float(timings_s[phase]) * 1e9)
        child = tracer.start_span(f"cold_start.{phase}", context=ctx, start_time=at,
                                  attributes={"flashpoint.phase": phase, **attrs})
        at = min(at + step, end_ns)
        child.end(end_time=at)
    root.end(end_time=end_ns)
