"""End to end: a tiny ViT pushed from a Hugging Face directory, deployed, and invoked with
encoded images through the KServe API (tritonclient) and the native one (base64)."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_image_classifier
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(180)

LABELS = ("cat", "dog", "bird")


def encode(seed: int, height: int, width: int, fmt: str) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def reference(directory: Path, images: list[bytes]) -> np.ndarray:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(str(directory), backend="pil",
                                                   local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(str(directory),
                                                            local_files_only=True).eval()
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    with torch.inference_mode():
        return model(pixel_values=processor(images=pil, return_tensors="pt")["pixel_values"]
                     ).logits.numpy()


async def test_vit_served_from_jpeg_and_png_over_both_apis(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    directory = make_image_classifier(tmp_path / "vit", family="vit", labels=LABELS)
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    await publish_source(store, "vit", directory)
    images = [encode(1, 40, 56, "JPEG"), encode(2, 21, 30, "PNG")]
    want = reference(directory, images)
    want_labels = [[LABELS[i].encode() for i in np.argsort(-row, kind="stable")] for row in want]

    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    url = c.controller.url
    pids = [w.proc.pid for h in c.hosts for w in h.workers.values()]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{url}/v1/functions", json={"name": "vit-fn",
                                                           "model": "vit"}) as r:
                assert r.status == 201, await r.text()
                info = await r.json()
            assert [t["name"] for t in info["spec"]["inputs"]] == ["image"]

            def kserve() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                client = triton.InferenceServerClient(url.removeprefix("http://"))
                try:
                    inp = triton.InferInput("image", [2], "BYTES")
                    inp.set_data_from_numpy(np.array(images, dtype=object), binary_data=True)
                    outs = [triton.InferRequestedOutput(n, binary_data=True)
                            for n in ("label", "score", "logits")]
                    res = client.infer("vit-fn", [inp], outputs=outs)
                    return res.as_numpy("label"), res.as_numpy("score"), res.as_numpy("logits")
                finally:
                    client.close()

            labels, score, logits = await asyncio.to_thread(kserve)
            np.testing.assert_allclose(logits, want, atol=1e-4)
            assert labels.tolist() == want_labels
            assert score.shape == (2, len(LABELS)) and score.dtype == np.float32
            np.testing.assert_allclose(score.sum(axis=1), 1.0, rtol=1e-5)

            async def native(image: bytes) -> tuple[int, dict]:
                body = {"image": base64.b64encode(image).decode()}
                async with s.post(f"{url}/v1/functions/vit-fn/invoke", json=body) as r:
                    return r.status, await r.json()

            status, out = await native(images[1])
            assert status == 200, out
            got = out["outputs"]["logits"]
            np.testing.assert_allclose(np.asarray(got["data"], np.float32).reshape(got["shape"]),
                                       want[1:2], atol=1e-4)
            assert out["outputs"]["label"]["data"] == [b.decode() for b in want_labels[1]]

            # Garbage is a 400 naming the input, on both APIs; the function keeps serving.
            status, err = await native(b"\x89PNG\r\n\x1a\n not really")
            assert (status, err["code"]) == (400, "invalid_input"), err
            assert "image" in err["error"]

            def kserve_garbage() -> InferenceServerException:
                client = triton.InferenceServerClient(url.removeprefix("http://"))
                try:
                    inp = triton.InferInput("image", [1], "BYTES")
                    inp.set_data_from_numpy(np.array([b"garbage"], dtype=object),
                                            binary_data=True)
                    with pytest.raises(InferenceServerException) as info:
                        client.infer("vit-fn", [inp])
                    return info.value
                finally:
                    client.close()

            exc = await asyncio.to_thread(kserve_garbage)
            assert exc.status() == "400", exc
            status, out = await native(images[0])
            assert status == 200, out
            got = out["outputs"]["logits"]
            np.testing.assert_allclose(np.asarray(got["data"], np.float32).reshape(got["shape"]),
                                       want[0:1], atol=1e-4)
    finally:
        await asyncio.wait_for(c.stop(), 60)
    for pid in pids:  # leak check: every worker process the cluster started has exited
        status_file = Path(f"/proc/{pid}/status")
        assert not status_file.exists() or "zombie" in status_file.read_text().lower(), pid
