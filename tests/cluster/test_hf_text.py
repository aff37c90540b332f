"""A Hugging Face text classifier pushed from a directory, served by a real local cluster,
answered through tritonclient (BYTES) and the native API, and compared with what
transformers computes in this process; bad inputs are 400s with a code, never 500s."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from flashpoint.models.sources import publish, publish_source
from flashpoint.models.tiny_hf import make_text_classifier
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(240)

TEXTS = ["this movie was great", "a cold start fetches bytes from a peer and the cluster "
         "scales replicas down to zero", "terrible"]


def reference_logits(directory: Path, texts: list[str]) -> np.ndarray:
    """transformers' own answer, one text at a time (no padding at all)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    rows = []
    with torch.inference_mode():
        for t in texts:
            rows.append(model(**tok([t], return_tensors="pt")).logits[0].numpy())
    return np.stack(rows)


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
        return r.status, await r.json()


async def test_hf_text_classifier_end_to_end(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    model_dir = make_text_classifier(tmp_path / "src", family="bert")
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    manifest = await publish_source(store, "sentiment", model_dir)
    assert manifest.task == "text-classification" and "tokenizer.json" in manifest.files
    await publish(store, "bert", "tiny", "1", model_name="bert")
    cluster = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    url = cluster.controller.url
    async with aiohttp.ClientSession() as s:
        for name, model, wait in (("tc", "sentiment", 200), ("zb", "bert", 0)):
            status, body = await _post(s, f"{url}/v1/functions", {
                "name": name, "model": model, "max_batch_size": 16, "batch_wait_ms": wait})
            assert status in (200, 201), body
        expected = reference_logits(model_dir, TEXTS)

        # native: {"text": [...]}, a cold start, then labels best first
        status, body = await _post(s, f"{url}/v1/functions/tc/invoke", {"text": TEXTS})
        assert status == 200, body
        out = body["outputs"]
        logits = np.array(out["logits"]["data"], np.float32).reshape(out["logits"]["shape"])
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
        labels = np.array(out["label"]["data"]).reshape(out["label"]["shape"])
        assert [row[0] for row in labels] == [["negative", "positive"][i]
                                              for i in expected.argmax(axis=1)]
        scores = np.array(out["score"]["data"]).reshape(out["score"]["shape"])
        assert np.all(np.diff(scores, axis=1) <= 0)  # best first
        np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)

        # requests of different lengths, sent together, share batches and still equal
        # transformers' unpadded answers
        many = [TEXTS[i % 3] + " great" * i for i in range(8)]
        ref = reference_logits(model_dir, many)
        replies = await asyncio.gather(*(_post(s, f"{url}/v1/functions/tc/invoke",
                                               {"text": t}) for t in many))
        rows = []
        for (status, body), want in zip(replies, ref, strict=True):
            assert status == 200, body
            got = np.array(body["outputs"]["logits"]["data"], np.float32)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
            rows.append(body["timings_s"]["batch_rows"])
        assert max(rows) >= 2, rows  # batched across lengths

        # bad inputs: a code and a 400, and the function keeps serving
        too_long = " ".join(["great"] * 200)
        for bad, code in (({"text": too_long}, "input_too_long"),
                          ({"inputs": {"text": {"data": [1.0], "shape": [1],
                                                 "datatype": "FP32"}}}, "bad_request"),
                          ({"image": "not base64!"}, "bad_request")):
            status, body = await _post(s, f"{url}/v1/functions/tc/invoke", bad)
            assert status == 400 and body["code"] == code, body
        status, body = await _post(s, f"{url}/v1/functions/tc/invoke",
                                   {"inputs": {"text": {"data": ["\udcff"], "shape": [1],
                                                        "datatype": "BYTES"}}})
        assert status == 400, body

        # the built-in BERT: a token id past the vocabulary and a sequence past its
        # positions are 400s (formerly 500 model_failed)
        for ids, code in (([[1, 2, 4096]], "invalid_input"),
                          ([list(range(1, 130))], "input_too_long"),
                          ([[1, -3]], "invalid_input")):
            status, body = await _post(s, f"{url}/v1/functions/zb/invoke", {"inputs": {
                "input_ids": {"data": ids, "shape": [1, len(ids[0])], "datatype": "INT64"}}})
            assert status == 400 and body["code"] == code, body
        status, body = await _post(s, f"{url}/v1/functions/tc/invoke", {"text": TEXTS[0]})
        assert status == 200, body

    # tritonclient, BYTES in (binary and JSON), labels and logits out
    await asyncio.to_thread(_triton_check, url, expected)


def _triton_check(url: str, expected: np.ndarray) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=60)
    try:
        assert client.is_model_ready("tc")
        meta = client.get_model_metadata("tc")
        assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        for binary in (True, False):
            inp = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
            inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object),
                                    binary_data=binary)
            outs = [httpclient.InferRequestedOutput(n, binary_data=binary)
                    for n in ("label", "logits")]
            result = client.infer("tc", [inp], outputs=outs)
            np.testing.assert_allclose(result.as_numpy("logits"), expected, atol=1e-4, rtol=1e-4)
            top = result.as_numpy("label")[:, 0]
            assert [x.decode() if isinstance(x, bytes) else x for x in top] == [
                ["negative", "positive"][i] for i in expected.argmax(axis=1)]
    finally:
        client.close()
