"""A Llama-style causal LM pushed from a directory (no flag), served by a real local
cluster: greedy ids through the native API equal ``transformers``' ``generate`` in this
process for prompts sent together (batched in one replica's token loop), and the official
``openai`` client gets completions, chat completions and models from the OpenAI routes."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from flashpoint.gateway.standalone import StandaloneGateway
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry import make_store
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import greedy_reference

pytestmark = pytest.mark.timeout(240)

PROMPTS = ("the cluster scales", "a cold start fetches bytes from a peer", "gpus are shared",
           "a spot eviction drains")


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
        return r.status, await r.json()


async def test_causal_lm_native_and_openai(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    model_dir = make_causal_lm(tmp_path / "src", family="llama")
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    manifest = await publish_source(store, "tiny-llama", model_dir)
    assert manifest.task == "text-generation"
    cluster = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    url = cluster.controller.url
    async with aiohttp.ClientSession() as s:
        status, body = await _post(s, f"{url}/v1/functions", {
            "name": "llm", "model": "tiny-llama", "max_batch_size": 8})
        assert status in (200, 201), body

        # native: sent together, batched in one token loop; ids equal generate's alone
        def native(prompt: str, n: int) -> dict[str, Any]:
            return {"inputs": {
                "text": {"data": [prompt], "shape": [1], "datatype": "BYTES"},
                "max_tokens": {"data": [n], "shape": [1], "datatype": "INT64"},
                "temperature": {"data": [0.0], "shape": [1], "datatype": "FP32"}}}

        lengths = [6 + 3 * i for i in range(len(PROMPTS))]
        replies = await asyncio.gather(*(
            _post(s, f"{url}/v1/functions/llm/invoke", native(p, n))
            for p, n in zip(PROMPTS, lengths, strict=True)))
        for (status, body), prompt, n in zip(replies, PROMPTS, lengths, strict=True):
            assert status == 200, body
            want_ids, want_text = greedy_reference(model_dir, prompt, n)
            assert body["outputs"]["token_ids"]["data"] == want_ids
            assert body["outputs"]["text"]["data"] == [want_text]

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         timeout=60)
    try:
        models = await client.models.list()
        assert "llm" in [m.id for m in models.data]
        done = await client.completions.create(model="llm", prompt=PROMPTS[1],
                                               max_tokens=9, temperature=0)
        want_ids, want_text = greedy_reference(model_dir, PROMPTS[1], 9)
        assert done.choices[0].text == want_text
        assert done.usage is not None and done.usage.completion_tokens == len(want_ids)
        assert done.choices[0].finish_reason in ("stop", "length")

        # seeded sampling: the same seed gives the same text
        a, b = [await client.completions.create(
            model="llm", prompt=PROMPTS[0], max_tokens=8, temperature=1.2, top_p=0.9,
            seed=11) for _ in range(2)]
        assert a.choices[0].text == b.choices[0].text

        chat = await client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": PROMPTS[2]}],
            max_tokens=7, temperature=0)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        rendered = tok.apply_chat_template([{"role": "user", "content": PROMPTS[2]}],
                                           add_generation_prompt=True, tokenize=False)
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False).input_ids)

        # streamed: server-sent events through the client add up to the same text
        pieces, usage, finish = [], None, None
        stream = await client.completions.create(
            model="llm", prompt=PROMPTS[3], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        want_ids, want_text = greedy_reference(model_dir, PROMPTS[3], 12)
        assert "".join(pieces) == want_text and len(pieces) > 2
        assert finish in ("stop", "length")
        assert usage is not None and usage.completion_tokens == len(want_ids)
        chat_pieces = []
        chat_stream = await client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": PROMPTS[2]}],
            max_tokens=7, temperature=0, stream=True)
        async for chunk in chat_stream:
            chat_pieces += [c.delta.content or "" for c in chunk.choices]
        assert "".join(chat_pieces) == chat.choices[0].message.content
    finally:
        await client.close()

    # the same routes through a stand-alone gateway (gw_invoke, and gw_stream's chunks)
    gw_cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
        cfg.gateway, controller_url=cluster.controller.rpc_url, refresh_s=0.1))
    gw = await asyncio.wait_for(StandaloneGateway.start(gw_cfg, port=0), 30)
    gw_client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                            timeout=60)
    try:
        await wait_for("the gateway's function table holds llm", lambda: "llm" in [
            i.spec.name for i in gw.backend.list_functions()], 20)
        want_ids, want_text = greedy_reference(model_dir, PROMPTS[0], 10)
        done = await gw_client.completions.create(model="llm", prompt=PROMPTS[0],
                                                  max_tokens=10, temperature=0)
        assert done.choices[0].text == want_text
        pieces = []
        stream = await gw_client.completions.create(
            model="llm", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
        async for chunk in stream:
            pieces += [c.text for c in chunk.choices]
        assert "".join(pieces) == want_text
    finally:
        await gw_client.close()
        await asyncio.wait_for(gw.stop(), 30)

    # a client that disconnects mid-stream cancels its sequence in the worker
    replica = body["replica_id"]
    worker = cluster.controller.workers[replica]
    before = await worker.conn.call("replica_status", {}, timeout_s=5)
    assert before["running"] == 0
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={
                "model": "llm", "prompt": "gpus", "max_tokens": 55, "temperature": 0,
                "stream": True},
                timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200
            events = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    events += 1
                if events == 2:
                    break
            r.close()  # gone mid-stream
    statuses: list[dict[str, Any]] = []

    async def idle() -> bool:
        statuses.append(await worker.conn.call("replica_status", {}, timeout_s=5))
        return statuses[-1]["running"] == 0 and statuses[-1]["depth"] == 0

    for _ in range(200):  # bounded: the worker leaves it at a token boundary
        if await idle():
            break
    assert statuses[-1]["running"] == 0, statuses[-3:]
    # far fewer steps than its 55 tokens would have taken
    assert statuses[-1]["batches"] - before["batches"] < 40, (before, statuses[-1])
