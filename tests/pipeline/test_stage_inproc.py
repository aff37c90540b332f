"""StageServers in one event loop: ordering and overlap, typed failures, timeouts, auth."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import torch

from flashpoint.errors import AuthFailed, ConnectFailed, DeadlineExceeded, ModelFailed, PeerLost
from flashpoint.pipeline.client import PipelineClient
from flashpoint.pipeline.frames import HEAD
from flashpoint.pipeline.stage import StageServer
from flashpoint.transfer.plan import Endpoint
from flashpoint.transfer.wire import DataConn

from .conftest import SECRET, assert_one_at_a_time, pipe_tasks


class Servers:
    def __init__(self) -> None:
        self.started: list[StageServer] = []

    async def add(self, module: Callable[..., Any], *, next_hop: Endpoint | None = None,
                  stage_id: str = "s", secret: bytes = SECRET, port: int = 0,
                  **kw: Any) -> StageServer:
        server = StageServer(module, host="127.0.0.1", port=port, secret=secret, next_hop=next_hop,
                             stage_id=stage_id, **kw)
        await server.start()
        self.started.append(server)
        return server


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        for server in s.started:
            await server.stop()
    await asyncio.sleep(0)
    assert pipe_tasks() == []


def sleeper(delay_s: float, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def run(x: torch.Tensor) -> torch.Tensor:
        time.sleep(delay_s)
        return fn(x)
    return run


async def test_stages_take_one_request_at_a_time_and_overlap(servers: Servers):
    b = await servers.add(sleeper(0.15, lambda x: x * 2), stage_id="b")
    a = await servers.add(sleeper(0.15, lambda x: x + 1), next_hop=b.endpoint, stage_id="a")
    async with PipelineClient(a.endpoint, SECRET, timeout_s=10) as client:
        xs = [np.full((2, 3), i, dtype=np.float32) for i in range(4)]
        outs = await asyncio.gather(*(client.infer({"x": x}, trace_id=100 + i)
                                      for i, x in enumerate(xs)))
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out, (x + 1) * 2)
    assert [r.outcome for r in a.records] == ["forwarded"] * 4
    assert [r.outcome for r in b.records] == ["returned"] * 4
    assert_one_at_a_time(a.records, "a")
    assert_one_at_a_time(b.records, "b")
    # pipelining: b worked on request n while a was already computing request n+1
    a_by_start = sorted(a.records, key=lambda r: r.started_s)
    b_by_trace = {r.trace_id: r for r in b.records}
    overlaps = [b_by_trace[r.trace_id].started_s < nxt.computed_s
                for r, nxt in zip(a_by_start, a_by_start[1:], strict=False)]
    assert any(overlaps), (a.records, b.records)


async def test_model_failure_is_typed_and_the_stage_keeps_serving(servers: Servers):
    def module(x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) < 0:
            raise ValueError("negative input")
        return x * 3
    last = await servers.add(module, stage_id="last")
    first = await servers.add(lambda x: x, next_hop=last.endpoint, stage_id="first")
    async with PipelineClient(first.endpoint, SECRET, timeout_s=10) as client:
        with pytest.raises(ModelFailed, match="negative input"):
            await client.infer({"x": -np.ones(3, dtype=np.float32)})
        np.testing.assert_array_equal(await client.infer({"x": np.ones(3, dtype=np.float32)}), [3, 3, 3])
    assert [r.outcome for r in last.records] == ["failed", "returned"]


async def test_bf16_activations_and_multiple_outputs(servers: Servers):
    last = await servers.add(lambda h: (h.float() * 2, h.shape[0] * torch.ones(1, dtype=torch.int64)),
                             stage_id="last")
    first = await servers.add(lambda x: x.to(torch.bfloat16), next_hop=last.endpoint, stage_id="first")
    x = np.array([1.0, 1.00390625, 3.14159], dtype=np.float32)
    async with PipelineClient(first.endpoint, SECRET, timeout_s=10) as client:
        doubled, n = await client.infer_outputs({"x": x})
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy() * 2
    np.testing.assert_array_equal(doubled, want)
    np.testing.assert_array_equal(n, [3])


async def test_a_hung_stage_is_a_deadline_not_a_hang(servers: Servers):
    release = threading.Event()

    def module(x: torch.Tensor) -> torch.Tensor:
        release.wait(10)
        return x
    stage = await servers.add(module)
    try:
        async with PipelineClient(stage.endpoint, SECRET, timeout_s=0.5) as client:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await client.infer({"x": np.zeros(2, dtype=np.float32)})
            assert time.monotonic() - t0 < 2.0
    finally:
        release.set()


async def test_unreachable_next_stage_is_peer_lost(servers: Servers):
    dead = Endpoint("gone", "127.0.0.1", 1)
    first = await servers.add(lambda x: x, next_hop=dead, stage_id="first", connect_timeout_s=2)
    async with PipelineClient(first.endpoint, SECRET, timeout_s=10) as client:
        with pytest.raises(PeerLost, match="next stage gone lost"):
            await client.infer({"x": np.zeros(2, dtype=np.float32)})


async def test_a_stopped_next_stage_fails_requests_in_flight(servers: Servers):
    entered, release = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        entered.set()
        release.wait(10)
        return x
    last = await servers.add(slow, stage_id="last")
    first = await servers.add(lambda x: x, next_hop=last.endpoint, stage_id="first")
    try:
        async with PipelineClient(first.endpoint, SECRET, timeout_s=10) as client:
            calls = [asyncio.create_task(client.infer({"x": np.zeros(2, dtype=np.float32)}))
                     for _ in range(3)]
            await asyncio.to_thread(entered.wait, 5)
            t0 = time.monotonic()
            await last.stop()
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert time.monotonic() - t0 < 3.0
        assert all(isinstance(r, PeerLost) for r in results), results
    finally:
        release.set()


async def test_peers_without_the_secret_are_refused(servers: Servers):
    last = await servers.add(lambda x: x, stage_id="last")
    # a client with the wrong secret
    async with PipelineClient(last.endpoint, b"wrong", timeout_s=5) as client:
        with pytest.raises(AuthFailed):
            await client.infer({"x": np.zeros(2, dtype=np.float32)})
    # a stage whose next hop does not share its secret: the client learns why
    first = await servers.add(lambda x: x, next_hop=last.endpoint, stage_id="first", secret=b"other")
    async with PipelineClient(first.endpoint, b"other", timeout_s=5) as client:
        with pytest.raises(AuthFailed, match="next stage last"):
            await client.infer({"x": np.zeros(2, dtype=np.float32)})
    assert not last.records  # nothing reached the stage


async def test_a_malformed_frame_closes_only_its_connection(servers: Servers):
    stage = await servers.add(lambda x: x + 1)
    conn = await DataConn.connect(stage.endpoint, SECRET, name="bad", timeout_s=5)
    try:
        await conn.sendall(b"FPD1" + bytes(HEAD.size - 4), 5)
        with pytest.raises(PeerLost):
            await conn.recv_exact(1, 5)
    finally:
        conn.close()
    async with PipelineClient(stage.endpoint, SECRET, timeout_s=5) as client:
        np.testing.assert_array_equal(await client.infer({"x": np.zeros(2, dtype=np.float32)}), [1, 1])


async def test_client_reconnects_after_its_first_stage_restarts(servers: Servers):
    stage = await servers.add(lambda x: x + 1)
    port = stage.endpoint.port
    async with PipelineClient(stage.endpoint, SECRET, timeout_s=5) as client:
        assert (await client.infer({"x": np.zeros(1, dtype=np.float32)}))[0] == 1
        await stage.stop()
        with pytest.raises((PeerLost, ConnectFailed)):
            await client.infer({"x": np.zeros(1, dtype=np.float32)})
        await servers.add(lambda x: x + 2, port=port)
        assert (await client.infer({"x": np.zeros(1, dtype=np.float32)}))[0] == 2
