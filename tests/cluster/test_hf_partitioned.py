"""A Hugging Face BERT (a directory pushed with ``--profile``) scales up as a pipeline of
stages that tokenizes at its first stage and answers labels at its last, then completes
into whole replicas (issue 18 item 3). Invocations go through the HTTP gateway as text."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint.models.sources import PushOptions, publish_source
from flashpoint.models.tiny_hf import make_text_classifier
from flashpoint.registry.local import LocalStore
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import serve_until_dissolved
from .test_partitioned_scaleup import CHUNK, SlowStore, _config

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)

TEXTS = ["a short one", "this one is a good deal longer than the first, so it pads",
         "middling text"]


def _reference(source: Path, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(source),
                                                               local_files_only=True).eval()
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**enc).logits.numpy()


async def _invoke(s: aiohttp.ClientSession, url: str, texts: list[str]) -> dict[str, Any]:
    body = {"inputs": {"text": {"data": texts, "shape": [len(texts)], "datatype": "BYTES"}}}
    async with s.post(f"{url}/v1/functions/hf-part/invoke", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _logits(out: dict[str, Any]) -> np.ndarray:
    got = out["outputs"]["logits"]
    return np.asarray(got["data"], dtype=np.float32).reshape(got["shape"])


async def test_hf_bert_serves_as_a_pipeline_then_completes(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    source = make_text_classifier(tmp_path / "src", family="bert")
    store = SlowStore(cfg.registry.root)
    manifest = await publish_source(store, "hfbert", source, chunk_size=CHUNK,
                                    options=PushOptions(profile=True))
    expected = {i: _reference(source, TEXTS[i:] + TEXTS[:i]) for i in range(len(TEXTS))}
    store.delay_s = 0.25
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=60)
    url = c.controller.url
    async with aiohttp.ClientSession() as s:
        spec = {"name": "hf-part", "model": "hfbert", "max_stages": 2, "min_replicas": 2,
                "max_replicas": 2, "replica_concurrency": 1, "keep_alive_s": 300}
        async with s.post(f"{url}/v1/functions", json=spec) as r:
            assert r.status == 201, await r.text()

        async def one(seed: int) -> dict[str, Any]:
            i = seed % len(TEXTS)
            out = await _invoke(s, url, TEXTS[i:] + TEXTS[:i])
            np.testing.assert_allclose(_logits(out), expected[i], rtol=1e-4, atol=1e-4)
            assert out["outputs"]["label"]["shape"][0] == len(TEXTS)
            return out

        await wait_for("a group is planned", lambda: bool(c.controller.state.groups), 10)
        burst = asyncio.gather(*(one(i) for i in range(3)))
        (group,) = c.controller.state.groups.values()
        stages = [c.controller.state.replicas[r] for r in group.stages]
        assert stages[0].stage[0] == 0 and stages[-1].stage[1] == len(manifest.layers) - 1
        outs = await asyncio.wait_for(burst, 90)
        assert {o["replica_id"] for o in outs} == {group.group_id}  # the pipeline answered
        assert outs[0]["cold_start_source"] == "pipeline:2"

        await serve_until_dissolved(c, group, stages, one, 3, 90)
        outs = await asyncio.gather(*(one(100 + i) for i in range(3)))
        assert {o["replica_id"] for o in outs} <= {r.replica_id for r in stages}


async def test_an_hf_model_without_a_stage_adapter_serves_whole(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    import dataclasses

    cfg = cluster_config(tmp_path)
    source = make_text_classifier(tmp_path / "src", family="bert")
    store = LocalStore(cfg.registry.root)
    manifest = await publish_source(store, "hfbert", source, options=PushOptions(profile=True))
    # The same blob under a family with no adapter (its profiles kept): stages are refused
    # for the family, not for a missing profile.
    other = dataclasses.replace(manifest, name="other", config={
        **manifest.config, "architecture": "ElectraForSequenceClassification",
        "hf_config": {**manifest.config["hf_config"], "model_type": "electra"}})
    await store.put(other, store.blob_path("hfbert", "1"))
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=60)
    async with aiohttp.ClientSession() as s:
        spec = {"name": "p", "model": "other", "max_stages": 2}
        async with s.post(f"{c.controller.url}/v1/functions", json=spec) as r:
            assert r.status == 400
            body = await r.json()
        assert body["code"] == "bad_request" and "serves whole" in body["error"], body
        async with s.get(f"{c.controller.url}/v1/functions/p") as r:
            assert r.status == 404
        spec = {"name": "q", "model": "hfbert", "max_stages": 2}
        async with s.post(f"{c.controller.url}/v1/functions", json=spec) as r:
            assert r.status == 201, await r.text()
