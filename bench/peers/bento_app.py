"""BentoML side of the peer benchmark; runs in the BentoML venv (bench/peers/envs.py), never
in the project's, as ``bentoml serve bento_app:Peer --host 127.0.0.1 --port P``.

One service with an endpoint per workload, configured by environment (BentoML reads the
decorators at import):

- ``BENCH_MODELS``: comma list of models to load at start (``mlp``, ``big``, ``bert``), paths
  under ``BENCH_MODEL_DIR``;
- ``BENCH_WORKERS``: ``workers=`` of the service (unset: BentoML's default, 1);
- ``BENCH_BATCH=1``: the ``mlp_batched`` endpoint is adaptive-batched (``batchable=True``).

``/noop``, ``/mlp``, ``/big`` take Flashpoint's JSON tensor form (``{"inputs": {"x": {"data",
"shape", "datatype"}}}``); ``/mlp_batched`` takes ``{"x": [[...]]}`` (BentoML batches along
the first axis of an array argument); ``/bert`` takes ``{"inputs": {"text": [...]}}``.
"""

from __future__ import annotations

import os
from typing import Any

import bentoml
import numpy as np

MODELS = [m for m in os.environ.get("BENCH_MODELS", "").split(",") if m]
MODEL_DIR = os.environ.get("BENCH_MODEL_DIR", ".")
_WORKERS = os.environ.get("BENCH_WORKERS")
SERVICE_OPTS: dict[str, Any] = {"workers": int(_WORKERS)} if _WORKERS else {}
BATCHED = os.environ.get("BENCH_BATCH") == "1"


def _tensor(inputs: dict[str, Any]) -> np.ndarray:
    x = inputs["x"]
    return np.asarray(x["data"], dtype=np.float32).reshape(x["shape"])


def _reply(name: str, y: np.ndarray) -> dict[str, Any]:
    return {"outputs": {name: {"data": y.reshape(-1).tolist(), "shape": list(y.shape),
                               "datatype": "FP32"}}, "replica": str(os.getpid())}


@bentoml.service(**SERVICE_OPTS)
class Peer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # as Flashpoint's CPU workers (torch_threads = 1)
        self.modules: dict[str, Any] = {}
        for name in ("mlp", "big"):
            if name in MODELS:
                self.modules[name] = torch.jit.load(os.path.join(MODEL_DIR, f"{name}.pt"),
                                                    map_location="cpu").eval()
        if "bert" in MODELS:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = os.path.join(MODEL_DIR, "bert-base")
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.bert_model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    def _run(self, name: str, x: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return self.modules[name](torch.from_numpy(x)).numpy()

    @bentoml.api
    def noop(self, inputs: dict) -> dict:
        return {"outputs": {"y": inputs["x"]}, "replica": str(os.getpid())}

    @bentoml.api
    def mlp(self, inputs: dict) -> dict:
        return _reply("y", self._run("mlp", _tensor(inputs)))

    @bentoml.api(batchable=BATCHED, max_batch_size=16)
    def mlp_batched(self, x: np.ndarray) -> np.ndarray:
        return self._run("mlp", x.astype(np.float32))

    @bentoml.api
    def big(self, inputs: dict) -> dict:
        return _reply("y", self._run("big", _tensor(inputs)))

    @bentoml.api
    def bert(self, inputs: dict) -> dict:
        import torch

        enc = self.tokenizer(list(inputs["text"]), return_tensors="pt", padding=True,
                             truncation=True)
        with torch.inference_mode():
            logits = self.bert_model(**enc).logits.numpy()
        return _reply("logits", logits)
