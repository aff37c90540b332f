"""Tensors in, tensors out: the built-in models, TorchScript and exported programs.

The request's tensors are the module's inputs (the manifest's ``io`` order) and its
outputs the answer. Where the manifest says what an input may hold -- ``config.limits``,
``{"input_ids": {"max_value": 4095, "max_len": 128}}``, which the built-in BERT publishes
from its vocabulary and positions -- a value past it is a typed 400 here, instead of an
index error inside the model that would come back as ``500 model_failed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashpoint.errors import InputTooLong, InvalidInput
from flashpoint.tensors import DECODED_DTYPE


@dataclass(frozen=True)
class InputLimit:
    """What one integer input may hold: values in ``0..max_value``, axis 1 at most
    ``max_len`` long (0 = no bound)."""

    max_value: int = 0
    max_len: int = 0


def limits_of(manifest: Any) -> dict[str, InputLimit]:
    """The manifest's input limits: ``config.limits``, or for the built-in BERT its
    vocabulary and positions."""
    config = manifest.config if isinstance(manifest.config, Mapping) else {}
    raw = config.get("limits")
    if isinstance(raw, Mapping):
        return {str(k): InputLimit(int(v.get("max_value", 0)), int(v.get("max_len", 0)))
                for k, v in raw.items() if isinstance(v, Mapping)}
    if manifest.entry_point == "flashpoint.models.bert:build_empty":
        return {"input_ids": InputLimit(int(config["vocab_size"]) - 1,
                                        int(config["max_position"]))}
    return {}


@dataclass
class TensorServing:
    """The request's tensors are the module's inputs; see the module docstring."""

    module_inputs: tuple[str, ...]
    module_outputs: tuple[str, ...]
    datatypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    limits: dict[str, InputLimit] = field(default_factory=dict)
    pad_values: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def for_manifest(cls, manifest: Any) -> TensorServing:
        ins, outs = manifest.io.inputs, manifest.io.outputs
        return cls(tuple(t.name for t in ins), tuple(t.name for t in outs),
                   {t.name: t.datatype for t in ins}, {t.name: tuple(t.shape) for t in ins},
                   limits_of(manifest))

    def prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, limit in self.limits.items():
            arr = inputs.get(name)
            if arr is None or arr.dtype.kind not in "iu" or arr.size == 0:
                continue
            if limit.max_len and arr.ndim >= 2 and arr.shape[1] > limit.max_len:
                raise InputTooLong(f"input {name!r}: length {arr.shape[1]} is over the model's "
                                   f"limit of {limit.max_len}", limit=limit.max_len)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or (limit.max_value and hi > limit.max_value):
                bad = lo if lo < 0 else hi
                raise InvalidInput(f"input {name!r}: value {bad} is outside 0..{limit.max_value}"
                                   " (the model's vocabulary)", limit=limit.max_value)
        return inputs

    def finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return outputs

    def warmup_request(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name in self.module_inputs:
            shape = [1] + [8 if s < 0 else s for s in self.shapes[name][1:]]
            dtype = DECODED_DTYPE[self.datatypes[name]]
            if dtype.kind == "O":  # BYTES: one empty element per slot
                arr = np.empty(shape, dtype=object)
                arr.fill(b"")
                out[name] = arr
            else:
                out[name] = np.zeros(shape, dtype=dtype)
        return out
