"""The built-in models by name: ``bert``, ``resnet`` and ``noop``.

Every model has presets ``tiny`` (2-5 MB, for tests; noop's tiny is a few bytes),
``small`` (30-60 MB), ``base`` (about 500 MB) and ``large`` (1 GB or more), accepts a
dict of config overrides (``{"preset": "small", "num_layers": 4}``), builds
deterministic weights from a seed, and names the entry point that rebuilds the empty
module from its config (``flashpoint.models.bert:build_empty``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from flashpoint.errors import BadRequest
from flashpoint.models import bert, noop, resnet
from flashpoint.models.base import LayeredModel, config_to_dict
from flashpoint.registry.format import DTYPES
from flashpoint.registry.manifest import IoSignature

PRESET_NAMES = ("tiny", "small", "base", "large")


@dataclass(frozen=True)
class ModelDef:
    """One built-in model: its presets and the functions that build and describe it."""

    name: str
    module: ModuleType

    @property
    def entry_point(self) -> str:
        return f"{self.module.__name__}:build_empty"

    @property
    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        return self.module.PRESETS

    def resolve(self, preset_or_config: str | Mapping[str, Any]) -> dict[str, Any]:
        return config_to_dict(self.module.resolve(preset_or_config))

    @property
    def build_empty(self) -> Callable[[Mapping[str, Any]], LayeredModel]:
        return self.module.build_empty

    @property
    def build_from_config(self) -> Callable[..., LayeredModel]:
        return self.module.build_from_config


MODELS: dict[str, ModelDef] = {
    "bert": ModelDef("bert", bert),
    "resnet": ModelDef("resnet", resnet),
    "noop": ModelDef("noop", noop),
}


def get(name: str) -> ModelDef:
    try:
        return MODELS[name]
    except KeyError:
        raise BadRequest(f"unknown built-in model {name!r}; choose one of {sorted(MODELS)}") from None


def resolve_config(name: str, preset_or_config: str | Mapping[str, Any] = "tiny") -> dict[str, Any]:
    """The full, validated config dict of a preset or an override dict."""
    return get(name).resolve(preset_or_config)


def build(
    name: str, preset_or_config: str | Mapping[str, Any] = "tiny", *, seed: int = 0
) -> tuple[LayeredModel, dict[str, Any]]:
    """The model with deterministic weights (CPU, eval mode) and its full config dict."""
    model = get(name)
    config = model.resolve(preset_or_config)
    return model.build_from_config(config, seed=seed), config


def build_empty(name: str, config: Mapping[str, Any]) -> LayeredModel:
    """The model on the ``meta`` device (no weight memory)."""
    return get(name).build_empty(config)


def param_bytes(name: str, preset_or_config: str | Mapping[str, Any] = "tiny") -> int:
    """Bytes of the model's state dict (parameters and buffers), computed without memory."""
    module = get(name).build_empty(resolve_config(name, preset_or_config))
    return state_dict_bytes(module)


def state_dict_bytes(module: nn.Module) -> int:
    total = 0
    for t in module.state_dict().values():
        if t.dtype not in DTYPES.values():
            raise BadRequest(f"unsupported dtype {t.dtype} in state dict")
        total += t.numel() * t.element_size()
    return total


def io_signature(name: str, config: Mapping[str, Any]) -> IoSignature:
    return get(name).module.io_signature(config)


def example_inputs(
    name: str, config: Mapping[str, Any], batch: int = 1, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """Deterministic inputs matching :func:`io_signature` (same arguments, same arrays)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise BadRequest("batch must be a positive integer")
    return get(name).module.example_inputs(config, batch, seed=seed)


def run_example(module: nn.Module, inputs: Mapping[str, np.ndarray]) -> torch.Tensor:
    """Run a single-input built-in model on numpy inputs (tests and profiling)."""
    (array,) = inputs.values()
    device = next(iter(module.parameters())).device
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(array)).to(device))
