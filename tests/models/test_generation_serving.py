"""A causal LM pushed from a Hugging Face directory (no flag: its config says so), rebuilt
from the blob as a worker does, and served by the worker's generation loop: greedy ids equal
``transformers``' ``generate`` in this process, alone and with other sequences running;
a stream closed early cancels its sequence and frees its KV cache; bad requests are typed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flashpoint.errors import InvalidInput, KvCacheFull, KvCacheTooSmall
from flashpoint.models import serving
from flashpoint.models.publish import load_module, read_files
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry.local import LocalStore
from flashpoint.worker.generation import GenerationLoop

pytestmark = pytest.mark.timeout(120)

PROMPTS = ("the cluster scales", "a cold start fetches bytes from a peer", "gpus are shared")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pushed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, Any, Any]:
    tmp = tmp_path_factory.mktemp("gen")
    d = make_causal_lm(tmp / request.param, family=request.param)
    store = LocalStore(tmp / "reg")
    m = asyncio.run(publish_source(store, "lm", d))
    blob = store.blob_path("lm", "1").read_bytes()
    module = load_module(m, memoryview(blob), copy=True)
    served = serving.for_manifest(m, read_files(m, memoryview(blob)))
    return d, m, (module, served)


def _reference(d: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _request(prompt: str, **params: Any) -> dict[str, np.ndarray]:
    inputs = {"text": np.array([prompt.encode()], dtype=object)}
    for k, v in params.items():
        inputs[k] = np.array([v], dtype=np.float32 if isinstance(v, float) else np.int64)
    return inputs


def test_push_needs_no_flag(pushed: tuple[Path, Any, Any]) -> None:
    d, m, _ = pushed
    assert m.task == "text-generation"
    assert "tokenizer.json" in m.files and "tokenizer_config.json" in m.files
    assert [t.name for t in m.io.outputs][:2] == ["text", "token_ids"]


async def test_greedy_ids_equal_generate_alone_and_batched(pushed: tuple[Path, Any, Any]) -> None:
    d, _, (module, served) = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        reqs = [served.prepare(_request(p, max_tokens=8 + 2 * i, temperature=0.0))
                for i, p in enumerate(PROMPTS)]
        alone, _ = await asyncio.wait_for(loop.submit(reqs[0]), 30)
        together = await asyncio.wait_for(asyncio.gather(*(loop.submit(r) for r in reqs)), 30)
        assert loop.engine.idle and loop.engine.reserved_bytes == 0
    finally:
        await loop.stop()
    for req, (result, _) in zip(reqs, together, strict=True):
        want = _reference(d, list(req.prompt_ids), req.params.max_tokens)
        assert list(result.token_ids) == want
        answer = served.finish(result)
        assert int(answer["completion_tokens"][0]) == len(want)
        assert int(answer["prompt_tokens"][0]) == len(req.prompt_ids)
    assert alone.token_ids == together[0][0].token_ids


async def test_closing_a_stream_cancels_its_sequence(pushed: tuple[Path, Any, Any]) -> None:
    _, _, (module, served) = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        long = served.prepare(_request(PROMPTS[0], max_tokens=40, temperature=0.0))
        other = loop.enqueue(served.prepare(_request(PROMPTS[1], max_tokens=30, temperature=0.0)))
        stream = loop.stream(long)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        assert seen == 3
        # the other sequence goes on; the cancelled one leaves at the next token boundary
        result, _ = await asyncio.wait_for(other, 30)
        assert len(result.token_ids) >= 1
        await asyncio.wait_for(loop.wait_idle(), 30)
        assert loop.engine.steps < 40  # its 40 tokens were never all generated
        assert loop.engine.idle and loop.engine.reserved_bytes == 0 and not loop.engine.running
    finally:
        await loop.stop()


async def test_too_big_and_too_many_are_typed(pushed: tuple[Path, Any, Any]) -> None:
    _, _, (module, served) = pushed
    engine = served.build_engine(module, max_running=1)
    engine.kv_budget_bytes = 20 * engine.bytes_per_token
    loop = GenerationLoop(engine, max_waiting=1)
    loop.start()
    try:
        with pytest.raises(KvCacheTooSmall):
            await asyncio.wait_for(loop.submit(served.prepare(_request(PROMPTS[0], max_tokens=30))), 30)
        first = loop.enqueue(served.prepare(_request(PROMPTS[0], max_tokens=8, temperature=0.0)))
        with pytest.raises(KvCacheFull):  # one already waits to join
            await loop.submit(served.prepare(_request(PROMPTS[0], max_tokens=8)))
        result, _ = await asyncio.wait_for(first, 30)  # the replica serves on
        assert len(result.token_ids) >= 1
    finally:
        await loop.stop()
    with pytest.raises(InvalidInput):
        served.prepare({"max_tokens": np.array([3])})
    with pytest.raises(InvalidInput):
        served.prepare(_request(PROMPTS[0], top_p=0.0))


def test_chat_template_renders_messages(pushed: tuple[Path, Any, Any]) -> None:
    d, _, (_, served) = pushed
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "the cluster scales"}]
    inputs = {"messages": np.array([json.dumps(messages).encode()], dtype=object)}
    tok = AutoTokenizer.from_pretrained(str(d))
    if not tok.chat_template:  # gpt2 here: no template, a typed 400
        with pytest.raises(InvalidInput, match="chat template"):
            served.prepare(inputs)
        return
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert list(served.prepare(inputs).prompt_ids) == list(want)


def test_a_chat_template_that_refuses_the_messages_is_a_bad_input(
        pushed: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A template's own ``raise_exception`` (Llama-2's "roles must alternate" and the like)
    is the caller's error, a typed 400, not a model failure."""
    _, _, (_, served) = pushed
    refusing = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversation must start with a user message') }}"
                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(served.tokenizer, "chat_template", refusing)
    bad = [{"role": "assistant", "content": "hello"}]
    with pytest.raises(InvalidInput, match="must start with a user message"):
        served.prepare({"messages": np.array([json.dumps(bad).encode()], dtype=object)})
    good = [{"role": "user", "content": "the cluster scales"}]
    assert served.prepare({"messages": np.array([json.dumps(good).encode()], dtype=object)
                           }).prompt_ids
