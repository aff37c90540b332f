"""Text generation (causal language models): a prompt in, its continuation out.

A request carries ``text`` (``BYTES [1]``, the prompt) or ``messages`` (``BYTES [1]``, a
JSON list of ``{"role", "content"}`` rendered with the tokenizer's own chat template), and
optionally ``max_tokens`` (``INT64 [1]``), ``temperature``, ``top_p`` (``FP32 [1]``),
``seed`` (``INT64 [1]``) and ``stop`` (``BYTES [1, k]``). Every input is optional (the
manifest declares none), but a request needs one of ``text`` and ``messages``.
:meth:`TextGeneration.prepare` turns it into a
:class:`~flashpoint.models.generate.GenerationRequest`; the worker's generation loop
(:mod:`flashpoint.worker.generation`) runs it; :meth:`TextGeneration.finish` turns the
:class:`~flashpoint.models.generate.GenerationResult` into the answer: ``text``,
``token_ids``, ``finish_reason``, ``prompt_tokens`` and ``completion_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashpoint.errors import InvalidInput
from flashpoint.models.generate import (
    DEFAULT_MAX_TOKENS,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    kv_bytes_per_token,
)
from flashpoint.models.serving.text import decode_texts, load_tokenizer, max_length

PROMPT_INPUT = "text"
MESSAGES_INPUT = "messages"
OUTPUTS = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens")


def _scalar(inputs: Mapping[str, np.ndarray], name: str, kind: type, default: Any) -> Any:
    arr = inputs.get(name)
    if arr is None:
        return default
    if arr.size != 1 or arr.dtype == object:
        raise InvalidInput(f"input {name!r} must hold one number")
    return kind(arr.reshape(-1)[0])


@dataclass
class TextGeneration:
    """See the module docstring."""

    tokenizer: Any
    max_len: int
    hf_config: Mapping[str, Any]
    kv_cache_bytes: int = 0  # the replica's KV budget; 0: room for max_batch_size full sequences
    module_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    module_outputs: tuple[str, ...] = ("logits",)
    pad_values: Mapping[str, int] = field(default_factory=dict)
    required_inputs: tuple[str, ...] = ()  # text or messages: prepare says which is missing
    generates: bool = True

    @classmethod
    def for_manifest(cls, manifest: Any, files: Mapping[str, bytes]) -> TextGeneration:
        config = manifest.config
        tok = load_tokenizer(files)
        tok.padding_side = "left"
        hf = config["hf_config"]
        return cls(tok, int(config.get("max_length") or max_length(hf, tok)), hf,
                   int(config.get("kv_cache_bytes", 0)))

    def build_engine(self, module: Any, *, max_running: int) -> GenerationEngine:
        """The replica's engine over a :class:`~flashpoint.models.hf.CausalLM` module."""
        import torch

        model = module.model
        eos = model.config.eos_token_id if model.config.eos_token_id is not None else (
            self.tokenizer.eos_token_id)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        budget = self.kv_cache_bytes or max_running * self.max_len * kv_bytes_per_token(
            model.config, next(model.parameters()).dtype if any(True for _ in model.parameters())
            else torch.float32)
        return GenerationEngine(model, eos_token_ids=eos_ids, max_positions=self.max_len,
                                kv_budget_bytes=budget, max_running=max_running,
                                decode=self.decode)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        if MESSAGES_INPUT in inputs:
            (raw,) = decode_texts(inputs[MESSAGES_INPUT].reshape(-1)[:1], MESSAGES_INPUT)
            try:
                messages = json.loads(raw)
            except ValueError as e:
                raise InvalidInput(f"input 'messages' is not JSON: {e}") from None
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages):
                raise InvalidInput("messages must be a non-empty list of {role, content} "
                                   "with text content")
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidInput("this model's tokenizer has no chat template: use "
                                   "completions with a prompt")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=False)
            except Exception as e:  # noqa: BLE001 - the template judged the messages
                # (a template raises for a conversation it does not take: roles out of
                # order, a system message it has no place for): the caller's to fix
                raise InvalidInput(f"the model's chat template refused these messages: "
                                   f"{type(e).__name__}: {e}"[:500]) from None
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if PROMPT_INPUT not in inputs:
            raise InvalidInput("a generation request needs 'text' (a prompt) or 'messages'")
        arr = inputs[PROMPT_INPUT]
        if arr.size != 1:
            raise InvalidInput(f"input 'text' must hold one prompt, got shape {list(arr.shape)}")
        (prompt,) = decode_texts(arr.reshape(-1))
        return list(self.tokenizer(prompt).input_ids)

    def prepare(self, inputs: dict[str, np.ndarray]) -> GenerationRequest:  # type: ignore[override]
        seed = _scalar(inputs, "seed", int, None)
        stop = tuple(decode_texts(inputs["stop"].reshape(-1), "stop")) if "stop" in inputs else ()
        params = SamplingParams(
            max_tokens=_scalar(inputs, "max_tokens", int, DEFAULT_MAX_TOKENS),
            temperature=_scalar(inputs, "temperature", float, 1.0),
            top_p=_scalar(inputs, "top_p", float, 1.0),
            seed=seed, stop=stop)
        return GenerationRequest(tuple(self.prompt_ids(inputs)), params)

    def finish(self, result: GenerationResult) -> dict[str, np.ndarray]:  # type: ignore[override]
        return {
            "text": np.array([result.text.encode()], dtype=object),
            "token_ids": np.array(result.token_ids, dtype=np.int64),
            "finish_reason": np.array([str(result.finish).encode()], dtype=object),
            "prompt_tokens": np.array([result.prompt_tokens], dtype=np.int64),
            "completion_tokens": np.array([len(result.token_ids)], dtype=np.int64),
        }

    def warmup_request(self) -> dict[str, np.ndarray]:
        return {PROMPT_INPUT: np.array([b"warm up"], dtype=object),
                "max_tokens": np.array([2], dtype=np.int64)}

    def warmup_module_inputs(self) -> dict[str, np.ndarray]:
        """Module inputs of one short prompt (the replica's first forward pass)."""
        ids = np.array([self.tokenizer("warm up").input_ids], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
