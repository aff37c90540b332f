"""The tiny causal LM the worker-level generation tests share, pushed and built as a worker
builds it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from flashpoint.models import serving
from flashpoint.models.publish import load_module, read_files
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry.local import LocalStore


def push_causal_lm(tmp: Path) -> tuple[Path, Any, Any]:
    """A random Llama-style causal LM under ``tmp`` (seed 2: its greedy text from the tests'
    prompts has no repeats and no EOS within 16 tokens, so a stop string from its middle
    first occurs there; seed 0 repeats one word), pushed to a local registry; its directory,
    and the module and serving built over the pushed blob."""
    d = make_causal_lm(tmp / "llama", family="llama", seed=2)
    store = LocalStore(tmp / "reg")
    m = asyncio.run(publish_source(store, "lm", d))
    blob = store.blob_path("lm", "1").read_bytes()
    module = load_module(m, memoryview(blob), copy=True)
    return d, module, serving.for_manifest(m, read_files(m, memoryview(blob)))
