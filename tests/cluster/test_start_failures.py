"""A model whose load fails at every cold start (issue 18, item 8): the request waiting for
it fails with a typed error carrying the load's message instead of hanging until its
timeout, the controller backs off instead of looping, `/v1/functions/{name}` says why the
function is not ready, and its OIP ready route is not 200 (tritonclient's `is_model_ready`
is False) while a healthy function's is True, on the controller and through a stand-alone
gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import aiohttp
import pytest
import tritonclient.http as triton

from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.models import zoo
from flashpoint.models.publish import publish_module
from flashpoint.models.sources import publish
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

pytestmark = pytest.mark.timeout(180)

BODY = {"inputs": {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}}
LOAD_ERROR = "blob does not fit flashpoint.models.bert:build_empty"


async def _publish_broken(store) -> None:
    """The tiny no-op model's blob under the built-in BERT's builder: every load fails in
    the worker (``load_module``: the blob does not fit the module it builds)."""
    noop = zoo.get("noop")
    config = noop.resolve("tiny")
    await publish_module(store, lambda: noop.build_from_config(config), name="broken",
                         version="1", entry_point=zoo.get("bert").entry_point,
                         config=zoo.resolve_config("bert", "tiny"),
                         io=zoo.io_signature("noop", config))


def _ready(url: str, name: str) -> bool:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        return client.is_model_ready(name)
    finally:
        client.close()


async def test_failing_cold_start_fails_fast_says_why_and_is_not_ready(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    # A long back-off, so the checks below all fall inside it.
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, start_backoff_s=120.0, start_backoff_max_s=120.0))
    store = make_store(cfg)
    await publish(store, "noop", "tiny", "1", model_name="noop")
    await _publish_broken(store)
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    gw = None
    try:
        url, state = c.controller.url, c.controller.state
        async with aiohttp.ClientSession() as s:
            for spec in ({"name": "bad", "model": "broken", "timeout_s": 120},
                         {"name": "good", "model": "noop"}):
                async with s.post(f"{url}/v1/functions", json=spec) as r:
                    assert r.status == 201, await r.text()
            async with s.get(f"{url}/v1/functions/bad") as r:
                info = await r.json()
            assert info["ready"] is True and "reason" not in info  # nothing has failed yet
            async with s.post(f"{url}/v1/functions/good/invoke", json=BODY) as r:
                assert r.status == 200, await r.text()

            # The first request waits for the cold starts, which fail: it gets the load's
            # error, typed, long before its 120 s timeout.
            t0 = time.monotonic()
            async with s.post(f"{url}/v1/functions/bad/invoke", json=BODY) as r:
                err = await r.json()
                status, retry_after = r.status, r.headers.get("Retry-After")
            assert time.monotonic() - t0 < 90
            assert status == 503 and err["code"] == "model_load_failed", err
            assert LOAD_ERROR in err["error"]
            assert err["details"]["error_code"] == "registry_error"
            assert err["details"]["failed_starts"] == 3
            assert retry_after is not None and int(retry_after) > 60

            # Backing off: no start is made, and a new request fails at once.
            t0 = time.monotonic()
            async with s.post(f"{url}/v1/functions/bad/invoke", json=BODY) as r:
                assert r.status == 503 and (await r.json())["code"] == "model_load_failed"
            assert time.monotonic() - t0 < 2.0
            assert not [r for r in state.replicas.values() if r.function == "bad"]

            async with s.get(f"{url}/v1/functions/bad") as r:
                info = await r.json()
            assert info["ready"] is False and info["replicas_warm"] == 0
            reason = info["reason"]
            assert reason["code"] == "model_load_failed" and LOAD_ERROR in reason["message"]
            assert reason["error_code"] == "registry_error" and reason["failed_starts"] == 3
            assert reason["since"] <= reason["last_failure"] <= time.time()
            assert 60 < reason["retry_in_s"] <= 120
            async with s.get(f"{url}/v1/functions") as r:
                listed = {f["spec"]["name"]: f for f in await r.json()}
            assert listed["bad"]["reason"] == reason | {"retry_in_s": listed["bad"]["reason"]
                                                        ["retry_in_s"]}
            assert listed["good"]["ready"] is True and "reason" not in listed["good"]

        assert not await asyncio.to_thread(_ready, url, "bad")
        assert await asyncio.to_thread(_ready, url, "good")

        # The same through a stand-alone gateway (its function table comes over RPC).
        gcfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
            cfg.gateway, controller_url=c.controller.rpc_url, refresh_s=0.1))
        gw = await asyncio.wait_for(StandaloneGateway.start(gcfg, port=0), 30)
        await wait_for("the gateway's function table", lambda: {"bad", "good"} <= {
            i.spec.name for i in gw.backend.list_functions()}, 20)
        assert not await asyncio.to_thread(_ready, gw.url, "bad")
        assert await asyncio.to_thread(_ready, gw.url, "good")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{gw.url}/v1/functions/bad") as r:
                info = await r.json()
            assert info["ready"] is False and info["reason"]["error_code"] == "registry_error"
            async with s.post(f"{gw.url}/v1/functions/bad/invoke", json=BODY) as r:
                err = await r.json()
            assert r.status == 503 and err["code"] == "model_load_failed"
            assert LOAD_ERROR in err["error"]
    finally:
        if gw is not None:
            await asyncio.wait_for(gw.stop(), 30)
        await asyncio.wait_for(c.stop(), 60)
