"""Text classification: UTF-8 text in (an OIP ``BYTES`` tensor ``text``), labels out.

The model's own tokenizer (carried in its model version, loaded from those bytes with
``transformers`` and local files only) turns each request's texts into ``input_ids`` and
``attention_mask``, padded to the request's longest text; the batcher pads further to the
batch's longest (``pad_values``), which attention masks out, so a text's logits do not
depend on what it was batched with. A text longer than the model's positions is a 400
``input_too_long`` unless the model was pushed with truncation. The answer: ``label``
(``BYTES [rows, k]``, from the config's ``id2label``), ``score`` (softmax, ``FP32 [rows,
k]``, best first) and the raw ``logits``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashpoint.errors import InputTooLong, InvalidInput, RegistryError

TEXT_INPUT = "text"
DEFAULT_TOP_K = 5


def load_tokenizer(files: Mapping[str, bytes]) -> Any:
    """The model's tokenizer from its carried files (never a hub download)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="fp-tokenizer-") as d:
        for path, data in files.items():
            target = Path(d) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        try:
            tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as e:  # transformers raises many types for a bad directory
            raise RegistryError(f"the model's tokenizer does not load: {e}"[:500]) from None
    tok.padding_side = "right"  # the batcher pads on the right too
    return tok


def labels_of(hf_config: Mapping[str, Any], num_labels: int) -> list[str]:
    """Label names by class index: ``id2label`` where it names them, else ``LABEL_i``."""
    raw = hf_config.get("id2label") or {}
    return [str(raw.get(str(i), raw.get(i, f"LABEL_{i}"))) for i in range(num_labels)]


def top_k_answer(logits: np.ndarray, labels: list[str], top_k: int) -> dict[str, np.ndarray]:
    """``label`` / ``score`` (softmax, best first, ``top_k`` of them) and ``logits``."""
    x = logits.astype(np.float32, copy=False)
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    probs = z / z.sum(axis=-1, keepdims=True)
    k = min(top_k, probs.shape[-1])
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    names = np.empty(order.shape, dtype=object)
    for idx in np.ndindex(order.shape):
        names[idx] = labels[int(order[idx])].encode()
    return {"label": names, "score": np.take_along_axis(probs, order, axis=-1),
            "logits": x}


def decode_texts(arr: np.ndarray, name: str = TEXT_INPUT) -> list[str]:
    """The texts of a ``BYTES [rows]`` tensor; InvalidInput for what is not UTF-8 text."""
    texts = []
    for item in arr.reshape(-1):
        if isinstance(item, str):
            texts.append(item)
            continue
        if not isinstance(item, (bytes, bytearray)):
            raise InvalidInput(f"input {name!r} must hold text (BYTES), got {type(item).__name__}")
        try:
            texts.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidInput(f"input {name!r} is not UTF-8 text: {e}") from None
    return texts


@dataclass
class TextClassification:
    """See the module docstring."""

    tokenizer: Any
    max_len: int
    truncate: bool
    labels: list[str]
    top_k: int = DEFAULT_TOP_K
    module_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    module_outputs: tuple[str, ...] = ("logits",)
    pad_values: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def for_manifest(cls, manifest: Any, files: Mapping[str, bytes]) -> TextClassification:
        config = manifest.config
        hf = config["hf_config"]
        tok = load_tokenizer(files)
        max_len = int(config.get("max_length") or max_length(hf, tok))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return cls(tok, max_len, bool(config.get("truncate", False)),
                   labels_of(hf, int(config["num_labels"])),
                   int(config.get("top_k", DEFAULT_TOP_K)),
                   pad_values={"input_ids": int(pad), "attention_mask": 0})

    @classmethod
    def for_answers(cls, manifest: Any) -> TextClassification:
        """Only :meth:`finish` works (no tokenizer): a pipeline's last stage, which does not
        hold the files the model carries (they are at the front of its first layer)."""
        config = manifest.config
        return cls(None, 0, False, labels_of(config["hf_config"], int(config["num_labels"])),
                   int(config.get("top_k", DEFAULT_TOP_K)))

    def prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arr = inputs[TEXT_INPUT]
        if arr.ndim != 1:
            raise InvalidInput(f"input {TEXT_INPUT!r} must be BYTES of shape [n] (one text per "
                               f"row), got {list(arr.shape)}")
        texts = decode_texts(arr)
        enc = self._encode(texts, truncate=self.truncate)
        longest = int(enc["attention_mask"].sum(axis=1).max()) if len(texts) else 0
        if longest > self.max_len:
            raise InputTooLong(f"input {TEXT_INPUT!r}: {longest} tokens, over the model's limit "
                               f"of {self.max_len} (push the model with --truncate to cut "
                               "long texts)", limit=self.max_len, tokens=longest)
        return enc

    def _encode(self, texts: list[str], *, truncate: bool) -> dict[str, np.ndarray]:
        logger = logging.getLogger("transformers.tokenization_utils_base")
        level = logger.level
        logger.setLevel(logging.ERROR)  # the over-length warning: answered as a 400 instead
        try:
            enc = self.tokenizer(texts, padding=True, truncation=truncate,
                                 max_length=self.max_len if truncate else None,
                                 return_tensors="np")
        finally:
            logger.setLevel(level)
        return {"input_ids": enc["input_ids"].astype(np.int64),
                "attention_mask": enc["attention_mask"].astype(np.int64)}

    def finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return top_k_answer(outputs["logits"], self.labels, self.top_k)

    def warmup_request(self) -> dict[str, np.ndarray]:
        return {TEXT_INPUT: np.array([b"warm up"], dtype=object)}


def max_length(hf_config: Mapping[str, Any], tokenizer: Any) -> int:
    """The longest sequence the model takes: its positions, and the tokenizer's limit
    where that is set (``model_max_length`` is a huge sentinel when it is not)."""
    limits = [int(v) for k in ("max_position_embeddings", "n_positions")
              if isinstance(v := hf_config.get(k), int) and v > 0]
    tok_limit = getattr(tokenizer, "model_max_length", 0)
    if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
        limits.append(tok_limit)
    return min(limits) if limits else 512
