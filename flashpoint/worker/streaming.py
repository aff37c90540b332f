"""A streamed generation request on the worker: tokens go back as they come.

One ``gen_chunk`` notification per token boundary to the caller (``index`` from 0), then
the reply: the whole answer and ``chunks``, how many were sent. The caller cancelling the
call (a client gone) cancels the sequence and frees its cache. Live migration: a request
with ``resume`` goes on from another replica's tokens (its chunks numbered on); one handed
off here (``hand_off``) answers :class:`~flashpoint.messages.migration.InferHandedOff`. A
resumed request's timings carry ``resume_prefill`` (its pass here, inside the gap) and, when
it went on from a prefix parked ahead (multi-round), ``park_prefill`` (that prefill's pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from flashpoint.messages import controller_worker as cw
from flashpoint.messages.base import to_payload
from flashpoint.messages.migration import InferHandedOff
from flashpoint.tensors import encode_tensors


async def serve_stream(conn: Any, msg: cw.InferRequest, request: Any, loop: Any,
                       finish: Callable[[Any], dict[str, np.ndarray]]
                       ) -> cw.InferStreamReply | InferHandedOff:
    """Run ``request`` (prepared from ``msg``) on the generation ``loop``, notifying ``conn``
    of each token; ``finish`` turns the result into the answer's tensors."""
    from flashpoint.models.generate import FinishReason, GenerationResult
    from flashpoint.worker.generation import hand_off_message, resumed_request

    rid = msg.request_id
    started = time.perf_counter()
    request, index = resumed_request(
        request, None if isinstance(msg.resume, msgspec.UnsetType) else msg.resume)
    stream = loop.stream(request, key=rid)
    ids: list[int] = list(request.progress.generated_ids) if request.progress else []
    text = request.progress.emitted_text if request.progress else ""
    reason = FinishReason.LENGTH
    try:
        async for event in stream:
            if event.token_id is not None:
                ids.append(event.token_id)
            text += event.text_delta
            if event.finish is not None:
                reason = event.finish
            await conn.notify("gen_chunk", to_payload(cw.GenChunk(
                request_id=rid, index=index, text=event.text_delta,
                token_id=event.token_id)), trace=rid)
            index += 1
    finally:
        await stream.aclose()
    if stream.handed_off is not None:  # left for another replica (hand_off)
        return InferHandedOff(handed_off=hand_off_message(request, stream.handed_off, index),
                              chunks=index)
    result = GenerationResult(len(request.prompt_ids), tuple(ids), text, reason)
    timings = {"inference": time.perf_counter() - started}
    if request.progress is not None:  # resumed here: its prefill is part of the gap
        timings["resume_prefill"] = stream.prefill_s
        if stream.park_prefill_s is not None:  # went on from a parked prefix (multi-round)
            timings["park_prefill"] = stream.park_prefill_s
    return cw.InferStreamReply(outputs=encode_tensors(finish(result)), chunks=index,
                               timings_s=timings)
