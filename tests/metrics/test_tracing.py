"""OpenTelemetry traces (flashpoint/tracing.py): one request's spans link gateway ->
controller -> worker under the caller's ``traceparent`` (the controller's own API, and a
stand-alone gateway in front of it), and a cold start's phases are spans under the request
that waited for it.

The gateway's and controller's spans (this process) go to the SDK's in-memory exporter; the
worker, a process of its own, writes its spans to ``FLASHPOINT_TRACES_FILE`` (inherited from
this process's environment through its host). References are the test's own: the trace and
parent ids it sent, and the phase durations the invoke's reply reports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint import tracing
from flashpoint.controller.cold_timings import COLD_PHASES
from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra (opentelemetry-sdk)")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

pytestmark = pytest.mark.timeout(180)

X = np.arange(6, dtype=np.float32).reshape(2, 3)
BODY = {"inputs": {"x": {"data": X.ravel().tolist(), "shape": [2, 3], "datatype": "FP32"}}}


@pytest.fixture
def memory_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into an in-memory exporter; off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


def _spans(exporter: InMemorySpanExporter, trace_id: str) -> list[dict[str, Any]]:
    return [s for s in map(tracing.span_dict, exporter.get_finished_spans())
            if s["trace_id"] == trace_id]


def _worker_spans(path: Path, trace_id: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["trace_id"] == trace_id]


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [s["name"] for s in spans])
    return found[0]


async def _invoke(s: aiohttp.ClientSession, url: str, traceparent: str | None) -> dict[str, Any]:
    headers = {"traceparent": traceparent} if traceparent else {}
    async with s.post(f"{url}/v1/functions/tf/invoke", json=BODY, headers=headers) as r:
        body = await r.json()
        assert r.status == 200, body
    np.testing.assert_allclose(np.asarray(body["outputs"]["y"]["data"]).reshape(2, 3), X)
    return body


async def test_a_request_and_its_cold_start_are_one_trace(make_cluster: ClusterFactory,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        memory_spans: InMemorySpanExporter) -> None:
    worker_file = tmp_path / "worker-spans.jsonl"
    monkeypatch.setenv(tracing.TRACES_FILE_ENV, str(worker_file))  # the workers inherit it
    cfg = cluster_config(tmp_path)
    c = await make_cluster(config=cfg)
    gateway: StandaloneGateway | None = None
    try:
        url = c.controller.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
            async with s.post(f"{url}/v1/functions", json={"name": "tf", "model": "noop"}) as r:
                assert r.status == 201, await r.text()
            # The caller's own trace: a scale from zero, then a warm request.
            for cold in (True, False):
                trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
                reply = await _invoke(s, url, f"00-{trace_id}-{caller_span}-01")
                assert reply["cold"] is cold
                spans = _spans(memory_spans, trace_id)
                gw = _one(spans, "POST /v1/functions/{name}/invoke")
                assert gw["parent_id"] == caller_span  # the caller's traceparent honoured
                assert gw["attributes"]["http.response.status_code"] == 200
                ctl = _one(spans, "flashpoint.controller.invoke")
                assert ctl["parent_id"] == gw["span_id"]
                assert ctl["attributes"]["flashpoint.function"] == "tf"
                # the worker's span, in its own process, is a child of the controller's
                (work,) = _worker_spans(worker_file, trace_id)
                assert work["name"] == "flashpoint.worker.infer"
                assert work["parent_id"] == ctl["span_id"]
                assert work["service"] == "flashpoint-worker"
                assert work["attributes"]["flashpoint.inference_s"] == pytest.approx(
                    reply["timings_s"]["inference"])
                cold_spans = [sp for sp in spans if sp["name"] == "flashpoint.cold_start"]
                if not cold:
                    assert cold_spans == []  # a warm request has no cold start
                    continue
                (root,) = cold_spans
                assert root["parent_id"] == ctl["span_id"]
                assert root["attributes"]["flashpoint.tier"] == "registry"  # no host held it
                assert root["attributes"]["flashpoint.source"] == reply["cold_start_source"]
                assert (root["end_ns"] - root["start_ns"]) / 1e9 == pytest.approx(
                    reply["timings_s"]["total"], abs=1e-6)
                # one child per phase of the reply's breakdown, end to end, in order
                phases = [sp for sp in spans if sp["parent_id"] == root["span_id"]]
                phases.sort(key=lambda sp: sp["start_ns"])
                want = [p for p in COLD_PHASES if p in reply["timings_s"]]
                assert [sp["attributes"]["flashpoint.phase"] for sp in phases] == want
                assert len(want) == len(COLD_PHASES)  # the full breakdown (issue 21)
                assert phases[0]["start_ns"] == root["start_ns"]
                for a, b in zip(phases, phases[1:], strict=False):
                    assert a["end_ns"] == b["start_ns"]
                for sp in phases:
                    assert (sp["end_ns"] - sp["start_ns"]) / 1e9 == pytest.approx(
                        reply["timings_s"][sp["attributes"]["flashpoint.phase"]], abs=1e-6)
            # No traceparent: the gateway starts the trace, and the rest still joins it.
            memory_spans.clear()
            await _invoke(s, url, None)
            (gw,) = [sp for sp in map(tracing.span_dict, memory_spans.get_finished_spans())
                     if sp["name"].startswith("POST ")]
            assert gw["parent_id"] is None
            trace_id = gw["trace_id"]
            assert _one(_spans(memory_spans, trace_id),
                        "flashpoint.controller.invoke")["parent_id"] == gw["span_id"]
            assert len(_worker_spans(worker_file, trace_id)) == 1
            # Through a stand-alone gateway: its span rides the RPC to the controller.
            gw_cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
                cfg.gateway, controller_url=c.controller.rpc_url, refresh_s=0.1))
            gateway = await asyncio.wait_for(StandaloneGateway.start(gw_cfg, port=0), 30)
            for _ in range(100):  # bounded: its function list refreshes every 0.1 s
                async with s.get(f"{gateway.url}/v1/functions/tf") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the stand-alone gateway never listed tf within 10 s")
            trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
            await _invoke(s, gateway.url, f"00-{trace_id}-{caller_span}-01")
            spans = _spans(memory_spans, trace_id)
            gws = [sp for sp in spans if sp["name"] == "POST /v1/functions/{name}/invoke"]
            assert [sp["parent_id"] for sp in gws] == [caller_span]  # the gateway's own
            ctl = _one(spans, "flashpoint.controller.invoke")
            assert ctl["parent_id"] == gws[0]["span_id"]
            (work,) = _worker_spans(worker_file, trace_id)
            assert work["parent_id"] == ctl["span_id"]
    finally:
        if gateway is not None:
            await asyncio.wait_for(gateway.stop(), 30)
        await asyncio.wait_for(c.stop(), 60)


def test_tracing_is_off_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.TRACES_FILE_ENV, raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.setup_from_env("flashpoint-test") is False
    assert not tracing.enabled()
    carrier: dict[str, Any] = {}
    tracing.inject(carrier)
    assert carrier == {}  # nothing rides on a request payload
