"""Streamed generation requests: token chunks relayed hop by hop to the HTTP client.

A streamed request is an ordinary invocation (queue, dispatch, retries, deadline) whose
payload says ``stream``; the worker answers it with ``gen_chunk`` notifications -- one per
token boundary, numbered from 0 -- before its reply, which holds the whole answer. The
controller relays them (:func:`stream_invocation` over a :class:`StreamRegistry`); so does a
stand-alone gateway, which gets them from the controller's ``gw_stream`` as ``gw_chunk``
notifications of the same shape (``request_id``, ``index``, ``text``, ``token_id``).

A chunk counts only from the connection its request was sent to (a worker cannot write into
another's stream). Notifications are handled as tasks of their own, so the reply may
overtake the last few: the stream waits for every chunk up to ``completion_tokens`` before
its final item, within ``STRAGGLER_WAIT_S``. Closing the stream early (the HTTP client went
away) cancels the invocation, and with it the call to the next hop, which in the worker
cancels the sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from flashpoint.errors import ProtocolError
from flashpoint.gateway.backend import InvokeResult, StreamChunk
from flashpoint.log import get_logger
from flashpoint.messages.base import from_payload
from flashpoint.messages.gateway_controller import StreamChunkNote

log = get_logger("flashpoint.gateway.streams")

STRAGGLER_WAIT_S = 5.0
_END = object()


@dataclass(eq=False)
class _Sink:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    conn: Any = None  # the worker connection the request went to, once sent
    chunks: int = 0  # received so far


class StreamRegistry:
    """Open streams by request id (see the module docstring)."""

    def __init__(self) -> None:
        self._sinks: dict[str, _Sink] = {}

    def open(self, request_id: str) -> _Sink:
        sink = self._sinks[request_id] = _Sink()
        return sink

    def close(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def relayed(self, request_id: str) -> bool:
        """Whether a chunk of it came back already (it may no longer be re-sent: its
        client has tokens of that attempt)."""
        sink = self._sinks.get(request_id)
        return sink is not None and sink.chunks > 0

    def sent(self, request_id: str, conn: Any) -> None:
        """The request went out on ``conn``: its chunks come from there."""
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.conn = conn

    async def on_chunk(self, conn: Any, payload: Any) -> None:
        """The ``gen_chunk`` / ``gw_chunk`` notification handler (a StreamChunkNote). A
        notification has no answer to carry an error: a malformed one is logged and dropped."""
        try:
            note = from_payload(StreamChunkNote, payload, method="gen_chunk")
        except ProtocolError as exc:
            log.warning("gen_chunk_malformed", error=exc.message)
            return
        sink = self._sinks.get(note.request_id)
        if sink is None:
            return  # its caller already left
        if sink.conn is not conn:
            log.warning("gen_chunk_from_another_connection", request_id=note.request_id)
            return
        sink.chunks += 1
        sink.queue.put_nowait(StreamChunk(note.index, note.text, note.token_id))


async def stream_invocation(
    registry: StreamRegistry, request_id: str,
    invoke: Callable[[], Awaitable[InvokeResult]],
) -> AsyncIterator[StreamChunk | InvokeResult]:
    """Run ``invoke()`` (a streamed invocation of ``request_id``) and yield its chunks in
    order, then its :class:`InvokeResult`; closing the iterator early cancels it.
    ``invoke`` calls :meth:`StreamRegistry.sent` with the connection it sends on."""
    sink = registry.open(request_id)
    task = asyncio.ensure_future(invoke())
    task.add_done_callback(lambda _: sink.queue.put_nowait(_END))
    try:
        expected = 0
        early: dict[int, StreamChunk] = {}
        while True:
            item = await sink.queue.get()
            if item is _END:
                break
            early[item.index] = item
            while expected in early:
                yield early.pop(expected)
                expected += 1
        result = task.result()  # its error, if it failed
        total = int(result.outputs["completion_tokens"].reshape(-1)[0]) \
            if "completion_tokens" in result.outputs else expected
        async with asyncio.timeout(STRAGGLER_WAIT_S):
            while expected < total:
                if expected in early:
                    yield early.pop(expected)
                    expected += 1
                    continue
                item = await sink.queue.get()
                early[item.index] = item
        yield result
    finally:
        registry.close(request_id)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
