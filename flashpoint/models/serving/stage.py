"""A pipeline stage of a model with a serving task (text, image): the task's two ends.

A whole replica runs :meth:`Serving.prepare` before its module and :meth:`Serving.finish`
after it. In a pipeline, the first stage takes the request's tensors as the client sent
them (text travels as BYTES in activation frames) and prepares them -- it holds the files
the model carries, which are at the front of the first layer -- and the last stage
finishes the answer (labels, scores: BYTES and FP32), so a pipeline answers what a whole
replica answers. A text-generation model's stages serve token steps instead
(:mod:`flashpoint.models.serving.stage_generation`). Stages in between only pass
activations on. ``tensor`` models need none of this: their stages take and return the
module's own tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from flashpoint.models.serving import Serving


class ServedStage(nn.Module):
    """``stage`` with ``prepare.prepare`` before it (first stage) and/or
    ``finish.finish`` after it (last stage); ``request_inputs`` / ``answer_outputs``: the
    model's request and answer tensor names in their wire order."""

    def __init__(self, stage: nn.Module, *, prepare: Serving | None, finish: Serving | None,
                 request_inputs: Sequence[str], answer_outputs: Sequence[str]) -> None:
        super().__init__()
        self.stage = stage
        self._prepare = prepare
        self._finish = finish
        self.request_inputs = list(request_inputs)
        self.answer_outputs = list(answer_outputs)

    def _device(self) -> torch.device:
        first = next(iter(self.stage.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    def forward(self, *args: Any) -> Any:
        if self._prepare is not None:
            request = {n: a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
                       for n, a in zip(self.request_inputs, args, strict=True)}
            prepared = self._prepare.prepare(request)
            device = self._device()
            args = tuple(torch.from_numpy(np.ascontiguousarray(prepared[n])).to(device)
                         for n in self._prepare.module_inputs)
        out = self.stage(*args)
        if self._finish is None:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        answer = self._finish.finish({n: o.detach().cpu().numpy() for n, o in
                                      zip(self._finish.module_outputs, outs, strict=True)})
        return tuple(answer[n] for n in self.answer_outputs)


def served_stage(manifest: Any, stage: nn.Module, buffer: Any, *, first: bool,
                 last: bool) -> nn.Module:
    """``stage`` as it serves in a pipeline: wrapped in :class:`ServedStage` for a model
    whose task is not ``tensor`` and which is the first or last stage; ``buffer`` holds
    the blob bytes from offset 0 (the first stage reads the carried files from it)."""
    if manifest.task == "text-generation":  # every stage: the step's state travels along
        from flashpoint.models.serving.stage_generation import generation_stage

        return generation_stage(manifest, stage, buffer, first=first, last=last)
    if manifest.task == "tensor" or not (first or last):
        return stage
    from flashpoint.models import serving
    from flashpoint.models.publish import read_files
    from flashpoint.models.serving.text import TextClassification

    prepare = serving.for_manifest(manifest, read_files(manifest, buffer)) if first else None
    finish: Serving | None = None
    if last:
        if prepare is not None:
            finish = prepare
        elif manifest.task == "text-classification":
            finish = TextClassification.for_answers(manifest)
        else:
            from flashpoint.errors import RegistryError

            raise RegistryError(f"task {manifest.task!r} cannot be served in stages")
    return ServedStage(stage, prepare=prepare, finish=finish,
                       request_inputs=[t.name for t in manifest.io.inputs],
                       answer_outputs=[t.name for t in manifest.io.outputs])
