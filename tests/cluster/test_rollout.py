"""Version roll-outs with no failed request (issue 18 item 6): under a closed-loop HTTP load a
live function rolls from model version 1 to 2 replica by replica, splits its traffic with a
canary, and rolls back to 1; every request gets an answer, and every answer is what one of
the two versions computes (the one the roll-out says, once it is complete)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint.models import zoo
from flashpoint.models.sources import publish
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

pytestmark = pytest.mark.timeout(300)

FN = "roll-fn"


class VersionedLoad:
    """Closed-loop HTTP clients; each answer is matched against every reference model and
    kept as (time the request was sent, the version that computed it). A non-200 answer, or
    an output no reference computes, is a failure."""

    def __init__(self, session: aiohttp.ClientSession, url: str, config: Any,
                 references: dict[str, Any], clients: int = 4) -> None:
        self.session, self.url, self.config = session, url, config
        self.references = references
        self.answers: list[tuple[float, str]] = []
        self.failures: list[Any] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(1000 * i)) for i in range(clients)]

    async def _client(self, seed: int) -> None:
        for i in range(100_000):  # bounded; ends when stopped
            if self._stop.is_set():
                return
            x = zoo.example_inputs("bert", self.config, 1, seed=seed + i)
            body = {"inputs": {"input_ids": {"data": x["input_ids"].ravel().tolist(),
                                             "shape": list(x["input_ids"].shape),
                                             "datatype": "INT64"}}}
            sent = time.monotonic()
            async with self.session.post(f"{self.url}/v1/functions/{FN}/invoke", json=body) as r:
                out = await r.json()
            if r.status != 200:
                self.failures.append(out)
                continue
            got = out["outputs"]["logits"]
            logits = np.asarray(got["data"], np.float32).reshape(got["shape"])
            versions = [v for v, ref in self.references.items()
                        if np.allclose(logits, zoo.run_example(ref, x).numpy(),
                                       rtol=1e-4, atol=1e-5)]
            if len(versions) != 1:
                self.failures.append(f"output matches versions {versions}")
                continue
            self.answers.append((sent, versions[0]))

    def since(self, t: float) -> list[str]:
        return [v for sent, v in self.answers if sent >= t]

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)


async def test_roll_out_canary_and_roll_back_under_load_fail_no_request(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    manifest = await publish(store, "bert", "tiny", "1", model_name="bert", seed=0)
    await publish(store, "bert", "tiny", "2", model_name="bert", seed=1)
    references = {"1": zoo.build("bert", "tiny", seed=0)[0], "2": zoo.build("bert", "tiny", seed=1)[0]}
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=90)
    url = c.controller.url

    def rollout() -> dict[str, Any]:
        return c.controller.get_function(FN).to_dict()["rollout"]

    def settled(version: str, canary: bool = False) -> bool:
        """Every replica warm on ``version`` (or, for a canary, one warm on each version)."""
        r = rollout()
        want = ({f"bert@{v}": 1 for v in ("1", "2")} if canary else {f"bert@{version}": 2})
        return (r["phase"] == ("canary" if canary else "stable") and r["version"] == version
                and {k: n["warm"] for k, n in r["replicas"].items() if any(n.values())} == want
                and all(n["starting"] == n["stopping"] == 0 for n in r["replicas"].values()))

    async def deploy(s: aiohttp.ClientSession, version: str, **extra: Any) -> None:
        async with s.post(f"{url}/v1/functions", json={
                "name": FN, "model": "bert", "model_version": version, "min_replicas": 2,
                "max_replicas": 4, "keep_alive_s": 300, **extra}) as r:
            assert r.status == 201, await r.text()

    async with aiohttp.ClientSession() as s:
        # A bad canary percentage is a typed 400, and changes nothing.
        async with s.post(f"{url}/v1/functions", json={
                "name": FN, "model": "bert", "canary_pct": 150}) as r:
            assert r.status == 400 and (await r.json())["code"] == "bad_request"
        await deploy(s, "1")
        await wait_for("two warm replicas of version 1", lambda: settled("1"), 90, rollout)
        load = VersionedLoad(s, url, manifest.config, references)
        await wait_for("requests served", lambda: len(load.answers) >= 20 or bool(
            load.failures), 60, lambda: load.failures[:3])

        # Roll out version 2: one replica at a time, while version 1 serves.
        await deploy(s, "2")
        async with s.get(f"{url}/v1/functions/{FN}") as r:
            view = (await r.json())["rollout"]
        assert view["phase"] == "rolling" and view["previous_version"] == "1", view
        await wait_for("every replica on version 2", lambda: settled("2"), 120, rollout)
        done = time.monotonic()
        await wait_for("requests after the roll", lambda: len(load.since(done)) >= 20, 60,
                       lambda: (len(load.since(done)), load.failures[:3]))
        assert set(load.since(done)) == {"2"}, load.since(done)
        assert "1" in [v for _, v in load.answers], "version 1 never answered"

        # A canary of version 1: half of the replicas and requests.
        await deploy(s, "1", canary_pct=50)
        await wait_for("one replica of each version", lambda: settled("1", canary=True),
                       120, rollout)
        split = time.monotonic()
        await wait_for("answers from both versions", lambda: {"1", "2"} <= set(
            load.since(split)) and len(load.since(split)) >= 40, 60,
            lambda: (load.since(split)[-10:], load.failures[:3]))
        answers = load.since(split)
        assert 0.25 <= answers.count("1") / len(answers) <= 0.75, answers

        # Roll back: version 1 everywhere.
        await deploy(s, "1")
        await wait_for("every replica back on version 1", lambda: settled("1"), 120, rollout)
        back = time.monotonic()
        await wait_for("requests after the roll-back", lambda: len(load.since(back)) >= 20,
                       60, lambda: (len(load.since(back)), load.failures[:3]))
        await load.stop()
        assert set(load.since(back)) == {"1"}, load.since(back)
        assert not load.failures, load.failures[:3]
        async with s.get(f"{url}/v1/functions/{FN}") as r:
            view = (await r.json())["rollout"]
        assert view["phase"] == "stable" and view["previous_version"] is None, view
