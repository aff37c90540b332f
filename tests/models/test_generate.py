"""The generation engine against ``transformers``' own ``generate`` in this process: greedy
ids equal, alone and with other sequences joining and leaving around them; seeded sampling
reproducible whatever it is batched with; stop strings; the KV-cache budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashpoint.errors import InputTooLong, KvCacheTooSmall
from flashpoint.models.generate import FinishReason, GenerationEngine, SamplingParams
from flashpoint.models.tiny_hf import make_causal_lm

PROMPTS = ("the cluster scales", "a cold start fetches bytes from a peer", "gpus",
           "the food was terrible and the service slow")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = make_causal_lm(tmp_path_factory.mktemp("clm") / request.param, family=request.param)
    return AutoModelForCausalLM.from_pretrained(str(d)).eval(), AutoTokenizer.from_pretrained(str(d))


def _engine(lm: tuple[Any, Any], *, budget: int = 10**9, max_running: int = 8) -> GenerationEngine:
    model, tok = lm
    return GenerationEngine(model, eos_token_ids=[tok.eos_token_id], max_positions=64,
                            kv_budget_bytes=budget, max_running=max_running,
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True))


def _reference(lm: tuple[Any, Any], prompt: str, n: int) -> list[int]:
    model, tok = lm
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _alone(lm: tuple[Any, Any], prompt: str, params: SamplingParams) -> list[int]:
    """The ids ``prompt`` gets with ``params`` on an engine of its own."""
    engine = _engine(lm)
    sid = engine.add(lm[1](prompt).input_ids, params)
    got: dict[int, list[int]] = {}
    _run(engine, got, 40)
    return got[sid]


def _run(engine: GenerationEngine, got: dict[int, list[int]], steps: int) -> int:
    """Up to ``steps`` steps; the most sequences that took a token in one step."""
    most = 0
    for _ in range(steps):
        events = engine.step()
        most = max(most, len(events))
        for e in events:
            if e.token_id is not None:
                got.setdefault(e.seq_id, []).append(e.token_id)
        if engine.idle:
            break
    return most


def test_greedy_alone_equals_transformers_generate(lm: tuple[Any, Any]) -> None:
    _, tok = lm
    for prompt in PROMPTS:
        engine = _engine(lm)
        sid = engine.add(tok(prompt).input_ids, SamplingParams(12, temperature=0.0))
        got: dict[int, list[int]] = {}
        _run(engine, got, 50)
        assert engine.idle and got[sid] == _reference(lm, prompt, 12)


def test_greedy_batched_with_joins_and_leaves_equals_generate(lm: tuple[Any, Any]) -> None:
    """Sequences of different lengths and budgets join at different token boundaries; each
    one's ids equal generate's for its prompt alone."""
    _, tok = lm
    engine = _engine(lm)
    got: dict[int, list[int]] = {}
    lengths = (14, 5, 10, 7)
    sids = [engine.add(tok(PROMPTS[0]).input_ids, SamplingParams(lengths[0], temperature=0.0))]
    _run(engine, got, 2)
    sids.append(engine.add(tok(PROMPTS[1]).input_ids, SamplingParams(lengths[1], temperature=0.0)))
    sids.append(engine.add(tok(PROMPTS[2]).input_ids, SamplingParams(lengths[2], temperature=0.0)))
    most = _run(engine, got, 3)
    sids.append(engine.add(tok(PROMPTS[3]).input_ids, SamplingParams(lengths[3], temperature=0.0)))
    most = max(most, _run(engine, got, 60))
    assert most >= 2  # batched together (a random model may end a sequence early on EOS)
    assert engine.idle and engine.reserved_bytes == 0
    for sid, prompt, n in zip(sids, PROMPTS, lengths, strict=True):
        assert got[sid] == _reference(lm, prompt, n), prompt


def test_seeded_sampling_is_reproducible_alone_or_batched(lm: tuple[Any, Any]) -> None:
    _, tok = lm
    params = SamplingParams(10, temperature=1.5, top_p=0.9, seed=7)
    ids_alone = _alone(lm, PROMPTS[0], params)
    batched = _engine(lm)
    batched.add(tok(PROMPTS[1]).input_ids, SamplingParams(10, temperature=1.0, seed=1))
    _run(batched, {}, 1)
    b = batched.add(tok(PROMPTS[0]).input_ids, params)
    got_batched: dict[int, list[int]] = {}
    _run(batched, got_batched, 40)
    assert ids_alone == got_batched[b]
    other = _engine(lm)
    c = other.add(tok(PROMPTS[0]).input_ids, SamplingParams(10, temperature=1.5, top_p=0.9, seed=8))
    got_other: dict[int, list[int]] = {}
    _run(other, got_other, 40)
    assert got_other[c] != ids_alone  # 10 draws over a ~200-word vocabulary


def test_stop_string_cuts_the_text_and_finishes(lm: tuple[Any, Any]) -> None:
    _, tok = lm
    # a prompt whose greedy continuation is long enough to hold a stop string inside
    texts = {p: tok.decode(_reference(lm, p, 16), skip_special_tokens=True) for p in PROMPTS}
    prompt, full = max(texts.items(), key=lambda item: len(item[1]))
    assert len(full) > 8, texts
    stop = full[6:9]
    engine = _engine(lm)
    sid = engine.add(tok(prompt).input_ids, SamplingParams(16, temperature=0.0, stop=(stop,)))
    finishes, text = [], ""
    for _ in range(50):
        for e in engine.step():
            assert e.seq_id == sid
            text += e.text_delta
            finishes.append(e.finish)
        if engine.idle:
            break
    assert finishes[-1] == FinishReason.STOP and stop not in text
    assert text == full[:full.find(stop)]


def test_kv_budget_makes_a_sequence_wait_and_refuses_what_never_fits(lm: tuple[Any, Any]) -> None:
    _, tok = lm
    probe = _engine(lm)
    ids = tok(PROMPTS[0]).input_ids
    one = (len(ids) + 8) * probe.bytes_per_token
    engine = _engine(lm, budget=one)
    with pytest.raises(KvCacheTooSmall):
        engine.add(ids, SamplingParams(9, temperature=0.0))
    with pytest.raises(InputTooLong):
        engine.add(list(range(3, 67)), SamplingParams(1))
    first = engine.add(ids, SamplingParams(8, temperature=0.0))
    second = engine.add(ids, SamplingParams(8, temperature=0.0))
    engine.step()
    assert list(engine.running) == [first] and len(engine.waiting) == 1  # waits for room
    assert engine.reserved_bytes == one
    assert engine.cancel(first) and engine.reserved_bytes == 0  # cancelling frees the cache
    engine.step()
    assert list(engine.running) == [second]
    got: dict[int, list[int]] = {}
    _run(engine, got, 20)
    assert engine.idle and engine.reserved_bytes == 0


def test_joiners_at_one_boundary_prefill_in_one_pass(lm: tuple[Any, Any]) -> None:
    """Prompts of different lengths that join at the same token boundary take one padded
    forward pass together (not one each), then decode together; each greedy one's ids
    still equal generate's for its prompt alone, and a seeded sampled one among them draws
    what it draws alone."""
    model, tok = lm
    sampled = SamplingParams(10, temperature=1.3, top_p=0.95, seed=5)
    ids_alone = _alone(lm, PROMPTS[3], sampled)
    engine = _engine(lm)
    sids = [engine.add(tok(p).input_ids, SamplingParams(9, temperature=0.0)) for p in PROMPTS]
    s = engine.add(tok(PROMPTS[3]).input_ids, sampled)
    passes: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: passes.append(1))
    got: dict[int, list[int]] = {}
    try:
        first = engine.step()
        assert len(passes) == 1 and {e.seq_id for e in first} == {*sids, s}
        for e in first:
            got.setdefault(e.seq_id, []).append(e.token_id)
        running = len(engine.running)
        second = engine.step()
        assert len(passes) == 2 and len(second) == running  # the decode, all together
        for e in second:
            got.setdefault(e.seq_id, []).append(e.token_id)
    finally:
        hook.remove()
    _run(engine, got, 40)
    assert engine.idle and engine.reserved_bytes == 0
    for sid, prompt in zip(sids, PROMPTS, strict=True):
        assert got[sid] == _reference(lm, prompt, 9), prompt
    assert got[s] == ids_alone


def test_cancel_mid_batch_keeps_the_others_and_the_buffer_bounded(lm: tuple[Any, Any]) -> None:
    """A sequence cancelled between steps leaves the batch's KV buffer; the others' ids
    are unchanged. The buffer never holds more than its rows x (the longest row + the
    most tokens any row may still add), and nothing once the engine is idle."""
    _, tok = lm
    engine = _engine(lm)
    lengths = (12, 6, 10, 8)
    sids = [engine.add(tok(p).input_ids, SamplingParams(n, temperature=0.0))
            for p, n in zip(PROMPTS, lengths, strict=True)]
    got: dict[int, list[int]] = {}
    for step in range(60):  # bounded: every sequence ends within 12 steps
        if step == 3:
            assert engine.cancel(sids[2])
        for e in engine.step():
            if e.token_id is not None:
                got.setdefault(e.seq_id, []).append(e.token_id)
        rows = list(engine.running.values())
        if rows:
            longest = max(r.length for r in rows)
            room = max(r.end - r.length for r in rows)
            assert 0 < engine.kv_allocated_bytes <= (
                len(rows) * (longest + room) * engine.bytes_per_token)
        if engine.idle:
            break
    assert engine.idle and engine.kv_allocated_bytes == 0 and engine.reserved_bytes == 0
    assert len(got[sids[2]]) == 3
    for i in (0, 1, 3):
        assert got[sids[i]] == _reference(lm, PROMPTS[i], lengths[i]), PROMPTS[i]
