"""Hugging Face ``transformers`` models as Flashpoint modules (the entry point side).

A model pushed from a Hugging Face directory is rebuilt in a worker from its
``config.json`` alone -- ``transformers``' own class for the architecture, on the ``meta``
device, never a hub download -- and its weights are views over the blob like any other
model's. The module is wrapped so that it takes and returns plain tensors in a fixed order
(the worker calls ``module(*inputs)``): a text model takes ``input_ids, attention_mask``
and an image model ``pixel_values``; both return ``logits``.

Only classes that ``transformers`` itself defines are built here. A model whose config
names code of its own (``auto_map``) is custom code: ``flashpoint model push`` refuses it
unless an admin trusts it, and this entry point refuses it always (the bundle path,
:mod:`flashpoint.models.handler`, is where trusted code runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashpoint.errors import BadRequest, RegistryError, UnsupportedModel

ENTRY_POINT = "flashpoint.models.hf:build_empty"

# architecture suffix -> (task, the wrapper's input names)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ForSequenceClassification": ("text-classification", ("input_ids", "attention_mask")),
    "ForImageClassification": ("image-classification", ("pixel_values",)),
    "ForCausalLM": ("text-generation", ("input_ids", "attention_mask")),
    "LMHeadModel": ("text-generation", ("input_ids", "attention_mask")),  # GPT2LMHeadModel
}


def task_of(architecture: str) -> str:
    """The serving task of a ``transformers`` architecture name; BadRequest if unsupported."""
    for suffix, (task, _) in TASKS.items():
        if architecture.endswith(suffix):
            return task
    supported = ", ".join(f"*{s}" for s in TASKS)
    raise BadRequest(f"architecture {architecture!r} is not served yet (supported: {supported})")


def hf_config(raw: Mapping[str, Any]) -> Any:
    """A ``transformers`` config object from a ``config.json`` dict."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise BadRequest(f"config.json: unknown model_type {model_type!r}")
    if "auto_map" in raw:
        raise BadRequest("config.json names custom code (auto_map): not a built-in "
                         "transformers architecture")
    return CONFIG_MAPPING[model_type].from_dict(dict(raw))


def model_class(architecture: str) -> type[nn.Module]:
    """``transformers``' own class of that name (nothing else is ever imported)."""
    import transformers
    from transformers import PreTrainedModel

    cls = getattr(transformers, architecture, None) if architecture.isidentifier() else None
    if not isinstance(cls, type) or not issubclass(cls, PreTrainedModel) or not (
            cls.__module__.startswith("transformers.")):
        raise BadRequest(f"architecture {architecture!r} is not a transformers model class")
    return cls


class TextClassifier(nn.Module):
    """``input_ids, attention_mask -> logits`` over a ``*ForSequenceClassification``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class ImageClassifier(nn.Module):
    """``pixel_values -> logits`` over a ``*ForImageClassification``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


class CausalLM(nn.Module):
    """``input_ids, attention_mask -> logits`` (every position's next-token logits) over a
    ``*ForCausalLM``; generation (:mod:`flashpoint.models.generate`) drives ``self.model``
    itself, with its KV caches."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits


_WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "text-classification": TextClassifier,
    "image-classification": ImageClassifier,
    "text-generation": CausalLM,
}


def build(config: Mapping[str, Any], *, device: str | torch.device = "meta") -> nn.Module:
    """The wrapped model for a manifest config ``{"architecture", "hf_config"}``.

    On ``meta`` (the default) it holds no weight memory: the blob's tensors are bound to it.
    """
    architecture = config.get("architecture")
    raw = config.get("hf_config")
    if not isinstance(architecture, str) or not isinstance(raw, Mapping):
        raise RegistryError("a Hugging Face model's config needs 'architecture' and 'hf_config'")
    task = task_of(architecture)
    cls = model_class(architecture)
    cfg = hf_config(raw)
    with torch.device(device), _no_init(device):
        model = cls(cfg)
    model.eval()
    return _WRAPPERS[task](model)


def _no_init(device: str | torch.device) -> Any:
    """On ``meta`` skip transformers' weight initialisation (its Python walk over every
    module is ~2 ms of a BERT-base cold start): the blob's tensors replace the values."""
    import contextlib

    if torch.device(device).type != "meta":
        return contextlib.nullcontext()
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers release: initialise as before
        return contextlib.nullcontext()
    return no_init_weights()


def build_empty(config: Mapping[str, Any]) -> nn.Module:
    """The entry point: the wrapped model on ``meta`` (weights come from the blob)."""
    return build(config, device="meta")


def layer_plan(module: nn.Module) -> tuple[list[str], Callable[[str], str]]:
    """Layers in execution order for a wrapped model: ``embeddings`` (everything before
    the blocks), each block of its largest ``nn.ModuleList`` (``model.bert.encoder.layer.3``),
    and ``head`` (everything after); and the function that names a tensor's layer.

    This is the shape of every family served here (BERT, RoBERTa, DistilBERT, GPT-2, ViT:
    one stack of blocks between an embedding and a head). A model with no such list is
    one layer, ``model``, and serves whole.
    """
    lists = [(name, m) for name, m in module.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return ["model"], lambda key: "model"

    def size(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    blocks_path, blocks = max(lists, key=lambda item: size(item[1]))
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    first_block = order[blocks_path]
    block_names = [f"{blocks_path}.{i}" for i in range(len(blocks))]
    prefix = blocks_path + "."

    def layer_of(key: str) -> str:
        if key.startswith(prefix):
            return prefix + key[len(prefix):].split(".", 1)[0]
        owner = key.rpartition(".")[0]
        return "embeddings" if order.get(owner, len(order)) < first_block else "head"

    return ["embeddings", *block_names, "head"], layer_of


TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")
"""A tokenizer's vocabulary is in one of these; without any, transformers builds an empty
tokenizer that maps every text to unknown tokens (a model that answers nonsense)."""


def check_tokenizer(source: Path) -> Any:
    """The tokenizer of a Hugging Face directory, loaded offline; UnsupportedModel naming
    what is missing or broken."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if not any((source / f).is_file() for f in TOKENIZER_FILES):
        raise UnsupportedModel(f"{source}: no tokenizer (expected one of "
                               f"{', '.join(TOKENIZER_FILES)})")

    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModel(f"{source}: the tokenizer does not load (expected "
                               f"tokenizer.json or the tokenizer's vocabulary files): "
                               f"{first}"[:400]) from None
