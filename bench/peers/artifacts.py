"""The model files every platform serves, built once and kept in the cache directory.

- ``mlp.pt``: a small torch MLP (16 → 64 → 16, ReLU) as TorchScript, seed 0. Every platform
  loads these same bytes; :func:`reference_mlp` rebuilds the eager module from the seed in
  the benchmark's own process, the reference every platform's answers are checked against.
- ``big.pt``: a ~537 MB TorchScript MLP (8 × 4096×4096, no bias) for scale-from-zero and the
  burst: big enough that loading it is the cold start's work, cheap enough to run on CPU.
- ``bert-base/``: a Hugging Face ``BertForSequenceClassification`` directory with BERT-base's
  shape and random weights (:func:`flashpoint.models.tiny_hf.make_text_classifier`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

MLP_IN, MLP_HIDDEN, MLP_OUT = 16, 64, 16
BIG_WIDTH, BIG_LAYERS = 4096, 8
BUILD_VERSION = 1  # bump when a builder changes, so cached files are rebuilt


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(MLP_IN, MLP_HIDDEN), nn.ReLU(),
                         nn.Linear(MLP_HIDDEN, MLP_OUT)).eval()


def reference_mlp() -> nn.Module:
    """The small MLP as an eager module, rebuilt from its seed (not read from ``mlp.pt``)."""
    return _mlp()


def _big() -> nn.Module:
    torch.manual_seed(1)
    layers: list[nn.Module] = []
    for _ in range(BIG_LAYERS):
        layers += [nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False), nn.ReLU()]
    return nn.Sequential(*layers).eval()


@dataclass(frozen=True)
class Artifacts:
    """Paths of the built model files."""

    mlp: Path
    big: Path
    bert_dir: Path

    @property
    def big_bytes(self) -> int:
        return self.big.stat().st_size


def ensure(root: Path) -> Artifacts:
    """Build whatever is missing under ``root / "models"``; returns the paths."""
    out = root / "models"
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "built.json"
    arts = Artifacts(out / "mlp.pt", out / "big.pt", out / "bert-base")
    if marker.exists() and json.loads(marker.read_text()).get("version") == BUILD_VERSION:
        return arts
    with torch.no_grad():
        torch.jit.save(torch.jit.script(_mlp()), str(arts.mlp))
        torch.jit.save(torch.jit.script(_big()), str(arts.big))
    from flashpoint.models.tiny_hf import make_text_classifier

    make_text_classifier(arts.bert_dir, size="base")
    marker.write_text(json.dumps({"version": BUILD_VERSION}))
    return arts


def warm_page_cache(path: Path) -> None:
    """Read every file under ``path`` once, so the peers load it from the page cache."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
