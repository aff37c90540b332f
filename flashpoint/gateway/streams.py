"""Streamed generation requests: token chunks relayed hop by hop to the HTTP client.

A streamed request is an ordinary invocation (queue, dispatch, retries, deadline) whose
payload says ``stream``; the worker answers it with ``gen_chunk`` notifications -- one per
token boundary, numbered from 0 -- before its reply, which holds the whole answer. The
controller relays them (:func:`stream_invocation` over a :class:`StreamRegistry`); so does a
stand-alone gateway, which gets them from the controller's ``gw_stream`` as ``gw_chunk``
notifications of the same shape (``request_id``, ``index``, ``text``, ``token_id``).

A chunk counts only from a connection its request was sent to (a worker cannot write into
another's stream). A sequence that moves to another replica mid-stream (live migration,
``controller/migration.py``) was sent on two: the destination numbers its chunks on from
where the source stopped, and the source's last chunks may still arrive after the
destination's first, so both count and the stream orders them by index. The time between
the source's last chunk and the destination's first is the move's **gap**, in the result's
``timings_s`` as ``migration_gap`` (the longest, when it moved more than once) with
``migrations``, the number of moves, and ``migrated_at``, the index of the first chunk after
the last move. Notifications are handled as tasks of their own, so the reply may
overtake the last few: the stream waits for every chunk up to ``completion_tokens`` before
its final item, within ``STRAGGLER_WAIT_S``. Closing the stream early (the HTTP client went
away) cancels the invocation, and with it the call to the next hop, which in the worker
cancels the sequence.
"""

from __future__ import annotations

import asyncio
import time
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
    conns: list[Any] = field(default_factory=list)  # the connections it was sent on
    chunks: int = 0  # received so far
    arrived_s: dict[int, float] = field(default_factory=dict)  # chunk index -> when (monotonic)
    moved_at: list[int] = field(default_factory=list)  # first chunk index after each move

    def gaps_s(self) -> list[float]:
        """Per move: from the last chunk before it to the first after it (both arrived; 0
        when the source's last chunk was handled after the destination's first)."""
        return [max(0.0, self.arrived_s[i] - self.arrived_s[i - 1]) for i in self.moved_at
                if i in self.arrived_s and i - 1 in self.arrived_s]


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
        if sink is not None and not any(c is conn for c in sink.conns):
            sink.conns.append(conn)

    def chunks(self, request_id: str) -> int:
        """Chunks of ``request_id`` received so far (0 once closed)."""
        sink = self._sinks.get(request_id)
        return sink.chunks if sink is not None else 0

    def moved(self, request_id: str, next_index: int) -> None:
        """The request left one replica for another; its chunks go on from
        ``next_index`` (for the gap)."""
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.moved_at.append(next_index)

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
        if not any(c is conn for c in sink.conns):
            log.warning("gen_chunk_from_another_connection", request_id=note.request_id)
            return
        sink.chunks += 1
        sink.arrived_s[note.index] = time.monotonic()
        sink.queue.put_nowait(StreamChunk(note.index, note.text, note.token_id))


async def stream_invocation(
    registry: StreamRegistry, request_id: str,
    invoke: Callable[[], Awaitable[InvokeResult]],
    on_gap: Callable[[float], None] | None = None,
) -> AsyncIterator[StreamChunk | InvokeResult]:
    """Run ``invoke()`` (a streamed invocation of ``request_id``) and yield its chunks in
    order, then its :class:`InvokeResult`; closing the iterator early cancels it.
    ``invoke`` calls :meth:`StreamRegistry.sent` with the connection it sends on.
    ``on_gap`` gets each migration gap of the stream, in seconds (a metric)."""
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
        if sink.moved_at:
            gaps = sink.gaps_s()
            result.timings_s["migrations"] = float(len(sink.moved_at))
            result.timings_s["migrated_at"] = float(sink.moved_at[-1])  # a chunk index
            if gaps:
                result.timings_s["migration_gap"] = max(gaps)
            for gap in gaps if on_gap is not None else ():
                on_gap(gap)
        yield result
    finally:
        registry.close(request_id)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
