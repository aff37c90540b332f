"""``deploy/``'s Prometheus rules and Grafana dashboard, checked by a real Prometheus.

``promtool`` validates the rules and the example scrape config and runs the rules' unit
tests (each alert fires on the series that should raise it, and only there). Then a real
Prometheus scrapes a running two-host local cluster (the controller and each host's own
metrics port) every second while it fails a cold start, scales a function from zero, chains
its model to a second host and serves requests; every query of every panel of the Grafana
dashboard must then return data (a finite value) through Prometheus' HTTP API, and the
values Prometheus reports are compared with what the test itself did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from cluster.test_start_failures import _publish_broken

from flashpoint.testing.harness import ClusterFactory, cluster_config

from .conftest import DEPLOY, PROMTOOL, Prometheus, need

pytestmark = pytest.mark.timeout(300)

RULES = DEPLOY / "prometheus" / "flashpoint-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "flashpoint-dashboard.json"
X = np.arange(6, dtype=np.float32).reshape(2, 3)
BODY = {"inputs": {"x": {"data": X.ravel().tolist(), "shape": [2, 3], "datatype": "FP32"}}}
CONTROLLER_JOB, HOSTS_JOB = "flashpoint-controller", "flashpoint-hosts"


def _promtool(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run([need(PROMTOOL), *args], capture_output=True, text=True, timeout=60,
                         cwd=cwd)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def test_the_alert_rules_pass_promtool_check() -> None:
    out = _promtool("check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_the_alerts_fire_where_their_unit_tests_say() -> None:
    _promtool("test", "rules", "flashpoint-rules.test.yml", cwd=RULES.parent)


def test_the_example_scrape_config_is_valid() -> None:
    _promtool("check", "config", "prometheus.yml", cwd=RULES.parent)


def panel_queries() -> list[tuple[str, str]]:
    """Every (panel title, PromQL) of the dashboard, rows' nested panels included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def test_the_dashboard_has_a_query_in_every_panel_and_names_a_job() -> None:
    dash = json.loads(DASHBOARD.read_text())
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15 and all(p.get("targets") for p in graphs)
    for title, expr in panel_queries():
        assert f'job="{CONTROLLER_JOB}"' in expr or f'job="{HOSTS_JOB}"' in expr, title


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _scalar(result: list[dict[str, Any]], **labels: str) -> float:
    rows = [r for r in result if all(r["metric"].get(k) == v for k, v in labels.items())]
    assert len(rows) == 1, (labels, result)
    return float(rows[0]["value"][1])


async def _invoke(s: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with s.post(f"{url}/v1/functions/{name}/invoke", json=BODY) as r:
        body = await r.json()
        assert r.status == 200, body
    np.testing.assert_allclose(np.asarray(body["outputs"]["y"]["data"]).reshape(2, 3), X)
    return body


async def test_every_dashboard_panel_returns_data_from_a_real_prometheus(make_cluster: ClusterFactory,
        tmp_path: Path, prometheus: Prometheus) -> None:
    # One device per host with room for one replica: the second replica goes to the other
    # host and gets its bytes down a chain from the first.
    cfg = cluster_config(tmp_path, metrics_listen="127.0.0.1:0",
                         device_memory_bytes=100 << 20, worker_memory_bytes=64 << 20)
    # Function names no other test uses: the controller's metrics are process-wide, and a
    # suite run has served other functions named "nf" before this test counts requests.
    # One failed start begins a long back-off: exactly one start of "prom-bad" fails.
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, max_start_failures=1, start_backoff_s=300.0, start_backoff_max_s=300.0))
    c = await make_cluster(hosts=2, config=cfg)
    await _publish_broken(c.store)
    host_urls = [h.metrics.url for h in c.hosts if h.metrics is not None]
    assert len(host_urls) == 2 and len(set(host_urls)) == 2
    url = c.controller.url
    await prometheus.start({CONTROLLER_JOB: [url.removeprefix("http://")],
                            HOSTS_JOB: [u.removeprefix("http://") for u in host_urls]})

    async def all_up() -> tuple[bool, Any]:
        up = await prometheus.query("up")
        return len(up) == 3 and all(r["value"][1] == "1" for r in up), up

    await prometheus.wait("every target up", all_up, timeout_s=30)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        # A function whose every start fails: its first request fails after the
        # controller's streak of failed starts (tests/cluster/test_start_failures.py).
        async with s.post(f"{url}/v1/functions", json={
                "name": "prom-bad", "model": "broken", "timeout_s": 120}) as r:
            assert r.status == 201, await r.text()
        async with s.post(f"{url}/v1/functions/prom-bad/invoke", json=BODY) as r:
            err = await r.json()
            assert r.status == 503 and err["code"] == "model_load_failed", err
        failed_starts = err["details"]["failed_starts"]
        # A scale from zero, then a second replica chained from the first one's host.
        async with s.post(f"{url}/v1/functions", json={
                "name": "prom-nf", "model": "noop", "slo_ms": 30_000}) as r:
            assert r.status == 201, await r.text()
        first = await _invoke(s, url, "prom-nf")
        assert first["cold"] is True
        async with s.post(f"{url}/v1/functions", json={
                "name": "prom-nf", "model": "noop", "slo_ms": 30_000, "min_replicas": 2}) as r:
            assert r.status in (200, 201), await r.text()
        state = c.controller.state

        async def two_warm() -> tuple[bool, Any]:
            warm = [r for r in state.replicas.values()
                    if r.function == "prom-nf" and r.phase == "warm"]
            return len(warm) == 2, [(r.replica_id, r.phase) for r in state.replicas.values()]

        await prometheus.wait("a second warm replica", two_warm, timeout_s=60)
        # Requests in two waves a few scrapes apart, so every counter Prometheus saw
        # born also grows inside the panels' rate windows.
        requests = 1
        for wave in range(2):
            for _ in range(5):
                await _invoke(s, url, "prom-nf")
            await asyncio.gather(*(_invoke(s, url, "prom-nf") for _ in range(10)))
            requests += 15
            if wave == 0:
                async def seen(n: int = requests) -> tuple[bool, Any]:
                    got = await prometheus.query(
                        f'sum(flashpoint_requests_total{{job="{CONTROLLER_JOB}",'
                        f'function="prom-nf",outcome="ok"}})')
                    return bool(got) and float(got[0]["value"][1]) == n, got

                await prometheus.wait("the first wave scraped", seen, timeout_s=30)

        queries = panel_queries()

        async def every_panel() -> tuple[bool, Any]:
            empty = []
            for title, expr in queries:
                if not _finite(await prometheus.query(expr)):
                    empty.append((title, expr))
            return not empty, f"panels without data: {empty}"

        await prometheus.wait(f"data in all {len(queries)} panel queries", every_panel,
                              timeout_s=60)

        # What Prometheus holds is what the test did (once it scraped the last wave).
        ctl = f'job="{CONTROLLER_JOB}"'

        async def last_wave() -> tuple[bool, Any]:
            ok = await prometheus.query(f'sum by (function) '
                                        f'(flashpoint_requests_total{{{ctl},outcome="ok"}})')
            return bool(ok) and _scalar(ok, function="prom-nf") == requests, ok

        await prometheus.wait(f"{requests} requests of prom-nf counted", last_wave, timeout_s=30)
        failed = await prometheus.query(
            f'sum by (function) (flashpoint_cold_starts_failed_total{{{ctl}}})')
        assert _scalar(failed, function="prom-bad") == failed_starts == 1
        started = await prometheus.query(
            f'sum by (tier) (flashpoint_replicas_started_total{{{ctl},function="prom-nf"}})')
        # the scale from zero read the registry (no host held the model); the second
        # replica came down a chain from the first one's host
        assert _scalar(started, tier="registry") == 1 and _scalar(started, tier="peer") == 1
        replicas = await prometheus.query(f'flashpoint_function_replicas{{{ctl},phase="warm"}}')
        assert _scalar(replicas, function="prom-nf") == 2
        assert _scalar(replicas, function="prom-bad") == 0

        async def served() -> tuple[bool, Any]:
            # every request was run by a replica's batcher, which counted it
            got = await prometheus.query(f'sum(flashpoint_replica_requests_total'
                                         f'{{job="{HOSTS_JOB}",function="prom-nf"}})')
            return bool(got) and float(got[0]["value"][1]) == requests, got

        await prometheus.wait(f"the replicas' {requests} requests", served, timeout_s=30)
        walls = await prometheus.query(
            f'sum by (tier) (flashpoint_cold_start_wall_seconds_count{{{ctl},function="prom-nf"}})')
        assert _scalar(walls, tier="registry") == 1  # the one request that waited
        phases = await prometheus.query(
            f'sum by (phase) (flashpoint_cold_start_seconds_sum{{{ctl},function="prom-nf",'
            f'tier="registry"}})')
        timed = {r["metric"]["phase"]: float(r["value"][1]) for r in phases}
        for phase in ("decision", "obtain", "load", "first_inference", "request"):
            assert phase in timed, timed
            assert timed[phase] == pytest.approx(first["timings_s"][phase], abs=1e-6), phase
        lost = await prometheus.query(f'flashpoint_hosts{{{ctl}}}')
        assert _scalar(lost, state="alive") == 2 and _scalar(lost, state="lost") == 0
