"""Hugging Face model directories built here, with random weights: for the demo, the
tests and the benchmarks (this machine reaches no model hub, and none is needed).

Each is what a user's ``save_pretrained`` directory holds: ``config.json``,
``model.safetensors`` and the tokenizer files (a WordPiece tokenizer whose vocabulary
comes from a few sentences), built from a seed so the same call gives the same
bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bars in the demo's tables

SENTENCES = (
    "flashpoint serves models from host memory",
    "a cold start fetches bytes from a peer",
    "the cluster scales replicas down to zero",
    "this movie was great and the acting was wonderful",
    "the food was terrible and the service slow",
    "GPUs are shared between tenants with time tokens",
    "a spot eviction drains the replicas on a host",
)

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 64},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 1024, "max_position_embeddings": 256},
    # BERT-base's shape with its 30,522-word vocabulary: about 438 MB of float32.
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512},
}


def wordpiece_vocab(size: int = 200) -> dict[str, int]:
    """A WordPiece vocabulary over :data:`SENTENCES`, the same in every process: the special
    tokens, every letter alone and as a ``##`` continuation, every whole word, then word
    endings (``##`` pieces, longest first) up to ``size`` entries.

    Built here rather than by ``tokenizers``' ``WordPieceTrainer``: the trainer breaks ties
    between equally frequent merges in hash-map order, which changes from one process to the
    next, so every run got a different tokenizer and the random model behind it generated
    different text (a test that needed a dozen characters before EOS passed here and failed
    on another machine)."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for s in SENTENCES for w in s.lower().split()})
    letters = sorted({c for w in words for c in w})
    pieces = special + letters + [f"##{c}" for c in letters] + words
    endings = sorted({f"##{w[i:]}" for w in words for i in range(1, len(w) - 1)},
                     key=lambda e: (-len(e), e))
    for e in endings:
        if len(pieces) >= size:
            break
        if e not in pieces:
            pieces.append(e)
    return {p: i for i, p in enumerate(pieces)}


def build_tokenizer(directory: Path, vocab_size: int | None = None) -> Any:
    """A BERT-style WordPiece tokenizer over :data:`SENTENCES` (:func:`wordpiece_vocab`), saved to
    ``directory`` as a ``transformers`` fast tokenizer; returns it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(wordpiece_vocab(), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(directory))
    return fast


def make_text_classifier(
    directory: str | Path,
    *,
    size: str = "tiny",
    family: str = "bert",
    labels: tuple[str, ...] = ("negative", "positive"),
    seed: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """A ``*ForSequenceClassification`` directory (``family``: bert, roberta, distilbert,
    gpt2) with random weights and a tokenizer; returns its path."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    dims = SIZES[size]
    vocab = vocab_size or (30522 if size == "base" else max(len(tok), 64))
    common = {"vocab_size": vocab, "pad_token_id": tok.pad_token_id, **_label_maps(labels)}
    if family == "bert":
        config: Any = BertConfig(**dims, **common)
        cls: Any = BertForSequenceClassification
    elif family == "roberta":
        config = RobertaConfig(**{**dims, "max_position_embeddings":
                                  dims["max_position_embeddings"] + 2}, **common)
        cls = RobertaForSequenceClassification
    elif family == "distilbert":
        config = DistilBertConfig(
            dim=dims["hidden_size"], n_layers=dims["num_hidden_layers"],
            n_heads=dims["num_attention_heads"], hidden_dim=dims["intermediate_size"],
            max_position_embeddings=dims["max_position_embeddings"], **common)
        cls = DistilBertForSequenceClassification
    elif family == "gpt2":
        config = GPT2Config(
            n_embd=dims["hidden_size"], n_layer=dims["num_hidden_layers"],
            n_head=dims["num_attention_heads"], n_inner=dims["intermediate_size"],
            n_positions=dims["max_position_embeddings"], bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id, **common)
        cls = GPT2ForSequenceClassification
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(str(out))
    return out


def _label_maps(labels: tuple[str, ...]) -> dict[str, dict[Any, Any]]:
    """A classifier config's ``id2label`` / ``label2id`` for these label names."""
    id2label = dict(enumerate(labels))
    return {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}


IMAGE_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"image_size": 32, "patch_size": 8, "width": 32, "depth": 2},
    "small": {"image_size": 64, "patch_size": 8, "width": 128, "depth": 4},
    # ViT-B/16's shape at 224 x 224: about 343 MB of float32.
    "base": {"image_size": 224, "patch_size": 16, "width": 768, "depth": 12},
}


def make_image_classifier(
    directory: str | Path,
    *,
    family: str = "vit",
    size: str = "tiny",
    labels: tuple[str, ...] = ("cat", "dog", "bird"),
    seed: int = 0,
) -> Path:
    """A ``*ForImageClassification`` directory (``family``: vit, resnet) with random
    weights (a ResNet's batch-norm statistics too) and the ``preprocessor_config.json`` of
    the image processor ``transformers`` pairs with it (ViTImageProcessor; ResNet
    checkpoints use ConvNextImageProcessor); returns its path."""
    import torch
    from transformers import (
        ConvNextImageProcessor,
        ResNetConfig,
        ResNetForImageClassification,
        ViTConfig,
        ViTForImageClassification,
        ViTImageProcessor,
    )

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dims = IMAGE_SIZES[size]
    side, width, depth = dims["image_size"], dims["width"], dims["depth"]
    common = _label_maps(labels)
    if family == "vit":
        config: Any = ViTConfig(
            image_size=side, patch_size=dims["patch_size"], hidden_size=width,
            num_hidden_layers=depth, num_attention_heads=max(2, width // 64),
            intermediate_size=4 * width, **common)
        cls: Any = ViTForImageClassification
        processor: Any = ViTImageProcessor(size={"height": side, "width": side})
    elif family == "resnet":
        config = ResNetConfig(
            embedding_size=width // 2, hidden_sizes=[width // 2 * 2 ** i for i in range(depth)],
            depths=[1] * depth, layer_type="basic" if size == "tiny" else "bottleneck",
            **common)
        cls = ResNetForImageClassification
        processor = ConvNextImageProcessor(size={"shortest_edge": side}, crop_pct=0.875)
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # statistics a trained network would have, not 0 and 1
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out


LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
"""A small chat template (Llama-style models carry theirs in ``tokenizer_config.json``)."""


def build_causal_tokenizer(directory: Path, *, chat_template: str | None = None) -> Any:
    """A WordPiece tokenizer for a causal LM over :data:`SENTENCES`, saved to
    ``directory``: a text starts with the BOS token ``[CLS]`` and ends with nothing (the
    model continues it); ``[SEP]`` is EOS, ``[PAD]`` pads; decoding joins word pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(wordpiece_vocab(), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[CLS]",
        eos_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(directory))
    if chat_template is not None:  # in tokenizer_config.json, where Llama checkpoints have it
        import json

        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = chat_template
        config_path.write_text(json.dumps(config, indent=2))
        fast.chat_template = chat_template
    return fast


def make_causal_lm(
    directory: str | Path,
    *,
    family: str = "gpt2",
    size: str = "tiny",
    seed: int = 0,
) -> Path:
    """A causal language model directory (``family``: gpt2 -> ``GPT2LMHeadModel``, llama
    -> ``LlamaForCausalLM`` with a chat template) with random weights and a tokenizer;
    returns its path."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_causal_tokenizer(
        out, chat_template=LLAMA_CHAT_TEMPLATE if family == "llama" else None)
    dims = SIZES[size]
    special = {"vocab_size": max(len(tok), 64), "pad_token_id": tok.pad_token_id,
               "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    if family == "gpt2":
        config: Any = GPT2Config(
            n_embd=dims["hidden_size"], n_layer=dims["num_hidden_layers"],
            n_head=dims["num_attention_heads"], n_inner=dims["intermediate_size"],
            n_positions=dims["max_position_embeddings"], **special)
        cls: Any = GPT2LMHeadModel
    elif family == "llama":
        config = LlamaConfig(
            hidden_size=dims["hidden_size"], num_hidden_layers=dims["num_hidden_layers"],
            num_attention_heads=dims["num_attention_heads"],
            num_key_value_heads=max(1, dims["num_attention_heads"] // 2),  # GQA
            intermediate_size=dims["intermediate_size"],
            max_position_embeddings=dims["max_position_embeddings"], **special)
        cls = LlamaForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(str(out))
    return out
