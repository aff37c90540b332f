"""The examples run as their READMEs write them: each command a process of its own (the
cluster is started here instead of by `flashpoint up`), and the answers are checked against
transformers computing the same inputs in this process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, cwd=cwd,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stdout, r.stderr)
    return r


async def test_text_and_image_examples_as_written(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path)
    cluster = await make_cluster(hosts=1, models=(), config=cfg, start_timeout_s=90)
    url = cluster.controller.url
    fp = [sys.executable, "-m", "flashpoint.cli", "--home", str(tmp_path)]
    def text() -> dict:
        _run(sys.executable, str(ROOT / "examples/text_classifier/make_model.py"),
             "sentiment-model", cwd=tmp_path)
        pushed = json.loads(_run(*fp, "model", "push", "sentiment", "./sentiment-model",
                                 cwd=tmp_path).stdout)
        assert pushed["format"] == "hf" and pushed["task"] == "text-classification"
        _run(*fp, "deploy", "sentiment-fn", "--model", "sentiment", "--url", url,
             cwd=tmp_path)
        return json.loads(_run(*fp, "invoke", "sentiment-fn", "--url", url, "--text",
                               "this movie was great", "--text", "terrible",
                               cwd=tmp_path).stdout)

    def image() -> dict:
        _run(sys.executable, str(ROOT / "examples/image_classifier/make_model.py"),
             "vit-model", cwd=tmp_path)
        _run(*fp, "model", "push", "vit", "./vit-model", cwd=tmp_path)
        _run(*fp, "deploy", "vit-fn", "--model", "vit", "--url", url, cwd=tmp_path)
        return json.loads(_run(*fp, "invoke", "vit-fn", "--url", url, "--image",
                               "./vit-model/example.jpg", cwd=tmp_path).stdout)

    answer = await asyncio.to_thread(text)
    from transformers import (
        AutoImageProcessor,
        AutoModelForImageClassification,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    d = tmp_path / "sentiment-model"
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForSequenceClassification.from_pretrained(str(d)).eval()
    with torch.inference_mode():
        want = model(**tok(["this movie was great", "terrible"], padding=True,
                           return_tensors="pt")).logits.numpy()
    got = np.array(answer["outputs"]["logits"]["data"], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    labels = answer["outputs"]["label"]["data"]
    assert labels[0] == ["negative", "positive"][int(want[0].argmax())]

    answer = await asyncio.to_thread(image)
    from PIL import Image

    d = tmp_path / "vit-model"
    proc = AutoImageProcessor.from_pretrained(str(d), backend="pil")
    model = AutoModelForImageClassification.from_pretrained(str(d)).eval()
    with torch.inference_mode():
        pixels = proc(Image.open(d / "example.jpg").convert("RGB"), return_tensors="pt")
        want = model(**pixels).logits.numpy()
    got = np.array(answer["outputs"]["logits"]["data"], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert answer["outputs"]["label"]["data"][0] == ["cat", "dog", "bird"][int(want[0].argmax())]
