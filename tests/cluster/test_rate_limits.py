"""Per-key rate limits configured in the cluster's [gateway] (issue 6, item 4): a caller over
its token bucket gets 429 with Retry-After, other keys are unaffected, roles still apply."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest

from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(90)

ADMIN, ALICE, BOB = "admin-key-0001", "alice-key-0001", "bob-key-00001"


async def test_each_key_has_its_own_bucket(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, api_keys={ADMIN: "admin", ALICE: "invoke", BOB: "invoke"},
        rate_limit_rps=0.5, rate_limit_burst=2))
    c = await make_cluster(config=cfg)
    url = c.controller.url
    async with aiohttp.ClientSession() as s:
        def auth(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        async with s.post(f"{url}/v1/functions", json={"name": "rl-fn", "model": "noop"},
                          headers=auth(ALICE)) as r:
            assert r.status == 403  # an invoke key cannot register functions
        async with s.post(f"{url}/v1/functions", json={"name": "rl-fn", "model": "noop"},
                          headers=auth(ADMIN)) as r:
            assert r.status == 201, await r.text()
            inputs = (await r.json())["spec"]["inputs"]
        body = {"inputs": {t["name"]: {"data": [1.0] * 4, "shape": [1, 4],
                                       "datatype": t["datatype"]} for t in inputs}}

        async def invoke(key: str) -> tuple[int, dict[str, str], dict]:
            async with s.post(f"{url}/v1/functions/rl-fn/invoke", json=body,
                              headers=auth(key)) as r:
                return r.status, dict(r.headers), await r.json()

        statuses = [(await invoke(ALICE))[0] for _ in range(2)]
        assert statuses == [200, 200]  # the burst
        status, headers, err = await invoke(ALICE)
        assert status == 429 and err["code"] == "overloaded", err
        assert int(headers["Retry-After"]) >= 1
        assert (await invoke(BOB))[0] == 200  # Bob's bucket is his own
