"""A no-op model for measuring platform overhead: ``y = x * w`` with ``w = 1.0``.

Input ``x`` FP32 ``[batch, -1]``, output ``y`` FP32 ``[batch, -1]`` (equal to ``x``).
``num_layers`` identical layers make it splittable into stages; ``ballast_bytes`` of
deterministic random ``U8`` buffers (split over the layers, never read by ``forward``) give
it a weight size, so cold-start paths (fetch, multicast, load) can be measured with a
forward pass that costs nothing. Presets: tiny has no ballast (4 bytes of weights per
layer), small/base/large carry 32 MiB / 512 MiB / 1 GiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
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

ENTRY_POINT = "flashpoint.models.noop:build_empty"
MiB = 1024 * 1024


@dataclass(frozen=True)
class NoopConfig:
    num_layers: int = 1
    ballast_bytes: int = 0
    features: int = 16  # example inputs only; any width runs

    def __post_init__(self) -> None:
        require_positive(self, "num_layers", "features")
        if self.ballast_bytes < 0:
            raise ValueError("ballast_bytes must be >= 0")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"ballast_bytes": 32 * MiB},
    "base": {"ballast_bytes": 512 * MiB},
    "large": {"ballast_bytes": 1024 * MiB},
}


class NoopLayer(nn.Module):
    def __init__(self, ballast_bytes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        if ballast_bytes:
            self.register_buffer("ballast", torch.zeros(ballast_bytes, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class NoopModel(LayeredModel):
    def __init__(self, cfg: NoopConfig) -> None:
        super().__init__()
        self.config = cfg
        per_layer, extra = divmod(cfg.ballast_bytes, cfg.num_layers)
        self.layers = nn.ModuleList(
            NoopLayer(per_layer + (extra if i == 0 else 0)) for i in range(cfg.num_layers)
        )


def resolve(preset_or_config: str | Mapping[str, Any]) -> NoopConfig:
    return resolve_config(NoopConfig, PRESETS, preset_or_config)


def _config(config: NoopConfig | Mapping[str, Any]) -> NoopConfig:
    return config if isinstance(config, NoopConfig) else config_from_dict(NoopConfig, config)


def build_empty(config: NoopConfig | Mapping[str, Any]) -> NoopModel:
    """The module on the ``meta`` device (no memory): the manifest's entry point."""
    with torch.device("meta"):
        return NoopModel(_config(config))


def init_weights(module: nn.Module, g: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, NoopLayer):
            m.weight.fill_(1.0)
            if hasattr(m, "ballast"):
                m.ballast.random_(0, 256, generator=g)


def build_from_config(config: NoopConfig | Mapping[str, Any], *, seed: int = 0) -> NoopModel:
    g = torch.Generator().manual_seed(seed)
    return materialize(build_empty(config), g, init_weights)  # type: ignore[return-value]


def io_signature(config: NoopConfig | Mapping[str, Any]) -> IoSignature:
    _config(config)
    return IoSignature(
        inputs=(TensorSpec("x", "FP32", (-1, -1)),),
        outputs=(TensorSpec("y", "FP32", (-1, -1)),),
    )


def example_inputs(
    config: NoopConfig | Mapping[str, Any], batch: int = 1, *, seed: int = 0
) -> dict[str, np.ndarray]:
    cfg = _config(config)
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, cfg.features), dtype=np.float32)}
