"""PipelineClient: send requests into a stage pipeline and await their results.

One authenticated connection to the first stage (opened on first use, reopened after it is
lost), shared by any number of concurrent :meth:`PipelineClient.infer` calls: each request
gets a link-local request id, and a reader task matches RESULT and ERROR frames back to
the waiting calls (replies may come back in any order). Results come back along the
pipeline's own links (see :mod:`flashpoint.pipeline.stage`), so the client needs no
listening port.

Every call has a total deadline (``timeout_s``: DeadlineExceeded) and every socket wait its
own bound. A lost stage reaches the caller as a typed error: the stage before it turns the
lost link into PeerLost for every request it had forwarded, and a lost first stage is
PeerLost for every call waiting on that connection. A cancelled or timed-out send closes the
connection (its stream position is unknown), which fails the other calls on it with
PeerLost too; they are safe to retry (inference is idempotent).

Imports numpy only (no torch).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flashpoint.errors import (
    BadRequest,
    DeadlineExceeded,
    FlashpointError,
    PeerLost,
    ProtocolError,
    Unavailable,
)
from flashpoint.pipeline.frames import MAX_FRAME_BYTES, DType, Frame, FrameKind, encode_frame
from flashpoint.pipeline.link import ActivationLink
from flashpoint.tensors import bf16_to_f32
from flashpoint.transfer.plan import Endpoint

U64_MASK = (1 << 64) - 1


class PipelineClient:
    """Requests into the pipeline whose first stage listens at ``first_stage``."""

    def __init__(
        self,
        first_stage: Endpoint,
        secret: bytes,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 10.0,
        idle_timeout_s: float = 3600.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        input_names: Sequence[str] | None = None,
        name: str = "pipeline-client",
    ) -> None:
        self.first_stage = first_stage
        self.secret = secret
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.input_names = list(input_names) if input_names is not None else None
        self.name = name
        self._link: ActivationLink | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._pending: dict[int, tuple[asyncio.Future[Frame], ActivationLink]] = {}
        self._next_id = 0
        self._closed = False

    async def __aenter__(self) -> PipelineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- calls -----------------------------------------------------------------------------

    async def infer(self, inputs: Mapping[str, np.ndarray], *, timeout_s: float | None = None,
                    trace_id: int | None = None) -> np.ndarray:
        """The output of a pipeline whose last stage returns one tensor."""
        outs = await self.infer_outputs(inputs, timeout_s=timeout_s, trace_id=trace_id)
        if len(outs) != 1:
            raise BadRequest(f"the pipeline returned {len(outs)} outputs; use infer_outputs")
        return outs[0]

    async def infer_outputs(self, inputs: Mapping[str, np.ndarray], *,
                            timeout_s: float | None = None,
                            trace_id: int | None = None) -> list[np.ndarray]:
        """Every output tensor of the last stage, in order (BF16 widened to float32).

        Inputs go to the first stage in ``input_names`` order when given, else in the
        mapping's order. ``trace_id`` (default: random) follows the request through every
        stage's logs and records."""
        arrays = self._ordered(inputs)
        tid = secrets.randbits(63) if trace_id is None else trace_id & U64_MASK
        budget_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(budget_s):
                frame = await self._call(arrays, tid)
        except TimeoutError:
            raise DeadlineExceeded(f"pipeline request {tid:x}: no reply within {budget_s}s",
                                   trace_id=tid, stage=self.first_stage.host_id) from None
        out = []
        for head, arr in zip(frame.table, frame.tensors_numpy(), strict=True):
            out.append(bf16_to_f32(arr) if head.dtype is DType.BFLOAT16 else arr)
        return out

    def _ordered(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if not inputs:
            raise BadRequest("a pipeline request needs at least one input")
        if self.input_names is None:
            return [np.asarray(a) for a in inputs.values()]
        if set(inputs) != set(self.input_names):
            raise BadRequest(f"inputs {sorted(inputs)} do not match {self.input_names}")
        return [np.asarray(inputs[n]) for n in self.input_names]

    async def _call(self, arrays: list[np.ndarray], trace_id: int) -> Frame:
        link = await self._ensure_link()
        self._next_id = (self._next_id + 1) & U64_MASK
        rid = self._next_id
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, link)
        try:
            await link.send(encode_frame(FrameKind.REQUEST, rid, trace_id, arrays),
                            self.io_timeout_s)
            return await fut
        finally:
            self._pending.pop(rid, None)

    # -- the connection ----------------------------------------------------------------------

    async def _ensure_link(self) -> ActivationLink:
        async with self._connect_lock:
            if self._closed:
                raise Unavailable("pipeline client is closed")
            link = self._link
            if link is not None and not link.closed:
                return link
            link = await ActivationLink.connect(
                self.first_stage, self.secret, name=self.name, timeout_s=self.connect_timeout_s,
                max_frame_bytes=self.max_frame_bytes)
            self._link = link
            self._reader = asyncio.create_task(self._read(link), name=f"pipe-client-{self.name}")
            return link

    async def _read(self, link: ActivationLink) -> None:
        """Match replies to calls; when the link dies, fail every call still waiting on it."""
        error: FlashpointError | None = None
        try:
            while True:
                frame = await link.recv(self.idle_timeout_s, self.io_timeout_s)
                if frame.head.kind is FrameKind.REQUEST:
                    raise ProtocolError(f"first stage {self.first_stage} sent a REQUEST frame")
                entry = self._pending.get(frame.head.request_id)
                if entry is None or entry[1] is not link or entry[0].done():
                    continue  # its call has given up already
                if frame.head.kind is FrameKind.ERROR:
                    entry[0].set_exception(frame.error())
                else:
                    entry[0].set_result(frame)
        except FlashpointError as exc:
            error = exc
        finally:
            link.close()
            if self._link is link:
                self._link = None
        why = error.message if error is not None else "connection closed"
        self._fail(link, PeerLost(f"first stage {self.first_stage.host_id} lost: {why}",
                                  stage=self.first_stage.host_id,
                                  cause=error.code if error is not None else "closed"))

    def _fail(self, link: ActivationLink | None, error: FlashpointError) -> None:
        for fut, owner in list(self._pending.values()):
            if (link is None or owner is link) and not fut.done():
                fut.set_exception(error)

    async def close(self) -> None:
        """Close the connection; calls still waiting fail with Unavailable."""
        self._closed = True
        reader, self._reader = self._reader, None
        if self._link is not None:
            self._link.close()
            self._link = None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._fail(None, Unavailable("pipeline client closed"))
