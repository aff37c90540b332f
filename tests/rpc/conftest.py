"""Fixtures for RPC tests: a harness that runs servers and clients over WebSockets on
127.0.0.1 (ephemeral ports) or over an in-process hub, and checks for leaked tasks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from flashpoint.rpc import InprocHub, RpcConnection, RpcServer, connect

SECRET = b"test-cluster-secret"


class Harness:
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.hub = InprocHub()
        self.servers: list[RpcServer] = []
        self.conns: list[RpcConnection] = []
        self._n = 0

    async def serve(
        self, handlers: Mapping[str, Any], *, port: int = 0, name: str | None = None, **kw: Any
    ) -> tuple[RpcServer, str]:
        kw.setdefault("secret", SECRET)
        self._n += 1
        name = name or f"server{self._n}"
        server = RpcServer(handlers, name=name, **kw)
        self.servers.append(server)
        if self.transport == "ws":
            host, bound = await server.start("127.0.0.1", port)
            return server, f"ws://{host}:{bound}/rpc"
        self.hub.register(name, server)
        return server, f"inproc://{name}"

    async def connect(self, url: str, handlers: Mapping[str, Any] | None = None, **kw: Any) -> RpcConnection:
        kw.setdefault("secret", SECRET)
        conn = await connect(url, handlers, hub=self.hub, **kw)
        self.conns.append(conn)
        return conn

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()
        for server in self.servers:
            await server.stop(timeout_s=5.0)


def leaked_rpc_tasks() -> list[asyncio.Task[Any]]:
    me = asyncio.current_task()
    return [
        t for t in asyncio.all_tasks() if t is not me and not t.done() and t.get_name().startswith("rpc-")
    ]


async def assert_no_leaks(timeout_s: float = 2.0) -> None:
    """Wait (bounded) for rpc tasks to finish; report the ones left."""
    try:
        async with asyncio.timeout(timeout_s):
            while leaked_rpc_tasks():
                await asyncio.sleep(0.01)
    except TimeoutError:
        names = [t.get_name() for t in leaked_rpc_tasks()]
        raise AssertionError(f"rpc tasks still running: {names}") from None


@pytest.fixture(params=["ws", "inproc"])
async def rpc(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    harness = Harness(request.param)
    try:
        yield harness
    finally:
        await harness.close()
    await assert_no_leaks()
