"""How a built module meets a blob's tensors: its layer plan, and binding views into it.

Kept apart from :mod:`flashpoint.models.publish` so that the source formats
(:mod:`flashpoint.models.sources`) and the Hugging Face stages
(:mod:`flashpoint.models.hf_stages`) need not import the publishing pipeline that imports
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from flashpoint.errors import RegistryError

LayerPlan = Callable[[nn.Module], tuple[Sequence[str] | None, Callable[[str], str] | None]]
"""A built module's layers in execution order and the function naming a tensor's layer."""


def bind_tensors(module: nn.Module, views: Mapping[str, torch.Tensor], buffers: Sequence[str],
          what: str) -> None:
    """Assign the state dict's tensors and the carried non-persistent buffers."""
    carried = set(buffers)
    state = {n: t for n, t in views.items() if n not in carried}
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise RegistryError(f"blob does not fit {what}: {e}") from e
    for name in buffers:
        if name not in views:
            continue
        owner_path, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_path)
        except AttributeError as e:
            raise RegistryError(f"carried buffer {name!r} has no module in {what}") from e
        if attr not in owner._buffers:
            raise RegistryError(f"carried buffer {name!r} is not a buffer of {what}")
        owner._buffers[attr] = views[name]
