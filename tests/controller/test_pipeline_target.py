"""The controller's pipeline target running generation token loops (issue 21 item 6) over a
fake pipeline client: one pipeline request per token with the sequence's state, one stream
chunk per token, the answer a replica would give, a hand-off at the next token boundary with
what a worker would hand off, a resumed sequence going on from its hand-off, and a lost stage
failing the request with its error."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from flashpoint.controller.handles import Pending
from flashpoint.controller.pipeline_target import PipelineTarget
from flashpoint.errors import PeerLost
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.migration import InferHandedOff, SequenceHandOff
from flashpoint.messages.pipeline_generation import PipelineStep, StepResult, decode, encode
from flashpoint.tensors import decode_tensors, encode_tensors

PROMPT = (1, 2, 3)
TOKENS = (10, 11, 12, 13, 14)


class _Client:
    """A pipeline whose model continues with TOKENS (the letters a, b, c... as text)."""

    def __init__(self, *, fail_at: int = -1) -> None:
        self.steps: list[PipelineStep] = []
        self.fail_at = fail_at
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()  # a step reached the pipeline

    async def infer_outputs(self, inputs: dict[str, np.ndarray], *,
                            timeout_s: float | None = None) -> list[np.ndarray]:
        step = decode(PipelineStep, inputs["step"])
        self.steps.append(step)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        n = len(step.generated_ids)
        if n == self.fail_at:
            raise PeerLost("stage s2 lost")
        token = TOKENS[n]
        generated = (*step.generated_ids, token)
        text = "".join(chr(ord("a") + t - 10) for t in generated)
        result = StepResult(token_id=token, text_delta=text[len(step.emitted_text):],
                            finish="length" if len(generated) == len(TOKENS) else "",
                            text=text, prompt_ids=step.prompt_ids or PROMPT,
                            generated_ids=generated, emitted_text=text)
        out = np.empty(1, dtype=object)
        out[0] = encode(result)
        return [out]


def _pending(rid: str, **payload: Any) -> Pending:
    inputs = encode_tensors({"text": np.array([b"hi"], dtype=object)})
    return Pending(rid, "llm", {"request_id": rid, "inputs": inputs, "stream": True, **payload},
                   asyncio.get_running_loop().create_future(), 0.0, 1e9, False, stream=True)


def _target(client: _Client, chunks: list[dict[str, Any]]) -> PipelineTarget:
    async def on_chunk(conn: Any, payload: dict[str, Any]) -> None:
        assert conn is client  # the connection the stream registry knows the request by
        chunks.append(payload)

    return PipelineTarget(client, "h0", [], generates=True, on_chunk=on_chunk)  # type: ignore[arg-type]


async def test_a_sequence_runs_one_pipeline_request_per_token() -> None:
    client, chunks, answered = _Client(), [], []
    target = _target(client, chunks)
    target.on_first_answer = lambda: answered.append(1)
    (reply,) = await target.infer([_pending("q1")], 10.0)
    assert len(client.steps) == len(TOKENS) and answered == [1]
    assert [s.generated_ids for s in client.steps] == [TOKENS[:i] for i in range(len(TOKENS))]
    assert all(s.prompt_ids == (PROMPT if i else ()) for i, s in enumerate(client.steps))
    assert [(c["index"], c["token_id"], c["text"]) for c in chunks] == [
        (i, t, chr(ord("a") + i)) for i, t in enumerate(TOKENS)]
    out = decode_tensors(reply["outputs"])
    assert out["token_ids"].tolist() == list(TOKENS) and reply["chunks"] == len(TOKENS)
    assert out["text"][0] == b"abcde" and out["finish_reason"][0] == b"length"
    assert out["prompt_tokens"][0] == len(PROMPT) and out["completion_tokens"][0] == len(TOKENS)


async def test_a_hand_off_leaves_at_the_next_token_boundary() -> None:
    client, chunks = _Client(), []
    client.gate = asyncio.Event()
    target = _target(client, chunks)
    run = asyncio.ensure_future(target.infer([_pending("q1")], 10.0))
    await asyncio.wait_for(client.entered.wait(), 5.0)
    assert await target.hand_off(("q1", "other")) == 1  # only q1 runs here
    client.gate.set()
    (reply,) = await asyncio.wait_for(run, 5.0)
    moved = from_payload(InferHandedOff, reply, method="infer")
    assert moved.chunks == 1 and len(chunks) == 1  # the step under way finished first
    assert moved.handed_off == SequenceHandOff(prompt_ids=PROMPT, generated_ids=TOKENS[:1],
                                               emitted_text="a", rng_state=None, chunks=1)
    assert await target.hand_off(("q1",)) == 0  # gone


async def test_a_resumed_sequence_goes_on_from_its_hand_off() -> None:
    client, chunks = _Client(), []
    wire = to_payload(SequenceHandOff(prompt_ids=PROMPT, generated_ids=TOKENS[:2],
                                      emitted_text="ab", chunks=2))
    (reply,) = await _target(client, chunks).infer([_pending("q1", resume=wire)], 10.0)
    assert client.steps[0].generated_ids == TOKENS[:2] and client.steps[0].prompt_ids == PROMPT
    assert [c["index"] for c in chunks] == [2, 3, 4]
    assert decode_tensors(reply["outputs"])["token_ids"].tolist() == list(TOKENS)


async def test_a_lost_stage_fails_the_request_with_its_error() -> None:
    client, chunks = _Client(fail_at=2), []
    (reply,) = await _target(client, chunks).infer([_pending("q1")], 10.0)
    assert reply["error"]["code"] == PeerLost("x").code and len(chunks) == 2


async def test_a_non_streamed_generation_finishes_in_the_pipeline() -> None:
    client, chunks = _Client(), []
    client.gate = asyncio.Event()
    target = _target(client, chunks)
    p = _pending("q1")
    p.payload.pop("stream")
    run = asyncio.ensure_future(target.infer([p], 10.0))
    await asyncio.wait_for(client.entered.wait(), 5.0)
    assert await target.hand_off(("q1",)) == 0
    client.gate.set()
    (reply,) = await asyncio.wait_for(run, 5.0)
    assert decode_tensors(reply["outputs"])["token_ids"].tolist() == list(TOKENS)
    assert not chunks  # nothing streamed
