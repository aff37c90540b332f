"""Multi-round live migration in the worker's generation loop (ServerlessLLM §5; issue 21
items 5 and 7): the destination parks a snapshot of a running sequence (prefills prompt +
tokens so far) while the source keeps generating; the resumed sequence then extends the
parked cache with the tokens generated since. The ids still equal ``transformers``' own
greedy ``generate`` in this process; a park that does not match is discarded (the resume
prefills as before); a park nothing resumes expires or is unparked, and every park's KV
reservation returns to zero."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.models.causal_lm import push_causal_lm

from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.migration import (
    ParkSequences,
    SequenceHandOff,
    SequenceSnapshot,
)
from flashpoint.worker.generation import GenerationLoop, hand_off_message, resumed_request

pytestmark = pytest.mark.timeout(120)

PROMPTS = ("a spot eviction drains the host", "the cluster scales", "gpus are shared")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    return push_causal_lm(tmp_path_factory.mktemp("park"))


def _inputs(prompt: str, max_tokens: int) -> dict[str, np.ndarray]:
    return {"text": np.array([prompt.encode()], dtype=object),
            "max_tokens": np.array([max_tokens], dtype=np.int64),
            "temperature": np.array([0.0], dtype=np.float32)}


def _reference(d: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()


async def _moved(served: Any, module: Any, prompts: tuple[str, ...], *, park_at: int,
                 extra: int, tamper: bool = False, max_tokens: int = 16
                 ) -> tuple[dict[str, list[int]], Any, GenerationLoop, list[Any]]:
    """Sequences of ``prompts`` on a source engine (stepped here, so the rounds interleave
    the same way every run); once they have ``park_at`` tokens the destination loop parks
    their snapshots (through the wire form) while the source takes ``extra`` more steps;
    then they are taken out, one more step apart, and resumed on the destination together
    from their hand-offs. Every
    sequence's ids, the source engine, the destination loop (stopped) and the park results.
    ``tamper``: the snapshots' tokens are altered, so no resume matches its park."""
    source = served.build_engine(module, max_running=8)
    dest = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    dest.start()
    ids: dict[str, list[int]] = {p: [] for p in prompts}
    requests = {p: served.prepare(_inputs(p, max_tokens)) for p in prompts}
    seq_of = {source.add(list(r.prompt_ids), r.params): p for p, r in requests.items()}

    def step() -> None:
        for e in source.step():
            assert e.finish is None, "finished before it was handed off"
            ids[seq_of[e.seq_id]].append(e.token_id)

    try:
        for _ in range(park_at):
            step()
        snaps = [SequenceSnapshot(request_id=p, prompt_ids=tuple(s.prompt_ids),
                                  generated_ids=tuple(s.generated), max_tokens=s.params.max_tokens)
                 for sid, s in source.running.items() for p in [seq_of[sid]]]
        if tamper:
            snaps = [SequenceSnapshot(request_id=s.request_id, prompt_ids=s.prompt_ids,
                                      generated_ids=(s.generated_ids[0] + 1,
                                                     *s.generated_ids[1:]),
                                      max_tokens=s.max_tokens) for s in snaps]
        msg = from_payload(ParkSequences, to_payload(ParkSequences(sequences=tuple(snaps))))
        async with asyncio.timeout(60):
            parked = await dest.park(msg.sequences, ttl_s=msg.ttl_s)
            assert dest.parked_bytes > 0
            for _ in range(extra):  # the source went on meanwhile
                step()
            handed: dict[str, SequenceHandOff] = {}
            for n, (sid, p) in enumerate(seq_of.items()):
                if n:  # the next ones later: each extends its park by one token more
                    step()
                progress = source.take_out(sid)
                assert progress is not None
                handed[p] = from_payload(SequenceHandOff, to_payload(hand_off_message(
                    requests[p], progress, len(ids[p]))))

            async def resume(p: str, stream: Any) -> None:
                async for event in stream:
                    ids[p].append(event.token_id)

            # joined together: one extension pass per count of tokens to add
            streams = {p: dest.stream(resumed_request(served.prepare(
                _inputs(p, max_tokens)), h)[0], key=p) for p, h in handed.items()}
            await asyncio.gather(*(resume(p, st) for p, st in streams.items()))
            await dest.wait_idle()
        return ids, source, dest, list(parked)
    finally:
        await dest.stop()


async def test_a_snapshot_reads_a_running_sequence_without_stopping_it(
        pushed: tuple[Path, Any, Any]) -> None:
    d, module, served = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    request = served.prepare(_inputs(PROMPTS[0], 12))
    try:
        got: list[int] = []
        snaps = []
        async with asyncio.timeout(60):
            async for event in loop.stream(request, key="k"):
                got.append(event.token_id)
                if len(got) == 3:
                    snaps = loop.snapshot(["k", "unknown"])
        want = _reference(d, list(request.prompt_ids), 12)
        assert got == want  # it went on to the end
        (snap,) = snaps
        n = len(snap.generated_ids)
        assert snap.request_id == "k" and snap.prompt_ids == request.prompt_ids
        assert n >= 3 and list(snap.generated_ids) == want[:n] and snap.max_tokens == 12
    finally:
        await loop.stop()


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
async def test_park_then_resume_with_extra_tokens_equals_generate(
        pushed: tuple[Path, Any, Any], prompts: tuple[str, ...]) -> None:
    d, module, served = pushed
    ids, source, dest, parked = await _moved(served, module, prompts, park_at=4, extra=3)
    assert all(r.parked and r.prefill_s > 0 for r in parked), parked
    for p in prompts:
        want = _reference(d, list(served.prepare(_inputs(p, 16)).prompt_ids), 16)
        assert ids[p] == want, p
    # every resume went on from its park (extended, not prefilled again)
    assert dest.engine.park_hits == len(prompts) and dest.engine.park_misses == 0
    assert dest.engine.reserved_bytes == 0 and source.reserved_bytes == 0
    assert dest.parked_bytes == 0


async def test_a_park_that_does_not_match_is_discarded(pushed: tuple[Path, Any, Any]) -> None:
    d, module, served = pushed
    ids, _, dest, parked = await _moved(served, module, PROMPTS[:2], park_at=3, extra=2,
                                        tamper=True)
    assert all(r.parked for r in parked)
    for p in PROMPTS[:2]:
        assert ids[p] == _reference(d, list(served.prepare(_inputs(p, 16)).prompt_ids), 16)
    assert dest.engine.park_misses == 2 and dest.engine.park_hits == 0
    assert dest.engine.reserved_bytes == 0


async def test_a_park_nothing_resumes_expires_and_frees_its_reservation(
        pushed: tuple[Path, Any, Any]) -> None:
    _, module, served = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        prompt = tuple(served.prepare(_inputs(PROMPTS[0], 8)).prompt_ids)
        snap = SequenceSnapshot(request_id="gone", prompt_ids=prompt, generated_ids=(5, 6, 7),
                                max_tokens=8)
        (result,) = await asyncio.wait_for(loop.park([snap], ttl_s=0.3), 30)
        assert result.parked and loop.parked_bytes > 0
        assert loop.engine.reserved_bytes == loop.parked_bytes
        async with asyncio.timeout(10):  # the idle loop wakes for the expiry itself
            while loop.parked_bytes:
                await asyncio.sleep(0.02)  # polling the loop's accounting, bounded above
        assert loop.engine.reserved_bytes == 0 and not loop.engine.parked
    finally:
        await loop.stop()


async def test_unpark_frees_the_parked_cache(pushed: tuple[Path, Any, Any]) -> None:
    """What the controller sends when the parked request's client left (or it finished
    on its source, or went elsewhere): the reservation returns to zero at once."""
    _, module, served = pushed
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        prompt = tuple(served.prepare(_inputs(PROMPTS[1], 8)).prompt_ids)
        snaps = [SequenceSnapshot(request_id=f"r{i}", prompt_ids=prompt,
                                  generated_ids=(5, 6), max_tokens=8) for i in range(2)]
        results = await asyncio.wait_for(loop.park(snaps, ttl_s=30), 30)
        assert all(r.parked for r in results)
        assert loop.unpark(["r0", "r1", "never"]) == 2
        async with asyncio.timeout(10):
            while loop.parked_bytes:
                await asyncio.sleep(0.02)  # polling the loop's accounting, bounded above
        assert loop.engine.reserved_bytes == 0
    finally:
        await loop.stop()


async def test_a_park_that_does_not_fit_is_refused_with_a_code(
        pushed: tuple[Path, Any, Any]) -> None:
    _, module, served = pushed
    engine = served.build_engine(module, max_running=8)
    prompt = tuple(served.prepare(_inputs(PROMPTS[0], 8)).prompt_ids)
    need = (len(prompt) + 8) * engine.bytes_per_token
    engine.kv_budget_bytes = need + need // 2  # room for one park, not two
    loop = GenerationLoop(engine, max_waiting=16)
    loop.start()
    try:
        snaps = [SequenceSnapshot(request_id=f"r{i}", prompt_ids=prompt, generated_ids=(5,),
                                  max_tokens=8) for i in range(2)]
        results = await asyncio.wait_for(loop.park(snaps, ttl_s=30), 30)
        assert [r.parked for r in results] == [True, False]
        assert results[1].code == "kv_cache_full"
        assert loop.unpark(["r0"]) == 1
    finally:
        await loop.stop()
    assert engine.reserved_bytes == 0 and not engine.parked  # stop drops every park


def test_the_extension_pass_computes_what_a_whole_prefill_does(
        pushed: tuple[Path, Any, Any]) -> None:
    """The resumed sequence's next-token logits, from its parked prefix extended by three
    tokens, equal ``transformers``' forward over prompt + every token in this process
    (greedy ids of a random model barely notice a wrong position; logits do)."""
    _, module, served = pushed
    engine = served.build_engine(module, max_running=8)
    request = served.prepare(_inputs(PROMPTS[0], 12))
    prompt = list(request.prompt_ids)
    generated = [11, 12, 13, 14, 15]
    engine.park("k", prompt, generated[:2], request.params, expires_s=1e9)
    engine.step()  # the park's pass
    assert engine.parked["k"].ready and engine.parked["k"].length == len(prompt) + 1
    from flashpoint.models.generate import SequenceProgress

    sid = engine.add(prompt, request.params, SequenceProgress(tuple(generated), ""), key="k")
    seen: list[torch.Tensor] = []
    sample = engine._sample

    def spy(seqs: list[Any], logits: torch.Tensor) -> list[int]:
        seen.append(logits.detach().clone())
        return sample(seqs, logits)

    engine._sample = spy  # type: ignore[method-assign]
    (event,) = engine.step()
    assert event.seq_id == sid and engine.park_hits == 1
    with torch.inference_mode():
        want = module.model(input_ids=torch.tensor([prompt + generated])).logits[0, -1]
    torch.testing.assert_close(seen[0][0], want, atol=1e-4, rtol=1e-4)
    engine.cancel(sid)
    assert engine.reserved_bytes == 0


async def test_a_later_round_extends_the_park_and_the_resume_equals_generate(
        pushed: tuple[Path, Any, Any]) -> None:
    """Multi-round: a second, longer snapshot of a parked sequence extends its prefix by the
    new tokens only (the reservation unchanged); the resume then extends by the last few,
    and the ids still equal ``generate``; a third snapshot with nothing new is ready at once."""
    from flashpoint.models.generate import SequenceProgress

    d, module, served = pushed
    request = served.prepare(_inputs(PROMPTS[2], 14))
    prompt = list(request.prompt_ids)
    want = _reference(d, prompt, 14)
    loop = GenerationLoop(served.build_engine(module, max_running=8), max_waiting=16)
    loop.start()
    try:
        async with asyncio.timeout(60):
            first = SequenceSnapshot(request_id="k", prompt_ids=tuple(prompt),
                                     generated_ids=tuple(want[:3]), max_tokens=14)
            (r1,) = await loop.park([first], ttl_s=30)
            reserved = loop.engine.reserved_bytes
            second = SequenceSnapshot(request_id="k", prompt_ids=tuple(prompt),
                                      generated_ids=tuple(want[:7]), max_tokens=14)
            (r2,) = await loop.park([second], ttl_s=30)
            (r3,) = await loop.park([second], ttl_s=30)  # nothing new
            assert r1.parked and r2.parked and r3.parked
            assert loop.engine.parked["k"].length == len(prompt) + 6
            assert loop.engine.reserved_bytes == reserved  # the same reservation
            got = list(want[:9])
            resumed = type(request)(request.prompt_ids, request.params,
                                    SequenceProgress(tuple(want[:9]), ""))
            async for event in loop.stream(resumed, key="k"):
                got.append(event.token_id)
            assert loop.engine.park_hits == 1
        assert got == want
        assert loop.engine.reserved_bytes == 0 and loop.parked_bytes == 0
    finally:
        await loop.stop()
