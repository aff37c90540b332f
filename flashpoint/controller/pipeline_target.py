"""A partitioned replica group as one dispatch target of the controller.

The controller sends a worker one RPC frame per batch of requests; a group is reached
instead through a :class:`~flashpoint.pipeline.client.PipelineClient` connected to its first
stage. :class:`PipelineTarget` gives the group the worker handle's shape (``infer`` over the
queued requests' payloads, one reply or wire error per request; ``conn.close()``), so the
dispatcher's credits, retries and deadlines apply to it unchanged. Requests go into the
pipeline one by one and overlap across its stages.

A text-generation model's group (``generates``, issue 21 item 6) runs each request's token
loop here: one pipeline request per token step (:mod:`flashpoint.messages.pipeline_generation`;
the stages recompute the sequence each step and keep nothing between steps), each token
relayed to the request's stream as the worker's ``gen_chunk`` would be. When the group
stops taking work (its stages completed into whole replicas) the controller's
:class:`~flashpoint.controller.migration.Migrator` asks it to :meth:`PipelineTarget.hand_off`
its streamed sequences: each leaves at its next token boundary with the
:class:`~flashpoint.messages.migration.SequenceHandOff` a worker would give, and goes on on a
whole replica (item 5's resume), so no token is lost or repeated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashpoint.errors import FlashpointError, ProtocolError
from flashpoint.log import get_logger
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.gateway_controller import StreamChunkNote
from flashpoint.messages.migration import SequenceHandOff
from flashpoint.messages.pipeline_generation import PipelineStep, StepResult, decode, encode
from flashpoint.pipeline.client import PipelineClient
from flashpoint.tensors import decode_tensors, encode_tensors

log = get_logger("flashpoint.controller.pipeline_target")


@dataclass
class PipelineTarget:
    """Requests into a group's pipeline; ``conn`` is its client (closed on forget)."""

    conn: PipelineClient
    host_id: str  # the first stage's host
    output_names: Sequence[str]
    timings_s: dict[str, float] = field(default_factory=dict)
    source: str = "pipeline"
    # Called once, at the group's first answer (any answer: an error is one too); the
    # controller then lets the stages' hosts complete the model (stage_hold.py).
    on_first_answer: Callable[[], None] | None = None
    # A text-generation model: requests run token loops (see the module docstring), their
    # chunks go to ``on_chunk(conn, StreamChunkNote payload)`` (the stream registry's).
    generates: bool = False
    on_chunk: Callable[[Any, dict[str, Any]], Awaitable[None]] | None = None
    _leaving: dict[str, bool] = field(default_factory=dict)  # stream's id -> hand-off asked

    async def infer(self, ps: Sequence[Any], timeout_s: float) -> list[dict[str, Any]]:
        """One reply per request: ``outputs``, or ``error`` in wire form (retryable errors
        such as a lost stage come back as errors; the controller retries those); a
        generation handed off answers ``handed_off`` (an ``InferHandedOff`` payload)."""
        if self.generates:
            return list(await asyncio.gather(*(self._generate(p, timeout_s) for p in ps)))
        replies = list(await asyncio.gather(*(self._one(p.payload, timeout_s) for p in ps)))
        self._answered()
        return replies

    def _answered(self) -> None:
        if self.on_first_answer is not None:
            call, self.on_first_answer = self.on_first_answer, None
            call()

    async def hand_off(self, request_ids: Sequence[str]) -> int:
        """Take these streamed sequences out at their next token boundary (live migration:
        each one's ``infer`` answers ``handed_off``); how many run here."""
        here = [r for r in request_ids if r in self._leaving]
        for r in here:
            self._leaving[r] = True
        return len(here)

    async def _generate(self, p: Any, timeout_s: float) -> dict[str, Any]:
        """``p``'s token loop through the pipeline: one step per token, each token relayed
        to its stream at once; its answer as a replica's (``TextGeneration.finish``)."""
        payload = p.payload
        rid = p.request_id
        stream = bool(payload.get("stream"))
        deadline = time.monotonic() + timeout_s
        prompt: tuple[int, ...] = ()
        generated: tuple[int, ...] = ()
        emitted, rng, index = "", None, 0
        try:
            if (resume := payload.get("resume")) is not None:  # a sequence moved here
                moved = from_payload(SequenceHandOff, resume, method="infer")
                prompt, generated, emitted = moved.prompt_ids, moved.generated_ids, \
                    moved.emitted_text
                rng, index = moved.rng_state, moved.chunks
        except ProtocolError as exc:
            return {"error": exc.to_wire()}
        if stream:  # only streams move (a non-streamed generation finishes here)
            self._leaving[rid] = False
        started, first_index = time.perf_counter(), index
        first_token_s = 0.0
        try:
            while True:
                if self._leaving.get(rid) and generated:
                    hand_off = SequenceHandOff(prompt_ids=prompt, generated_ids=generated,
                                               emitted_text=emitted, rng_state=rng,
                                               chunks=index)
                    log.info("pipeline_sequence_leaving", request_id=rid,
                             tokens=len(generated), chunks=index)
                    return {"handed_off": to_payload(hand_off), "chunks": index}
                step = PipelineStep(inputs=payload["inputs"], prompt_ids=prompt,
                                    generated_ids=generated, emitted_text=emitted,
                                    rng_state=rng)
                cell = np.empty(1, dtype=object)
                cell[0] = encode(step)
                outs = await self.conn.infer_outputs(
                    {"step": cell}, timeout_s=max(0.001, deadline - time.monotonic()))
                # The first token releases the stages' held completion (stage_hold.py): a
                # generation may run for long, and the whole replicas are what it moves to.
                self._answered()
                result = decode(StepResult, outs[0])
                if not first_token_s:
                    first_token_s = time.perf_counter() - started
                prompt, generated = result.prompt_ids, result.generated_ids
                emitted, rng = result.emitted_text, result.rng_state
                if stream and self.on_chunk is not None:
                    await self.on_chunk(self.conn, to_payload(StreamChunkNote(
                        request_id=rid, index=index, text=result.text_delta,
                        token_id=result.token_id)))
                index += 1
                if result.finish:
                    break
        except FlashpointError as exc:
            self._answered()
            return {"error": exc.to_wire()}
        finally:
            self._leaving.pop(rid, None)
        outputs = {
            "text": np.array([result.text.encode()], dtype=object),
            "token_ids": np.array(generated, dtype=np.int64),
            "finish_reason": np.array([result.finish.encode()], dtype=object),
            "prompt_tokens": np.array([len(prompt)], dtype=np.int64),
            "completion_tokens": np.array([len(generated)], dtype=np.int64),
        }
        return {"outputs": encode_tensors(outputs), "chunks": index,
                "timings_s": {"inference": time.perf_counter() - started,
                              "pipeline_first_token": first_token_s,
                              "pipeline_tokens": float(index - first_index)}}

    async def _one(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            outs = await self.conn.infer_outputs(decode_tensors(payload["inputs"]),
                                                 timeout_s=timeout_s)
        except FlashpointError as exc:
            return {"error": exc.to_wire()}
        names = list(self.output_names) or [f"output_{i}" for i in range(len(outs))]
        if len(names) != len(outs):
            names = [f"output_{i}" for i in range(len(outs))]
        return {"outputs": encode_tensors(dict(zip(names, outs, strict=True)))}
