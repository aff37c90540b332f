"""Models users bring, end to end: a TorchScript archive and the example handler bundle
published, deployed and invoked once each over the native HTTP API on a real cluster."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flashpoint.models.sources import PushOptions, publish_source
from flashpoint.models.sources.base import parse_tensor_spec
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(180)

BUNDLE = Path(__file__).resolve().parents[2] / "examples" / "handler"


async def _invoke(s: aiohttp.ClientSession, url: str, function: str, model: str,
                  x: np.ndarray) -> dict:
    async with s.post(f"{url}/v1/functions", json={"name": function, "model": model}) as r:
        assert r.status == 201, await r.text()
    body = {"inputs": {"x": {"data": x.ravel().tolist(), "shape": list(x.shape),
                             "datatype": "FP32"}}}
    async with s.post(f"{url}/v1/functions/{function}/invoke", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["outputs"]


def _array(out: dict, dtype: type) -> np.ndarray:
    return np.asarray(out["data"], dtype=dtype).reshape(out["shape"])


async def test_torchscript_and_handler_serve_over_http(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)).eval()
    torch.jit.save(torch.jit.script(mlp), str(tmp_path / "mlp.pt"))
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    await publish_source(store, "mlp", tmp_path / "mlp.pt",
                         options=PushOptions(inputs=(parse_tensor_spec("x:FP32:-1,16"),)))
    await publish_source(store, "lin", BUNDLE, trust_code=True)
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    url = c.controller.url
    rng = np.random.default_rng(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
        x = rng.normal(size=(2, 16)).astype(np.float32)
        out = await _invoke(s, url, "mlp-fn", "mlp", x)
        with torch.inference_mode():
            want = mlp(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(_array(out["output0"], np.float32), want,
                                   rtol=1e-4, atol=1e-5)

        x = rng.normal(4, 2, size=(3, 4)).astype(np.float32)
        out = await _invoke(s, url, "lin-fn", "lin", x)
    weights = load_file(str(BUNDLE / "weights.safetensors"))
    mean = np.array([5.8, 3.0, 3.8, 1.2], np.float32)
    std = np.array([0.8, 0.4, 1.8, 0.8], np.float32)
    logits = torch.from_numpy((x - mean) / std) @ weights["fc.weight"].T + weights["fc.bias"]
    np.testing.assert_allclose(_array(out["logits"], np.float32), logits.numpy(),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(_array(out["label"], np.int64), logits.argmax(-1).numpy())
