"""Generation measured and scaled in tokens (issue 21 item 4) on a real local cluster.

A streamed completion through the official ``openai`` client, from zero replicas, shows on
the controller's ``/metrics`` as one cold time-to-first-token (with its cold-start phases),
one time-per-output-token, and prompt/completion token counters equal to what the
model's own tokenizer and ``transformers``' ``generate`` (in this process) give. Then a
few long streams, which the concurrency rule would serve with one replica, make the
``tokens`` autoscaler ask for a second: token load drives the scale-up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from flashpoint.config import load_config
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, wait_for

pytestmark = pytest.mark.timeout(240)

PROMPT = "the cluster scales"


def _config(tmp_path: Path):
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05,
                       "autoscaler": "tokens",
                       # 20 tokens/s per replica, outstanding work to drain within 1 s
                       "autoscaler_params": {"replica_tokens_per_s": 20.0, "drain_s": 1.0}},
        "host": {"cpu_devices": 2, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache")},
    }).with_home(tmp_path)


def _samples(text: str, name: str, **labels: str) -> list[float]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append(s.value)
    return out


# The metrics are process-wide: a function name no other test uses keeps the counts this
# test asserts its own (test_generation.py serves an "llm" too).
async def test_token_metrics_and_token_driven_scale_up(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    from openai import AsyncOpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_causal_lm(tmp_path / "src", family="gpt2", size="small")
    cfg = _config(tmp_path)
    store = make_store(cfg)
    await publish_source(store, "lm", model_dir)
    cluster = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    client = AsyncOpenAI(base_url=f"{cluster.controller.url}/v1", api_key="unused",
                         max_retries=0, timeout=120)
    try:
        url = cluster.controller.url
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/functions", json={
                    "name": "llm-tokens", "model": "lm", "max_batch_size": 8, "max_replicas": 2,
                    "keep_alive_s": 60}) as r:
                assert r.status in (200, 201), await r.text()

            # one streamed completion from zero replicas
            pieces, usage = [], None
            stream = await client.completions.create(
                model="llm-tokens", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                pieces += [c.text for c in chunk.choices]
                usage = chunk.usage or usage
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
            ids = tok(PROMPT).input_ids
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            assert "".join(pieces) == tok.decode(want, skip_special_tokens=True)
            assert usage is not None and usage.completion_tokens == len(want)

            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
            assert _samples(text, "flashpoint_generation_tokens_total", function="llm-tokens",
                            kind="prompt") == [len(ids)]
            assert _samples(text, "flashpoint_generation_tokens_total", function="llm-tokens",
                            kind="completion") == [len(want)]
            assert sum(_samples(text, "flashpoint_generation_replica_tokens_total",
                                function="llm-tokens")) == len(want)
            assert _samples(text, "flashpoint_ttft_seconds_count", function="llm-tokens",
                            start="cold") == [1]
            assert _samples(text, "flashpoint_ttft_seconds_count", function="llm-tokens",
                            start="warm") in ([], [0])
            assert _samples(text, "flashpoint_tpot_seconds_count", function="llm-tokens") == [1]
            ttft = _samples(text, "flashpoint_ttft_seconds_sum", function="llm-tokens", start="cold")
            phases = {ph: _samples(text, "flashpoint_ttft_phase_seconds_sum", function="llm-tokens",
                                   phase=ph) for ph in ("load", "first_inference", "first_token")}
            assert all(len(v) == 1 for v in phases.values()), phases
            # the phases add up to the TTFT (each observed once, from the same request)
            total_phases = sum(sum(_samples(text, "flashpoint_ttft_phase_seconds_sum",
                                            function="llm-tokens", phase=ph))
                               for ph in {f.split('"')[3] for f in text.splitlines()
                                          if f.startswith("flashpoint_ttft_phase_seconds_sum{")
                                          and 'function="llm-tokens"' in f})
            assert total_phases == pytest.approx(ttft[0], rel=1e-6)
            fn = cluster.controller.state.functions["llm-tokens"]
            assert len(cluster.controller.state.replicas_of("llm-tokens")) == 1, fn.reason

            # long streams: 4 sequences (the concurrency rule: 1 replica at 16 each), a few
            # hundred tokens outstanding at 20 tokens/s per replica: the tokens plug-in
            # wants one per sequence, bounded by max_replicas = 2
            async def long_stream(i: int) -> int:
                st = await client.completions.create(
                    model="llm-tokens", prompt=f"{PROMPT} {i}", max_tokens=150, temperature=0,
                    stream=True)
                n = 0
                async for chunk in st:
                    n += len(chunk.choices)
                return n

            tasks = [asyncio.ensure_future(long_stream(i)) for i in range(4)]
            try:
                await wait_for("a second replica for the token load",
                               lambda: len(cluster.controller.state.replicas_of("llm-tokens")) >= 2,
                               60, state=lambda: (fn.desired, fn.reason))
                assert fn.reason.startswith("tokens:") and "tok@20tok/s" in fn.reason, fn.reason
            finally:
                counts = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert all(c > 0 for c in counts)
    finally:
        await client.close()
        await asyncio.wait_for(cluster.stop(), 60)
