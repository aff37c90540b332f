"""Helpers of the cluster tests; clusters themselves come from the ``make_cluster`` fixture
(tests/conftest.py, flashpoint/testing/harness.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashpoint.models import zoo
from flashpoint.testing.harness import ClusterFactory, InProcessCluster


@pytest.fixture
async def cluster(make_cluster: ClusterFactory) -> InProcessCluster:
    """Two in-process hosts with tiny BERT and noop published (leak-checked by make_cluster)."""
    c = await make_cluster(hosts=2, models=("bert", "noop"))
    assert isinstance(c, InProcessCluster)
    return c


class BertLoad:
    """Closed-loop HTTP clients invoking a tiny-BERT function until stopped, each output
    checked against ``reference``; what failed (a non-200 body, or "wrong output") is kept."""

    def __init__(self, session: Any, url: str, function: str, manifest: Any, reference: Any,
                 clients: int = 4) -> None:
        self.session, self.url, self.function = session, url, function
        self.manifest, self.reference = manifest, reference
        self.failures: list[Any] = []
        self.served = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(1000 * i)) for i in range(clients)]

    async def _client(self, seed: int) -> None:
        for i in range(100_000):  # bounded; ends when stopped
            if self._stop.is_set():
                return
            x = zoo.example_inputs("bert", self.manifest.config, 1, seed=seed + i)
            body = {"inputs": {"input_ids": {"data": x["input_ids"].ravel().tolist(),
                                             "shape": list(x["input_ids"].shape),
                                             "datatype": "INT64"}}}
            async with self.session.post(f"{self.url}/v1/functions/{self.function}/invoke",
                                         json=body) as r:
                out = await r.json()
            if r.status != 200:
                self.failures.append(out)
                continue
            got = out["outputs"]["logits"]
            logits = np.asarray(got["data"], np.float32).reshape(got["shape"])
            if not np.allclose(logits, zoo.run_example(self.reference, x).numpy(),
                               rtol=1e-4, atol=1e-5):
                self.failures.append("wrong output")
            self.served += 1

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)


def greedy_reference(d: Path, prompt: str, n: int) -> tuple[list[int], str]:
    """``transformers``' own greedy ``generate`` of ``n`` tokens after ``prompt`` for the
    causal LM directory ``d``, in the test process: the token ids and their decoded text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    return out, tok.decode(out, skip_special_tokens=True)


def assert_exited(pids: Iterable[int]) -> None:
    """Every process of ``pids`` has exited (gone, or a zombie awaiting its parent)."""
    for pid in pids:
        status_file = Path(f"/proc/{pid}/status")
        assert not status_file.exists() or "zombie" in status_file.read_text().lower(), pid


async def serve_until_dissolved(c: InProcessCluster, group: Any, stages: list[Any],
                                one: Any, first: int, timeout_s: float) -> None:
    """Keep requests flowing, two at a time (``one(i)`` sends request i, from ``first``),
    while a partitioned group's stages complete -- none may fail -- until the group is
    dissolved and its stages are whole, warm replicas."""
    from flashpoint.controller.state.records import ReplicaPhase
    from flashpoint.testing.harness import wait_for

    served, deadline = first, time.monotonic() + timeout_s
    while group.group_id in c.controller.state.groups:
        await asyncio.gather(*(one(served + i) for i in range(2)))
        served += 2
        assert time.monotonic() < deadline, \
            f"the group never dissolved: {c.controller.cluster_status()}"
    await wait_for("stages are whole replicas", lambda: all(
        c.controller.state.replicas[r.replica_id].phase == ReplicaPhase.WARM
        for r in stages), 30)
