"""Pipeline stages of Hugging Face encoders: embeddings -> blocks -> head, by family.

A Hugging Face model's blob layers (:func:`flashpoint.models.hf.layer_plan`) are
``embeddings``, one layer per block (``model.bert.encoder.layer.3``) and ``head``. They are
not a chain of one-tensor modules as the built-in models' layers are: every block needs the
attention mask too, and the embeddings and head are several modules each. A family adapter
(:data:`FAMILIES`) says which modules make up the embeddings and the head and how each
part runs; :class:`HFStage` runs layers ``first..last`` with it.

What travels between stages (activation frames carry several tensors, see
:mod:`flashpoint.pipeline.frames`): **the hidden states and the 2-D attention mask as the
tokenizer gave it** (``[batch, seq]``, 1 = token, 0 = padding), then whatever the family's
head needs from the inputs (GPT-2: each row's last non-padding position, ``int64
[batch]``). Each stage rebuilds the 4-D mask its blocks use with ``transformers``' own
``create_bidirectional_mask`` (encoders) or ``create_causal_mask`` (GPT-2) -- what the
model's forward does once -- for the model's attention implementation (sdpa, eager), so
a pipelined model computes what the whole model computes. So:

* a stage holding ``embeddings`` takes ``input_ids, attention_mask`` (the whole model's
  inputs), any other stage takes ``hidden_states, attention_mask, *extras``;
* a stage holding ``head`` returns ``logits``, any other returns
  ``hidden_states, attention_mask, *extras``.

Families served in stages (``*ForSequenceClassification``): BERT, RoBERTa, DistilBERT,
GPT-2; causal language models (:data:`LM_FAMILIES`): GPT-2 (``GPT2LMHeadModel``) and Llama
(``LlamaForCausalLM``, each stage computing the rotary embedding itself), whose head
returns the next-token logits of the last position (``[batch, vocab]``; a generation's
pipeline runs one unpadded sequence per request, see
:mod:`flashpoint.models.serving.stage_generation`). Any other Hugging Face model serves
whole: :func:`why_not_staged` says why, and the controller answers ``max_stages > 1`` for
it with a 400 carrying that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashpoint.errors import BadRequest, RegistryError
from flashpoint.models.hf import check_tokenizer
from flashpoint.models.module_tensors import bind_tensors
from flashpoint.partition.stageable import (
    HF_STAGED_FAMILIES,
    HF_STAGED_LM_FAMILIES,
    LM_ARCHITECTURE_SUFFIXES,
    hf_why_not_staged,
)

EMBEDDINGS = "embeddings"
HEAD = "head"
WARM_S = 0.5
MAX_WARM_PASSES = 200
"""Untimed passes through every layer before profiling them one by one: at least two, and
until ``WARM_S`` have passed (at most ``MAX_WARM_PASSES``)."""


@dataclass(frozen=True)
class Family:
    """How one family's ``*ForSequenceClassification`` splits into stage parts.

    Paths are relative to the ``transformers`` model (the wrapper's ``model``).
    ``embed(parts, input_ids)`` and ``head(parts, hidden_states, extras)`` get the parts
    by path; ``extras(config, input_ids, attention_mask)``: the tensors the head needs
    from the inputs (they travel with the hidden states); ``causal``: GPT-style blocks
    (causal mask, positions passed to each block).
    """

    embeddings: tuple[str, ...]
    blocks: str
    head_modules: tuple[str, ...]
    embed: Callable[[Mapping[str, nn.Module], torch.Tensor], torch.Tensor]
    head: Callable[[Mapping[str, nn.Module], torch.Tensor, tuple[torch.Tensor, ...]],
                   torch.Tensor]
    extras: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] = (
        lambda config, ids, mask: ())
    causal: bool = False
    # The model-level rotary position embedding (Llama: ``model.rotary_emb``), "" for none.
    # Every stage with blocks builds its own from the config, as the model's init does, and
    # hands its (cos, sin) to each block; the blob's copy of its buffers binds to the head.
    rotary: str = ""


Extras = tuple[torch.Tensor, ...]


def _bert_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
               ) -> torch.Tensor:
    pooled = parts["bert.pooler"](hidden)
    return parts["classifier"](pooled)  # dropout is the identity in eval mode


def _roberta_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
                  ) -> torch.Tensor:
    return parts["classifier"](hidden)  # RobertaClassificationHead takes the <s> token itself


def _distilbert_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
                     ) -> torch.Tensor:
    pooled = torch.relu(parts["pre_classifier"](hidden[:, 0]))
    return parts["classifier"](pooled)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _gpt2_embed(parts: Mapping[str, nn.Module], ids: torch.Tensor) -> torch.Tensor:
    tokens = parts["transformer.wte"](ids)
    return tokens + parts["transformer.wpe"](_positions(tokens))  # dropout: eval identity


def _gpt2_last_token(config: Any, ids: torch.Tensor, mask: torch.Tensor) -> Extras:
    """Each row's last non-padding position, as GPT2ForSequenceClassification pools."""
    if config.pad_token_id is None:
        return (torch.full((ids.shape[0],), ids.shape[-1] - 1, dtype=torch.int64,
                           device=ids.device),)
    non_pad = (ids != config.pad_token_id).to(torch.int32)
    positions = torch.arange(ids.shape[-1], device=ids.device, dtype=torch.int32)
    return ((positions * non_pad).argmax(-1).to(torch.int64),)


def _gpt2_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
               ) -> torch.Tensor:
    logits = parts["score"](parts["transformer.ln_f"](hidden))
    (last,) = extras
    return logits[torch.arange(logits.shape[0], device=logits.device), last]


FAMILIES: dict[str, Family] = {
    "bert": Family(("bert.embeddings",), "bert.encoder.layer", ("bert.pooler", "classifier"),
                   lambda p, ids: p["bert.embeddings"](input_ids=ids), _bert_head),
    "roberta": Family(("roberta.embeddings",), "roberta.encoder.layer", ("classifier",),
                      lambda p, ids: p["roberta.embeddings"](input_ids=ids), _roberta_head),
    "distilbert": Family(("distilbert.embeddings",), "distilbert.transformer.layer",
                         ("pre_classifier", "classifier"),
                         lambda p, ids: p["distilbert.embeddings"](ids), _distilbert_head),
    "gpt2": Family(("transformer.wte", "transformer.wpe"), "transformer.h",
                   ("transformer.ln_f", "score"), _gpt2_embed, _gpt2_head,
                   extras=_gpt2_last_token, causal=True),
}
"""``model_type`` -> adapter, for ``*ForSequenceClassification`` models."""
assert sorted(FAMILIES) == sorted(HF_STAGED_FAMILIES)


def _gpt2_lm_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
                  ) -> torch.Tensor:
    """The next-token logits of the last position (the only ones a token step uses)."""
    return parts["lm_head"](parts["transformer.ln_f"](hidden[:, -1:]))[:, -1]


def _llama_lm_head(parts: Mapping[str, nn.Module], hidden: torch.Tensor, extras: Extras,
                   ) -> torch.Tensor:
    return parts["lm_head"](parts["model.norm"](hidden[:, -1:]))[:, -1]


LM_FAMILIES: dict[str, Family] = {
    "gpt2": Family(("transformer.wte", "transformer.wpe"), "transformer.h",
                   ("transformer.ln_f", "lm_head"), _gpt2_embed, _gpt2_lm_head, causal=True),
    "llama": Family(("model.embed_tokens",), "model.layers",
                    ("model.norm", "model.rotary_emb", "lm_head"),
                    lambda p, ids: p["model.embed_tokens"](ids), _llama_lm_head, causal=True,
                    rotary="model.rotary_emb"),
}
"""``model_type`` -> adapter, for causal language models (``*LMHeadModel``,
``*ForCausalLM``)."""
assert sorted(LM_FAMILIES) == sorted(HF_STAGED_LM_FAMILIES)


def why_not_staged(config: Mapping[str, Any]) -> str | None:
    """None when a Hugging Face manifest config (``{"architecture", "hf_config"}``) can be
    served in stages, else why it serves whole
    (:func:`flashpoint.partition.stageable.hf_why_not_staged`)."""
    return hf_why_not_staged(config)


def family_of(config: Mapping[str, Any]) -> Family:
    """The adapter for a manifest config; BadRequest saying why there is none."""
    why = why_not_staged(config)
    if why is not None:
        raise BadRequest(why)
    model_type = config["hf_config"]["model_type"]
    if str(config.get("architecture") or "").endswith(LM_ARCHITECTURE_SUFFIXES):
        return LM_FAMILIES[model_type]
    return FAMILIES[model_type]


class HFStage(nn.Module):
    """Layers ``names`` (consecutive, in execution order) of a wrapped Hugging Face model.

    Holds only the modules of its own layers (``parts``, by path under the ``transformers``
    model), which are the very modules of ``wrapper``: binding weights to the wrapper's
    tensors, or to the stage's, is the same thing. The wrapper itself is not a submodule
    (its other layers stay on ``meta``); the stage keeps its config for the mask.
    See the module docstring for the inputs and outputs.
    """

    def __init__(self, wrapper: nn.Module, family: Family, names: Sequence[str]) -> None:
        super().__init__()
        model = wrapper.model
        self.layer_names = list(names)
        self.first = self.layer_names[0] == EMBEDDINGS
        self.last = self.layer_names[-1] == HEAD
        paths: list[str] = []
        self.block_paths: list[str] = []
        for name in self.layer_names:
            if name == EMBEDDINGS:
                paths.extend(family.embeddings)
            elif name == HEAD:
                paths.extend(family.head_modules)
            else:
                path = name.removeprefix("model.")
                if not path.startswith(family.blocks + "."):
                    raise RegistryError(f"layer {name!r} is not a block of {family.blocks}")
                paths.append(path)
                self.block_paths.append(path)
        self.paths = paths
        self.parts = nn.ModuleList([model.get_submodule(p) for p in paths])
        self._family = family
        self._config = model.config
        self.rotary: nn.Module | None = None
        if family.rotary and self.block_paths:
            # its own, computed from the config (the blob's buffers are in the head's range)
            with torch.device("cpu"):
                self.rotary = type(model.get_submodule(family.rotary))(config=model.config)

    def part(self, path: str) -> nn.Module:
        return self.parts[self.paths.index(path)]

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, *extras: torch.Tensor,
                ) -> Any:
        parts = dict(zip(self.paths, self.parts, strict=True))
        family = self._family
        if self.first:
            extras = family.extras(self._config, x, attention_mask)
            hidden = family.embed(parts, x)
        else:
            hidden = x
        if self.block_paths:
            hidden = self._blocks(parts, hidden, attention_mask)
        if self.last:
            return family.head(parts, hidden, tuple(extras))
        return (hidden, attention_mask, *extras)

    def _blocks(self, parts: Mapping[str, nn.Module], hidden: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        if self._family.causal:
            positions = _positions(hidden)
            mask = masking_utils.create_causal_mask(
                config=self._config, inputs_embeds=hidden, attention_mask=attention_mask,
                cache=None, position_ids=positions)
            if self.rotary is not None:
                rope = self.rotary(hidden, position_ids=positions)
                for path in self.block_paths:
                    out = parts[path](hidden, attention_mask=mask, position_ids=positions,
                                      position_embeddings=rope)
                    hidden = out[0] if isinstance(out, tuple) else out
                return hidden
            for path in self.block_paths:
                out = parts[path](hidden, None, mask, position_ids=positions)
                hidden = out[0] if isinstance(out, tuple) else out
            return hidden
        mask = masking_utils.create_bidirectional_mask(
            config=self._config, inputs_embeds=hidden, attention_mask=attention_mask)
        for path in self.block_paths:
            out = parts[path](hidden, mask)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def stage_of(wrapper: nn.Module, config: Mapping[str, Any], names: Sequence[str]) -> HFStage:
    """The stage running layers ``names`` of ``wrapper`` (a built wrapped model)."""
    return HFStage(wrapper, family_of(config), names)


def bind(stage: HFStage, views: Mapping[str, torch.Tensor], buffers: Sequence[str]) -> None:
    """Assign the blob's tensors (full names, ``model.bert.embeddings.word_embeddings.weight``)
    and carried non-persistent buffers to the stage's parts; every part's tensors must be
    there (RegistryError otherwise)."""
    left = set(views)
    for path, part in zip(stage.paths, stage.parts, strict=True):
        prefix = f"model.{path}."
        state = {n[len(prefix):]: t for n, t in views.items() if n.startswith(prefix)}
        part_buffers = [n[len(prefix):] for n in buffers if n.startswith(prefix)]
        bind_tensors(part, state, part_buffers, f"stage part {path!r}")
        left -= {prefix + n for n in state}
    if left:
        raise RegistryError(f"stage {stage.layer_names[0]}..{stage.layer_names[-1]}: tensors "
                            f"of no stage part: {sorted(left)[:3]}")


def example_inputs(source: Any, config: Mapping[str, Any], *, batch: int = 1,
                   seq_len: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids, attention_mask`` of ``batch`` texts padded to ``seq_len`` tokens (at
    most the model's ``max_length``), tokenized with the source directory's tokenizer:
    the batch a profile is measured on."""
    tokenizer = check_tokenizer(source)
    length = max(2, min(seq_len, int(config.get("max_length") or seq_len)))
    enc = tokenizer(["the quick brown fox jumps over the lazy dog"] * batch,
                    padding="max_length", truncation=True, max_length=length,
                    return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def profile_stages(wrapper: nn.Module, config: Mapping[str, Any], layout: Any,
                   inputs: tuple[torch.Tensor, torch.Tensor], device: str = "cpu", *,
                   repeats: int = 5, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Per layer of the blob ``layout``: ``bytes``, ``exec_time_s`` and ``output_bytes``,
    each layer run as a one-layer :class:`HFStage` on the previous one's outputs (what a
    cut after it sends: hidden states and mask)."""
    from flashpoint.models.profile import profile_callables

    family = family_of(config)
    names = [layer.name for layer in layout.layers]
    wrapper.to(torch.device(device))
    wrapper.eval()
    stages = [(n, HFStage(wrapper, family, [n])) for n in names]
    # Whole passes first: on the dev VM a process's first half second of compute runs
    # 100x slower (each op's first calls: ~10 ms for an embedding lookup, ~110 ms for a
    # tiny block), which the per-layer warm-up alone left on the first layers' times.
    import time

    started = time.perf_counter()
    with torch.inference_mode():
        for n in range(MAX_WARM_PASSES):
            args: Any = tuple(a.to(device) for a in inputs)
            for _, stage in stages:
                out = stage(*args)
                args = out if isinstance(out, tuple) else (out,)
            if n >= 1 and time.perf_counter() - started >= WARM_S:
                break
    return profile_callables(stages, [info.size_bytes for info in layout.layers], inputs,
                             device, repeats=repeats, warmup=warmup)
