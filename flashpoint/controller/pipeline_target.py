"""A partitioned replica group as one dispatch target of the controller.

The controller sends a worker one RPC frame per batch of requests; a group is reached
instead through a :class:`~flashpoint.pipeline.client.PipelineClient` connected to its first
stage. :class:`PipelineTarget` gives the group the worker handle's shape (``infer`` over the
queued requests' payloads, one reply or wire error per request; ``conn.close()``), so the
dispatcher's credits, retries and deadlines apply to it unchanged. Requests go into the
pipeline one by one and overlap across its stages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashpoint.errors import FlashpointError
from flashpoint.pipeline.client import PipelineClient
from flashpoint.tensors import decode_tensors, encode_tensors


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

    async def infer(self, ps: Sequence[Any], timeout_s: float) -> list[dict[str, Any]]:
        """One reply per request: ``outputs``, or ``error`` in wire form (retryable errors
        such as a lost stage come back as errors; the controller retries those)."""
        replies = list(await asyncio.gather(*(self._one(p.payload, timeout_s) for p in ps)))
        if self.on_first_answer is not None:
            call, self.on_first_answer = self.on_first_answer, None
            call()
        return replies

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
