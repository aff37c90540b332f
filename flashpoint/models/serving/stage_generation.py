"""A causal language model's pipeline stages serving token steps (issue 21 item 6).

While a cold generation model's hosts complete it, its first tokens come from a pipeline
of stages (lambdaScale's idea). One pipeline request is one token step of one sequence
(:mod:`flashpoint.messages.pipeline_generation`): the first stage prepares the request as a
whole replica would (prompt ids, sampling parameters), runs prompt + generated tokens
through its layers and sends the hidden states on with a :class:`StepCarry`; the last stage
takes the next-token logits of the last position and samples, decodes and checks for the
end exactly as a replica's engine does (:func:`~flashpoint.models.generate.take_token`), and
answers a :class:`StepResult`.

**No KV cache in the pipeline:** each step recomputes the whole sequence through every
stage (the stages keep no per-sequence state, so a pipeline serves any number of sequences
and a sequence leaves it at any token boundary with nothing to free). The cost grows with
the sequence (O(n^2) over a generation), which is acceptable for the few tokens a pipeline
serves before the sequence moves to a whole replica (live migration) -- and it is the
reason it moves. Both ends need the model's tokenizer, which is carried at the front of the
first layer: a generation model's last stage fetches those bytes with its own range
(``registry.manifest.stage_byte_ranges``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from flashpoint.errors import InputTooLong, InvalidInput
from flashpoint.messages.pipeline_generation import PipelineStep, StepCarry, StepResult, decode, encode
from flashpoint.models.generate import (
    GenSequence,
    SamplingParams,
    sample_token,
    sampler_for,
    take_token,
)
from flashpoint.tensors import decode_tensors


def _bytes_tensor(data: bytes) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = data
    return out


class GenerationStage(nn.Module):
    """``stage`` (an :class:`~flashpoint.models.hf_stages.HFStage` of a causal LM) serving
    token steps: ``head`` (a :class:`~flashpoint.models.serving.generation.TextGeneration`)
    when it is the first stage, ``tail`` when it is the last (one stage may be both)."""

    def __init__(self, stage: nn.Module, *, head: Any | None, tail: Any | None) -> None:
        super().__init__()
        self.stage = stage
        self._head = head
        self._tail = tail
        if tail is not None:
            eos = tail.hf_config.get("eos_token_id")
            if eos is None:
                eos = tail.tokenizer.eos_token_id
            self._eos = frozenset([] if eos is None else [eos] if isinstance(eos, int)
                                  else [int(t) for t in eos])

    def _device(self) -> torch.device:
        first = next(iter(self.stage.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    def forward(self, *args: Any) -> Any:
        if self._head is not None:
            (step,) = args
            ids, carry = self._begin(decode(PipelineStep, step))
            out = self.stage(ids, torch.ones_like(ids))
            hidden_mask = out if isinstance(out, tuple) else (out,)
        else:
            *hidden_mask, raw = args
            carry = decode(StepCarry, raw)
            out = self.stage(*hidden_mask)
            hidden_mask = out if isinstance(out, tuple) else (out,)
        if self._tail is None:
            return (*hidden_mask[:2], _bytes_tensor(encode(carry)))
        (logits,) = hidden_mask
        return (_bytes_tensor(encode(self._take(carry, logits))),)

    def _begin(self, step: PipelineStep) -> tuple[torch.Tensor, StepCarry]:
        """The first stage: the step's token ids and what travels with them."""
        head = self._head
        assert head is not None
        request = head.prepare(decode_tensors(step.inputs))
        prompt = list(step.prompt_ids) or list(request.prompt_ids)
        params = request.params
        if not prompt:
            raise InvalidInput("the prompt is empty")
        room = head.max_len - len(prompt)  # what the engine allows (GenerationEngine.add)
        if room < 1:
            raise InputTooLong(f"prompt of {len(prompt)} tokens leaves no room in the "
                               f"model's {head.max_len} positions",
                               limit=head.max_len, tokens=len(prompt))
        max_tokens = min(params.max_tokens, room)
        if len(step.generated_ids) >= max_tokens:
            raise InvalidInput(f"the sequence already holds {len(step.generated_ids)} of its "
                               f"{max_tokens} tokens")
        ids = torch.tensor([prompt + list(step.generated_ids)], dtype=torch.long,
                           device=self._device())
        carry = StepCarry(prompt_ids=tuple(prompt), generated_ids=step.generated_ids,
                          emitted_text=step.emitted_text, rng_state=step.rng_state,
                          max_tokens=max_tokens, temperature=params.temperature,
                          top_p=params.top_p, seed=params.seed, stop=params.stop)
        return ids, carry

    def _take(self, carry: StepCarry, logits: torch.Tensor) -> StepResult:
        """The last stage: the step's token, as a replica's engine takes it."""
        tail = self._tail
        assert tail is not None
        params = SamplingParams(carry.max_tokens, carry.temperature, carry.top_p, carry.seed,
                                carry.stop)
        generated = list(carry.generated_ids)
        seq = GenSequence(0, list(carry.prompt_ids), params, 0, generated=generated,
                          generator=sampler_for(params, carry.rng_state))
        if generated:  # the text so far, as the engine holds it between steps
            seq.text = tail.decode([t for t in generated if t not in self._eos])
            seq.emitted = carry.emitted_text
        event = take_token(seq, sample_token(logits[0], params, seq.generator), self._eos,
                           tail.decode)
        return StepResult(
            token_id=int(event.token_id if event.token_id is not None else -1),
            text_delta=event.text_delta, finish=str(event.finish or ""), text=seq.text,
            prompt_ids=carry.prompt_ids, generated_ids=tuple(seq.generated),
            emitted_text=seq.emitted,
            rng_state=(bytes(seq.generator.get_state().numpy().tobytes())
                       if seq.generator is not None else None))


def generation_stage(manifest: Any, stage: nn.Module, buffer: Any, *, first: bool,
                     last: bool) -> GenerationStage:
    """``stage`` of a text-generation model as it serves token steps; ``buffer`` holds the
    blob bytes from offset 0 (both ends read the carried tokenizer from it)."""
    from flashpoint.models import serving
    from flashpoint.models.publish import read_files

    served = serving.for_manifest(manifest, read_files(manifest, buffer)) if (
        first or last) else None
    return GenerationStage(stage, head=served if first else None,
                           tail=served if last else None)
