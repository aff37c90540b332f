"""Live migration in the worker's generation loop (issue 21 item 5): a sequence handed off
at a token boundary on one replica's loop and resumed on another's from prompt + tokens so
far gives the same token ids as ``transformers``' own greedy ``generate`` in this process;
its text deltas add up to the whole text; seeded sampling draws the same tokens as a run
that never moved; usage counts stay right; the source frees the sequence's KV cache."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.models.causal_lm import push_causal_lm

from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.migration import SequenceHandOff
from flashpoint.worker.generation import GenerationLoop, hand_off_message, resumed_request

pytestmark = pytest.mark.timeout(120)

PROMPT = "a spot eviction drains the host"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    return push_causal_lm(tmp_path_factory.mktemp("mig"))


def _inputs(prompt: str, **params: Any) -> dict[str, np.ndarray]:
    inputs = {"text": np.array([prompt.encode()], dtype=object)}
    for k, v in params.items():
        inputs[k] = np.array([v], dtype=np.float32 if isinstance(v, float) else np.int64)
    return inputs


def _reference(d: Path, ids: list[int], n: int) -> tuple[list[int], str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    return out, tok.decode(out, skip_special_tokens=True)


async def _migrated(served: Any, module: Any, inputs: dict[str, np.ndarray], after: int,
                    *, others: int = 0) -> tuple[list[int], str, int, Any, GenerationLoop]:
    """Run ``inputs``' request on a source loop (with ``others`` sequences alongside), hand it off
    after ``after`` tokens, resume it on a destination loop; (ids, text, chunks at hand-off,
    the hand-off, the source loop) -- the source stopped."""
    source = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    dest = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    request = served.prepare(inputs)
    source.start()
    dest.start()
    try:
        busy = [source.stream(served.prepare(_inputs(f"other {i}", max_tokens=40,
                                                     temperature=0.0)), key=f"o{i}")
                for i in range(others)]
        ids: list[int] = []
        text = ""
        stream = source.stream(request, key="r1")
        async with asyncio.timeout(30):
            async for event in stream:
                ids.append(event.token_id)
                text += event.text_delta
                if len(ids) == after:
                    assert source.hand_off(["r1", "unknown"]) == 1
        assert stream.handed_off is not None, "the sequence finished before it was handed off"
        assert len(ids) >= after
        # through the wire form, as the controller relays it
        wire = to_payload(hand_off_message(request, stream.handed_off, len(ids)))
        msg = from_payload(SequenceHandOff, wire)
        # the destination gets the same request (its sampling parameters) and the hand-off
        resumed, first_index = resumed_request(served.prepare(inputs), msg)
        assert first_index == len(ids) and resumed.prompt_ids == request.prompt_ids
        async with asyncio.timeout(30):
            async for event in dest.stream(resumed, key="r1"):
                ids.append(event.token_id)
                text += event.text_delta
        for s in busy:
            await s.aclose()
        async with asyncio.timeout(30):
            await source.wait_idle()
        return ids, text, first_index, msg, source
    finally:
        await dest.stop()
        await source.stop()


@pytest.mark.parametrize("others", [0, 3])
async def test_greedy_handoff_equals_generate(pushed: tuple[Path, Any, Any], others: int) -> None:
    d, module, served = pushed
    inputs = _inputs(PROMPT, max_tokens=14, temperature=0.0)
    request = served.prepare(inputs)
    ids, text, at, msg, source = await _migrated(served, module, inputs, after=5,
                                                 others=others)
    want_ids, want_text = _reference(d, list(request.prompt_ids), 14)
    assert ids == want_ids
    assert text == want_text
    assert 5 <= at < len(want_ids) and msg.generated_ids == tuple(want_ids[:at])
    assert msg.rng_state is None  # greedy: nothing to carry
    assert source.engine.reserved_bytes == 0 and source.engine.idle


async def test_seeded_sampling_draws_as_if_it_never_moved(pushed: tuple[Path, Any, Any]) -> None:
    _, module, served = pushed
    inputs = _inputs(PROMPT, max_tokens=12, temperature=1.3, top_p=0.95, seed=11)
    request = served.prepare(inputs)
    # undisturbed: one loop start to end
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        whole, _ = await asyncio.wait_for(loop.submit(request), 30)
    finally:
        await loop.stop()
    ids, text, at, msg, _ = await _migrated(served, module, inputs, after=4)
    assert msg.rng_state is not None and at >= 4
    assert ids == list(whole.token_ids) and text == whole.text


async def test_unseeded_sampling_carries_its_sampler(pushed: tuple[Path, Any, Any]) -> None:
    """No seed: the sampler's state still travels, so two destinations resuming the same
    hand-off draw the same tokens (a fresh random seed on each would not)."""
    _, module, served = pushed
    request = served.prepare(_inputs(PROMPT, max_tokens=10, temperature=1.5))
    engine = served.build_engine(module, max_running=8)
    seq_id = engine.add(list(request.prompt_ids), request.params)
    for _ in range(3):
        engine.step()
    progress = engine.take_out(seq_id)
    assert progress is not None and progress.rng_state is not None
    assert engine.idle and engine.reserved_bytes == 0 and len(progress.generated_ids) == 3
    outs = []
    for _ in range(2):
        dest = served.build_engine(module, max_running=8)
        sid = dest.add(list(request.prompt_ids), request.params, progress)
        out: list[int] = []
        for _ in range(20):  # bounded: 7 tokens are left
            if dest.idle:
                break
            out += [e.token_id for e in dest.step() if e.seq_id == sid]
        outs.append(out)
    assert outs[0] == outs[1] and len(outs[0]) == 10 - 3


async def test_stop_strings_and_held_back_text_survive_the_move(
        pushed: tuple[Path, Any, Any]) -> None:
    """Text a stop string could still claim is held back on the source; the destination
    sends it, so the deltas add up to the undisturbed text, cut at the stop string."""
    d, module, served = pushed
    want_ids, want_text = _reference(d, list(served.prepare(_inputs(PROMPT)).prompt_ids), 16)
    # a stop string made of the reference's own text, long enough to hold text back
    stop = want_text[len(want_text) // 2:len(want_text) // 2 + 6]
    assert len(stop) == 6
    inputs = _inputs(PROMPT, max_tokens=16, temperature=0.0)
    inputs["stop"] = np.array([stop.encode()], dtype=object)
    request = served.prepare(inputs)
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        whole, _ = await asyncio.wait_for(loop.submit(request), 30)
    finally:
        await loop.stop()
    assert stop not in whole.text and want_text.startswith(whole.text)
    ids, text, _, _, _ = await _migrated(served, module, inputs, after=2)
    assert text == whole.text == want_text[:want_text.find(stop)]
    assert ids == list(whole.token_ids)


async def test_a_sequence_not_yet_joined_leaves_as_it_came(pushed: tuple[Path, Any, Any]) -> None:
    _, module, served = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    request = served.prepare(_inputs(PROMPT, max_tokens=6, temperature=0.0))
    stream = loop.stream(request, key="k")  # the loop has not started: still joining
    assert loop.hand_off(["k"]) == 1
    assert [e async for e in stream] == []
    assert stream.handed_off is not None and stream.handed_off.generated_ids == ()
    assert loop.hand_off(["k"]) == 0  # asked twice: nothing more to do
    await loop.stop()
