"""A causal LM's pipeline stages (GPT-2, Llama) serve token steps (issue 21 item 6): running the
steps stage by stage, as the controller's token loop does, gives the same greedy ids and
text as ``transformers``' own ``generate`` in this process, at every cut; seeded sampling
draws the same tokens as a whole replica's engine; a model with no causal-LM adapter
serves whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flashpoint.messages.pipeline_generation import PipelineStep, StepResult, decode, encode
from flashpoint.models import serving
from flashpoint.models.publish import load_module, load_stage, read_files
from flashpoint.models.serving.stage import served_stage
from flashpoint.models.sources import PushOptions, publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.partition.stageable import why_not_staged
from flashpoint.registry.local import LocalStore
from flashpoint.tensors import encode_tensors

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

PROMPT = "a spot eviction drains the host"
N = 12


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pushed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
           ) -> tuple[Path, Any, bytes]:
    tmp = tmp_path_factory.mktemp("genstages")
    d = make_causal_lm(tmp / request.param, family=request.param, seed=2)
    store = LocalStore(tmp / "reg")
    m = asyncio.run(publish_source(store, "lm", d, options=PushOptions(profile=True)))
    return d, m, store.blob_path("lm", "1").read_bytes()


def _reference(d: Path, prompt: str, n: int) -> tuple[list[int], str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    return out, tok.decode(out, skip_special_tokens=True)


def _stages(m: Any, blob: bytes, cuts: list[tuple[int, int]]) -> list[Any]:
    last = len(m.layers) - 1
    return [served_stage(m, load_stage(m, memoryview(blob), i, j, device="cpu"),
                         memoryview(blob), first=i == 0, last=j == last) for i, j in cuts]


def _run(stages: list[Any], inputs: dict[str, np.ndarray], n: int,
         ) -> tuple[list[int], str, str, list[StepResult]]:
    """The controller's loop, stage by stage: (ids, streamed text, finish, results)."""
    generated: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()
    emitted, rng, text, finish = "", None, "", ""
    results = []
    with torch.inference_mode():
        for _ in range(n + 1):
            step = PipelineStep(inputs=encode_tensors(inputs), prompt_ids=prompt,
                                generated_ids=generated, emitted_text=emitted, rng_state=rng)
            args: Any = (np.array([encode(step)], dtype=object),)
            for stage in stages:
                args = stage(*args)
            result = decode(StepResult, args[0])
            results.append(result)
            prompt, generated = result.prompt_ids, result.generated_ids
            emitted, rng = result.emitted_text, result.rng_state
            text += result.text_delta
            if result.finish:
                finish = result.finish
                break
    return list(generated), text, finish, results


def _inputs(prompt: str, **params: Any) -> dict[str, np.ndarray]:
    inputs = {"text": np.array([prompt.encode()], dtype=object)}
    for k, v in params.items():
        inputs[k] = np.array([v], dtype=np.float32 if isinstance(v, float) else np.int64)
    return inputs


@pytest.mark.parametrize("cuts", [[(0, 3)], [(0, 1), (2, 3)], [(0, 0), (1, 1), (2, 2), (3, 3)]])
def test_greedy_steps_through_stages_equal_transformers_generate(
        pushed: tuple[Path, Any, bytes], cuts: list[tuple[int, int]]) -> None:
    d, m, blob = pushed
    assert len(m.layers) == 4 and why_not_staged(m.entry_point, m.config) is None
    ids, text, finish, results = _run(_stages(m, blob, cuts),
                                      _inputs(PROMPT, max_tokens=N, temperature=0.0), N)
    want_ids, want_text = _reference(d, PROMPT, N)
    assert ids == want_ids and text == want_text and finish == "length"
    assert len(results) == N  # one step per token
    assert results[-1].text == want_text


def test_seeded_sampling_through_stages_draws_what_a_replica_draws(
        pushed: tuple[Path, Any, bytes]) -> None:
    from flashpoint.worker.generation import GenerationLoop

    d, m, blob = pushed
    inputs = _inputs(PROMPT, max_tokens=N, temperature=0.9, top_p=0.95, seed=7)
    ids, text, _, _ = _run(_stages(m, blob, [(0, 1), (2, 3)]), inputs, N)
    served = serving.for_manifest(m, read_files(m, memoryview(blob)))
    module = load_module(m, memoryview(blob), copy=True)

    async def whole() -> tuple[list[int], str]:
        loop = GenerationLoop(served.build_engine(module, max_running=2), max_waiting=4)
        loop.start()
        try:
            got: list[int] = []
            out = ""
            async with asyncio.timeout(30):
                async for event in loop.stream(served.prepare(inputs), key="w"):
                    if event.token_id is not None:
                        got.append(event.token_id)
                    out += event.text_delta
            return got, out
        finally:
            await loop.stop()

    assert (ids, text) == asyncio.run(whole())


def test_a_causal_lm_without_a_stage_adapter_serves_whole(
        pushed: tuple[Path, Any, bytes]) -> None:
    _, m, _ = pushed
    other = {**m.config, "architecture": "MistralForCausalLM",
             "hf_config": {**m.config["hf_config"], "model_type": "mistral"}}
    why = why_not_staged(m.entry_point, other)
    assert why is not None and "serves whole" in why and "gpt2, llama" in why


def test_a_generation_models_later_stages_fetch_the_tokenizer_with_their_range(
        pushed: tuple[Path, Any, bytes]) -> None:
    from flashpoint.registry.manifest import byte_range_for_layers, stage_byte_ranges

    _, m, blob = pushed
    files = [m.tensors[f.tensor] for f in m.files.values()]
    lo, hi = min(t.start for t in files), max(t.end for t in files)
    assert stage_byte_ranges(m, 0, 1) == (byte_range_for_layers(m, 0, 1),)  # holds them
    assert stage_byte_ranges(m, 2, 3) == ((lo, hi), byte_range_for_layers(m, 2, 3))
    # those bytes are the carried files: the last stage reads its tokenizer from them alone
    only = bytearray(len(blob))
    for start, end in stage_byte_ranges(m, 2, 3):
        only[start:end] = blob[start:end]
    assert read_files(m, memoryview(bytes(only))) == read_files(m, memoryview(blob))
    # a classifier's stages need their own bytes only
    import dataclasses

    other = dataclasses.replace(m, task="text-classification")
    assert stage_byte_ranges(other, 2, 3) == (byte_range_for_layers(other, 2, 3),)
