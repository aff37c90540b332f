"""A streamed request that moves between replicas (live migration, gateway/streams.py):
chunks of both connections count and come out in index order even when the source's last
ones arrive after the destination's first; a third connection cannot write into it; the
gap between the source's last chunk and the destination's first is in the result."""

from __future__ import annotations

import asyncio

import numpy as np

from flashpoint.gateway.backend import InvokeResult, StreamChunk
from flashpoint.gateway.streams import StreamRegistry, stream_invocation


async def test_chunks_of_both_replicas_in_order_and_the_gap() -> None:
    reg = StreamRegistry()
    source, dest, stranger = object(), object(), object()
    release = asyncio.Event()
    gaps: list[float] = []

    async def invoke() -> InvokeResult:
        reg.sent("r", source)
        await reg.on_chunk(source, {"request_id": "r", "index": 0, "text": "a", "token_id": 1})
        reg.moved("r", 2)  # the source says it sent two chunks
        reg.sent("r", dest)
        await reg.on_chunk(dest, {"request_id": "r", "index": 2, "text": "c", "token_id": 3})
        await reg.on_chunk(stranger, {"request_id": "r", "index": 3, "text": "x",
                                      "token_id": 9})
        await release.wait()
        # the source's last chunk overtaken by the destination's first (and its reply)
        await reg.on_chunk(source, {"request_id": "r", "index": 1, "text": "b", "token_id": 2})
        return InvokeResult({"completion_tokens": np.array([3])}, {"total": 1.0}, "r2")

    items: list[StreamChunk | InvokeResult] = []
    async with asyncio.timeout(10):
        stream = stream_invocation(reg, "r", invoke, on_gap=gaps.append)
        first = await anext(stream)
        items.append(first)
        release.set()
        items += [i async for i in stream]
    chunks = [i for i in items if isinstance(i, StreamChunk)]
    assert [(c.index, c.text) for c in chunks] == [(0, "a"), (1, "b"), (2, "c")]
    result = items[-1]
    assert isinstance(result, InvokeResult)
    assert result.timings_s["migrations"] == 1.0
    # chunk 1 (the source's last) was handled after chunk 2 (the destination's first): no gap
    assert gaps == [result.timings_s["migration_gap"]] == [0.0]
    assert reg.chunks("r") == 0  # closed


async def test_no_move_no_gap() -> None:
    reg = StreamRegistry()
    conn = object()

    async def invoke() -> InvokeResult:
        reg.sent("r", conn)
        await reg.on_chunk(conn, {"request_id": "r", "index": 0, "text": "a", "token_id": 1})
        assert reg.chunks("r") == 1
        return InvokeResult({"completion_tokens": np.array([1])}, {}, "r1")

    async with asyncio.timeout(10):
        items = [i async for i in stream_invocation(reg, "r", invoke)]
    assert "migration_gap" not in items[-1].timings_s and "migrations" not in items[-1].timings_s


async def test_gap_from_the_source_last_chunk_to_the_destination_first() -> None:
    reg = StreamRegistry()
    source, dest = object(), object()
    gaps: list[float] = []

    async def invoke() -> InvokeResult:
        reg.sent("r", source)
        await reg.on_chunk(source, {"request_id": "r", "index": 0, "text": "a", "token_id": 1})
        reg.moved("r", 1)
        reg.sent("r", dest)
        await asyncio.sleep(0.05)  # the move takes time: that time is the gap
        await reg.on_chunk(dest, {"request_id": "r", "index": 1, "text": "b", "token_id": 2})
        return InvokeResult({"completion_tokens": np.array([2])}, {}, "r2")

    async with asyncio.timeout(10):
        items = [i async for i in stream_invocation(reg, "r", invoke, on_gap=gaps.append)]
    assert len(gaps) == 1 and 0.05 <= gaps[0] < 5.0
    assert items[-1].timings_s["migration_gap"] == gaps[0]
