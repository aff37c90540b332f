"""Write a small Hugging Face image classifier (ViT, random weights) and a test image.

Any ``save_pretrained`` directory of a ``*ForImageClassification`` model with its
``preprocessor_config.json`` serves the same way.

    python examples/image_classifier/make_model.py ./vit-model
"""

import sys
from pathlib import Path

import numpy as np
from PIL import Image

from flashpoint.models.tiny_hf import make_image_classifier

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "vit-model")
    make_image_classifier(out, family="vit", labels=("cat", "dog", "bird"))
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out / "example.jpg")
    print(out)
