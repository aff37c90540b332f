"""Writes weights.safetensors for the example bundle (fixed seed: the same file each run).

    python examples/handler/make_weights.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file

generator = torch.Generator().manual_seed(0)
weights = {"fc.weight": torch.randn(3, 4, generator=generator),
           "fc.bias": torch.randn(3, generator=generator)}
save_file(weights, str(Path(__file__).with_name("weights.safetensors")))
