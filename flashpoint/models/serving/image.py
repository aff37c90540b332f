"""Image classification: encoded images in (an OIP ``BYTES`` tensor ``image``, one JPEG or
PNG per row), labels out.

Each image is decoded with Pillow -- only JPEG and PNG, and only up to
:data:`MAX_IMAGE_PIXELS` (a small file can declare a huge image: a decompression bomb is
refused from its header, before its pixels are decoded) -- turned upright by its EXIF
orientation and converted to RGB, as ``transformers``' own pipelines do. The model's image
processor (its ``preprocessor_config.json``, carried in the model version and loaded from
those bytes with ``transformers``' PIL backend and local files only) then resizes, crops,
rescales and normalizes it exactly as that config says, into ``pixel_values`` (``FP32
[rows, 3, H, W]``). Every image comes out the same size (checked at push), so requests
batch with no padding. Bytes that are no image, or a tensor that is not ``BYTES``, are a
400 ``invalid_input``. The answer is the text classifier's: ``label``, ``score``, ``logits``.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashpoint.errors import InvalidInput, RegistryError, UnsupportedModel
from flashpoint.models.serving.text import DEFAULT_TOP_K, labels_of, top_k_answer

IMAGE_INPUT = "image"
PROCESSOR_FILE = "preprocessor_config.json"
IMAGE_FORMATS = ("JPEG", "PNG")
MAX_IMAGE_PIXELS = 40_000_000
"""The largest image decoded (width x height): about 120 MB as RGB."""


class ProcessorError(Exception):
    """The image processor config does not load (the caller says where it came from)."""


def load_image_processor(directory: str | Path) -> Any:
    """The image processor of a model directory: ``transformers``' own class named in
    its ``preprocessor_config.json``, PIL backend (no torchvision), never a download and
    never custom code; ProcessorError saying why not."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(
            str(directory), backend="pil", local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a bad config
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProcessorError(first) from None
    if not type(processor).__module__.startswith("transformers."):
        raise ProcessorError(f"{type(processor).__name__} is not a transformers image processor")
    return processor


def _write_files(directory: Path, files: Mapping[str, bytes]) -> None:
    for path, data in files.items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def check_image_processor(source: Path, files: Mapping[str, bytes]) -> dict[str, Any]:
    """At push: the directory's image processor loads from the files the model version
    carries and gives every image the same size; the manifest config entries
    (``image_size``: ``[channels, height, width]`` of ``pixel_values``). UnsupportedModel
    naming the file otherwise."""
    where = source / PROCESSOR_FILE
    if PROCESSOR_FILE not in files or not where.is_file():
        raise UnsupportedModel(
            f"{where}: missing; an image model needs the {PROCESSOR_FILE} its image "
            "processor writes (save_pretrained of e.g. ViTImageProcessor: size, image_mean, "
            "image_std...)")
    with tempfile.TemporaryDirectory(prefix="fp-image-processor-") as d:
        _write_files(Path(d), files)  # what a worker will see, not the whole directory
        try:
            processor = load_image_processor(d)
        except ProcessorError as e:
            raise UnsupportedModel(f"{where}: the image processor does not load: "
                                   f"{e}"[:400]) from None
    shapes = set()
    for size in ((37, 23), (64, 96)):
        try:
            pixels = _process(processor, _noise_image(size))
        except Exception as e:  # the processor's own code, on a plain RGB image
            raise UnsupportedModel(f"{where}: the image processor fails on an image: "
                                   f"{type(e).__name__}: {e}"[:400]) from None
        shapes.add(pixels.shape[1:])
    if len(shapes) != 1:
        raise UnsupportedModel(f"{where}: the image processor gives images of different sizes "
                               f"{sorted(shapes)}; a classifier needs one fixed size")
    return {"image_size": [int(n) for n in shapes.pop()]}


def decode_image(item: Any, index: int) -> Any:
    """A ``PIL.Image`` in RGB from one element of the ``image`` tensor; InvalidInput for
    what is not a JPEG or PNG of at most MAX_IMAGE_PIXELS."""
    from PIL import Image, ImageOps

    if not isinstance(item, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"input {IMAGE_INPUT!r} item {index} must be the bytes of a JPEG or "
                           f"PNG file (BYTES), got {type(item).__name__}")
    try:
        # Pillow itself refuses past 2 x Image.MAX_IMAGE_PIXELS (DecompressionBombError).
        img = Image.open(io.BytesIO(bytes(item)), formats=IMAGE_FORMATS)
        width, height = img.size
        if width * height > MAX_IMAGE_PIXELS:  # from the header: nothing decoded yet
            raise InvalidInput(f"input {IMAGE_INPUT!r} item {index}: {width}x{height} pixels, "
                               f"over the limit of {MAX_IMAGE_PIXELS}")
        img.load()
        img = ImageOps.exif_transpose(img)
        return img.convert("RGB")
    except InvalidInput:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidInput(f"input {IMAGE_INPUT!r} item {index}: too many pixels: {e}") from None
    except Exception as e:  # Pillow: UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise InvalidInput(f"input {IMAGE_INPUT!r} item {index} is not a readable JPEG or PNG "
                           f"image: {e}"[:300]) from None


def _process(processor: Any, image: Any) -> np.ndarray:
    out = processor(images=image, return_tensors="np")["pixel_values"]
    return np.ascontiguousarray(out, dtype=np.float32)


def _noise_image(size: tuple[int, int], seed: int = 0) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def encode_png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class ImageClassification:
    """See the module docstring."""

    processor: Any
    image_size: tuple[int, ...]
    labels: list[str]
    top_k: int = DEFAULT_TOP_K
    module_inputs: tuple[str, ...] = ("pixel_values",)
    module_outputs: tuple[str, ...] = ("logits",)
    pad_values: Mapping[str, int] = field(default_factory=dict)
    # Decoding and resizing take milliseconds (bench/hf_models.py): the worker prepares
    # these requests on a thread, never on its event loop.
    prepare_in_thread: bool = True

    @classmethod
    def for_manifest(cls, manifest: Any, files: Mapping[str, bytes]) -> ImageClassification:
        config = manifest.config
        if PROCESSOR_FILE not in files:
            raise RegistryError(f"{manifest.name}:{manifest.version}: carries no "
                                f"{PROCESSOR_FILE}")
        with tempfile.TemporaryDirectory(prefix="fp-image-processor-") as d:
            _write_files(Path(d), files)
            try:
                processor = load_image_processor(d)
            except ProcessorError as e:
                raise RegistryError(f"the model's image processor does not load: "
                                    f"{e}"[:500]) from None
        size = config.get("image_size")
        if size is None:
            size = _process(processor, _noise_image((16, 16))).shape[1:]
        return cls(processor, tuple(int(n) for n in size),
                   labels_of(config["hf_config"], int(config["num_labels"])),
                   int(config.get("top_k", DEFAULT_TOP_K)))

    def prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arr = inputs[IMAGE_INPUT]
        if arr.dtype != object:
            raise InvalidInput(f"input {IMAGE_INPUT!r} must be BYTES (one encoded image per "
                               f"row), got {arr.dtype} values")
        if arr.ndim != 1 or arr.shape[0] == 0:
            raise InvalidInput(f"input {IMAGE_INPUT!r} must be BYTES of shape [n], n >= 1 (one "
                               f"encoded image per row), got {list(arr.shape)}")
        out = np.empty((arr.shape[0], *self.image_size), dtype=np.float32)
        for i, item in enumerate(arr):  # one at a time: one decoded image in memory
            pixels = _process(self.processor, decode_image(item, i))
            if pixels.shape[1:] != self.image_size:
                raise RegistryError(f"the image processor gave {list(pixels.shape[1:])}, not "
                                    f"the model's {list(self.image_size)}")
            out[i] = pixels[0]
        return {"pixel_values": out}

    def finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return top_k_answer(outputs["logits"], self.labels, self.top_k)

    def warmup_request(self) -> dict[str, np.ndarray]:
        data = np.empty(1, dtype=object)
        data[0] = encode_png(_noise_image((24, 16)))
        return {IMAGE_INPUT: data}
