"""A handler bundle (format ``handler``): a directory with ``flashpoint.toml``.

``flashpoint.toml``::

    handler = "linear:LinearClassifier"   # module file linear.py, its class
    inputs = ["x:FP32:-1,4"]              # the request's tensors (required)
    outputs = ["label:INT64:-1"]          # the answer's (default: read off a warm-up run)
    module_inputs = ["x"]                 # what preprocess hands predict (default: inputs)

Weights: every ``*.safetensors`` in the directory, into the blob. Carried: the toml and
every other file (the ``.py`` modules). It runs the bundle's code, so a push needs
``--trust-code`` (admin only; recorded in the manifest as ``trusted_code``). At push the
bundle is imported, loaded and answers one warm-up request (which is how its module
outputs, and by default its answer's tensors, are known). Served whole (one layer).
See :mod:`flashpoint.models.handler` for the class and how a worker runs it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashpoint.errors import FlashpointError, UnsupportedModel
from flashpoint.models.handler import MANIFEST_FILE, HandlerModule, import_handler
from flashpoint.models.sources.base import (
    Prepared,
    PushOptions,
    carried_files,
    discover_outputs,
    one_layer,
    parse_tensor_spec,
    read_file,
    warmup_inputs,
)
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import TensorSpec

ENTRY_POINT = "flashpoint.models.handler:build_empty"


class HandlerBundle:
    """The ``handler`` format (see the module docstring)."""

    name = "handler"

    def matches(self, source: Path) -> bool:
        return source.is_dir() and (source / MANIFEST_FILE).is_file()

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        if not options.trust_code:
            raise UnsupportedModel(f"{source}: a handler bundle runs its own code: an admin "
                                   "must push it with --trust-code")
        toml_path = source / MANIFEST_FILE
        try:
            raw = tomllib.loads(read_file(toml_path, "the bundle's manifest").decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise UnsupportedModel(f"{toml_path}: not valid TOML: {e}") from None
        ref = raw.get("handler")
        if not isinstance(ref, str) or ref.count(":") != 1:
            raise UnsupportedModel(f"{toml_path}: needs handler = \"module:Class\"")
        if not (source / f"{ref.partition(':')[0]}.py").is_file():
            raise UnsupportedModel(f"{source / (ref.partition(':')[0] + '.py')}: missing (the "
                                   f"module of handler {ref!r})")
        inputs = _specs(raw, "inputs", toml_path) or tuple(options.inputs)
        if not inputs:
            raise UnsupportedModel(f"{toml_path}: needs inputs = [\"NAME:DTYPE:SHAPE\", ...] "
                                   "(e.g. \"x:FP32:-1,4\")")
        outputs = _specs(raw, "outputs", toml_path)
        module_inputs = raw.get("module_inputs", [s.name for s in inputs])
        if not isinstance(module_inputs, list) or not all(isinstance(n, str)
                                                          for n in module_inputs):
            raise UnsupportedModel(f"{toml_path}: module_inputs must be a list of names")
        weights = _weights(source)
        files = carried_files(source, skip=lambda p: p.suffix == ".safetensors")
        try:
            cls = import_handler(ref, files, str(source))
            handler = cls()
            module = HandlerModule(handler, weights, module_inputs, ())
        except FlashpointError as e:
            raise UnsupportedModel(e.message) from None
        except Exception as e:  # the bundle's own constructor, or clashing weight names
            raise UnsupportedModel(f"{source}: {type(e).__name__}: {e}"[:500]) from None
        module_outputs, answer = _warm_up(source, module, handler, inputs, module_inputs)
        module.module_outputs = tuple(s.name for s in module_outputs)
        config: dict[str, Any] = {
            "handler": ref, "module_inputs": list(module_inputs),
            "module_outputs": list(module.module_outputs),
            "weights": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)]
                        for n, t in weights.items()],
        }
        return Prepared(
            build=lambda: module, entry_point=ENTRY_POINT, config=config,
            io=IoSignature(tuple(inputs), tuple(outputs or answer)), task="handler",
            files=files, layer_plan=one_layer, trusted_code=True,
        )


def _specs(raw: dict[str, Any], key: str, path: Path) -> tuple[TensorSpec, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModel(f"{path}: {key} must be a list of \"NAME:DTYPE:SHAPE\" strings")
    return tuple(parse_tensor_spec(v) for v in value)


def _weights(source: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise UnsupportedModel(f"{path}: not a readable safetensors file: {e}") from None
        clash = sorted(set(tensors) & set(out))
        if clash:
            raise UnsupportedModel(f"{path}: weights {clash[:3]} are in another file too")
        out.update(tensors)
    return out


def _warm_up(source: Path, module: HandlerModule, handler: Any,
             inputs: tuple[TensorSpec, ...], module_inputs: list[str]
             ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """One warm-up request through preprocess, predict and postprocess: the module's
    output specs and the answer's."""
    request = warmup_inputs(inputs)
    variable = any(d < 0 for s in inputs for d in s.shape[1:])
    step = "preprocess"
    try:
        pre = getattr(handler, "preprocess", None)
        batch = pre(dict(request)) if pre is not None else request
        step = "predict"
        args = [torch.as_tensor(np.asarray(batch[n])) for n in module_inputs]
        with torch.inference_mode():
            module(*args)  # loads the weights (no module outputs known yet: returns none)
            out = handler.predict(dict(zip(module_inputs, args, strict=True)))
        if not isinstance(out, dict):
            raise TypeError(f"predict returned a {type(out).__name__}, not a dict")
        module_outputs = discover_outputs(out, variable, f"{source}: predict")
        step = "postprocess"
        post = getattr(handler, "postprocess", None)
        answer = post({n: _numpy(v) for n, v in out.items()}) if post is not None else out
        if not isinstance(answer, dict):
            raise TypeError(f"postprocess returned a {type(answer).__name__}, not a dict")
        answer = {n: _numpy(v) for n, v in answer.items()}
    except UnsupportedModel:
        raise
    except Exception as e:  # the bundle's own code on its warm-up request
        raise UnsupportedModel(f"{source}: {step} failed on a warm-up request: "
                               f"{type(e).__name__}: {e}"[:500]) from None
    return module_outputs, discover_outputs(answer, variable, f"{source}: postprocess")


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
