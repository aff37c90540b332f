"""The Python clients against a real local cluster: deploy, invoke (outputs compared with the
model run here), list, status, delete, rollout, push; server errors arrive as the same typed
error; an API-key cluster refuses a missing key; the blocking Client in and out of a loop.

The cluster runs in the test's event loop, so the blocking Client is always called from
another thread (``asyncio.to_thread``): called on the cluster's own loop it would block the
server it waits for."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpoint import AsyncClient, Client
from flashpoint.errors import (
    BadRequest,
    ConnectFailed,
    Forbidden,
    FunctionNotFound,
    Unauthorized,
)
from flashpoint.models import zoo
from flashpoint.models.sources import publish
from flashpoint.models.tiny_hf import make_text_classifier
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, InProcessCluster, cluster_config

pytestmark = pytest.mark.timeout(180)

ADMIN_KEY, INVOKE_KEY = "client-admin-key-01", "client-invoke-key-01"


async def test_async_client_deploy_invoke_list_delete(cluster: InProcessCluster) -> None:
    async with AsyncClient(cluster.controller.url) as fp:
        info = await fp.deploy("nf", "noop", max_batch_size=4)
        assert (info.name, info.model, info.model_version) == ("nf", "noop", "1")
        assert info.spec["max_batch_size"] == 4
        x = np.array([[1.5, -2.0, 3.0]], dtype=np.float32)
        r = await fp.invoke("nf", {"x": x})
        assert r.cold is True and r.timings_s["total"] > 0 and r.request_id
        assert r.outputs["y"].dtype == np.float32 and r.outputs["y"].shape == (1, 3)
        np.testing.assert_array_equal(r.outputs["y"], x)
        r = await fp.invoke("nf", {"x": x}, request_class="best_effort", timeout_s=30)
        assert r.cold is False

        # tiny BERT: the served logits are what the model computes here
        model, config = zoo.build("bert", "tiny")
        await fp.deploy("bf", "bert")
        ids = zoo.example_inputs("bert", config, 2, seed=7)
        r = await fp.invoke("bf", ids)
        expected = zoo.run_example(model, ids).numpy()
        assert r.outputs["logits"].dtype == np.float32
        assert r.outputs["logits"].shape == expected.shape
        np.testing.assert_allclose(r.outputs["logits"], expected, rtol=1e-4, atol=1e-5)

        assert sorted(f.name for f in await fp.functions()) == ["bf", "nf"]
        assert (await fp.function("bf")).replicas_warm >= 1
        status = await fp.status()
        assert len(status["hosts"]) == 2

        with pytest.raises(BadRequest):  # an input the function does not have
            await fp.invoke("bf", {"nope": np.zeros((1, 4), np.int64)})

        await fp.delete("nf")
        assert [f.name for f in await fp.functions()] == ["bf"]
        with pytest.raises(FunctionNotFound) as err:
            await fp.invoke("nf", {"x": x})
        assert err.value.code == "function_not_found" and "nf" in err.value.message
        with pytest.raises(FunctionNotFound):
            await fp.function("nf")
        with pytest.raises(FunctionNotFound):
            await fp.delete("nf")


async def test_rollout_and_push(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    c = await make_cluster(config=cfg)
    model_dir = make_text_classifier(tmp_path / "hf-src")
    async with AsyncClient(c.controller.url) as fp:
        manifest = await fp.push("mine", "noop", version="2", format="zoo", config=cfg)
        assert (manifest.name, manifest.version, manifest.source_format) == ("mine", "2", "zoo")
        assert await make_store(cfg).exists("mine", "2")

        # a Hugging Face directory, pushed by the client and asked in text
        manifest = await fp.push("words", str(model_dir), config=cfg)
        assert manifest.task == "text-classification"
        await fp.deploy("wf", "words")
        r = await fp.invoke("wf", text=["this movie was great", "terrible"])
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ref = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
        with torch.inference_mode():
            want = ref(**tok(["this movie was great", "terrible"], padding=True,
                             return_tensors="pt")).logits.numpy()
        np.testing.assert_allclose(r.outputs["logits"], want, atol=1e-4, rtol=1e-4)
        assert r.outputs["label"].shape == (2, 2) and r.outputs["score"].dtype == np.float32

        await fp.deploy("rf", "noop", max_batch_size=2, keep_alive_s=12.0)
        await publish(make_store(cfg), "noop", "tiny", "2", model_name="noop")
        info = await fp.rollout("rf", "2")
        assert (info.model, info.model_version) == ("noop", "2")
        assert info.spec["max_batch_size"] == 2 and info.spec["keep_alive_s"] == 12.0
        r = await fp.invoke("rf", {"x": np.arange(4, dtype=np.float32).reshape(1, 4)})
        np.testing.assert_array_equal(r.outputs["y"], [[0, 1, 2, 3]])


async def test_sync_client_in_and_out_of_a_loop(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    c = await make_cluster(config=cluster_config(tmp_path))
    url = c.controller.url
    x = np.array([[4.0, 5.0]], dtype=np.float64)

    def plain_thread() -> None:
        with Client(url) as fp:
            fp.deploy("sf", "noop")
            r = fp.invoke("sf", {"x": x.astype(np.float32)})
            np.testing.assert_array_equal(r.outputs["y"], [[4.0, 5.0]])
            assert [f.name for f in fp.functions()] == ["sf"]
            assert fp.function("sf").ready and "hosts" in fp.status()
            with pytest.raises(FunctionNotFound) as err:
                fp.invoke("missing", {"x": x})
            assert err.value.code == "function_not_found"

    def thread_with_a_running_loop() -> None:
        async def inside() -> None:
            asyncio.get_running_loop()  # a loop runs here, and the blocking client still works
            fp = Client(url)
            try:
                r = fp.invoke("sf", {"x": np.ones((2, 3), np.float32)})
                assert r.outputs["y"].shape == (2, 3)
                fp.delete("sf")
                assert fp.functions() == []
            finally:
                fp.close()

        asyncio.run(inside())

    try:
        await asyncio.wait_for(asyncio.to_thread(plain_thread), 120)
        await asyncio.wait_for(asyncio.to_thread(thread_with_a_running_loop), 60)
    finally:
        await asyncio.wait_for(c.stop(), 60)
    # nothing listens there any more: a typed, retryable error, not an aiohttp one
    with pytest.raises(ConnectFailed) as gone:
        async with AsyncClient(url, connect_timeout_s=5) as fp:
            await fp.status()
    assert gone.value.retryable and url in gone.value.message
    fp_sync = Client(url, connect_timeout_s=5)
    with pytest.raises(ConnectFailed):
        await asyncio.to_thread(fp_sync.functions)
    await asyncio.to_thread(fp_sync.close)


async def test_api_keys(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, api_keys={ADMIN_KEY: "admin", INVOKE_KEY: "invoke"}))
    c = await make_cluster(config=cfg)
    url = c.controller.url
    async with AsyncClient(url) as anonymous, AsyncClient(url, api_key=INVOKE_KEY) as user, \
            AsyncClient(url, api_key=ADMIN_KEY) as admin, \
            AsyncClient(url, api_key="wrong-key-0000001") as wrong:
        with pytest.raises(Unauthorized) as err:
            await anonymous.functions()
        assert err.value.code == "unauthorized" and "missing API key" in err.value.message
        with pytest.raises(Unauthorized):
            await wrong.status()
        with pytest.raises(Forbidden) as forbidden:
            await user.deploy("kf", "noop")
        assert forbidden.value.code == "forbidden"
        await admin.deploy("kf", "noop")
        r = await user.invoke("kf", {"x": np.ones((1, 2), np.float32)})
        np.testing.assert_array_equal(r.outputs["y"], [[1.0, 1.0]])
        with pytest.raises(Unauthorized):
            await anonymous.invoke("kf", {"x": np.ones((1, 2), np.float32)})

    def blocking() -> None:
        with Client(url) as fp, pytest.raises(Unauthorized):
            fp.functions()
        with Client(url, api_key=INVOKE_KEY) as fp:
            assert [f.name for f in fp.functions()] == ["kf"]

    await asyncio.wait_for(asyncio.to_thread(blocking), 60)


async def test_through_a_standalone_gateway(cluster: InProcessCluster) -> None:
    from flashpoint.gateway.standalone import StandaloneGateway

    cfg = dataclasses.replace(cluster.config, gateway=dataclasses.replace(
        cluster.config.gateway, controller_url=cluster.controller.rpc_url, refresh_s=0.1))
    gw = await asyncio.wait_for(StandaloneGateway.start(cfg, port=0), 30)
    try:
        async with AsyncClient(gw.url) as fp:
            await fp.deploy("gf", "noop")
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            r = await fp.invoke("gf", {"x": x})
            np.testing.assert_array_equal(r.outputs["y"], x)
            with pytest.raises(FunctionNotFound):  # the controller's error, forwarded
                await fp.invoke("nope", {"x": x})
            with pytest.raises(BadRequest):
                await fp.invoke("gf", {"x": np.ones((1, 2), np.int64)})
    finally:
        await asyncio.wait_for(gw.stop(), 30)
