"""The ``handler`` task: a trusted bundle's ``preprocess`` / ``postprocess`` per request.

The request's tensors go through the bundle's ``preprocess`` (when it has one) to become
the module inputs (``config.module_inputs``); each request's slice of the module outputs
through ``postprocess`` to become the answer. Both run on an instance of the bundle's
class of their own, which loads no weights (``predict`` runs inside the module, see
:mod:`flashpoint.models.handler`). What ``preprocess`` raises on a request's values
(ValueError, TypeError, KeyError) is a 400 ``invalid_input``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashpoint.errors import InvalidInput, RegistryError


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


@dataclass
class HandlerServing:
    """See the module docstring."""

    handler: Any
    module_inputs: tuple[str, ...]
    module_outputs: tuple[str, ...]
    request_inputs: tuple[Any, ...]  # TensorSpec of the request
    pad_values: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def for_manifest(cls, manifest: Any, files: Mapping[str, bytes]) -> HandlerServing:
        from flashpoint.models.handler import import_handler

        what = f"{manifest.name}:{manifest.version}"
        if not manifest.trusted_code:
            raise RegistryError(f"{what} runs code that came with it and no admin trusted it "
                                "(trusted_code is false); refusing to load it")
        config = manifest.config
        handler_cls = import_handler(str(config.get("handler", "")), files, what)
        try:
            handler = handler_cls()
        except Exception as e:  # the class's own constructor
            raise RegistryError(f"{what}: cannot be built: {type(e).__name__}: {e}"[:400]) from e
        return cls(handler, tuple(config.get("module_inputs", [])),
                   tuple(config.get("module_outputs", [])), tuple(manifest.io.inputs))

    def prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pre = getattr(self.handler, "preprocess", None)
        if pre is not None:
            try:
                inputs = pre(dict(inputs))
            except (ValueError, TypeError, KeyError) as e:
                raise InvalidInput(f"preprocess: {type(e).__name__}: {e}"[:300]) from None
        if not isinstance(inputs, Mapping):
            raise TypeError(f"preprocess returned a {type(inputs).__name__}, not a dict")
        missing = [n for n in self.module_inputs if n not in inputs]
        if missing:
            raise InvalidInput(f"request has no {missing} (the model takes "
                               f"{list(self.module_inputs)})")
        return {n: _as_array(inputs[n]) for n in self.module_inputs}

    def finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        post = getattr(self.handler, "postprocess", None)
        answer = post(dict(outputs)) if post is not None else outputs
        if not isinstance(answer, Mapping):
            raise TypeError(f"postprocess returned a {type(answer).__name__}, not a dict")
        return {str(n): _as_array(v) for n, v in answer.items()}

    def warmup_request(self) -> dict[str, np.ndarray]:
        from flashpoint.models.serving.tensor import TensorServing

        specs = self.request_inputs
        return TensorServing(tuple(s.name for s in specs), (),
                             {s.name: s.datatype for s in specs},
                             {s.name: tuple(s.shape) for s in specs}).warmup_request()
