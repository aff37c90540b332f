"""A ResNet-like CNN classifier (basic residual blocks).

Layers: ``[stem, block, block, ..., head]`` with every residual block its own layer (finer
pipeline cuts). Input ``image`` FP32 ``[batch, 3, H, W]`` (any H, W ≥ 32; the head pools
adaptively), output ``logits`` FP32 ``[batch, num_classes]``.

Sizes (float32 weights, BatchNorm statistics included): tiny ≈ 2.8 MB, small ≈ 47 MB
(ResNet-18 shape), base ≈ 490 MB, large ≈ 1.4 GB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flashpoint.models.base import (
    LayeredModel,
    config_from_dict,
    materialize,
    require_positive,
    resolve_config,
)
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import TensorSpec

ENTRY_POINT = "flashpoint.models.resnet:build_empty"


@dataclass(frozen=True)
class ResNetConfig:
    widths: tuple[int, ...] = (24, 48, 96, 192)
    blocks: tuple[int, ...] = (1, 1, 1, 1)
    num_classes: int = 10
    image_size: int = 32  # example inputs only

    def __post_init__(self) -> None:
        require_positive(self, "num_classes", "image_size")
        if not self.widths or len(self.widths) != len(self.blocks):
            raise ValueError("widths and blocks need one entry per stage")
        if min(self.widths) <= 0 or min(self.blocks) <= 0:
            raise ValueError("widths and blocks must be positive")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"widths": [64, 128, 256, 512], "blocks": [2, 2, 2, 2], "num_classes": 1000,
              "image_size": 224},
    "base": {"widths": [208, 416, 832, 1664], "blocks": [2, 2, 2, 2], "num_classes": 1000,
             "image_size": 224},
    "large": {"widths": [256, 512, 1024, 2048], "blocks": [3, 4, 6, 3], "num_classes": 1000,
              "image_size": 224},
}


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, stride=2, padding=1)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class Head(nn.Module):
    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNetModel(LayeredModel):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = [Stem(cfg.widths[0])]
        c_in = cfg.widths[0]
        for stage, (width, n) in enumerate(zip(cfg.widths, cfg.blocks, strict=True)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(c_in, width, stride))
                c_in = width
        layers.append(Head(c_in, cfg.num_classes))
        self.layers = nn.ModuleList(layers)


def resolve(preset_or_config: str | Mapping[str, Any]) -> ResNetConfig:
    return resolve_config(ResNetConfig, PRESETS, preset_or_config)


def _config(config: ResNetConfig | Mapping[str, Any]) -> ResNetConfig:
    return config if isinstance(config, ResNetConfig) else config_from_dict(ResNetConfig, config)


def build_empty(config: ResNetConfig | Mapping[str, Any]) -> ResNetModel:
    """The module on the ``meta`` device (no memory): the manifest's entry point."""
    with torch.device("meta"):
        return ResNetModel(_config(config))


def init_weights(module: nn.Module, g: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            m.weight.normal_(0.0, (2.0 / fan_in) ** 0.5, generator=g)
        elif isinstance(m, nn.BatchNorm2d):
            # Scale residual branches down so deep stacks stay numerically tame.
            m.weight.normal_(0.5, 0.05, generator=g)
            m.bias.normal_(0.0, 0.05, generator=g)
            m.running_mean.normal_(0.0, 0.1, generator=g)
            m.running_var.uniform_(0.5, 1.5, generator=g)
            m.num_batches_tracked.zero_()
        elif isinstance(m, nn.Linear):
            m.weight.normal_(0.0, 0.01, generator=g)
            m.bias.normal_(0.0, 0.01, generator=g)


def build_from_config(config: ResNetConfig | Mapping[str, Any], *, seed: int = 0) -> ResNetModel:
    """The module with deterministic weights (same config and seed, same bytes)."""
    g = torch.Generator().manual_seed(seed)
    return materialize(build_empty(config), g, init_weights)  # type: ignore[return-value]


def io_signature(config: ResNetConfig | Mapping[str, Any]) -> IoSignature:
    cfg = _config(config)
    return IoSignature(
        inputs=(TensorSpec("image", "FP32", (-1, 3, -1, -1)),),
        outputs=(TensorSpec("logits", "FP32", (-1, cfg.num_classes)),),
    )


def example_inputs(
    config: ResNetConfig | Mapping[str, Any], batch: int = 1, *, seed: int = 0
) -> dict[str, np.ndarray]:
    cfg = _config(config)
    rng = np.random.default_rng(seed)
    shape = (batch, 3, cfg.image_size, cfg.image_size)
    return {"image": rng.standard_normal(shape, dtype=np.float32)}
