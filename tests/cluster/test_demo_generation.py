"""The demo's streamed generation (``flashpoint demo``, demo.stream_generation) on a real
local cluster: the tokens it prints as they arrive are ``transformers``' own greedy
``generate`` of the model it built, computed in this process, after a scale from zero."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from flashpoint.demo import GENERATION_PROMPT, stream_generation
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(180)


async def test_demo_streams_a_generation_after_a_scale_from_zero(make_cluster: ClusterFactory,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    cluster = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            lines = await stream_generation(s, cluster.controller.url, store, tmp_path,
                                            max_tokens=10, delete=False)
        replicas = cluster.controller.state.replicas_of("gpt2-fn")
        assert len(replicas) == 1  # started by the streamed request (no min_replicas)
    finally:
        await asyncio.wait_for(cluster.stop(), 60)
    d = tmp_path / "tiny-gpt2"
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    ids = tok(GENERATION_PROMPT).input_ids
    want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    text = tok.decode(want, skip_special_tokens=True)
    printed = capsys.readouterr().out
    assert f"{GENERATION_PROMPT} ->{text}" in printed, printed  # streamed as it came
    assert repr(text) in lines[0]
    assert f"{len(want)} tokens (prompt {len(ids)})" in lines[1]
