"""Hugging Face image classifiers: pushed from a directory, loaded back from the blob the
way a worker does, and served from real JPEG and PNG bytes to the same logits that
``transformers`` computes from the same images."""

from __future__ import annotations

import io
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flashpoint.errors import InvalidInput, UnsupportedModel
from flashpoint.models import serving
from flashpoint.models.publish import load_module, read_files
from flashpoint.models.serving.image import MAX_IMAGE_PIXELS, ImageClassification
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_image_classifier
from flashpoint.registry.local import LocalStore

pytestmark = pytest.mark.timeout(120)

LABELS = ("cat", "dog", "bird", "fish")


def encode(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def reference(directory: Path, images: list[bytes]) -> np.ndarray:
    """What transformers computes from the same encoded images, in this process."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(str(directory), backend="pil",
                                                   local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(str(directory),
                                                            local_files_only=True).eval()
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        return model(pixel_values=pixels).logits.numpy()


class Loaded:
    """A published model version loaded back from its blob, as a worker loads it."""

    def __init__(self, store: LocalStore, manifest: Any) -> None:
        self.manifest = manifest
        with open(store.blob_path(manifest.name, manifest.version), "rb") as fh:
            self.mapping = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.module = load_module(manifest, memoryview(self.mapping))
        self.served = serving.for_manifest(manifest, read_files(manifest,
                                                                memoryview(self.mapping)))

    def infer(self, images: list[bytes]) -> dict[str, np.ndarray]:
        arr = np.empty(len(images), dtype=object)
        arr[:] = images
        prepared = self.served.prepare({"image": arr})
        with torch.inference_mode():
            out = self.module(*(torch.from_numpy(prepared[n])
                                for n in self.served.module_inputs))
        return self.served.finish({"logits": out.numpy()})


@pytest.fixture(params=["vit", "resnet"])
async def pushed(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Loaded]:
    directory = make_image_classifier(tmp_path / "src", family=request.param, labels=LABELS,
                                      seed=3)
    store = LocalStore(tmp_path / "store")
    manifest = await publish_source(store, f"img-{request.param}", directory)
    return directory, Loaded(store, manifest)


async def test_jpeg_and_png_served_as_transformers_computes(pushed: tuple[Path, Loaded]) -> None:
    directory, loaded = pushed
    m = loaded.manifest
    assert m.task == "image-classification"
    assert "preprocessor_config.json" in read_files(m, memoryview(loaded.mapping))
    assert [t.name for t in m.io.inputs] == ["image"]
    assert m.config["image_size"] == [3, 32, 32]
    assert isinstance(loaded.served, ImageClassification) and loaded.served.pad_values == {}

    images = [encode(noise(48, 64, 1), "JPEG"), encode(noise(20, 17, 2), "PNG"),
              encode(noise(90, 33, 3), "PNG")]
    got = loaded.infer(images)
    want = reference(directory, images)
    np.testing.assert_allclose(got["logits"], want, atol=1e-4)
    assert got["label"].shape == got["score"].shape == (3, len(LABELS))
    assert got["score"].dtype == np.float32
    best = [LABELS[i].encode() for i in want.argmax(axis=1)]
    assert list(got["label"][:, 0]) == best
    np.testing.assert_allclose(got["score"].sum(axis=1), 1.0, rtol=1e-5)
    # One image alone: the same logits as in a request of three.
    np.testing.assert_allclose(loaded.infer(images[1:2])["logits"], want[1:2], atol=1e-4)


async def test_modes_other_than_rgb_are_converted(pushed: tuple[Path, Loaded]) -> None:
    from PIL import Image

    directory, loaded = pushed
    buf = io.BytesIO()
    Image.fromarray(noise(30, 40, 5)[:, :, 0], mode="L").save(buf, format="PNG")
    rgba = np.concatenate([noise(30, 40, 6), np.full((30, 40, 1), 255, np.uint8)], axis=2)
    images = [buf.getvalue(), encode(rgba, "PNG")]
    np.testing.assert_allclose(loaded.infer(images)["logits"], reference(directory, images),
                               atol=1e-4)


async def test_bad_images_are_invalid_input(tmp_path: Path) -> None:
    from PIL import Image

    directory = make_image_classifier(tmp_path / "src", family="vit", labels=LABELS)
    store = LocalStore(tmp_path / "store")
    loaded = Loaded(store, await publish_source(store, "img", directory))
    served = loaded.served
    good = encode(noise(16, 16, 0), "PNG")

    def bad(*items: Any) -> str:
        arr = np.empty(len(items), dtype=object)
        arr[:] = list(items)
        with pytest.raises(InvalidInput) as info:
            served.prepare({"image": arr})
        assert info.value.code == "invalid_input" and info.value.http_status == 400
        return info.value.message

    assert "item 1" in bad(good, b"definitely not an image")
    assert "JPEG or PNG" in bad(good[: len(good) // 2])  # truncated PNG
    gif = io.BytesIO()
    Image.fromarray(noise(8, 8, 0)).save(gif, format="GIF")
    assert "JPEG or PNG" in bad(gif.getvalue())  # a format not taken
    assert "BYTES" in bad("a string, not bytes")
    with pytest.raises(InvalidInput, match="BYTES"):
        served.prepare({"image": np.zeros((1, 3, 32, 32), np.float32)})
    with pytest.raises(InvalidInput, match=r"shape \[n\]"):
        served.prepare({"image": np.empty(0, dtype=object)})

    # A decompression bomb: a small PNG whose header declares over the pixel limit, refused
    # from the header (the pixels are never decoded).
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 100
    big = io.BytesIO()
    Image.new("L", (side, side)).save(big, format="PNG", optimize=True)
    assert len(big.getvalue()) < 1 << 20
    assert "over the limit" in bad(big.getvalue())
    # The replica still serves after each refusal.
    assert loaded.infer([good])["label"].shape == (1, len(LABELS))


async def test_missing_preprocessor_config_is_refused_at_push(tmp_path: Path) -> None:
    directory = make_image_classifier(tmp_path / "src", family="resnet")
    (directory / "preprocessor_config.json").unlink()
    store = LocalStore(tmp_path / "store")
    with pytest.raises(UnsupportedModel, match="preprocessor_config.json") as info:
        await publish_source(store, "img", directory)
    assert str(directory) in info.value.message
    assert not await store.exists("img", "1")


async def test_unloadable_preprocessor_config_is_refused_at_push(tmp_path: Path) -> None:
    directory = make_image_classifier(tmp_path / "src", family="vit")
    (directory / "preprocessor_config.json").write_text(
        '{"image_processor_type": "NoSuchImageProcessor"}')
    with pytest.raises(UnsupportedModel, match="preprocessor_config.json.*does not load"):
        await publish_source(LocalStore(tmp_path / "store"), "img", directory)
