"""How a worker serves a model: request tensors in, module inputs, module outputs, answer.

A model's manifest names its ``task``; :func:`for_manifest` builds the :class:`Serving`
for it from the manifest and the files the model version carries (tokenizer, image
processor config...). The worker then, per request, calls :meth:`Serving.prepare` (text ->
token ids, image bytes -> pixels, value checks: a bad input is a typed 400 before it can
reach the model), batches prepared requests (padding the inputs in ``pad_values`` along
their second axis, so requests of different lengths share a batch), runs the module, and
calls :meth:`Serving.finish` on each request's slice of the outputs (logits -> labels).

Tasks: ``tensor`` (tensors in and out, the built-in models), ``text-classification`` and
``image-classification`` and ``text-generation`` (Hugging Face models; generation runs
in a token loop of its own, :mod:`flashpoint.worker.generation`), ``handler`` (a trusted bundle's own
pre- and postprocessing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from flashpoint.errors import RegistryError


class Serving(Protocol):
    """Per-replica request handling around a module (see the module docstring)."""

    module_inputs: tuple[str, ...]
    """The module's positional inputs, in order."""
    module_outputs: tuple[str, ...]
    """Names of the module's outputs, in order."""
    pad_values: Mapping[str, int]
    """Module inputs padded along axis 1 with this value when requests are batched."""
    # Optional ``prepare_in_thread: bool``: prepare requests off the worker's event loop
    # (image decoding); absent means False.

    def prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's tensors as module inputs (batch dimension first); BadRequest
        subclasses for what the model cannot take."""
        ...

    def finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's slice of the module outputs as the answer's tensors."""
        ...

    def warmup_request(self) -> dict[str, np.ndarray]:
        """A valid request (request-level tensors) for the replica's first inference."""
        ...


Factory = Callable[[Any, Mapping[str, bytes]], Serving]


def _tensor(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    from flashpoint.models.serving.tensor import TensorServing

    return TensorServing.for_manifest(manifest)


def _text(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    from flashpoint.models.serving.text import TextClassification

    return TextClassification.for_manifest(manifest, files)


def _generation(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    from flashpoint.models.serving.generation import TextGeneration

    return TextGeneration.for_manifest(manifest, files)  # type: ignore[return-value]


def _image(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    from flashpoint.models.serving.image import ImageClassification

    return ImageClassification.for_manifest(manifest, files)


def _handler(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    from flashpoint.models.serving.handler import HandlerServing

    return HandlerServing.for_manifest(manifest, files)


TASKS: dict[str, Factory] = {
    "tensor": _tensor,
    "text-classification": _text,
    "image-classification": _image,
    "text-generation": _generation,
    "handler": _handler,
}


def for_manifest(manifest: Any, files: Mapping[str, bytes]) -> Serving:
    """The :class:`Serving` of a model version; RegistryError for a task not known here."""
    factory = TASKS.get(manifest.task)
    if factory is None:
        raise RegistryError(f"{manifest.name}:{manifest.version}: task {manifest.task!r} is "
                            f"not served by this worker (known: {sorted(TASKS)})")
    return factory(manifest, files)
