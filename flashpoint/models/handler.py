"""Handler bundles: a model as user code an admin trusted (format ``handler``).

A bundle is a directory with ``flashpoint.toml`` (``handler = "module:Class"``, optional
``inputs`` / ``outputs``), the module file(s) and ``*.safetensors`` weights. The class::

    class Classifier:
        def load(self, weights: dict[str, torch.Tensor], device: str) -> None: ...
        def preprocess(self, inputs: dict[str, np.ndarray]) -> dict: ...   # optional
        def predict(self, batch: dict) -> dict[str, np.ndarray | torch.Tensor]: ...
        def postprocess(self, outputs: dict) -> dict: ...                    # optional

The weights travel in the blob like any model's; the ``.py`` files and the toml are
carried files. A worker runs :class:`HandlerModule` (built by ``build_empty``, listed in
``BUILTIN_ENTRY_POINTS`` and flagged ``runs_user_code``: refused unless the manifest says
``trusted_code``), whose ``forward`` takes the module inputs in order, calls ``load`` once
per device with the blob's tensors (views, zero-copy on CPU) and then ``predict`` on the
batch (torch tensors on that device), and returns the outputs in order. ``preprocess``
and ``postprocess`` run per request around the batch, in the ``handler`` serving task
(:mod:`flashpoint.models.serving.handler`), on an instance of their own that has loaded
no weights.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flashpoint.errors import RegistryError

MANIFEST_FILE = "flashpoint.toml"
_bundle_ids = itertools.count()


def import_handler(ref: str, files: Mapping[str, bytes], what: str) -> type:
    """The class ``ref`` (``module:Class``) from a bundle's carried ``.py`` files.

    The files are written to a private temporary directory, on ``sys.path`` only while the
    module is executed (so it may import its sibling files); the module gets a unique name
    and it and its siblings are removed from ``sys.modules`` afterwards: two bundles with a
    ``model.py`` each never see each other's. RegistryError when it cannot be imported.
    """
    module_name, _, class_name = ref.partition(":")
    if not module_name or not class_name or f"{module_name}.py" not in files:
        raise RegistryError(f"{what}: handler {ref!r} must name module:Class with module.py "
                            "in the bundle")
    unique = f"_flashpoint_bundle_{next(_bundle_ids)}_{module_name}"
    before = set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="fp-bundle-") as td:
        for path, data in files.items():
            if path.endswith(".py") and "/" not in path and not path.startswith("."):
                (Path(td) / path).write_bytes(data)
        sys.path.insert(0, td)
        try:
            spec = importlib.util.spec_from_file_location(unique, Path(td) / f"{module_name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[unique] = module  # dataclasses and the like look their module up
            spec.loader.exec_module(module)
        except Exception as e:  # the bundle's own code raised on import
            raise RegistryError(f"{what}: importing {module_name}.py failed: "
                                f"{type(e).__name__}: {e}"[:400]) from e
        finally:
            sys.path.remove(td)
            for name in set(sys.modules) - before:
                if name == unique or str(getattr(sys.modules[name], "__file__", "") or ""
                                         ).startswith(td):
                    del sys.modules[name]
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise RegistryError(f"{what}: {module_name}.py has no class {class_name!r}")
    if not callable(getattr(cls, "predict", None)) or not callable(getattr(cls, "load", None)):
        raise RegistryError(f"{what}: {class_name} needs load(weights, device) and "
                            "predict(batch) methods")
    return cls


def weight_tree(weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """Tensors named ``a.b.c`` as buffers of nested modules, so the state dict keeps their
    names (under ``weights.``) and ``load_state_dict(assign=True)`` binds them.
    ValueError when one name is another's prefix (``fc`` and ``fc.weight``)."""
    root = nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = dict(owner.named_children()).get(part)
            if child is None:
                try:
                    child = nn.Module()
                    owner.add_module(part, child)
                except (KeyError, TypeError) as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
            owner = child
        try:
            owner.register_buffer(leaf, tensor)
        except (KeyError, TypeError) as e:
            raise ValueError(f"weight {name!r}: {e}") from None
    return root


class HandlerModule(nn.Module):
    """A handler as the worker's module: ``forward(*module_inputs) -> outputs in order``."""

    def __init__(self, handler: Any, weights: Mapping[str, torch.Tensor],
                 module_inputs: Sequence[str], module_outputs: Sequence[str]) -> None:
        super().__init__()
        self.weights = weight_tree(weights)
        self.handler = handler
        self.module_inputs = tuple(module_inputs)
        self.module_outputs = tuple(module_outputs)
        self.loaded_on: str | None = None

    def _device(self, inputs: Sequence[torch.Tensor]) -> str:
        for t in self.weights.buffers():
            return str(t.device)
        return str(inputs[0].device) if inputs else "cpu"

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = self._device(inputs)
        if self.loaded_on != device:  # once, and again only after a move to another device
            self.handler.load(dict(self.weights.named_buffers()), device)
            self.loaded_on = device
        out = self.handler.predict(dict(zip(self.module_inputs, inputs, strict=True)))
        if not isinstance(out, Mapping):
            raise TypeError(f"predict returned a {type(out).__name__}, not a dict of tensors")
        missing = [n for n in self.module_outputs if n not in out]
        if missing:
            raise KeyError(f"predict returned no {missing} (it returned {sorted(out)})")
        return tuple(_as_tensor(out[n]) for n in self.module_outputs)


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.ascontiguousarray(value))


def build_empty(config: Mapping[str, Any], files: Mapping[str, bytes]) -> nn.Module:
    """The bundle's module with its weights on ``meta`` (``config.weights``: name, dtype,
    shape) until the blob's are bound; its class imported from the carried files."""
    what = f"handler bundle ({config.get('handler')})"
    cls = import_handler(str(config.get("handler", "")), files, what)
    try:
        weights = {str(n): torch.empty(tuple(shape), dtype=getattr(torch, str(dtype)),
                                       device="meta")
                   for n, dtype, shape in config.get("weights", [])}
        handler = cls()
    except Exception as e:  # a bad config, or the class's own constructor
        raise RegistryError(f"{what}: cannot be built: {type(e).__name__}: {e}"[:400]) from e
    return HandlerModule(handler, weights, config.get("module_inputs", []),
                         config.get("module_outputs", []))


build_empty.takes_files = True  # type: ignore[attr-defined]
build_empty.runs_user_code = True  # type: ignore[attr-defined]
