"""A BERT-like encoder classifier.

Layers: ``[embeddings, block × num_layers, head]``. The embeddings take ``input_ids``
(INT64 ``[batch, seq]``) and every later layer takes and returns float hidden states
``[batch, seq, hidden]``, except the head, which returns ``logits`` FP32 ``[batch, labels]``.
No attention mask: each layer's only input is the previous layer's output tensor.

Sizes (float32 weights): tiny ≈ 3.8 MB, small ≈ 42 MB, base ≈ 440 MB (BERT-base shape),
large ≈ 1.34 GB (BERT-large shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flashpoint.models.base import (
    LayeredModel,
    config_from_dict,
    materialize,
    require_positive,
    resolve_config,
)
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import TensorSpec

ENTRY_POINT = "flashpoint.models.bert:build_empty"


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    max_position: int = 128
    num_labels: int = 2
    pre_norm: bool = False
    layer_norm_eps: float = 1e-12
    seq_len: int = 32  # example inputs only; any length up to max_position runs

    def __post_init__(self) -> None:
        require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads",
                         "intermediate_size", "max_position", "num_labels", "seq_len")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.seq_len > self.max_position:
            raise ValueError("seq_len must not exceed max_position")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"vocab_size": 16384, "hidden_size": 256, "num_layers": 8, "num_heads": 4,
              "intermediate_size": 1024, "max_position": 512, "seq_len": 64},
    "base": {"vocab_size": 30522, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
             "intermediate_size": 3072, "max_position": 512, "seq_len": 128},
    "large": {"vocab_size": 30522, "hidden_size": 1024, "num_layers": 24, "num_heads": 16,
              "intermediate_size": 4096, "max_position": 512, "seq_len": 128},
}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.max_position = cfg.max_position
        self.token = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.max_position:
            raise ValueError(f"sequence length {seq} over max_position {self.max_position}")
        positions = torch.arange(seq, device=input_ids.device)
        return self.norm(self.token(input_ids) + self.position(positions)[None])


class BertBlock(nn.Module):
    """Self-attention + MLP, post-norm (original BERT) or pre-norm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.pre_norm = cfg.pre_norm
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, h))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.mlp(x))


class BertHead(nn.Module):
    """Pooler (first token, dense + tanh) and classifier; a final norm for pre-norm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if cfg.pre_norm else None
        self.pooler = nn.Linear(h, h)
        self.classifier = nn.Linear(h, cfg.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class BertModel(LayeredModel):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(
            [BertEmbeddings(cfg), *(BertBlock(cfg) for _ in range(cfg.num_layers)), BertHead(cfg)]
        )


def resolve(preset_or_config: str | Mapping[str, Any]) -> BertConfig:
    return resolve_config(BertConfig, PRESETS, preset_or_config)


def _config(config: BertConfig | Mapping[str, Any]) -> BertConfig:
    return config if isinstance(config, BertConfig) else config_from_dict(BertConfig, config)


def build_empty(config: BertConfig | Mapping[str, Any]) -> BertModel:
    """The module on the ``meta`` device (no memory): the manifest's entry point."""
    with torch.device("meta"):
        return BertModel(_config(config))


def init_weights(module: nn.Module, g: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.normal_(0.0, 0.02, generator=g)
            if getattr(m, "bias", None) is not None:
                m.bias.normal_(0.0, 0.02, generator=g)
        elif isinstance(m, nn.LayerNorm):
            m.weight.normal_(1.0, 0.02, generator=g)
            m.bias.normal_(0.0, 0.02, generator=g)


def build_from_config(config: BertConfig | Mapping[str, Any], *, seed: int = 0) -> BertModel:
    """The module with deterministic weights (same config and seed, same bytes)."""
    g = torch.Generator().manual_seed(seed)
    return materialize(build_empty(config), g, init_weights)  # type: ignore[return-value]


def io_signature(config: BertConfig | Mapping[str, Any]) -> IoSignature:
    cfg = _config(config)
    return IoSignature(
        inputs=(TensorSpec("input_ids", "INT64", (-1, -1)),),
        outputs=(TensorSpec("logits", "FP32", (-1, cfg.num_labels)),),
    )


def example_inputs(
    config: BertConfig | Mapping[str, Any], batch: int = 1, *, seed: int = 0
) -> dict[str, np.ndarray]:
    cfg = _config(config)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, cfg.seq_len), dtype=np.int64)
    return {"input_ids": ids}
