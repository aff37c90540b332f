"""What every built-in model shares: layered modules and strict, preset-based configs.

A layered model is an ``nn.Module`` whose ``layers`` (an ``nn.ModuleList``) are its
top-level sequential blocks: ``forward`` runs them in order, each taking the previous
one's output tensor, so any contiguous run of layers is a pipeline stage. Layer ``i``'s
state-dict keys all start with ``layers.<i>.``, which is how the weights blob groups them.

Configs are frozen dataclasses; presets are partial dicts over the defaults. A config
dict coming from a manifest or a user is parsed strictly (unknown keys and wrong types are
:class:`~flashpoint.errors.BadRequest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from flashpoint.errors import BadRequest

C = TypeVar("C")


class LayeredModel(nn.Module):
    """Base of the built-in models: ``forward`` = the layers in order."""

    layers: nn.ModuleList

    def layer_names(self) -> list[str]:
        """State-dict prefixes of the layers, in execution order (``layers.0``, ...)."""
        return [f"layers.{i}" for i in range(len(self.layers))]

    def run_layers(self, x: torch.Tensor, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Run layers ``first..last`` (inclusive) on ``x``; a pipeline stage's forward."""
        layers = self.layers
        last = len(layers) - 1 if last is None else last
        # Index, not slice: slicing a ModuleList builds a new ModuleList (a Module) per call,
        # which cost more than a small model's whole forward pass.
        for i in range(first, last + 1):
            x = layers[i](x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_layers(x)


def config_from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
    """Build a config dataclass from a dict: unknown keys and wrong types are BadRequest.

    Field types follow the defaults: ints (never bools) for int fields, numbers for float
    fields, bools for bool fields, lists or tuples of ints for tuple fields.
    """
    if not isinstance(data, Mapping):
        raise BadRequest(f"{cls.__name__} must be an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields)
    if unknown:
        raise BadRequest(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        default = fields[key].default
        kwargs[key] = _coerce(cls.__name__, key, default, value)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{cls.__name__}: {e}") from None


def _coerce(owner: str, key: str, default: Any, value: Any) -> Any:
    bad = BadRequest(f"{owner}.{key}: expected a value like {default!r}, got {value!r:.80}")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise bad
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise bad
        return tuple(value)
    raise bad


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as a JSON-ready dict (tuples become lists)."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in dataclasses.asdict(config).items()
    }


def resolve_config(
    cls: type[C],
    presets: Mapping[str, Mapping[str, Any]],
    preset_or_config: str | Mapping[str, Any],
    default_preset: str = "tiny",
) -> C:
    """A preset name, or a dict of overrides (optionally naming its base ``"preset"``)."""
    if isinstance(preset_or_config, str):
        base, overrides = preset_or_config, {}
    elif isinstance(preset_or_config, Mapping):
        overrides = dict(preset_or_config)
        base = overrides.pop("preset", default_preset)
    else:
        raise BadRequest("expected a preset name or a config object")
    if base not in presets:
        raise BadRequest(f"unknown preset {base!r}; choose one of {sorted(presets)}")
    return config_from_dict(cls, {**presets[base], **overrides})


def require_positive(owner: Any, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= 0:
            raise ValueError(f"{name} must be positive")


def materialize(module: nn.Module, generator: torch.Generator, init: Any) -> nn.Module:
    """Move a meta-device module to CPU memory and fill it deterministically."""
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        init(module, generator)
    return module.eval()
