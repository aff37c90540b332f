"""The dashboard (``/ui``) in a real headless Chromium against a real local cluster.

What the page shows is checked against what the API says independently (``/v1/status``, an
invoke's own reply) and against what a fresh cluster must have done (its first cold start
read the model from the registry: no host held it). Every test also reads the browser's
console: a failed load or an uncaught exception fails it. Screenshots of every view land in
``test-artifacts/ui/`` (tests/ui/conftest.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.testing.harness import ClusterFactory, cluster_config

from .conftest import console_errors, screenshot, wait_until

pytestmark = pytest.mark.timeout(240)

VIEWS = ("cluster", "functions", "waterfall", "transfers", "mig", "cost")
ADMIN_KEY = "ui-test-admin-key-0123456789abcdef"
X = np.arange(6, dtype=np.float32).reshape(2, 3)
BODY = {"inputs": {"x": {"data": X.ravel().tolist(), "shape": [2, 3], "datatype": "FP32"}}}


def _ids(driver: Any, view: str, attr: str) -> set[str]:
    return set(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))",
        f"#view-{view} [{attr}]", attr))


def _waterfall_row(driver: Any, replica_id: str) -> dict[str, Any] | None:
    """The row of ``replica_id`` as plain data, read in one script (the page re-renders
    every poll, so element handles go stale)."""
    return driver.execute_script("""
        const row = [...document.querySelectorAll('#view-waterfall .wf-row')]
            .find(e => e.dataset.replicaId === arguments[0]);
        return row ? {source: row.dataset.source, tier: row.dataset.tier, text: row.innerText,
                      phases: [...row.querySelectorAll('.wf-seg')].map(s => s.dataset.phase)}
                   : null;""", replica_id)


def _show(driver: Any, view: str) -> None:
    driver.find_element("css selector", f'#tabs a[data-view="{view}"]').click()
    wait_until(driver, f"the {view} view shown", lambda d: d.execute_script(
        "const v = document.getElementById(arguments[0]); return !v.hidden && v.dataset.rendered",
        f"view-{view}"))


def _check_page(driver: Any, base: str, status: dict[str, Any], invoked: dict[str, Any],
                shots: str) -> None:
    driver.get(f"{base}/ui")
    hosts = {h["host_id"] for h in status["hosts"]}
    replicas = {r["replica_id"] for r in status["replicas"]}
    assert hosts and invoked["replica_id"] in replicas
    wait_until(driver, f"hosts {sorted(hosts)} on the cluster map",
               lambda d: hosts <= _ids(d, "cluster", "data-host-id"))
    wait_until(driver, f"replicas {sorted(replicas)} on the cluster map",
               lambda d: replicas <= _ids(d, "cluster", "data-replica-id"))
    second = next(r for r in status["replicas"] if r["replica_id"] != invoked["replica_id"])
    first_host = next(r["host_id"] for r in status["replicas"]
                      if r["replica_id"] == invoked["replica_id"])
    assert second["host_id"] != first_host and second["source"] == f"chain:{first_host}"
    for view in VIEWS:
        _show(driver, view)
        screenshot(driver, f"{shots}-{view}")
        if view == "functions":
            assert "nf" in _ids(driver, "functions", "data-function")
        if view == "waterfall":
            row = wait_until(driver, "the scale-from-zero in the waterfall",
                             lambda d: _waterfall_row(d, invoked["replica_id"]))
            # Where the bytes came from, as the invoke's reply said, and as a fresh cluster
            # must have done it: from the registry (no host held the model before).
            assert row["source"] == invoked["cold_start_source"]
            assert row["tier"] == "registry"
            # every phase of the breakdown, in order (controller/cold_timings.py)
            phases = row["phases"]
            assert phases[:3] == ["decision", "placement", "deploy_rpc"] and "load" in phases
            assert phases[-1] == "request"
            assert invoked["cold_start_source"] in row["text"]
            # the second replica's bytes came down a chain from the first one's host
            row = wait_until(driver, "the chained replica in the waterfall",
                             lambda d: _waterfall_row(d, second["replica_id"]))
            assert (row["source"], row["tier"]) == (second["source"], "peer")
        if view == "transfers":
            chains = driver.execute_script("""
                return [...document.querySelectorAll('#view-transfers .chain')].map(c => ({
                    text: c.innerText,
                    hops: [...c.querySelectorAll('.hop[data-host-id]')].map(h => h.dataset.hostId)}));""")
            assert any(ch["hops"] == [second["host_id"]] and ch["text"].startswith("noop@1")
                       and first_host in ch["text"] for ch in chains), chains
    errors = console_errors(driver)
    assert errors == [], f"browser console errors: {errors}"


async def _status(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/status") as r:
        assert r.status == 200
        return await r.json()


async def _scale_from_zero_then_chain(url: str) -> tuple[dict, dict]:
    """A scale from zero (its request's reply), then a second replica, which must go to the
    other host (one replica fits a device) and get its bytes down a chain from the first."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/functions", json={"name": "nf", "model": "noop"}) as r:
            assert r.status == 201, await r.text()
        async with s.post(f"{url}/v1/functions/nf/invoke", json=BODY) as r:
            assert r.status == 200, await r.text()
            invoked = await r.json()
        np.testing.assert_allclose(
            np.asarray(invoked["outputs"]["y"]["data"]).reshape(2, 3), X)
        assert invoked["cold"] is True and invoked["cold_start_source"]
        async with s.post(f"{url}/v1/functions", json={
                "name": "nf", "model": "noop", "min_replicas": 2}) as r:
            assert r.status in (200, 201), await r.text()
        status: dict[str, Any] = {}
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            status = await _status(s, url)
            if sum(r["phase"] == "warm" for r in status["replicas"]) == 2:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"no second warm replica within 60 s: {status['replicas']}")
    return invoked, status


async def test_the_dashboard_shows_the_cluster_and_its_cold_start(make_cluster: ClusterFactory,
        tmp_path: Path,
                                                                  browser: Any) -> None:
    # One device per host with room for one replica: the second replica goes to the other host.
    cfg = cluster_config(tmp_path, device_memory_bytes=100 << 20, worker_memory_bytes=64 << 20)
    c = await make_cluster(hosts=2, config=cfg)
    gw: StandaloneGateway | None = None
    try:
        invoked, status = await _scale_from_zero_then_chain(c.controller.url)
        await asyncio.wait_for(asyncio.to_thread(
            _check_page, browser, c.controller.url, status, invoked, "controller"), 120)
        # The same page through a stand-alone gateway: its data calls go through it too.
        gw_cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
            cfg.gateway, controller_url=c.controller.rpc_url, refresh_s=0.1))
        gw = await asyncio.wait_for(StandaloneGateway.start(gw_cfg, port=0), 30)
        await asyncio.wait_for(asyncio.to_thread(
            _check_page, browser, gw.url, status, invoked, "gateway"), 120)
    finally:
        if gw is not None:
            await asyncio.wait_for(gw.stop(), 30)
        await asyncio.wait_for(c.stop(), 60)


def _log_in(driver: Any, base: str, hosts: set[str]) -> None:
    driver.get(f"{base}/ui")
    form = wait_until(driver, "the page asking for the API key",
                      lambda d: d.find_element("id", "login").is_displayed()
                      and d.find_element("id", "login"))
    assert not driver.find_element("tag name", "main").is_displayed()
    screenshot(driver, "key-asked")
    form.find_element("id", "api-key").send_keys(ADMIN_KEY)
    form.find_element("id", "login-submit").click()
    wait_until(driver, f"hosts {sorted(hosts)} after the key was given",
               lambda d: hosts <= _ids(d, "cluster", "data-host-id"))
    assert not driver.find_element("id", "login").is_displayed()
    assert driver.execute_script(
        "return sessionStorage.getItem('flashpoint.api_key')") == ADMIN_KEY
    screenshot(driver, "key-given-cluster")
    errors = console_errors(driver)
    assert errors == [], f"browser console errors: {errors}"


async def test_a_key_protected_cluster_asks_for_the_key(make_cluster: ClusterFactory,
        tmp_path: Path, browser: Any) -> None:
    cfg = cluster_config(tmp_path)
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, api_keys={ADMIN_KEY: "admin"}))
    c = await make_cluster(hosts=1, config=cfg)
    url = c.controller.url
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/ui") as r:  # the static shell holds no data
            assert r.status == 200 and "text/html" in r.headers["Content-Type"]
        async with s.get(f"{url}/v1/ui/state") as r:  # the data needs the key
            assert r.status == 401 and (await r.json())["code"] == "unauthorized"
        async with s.get(f"{url}/v1/status",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            hosts = {h["host_id"] for h in (await r.json())["hosts"]}
    assert hosts
    await asyncio.wait_for(asyncio.to_thread(_log_in, browser, url, hosts), 120)
    # Live: a replica started after the page loaded appears without a reload.
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession(headers=auth) as s:
        async with s.post(f"{url}/v1/functions", json={"name": "kf", "model": "noop"}) as r:
            assert r.status == 201, await r.text()
        async with s.post(f"{url}/v1/functions/kf/invoke", json=BODY) as r:
            assert r.status == 200, await r.text()
            rid = (await r.json())["replica_id"]
    await asyncio.wait_for(asyncio.to_thread(
        wait_until, browser, f"replica {rid} on the open page",
        lambda d: rid in _ids(d, "cluster", "data-replica-id")), 60)
    assert console_errors(browser) == []
