"""The cluster-secret handshake: refusal before any handler runs, and mutual proof."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from flashpoint.errors import AuthFailed, ConnectFailed, PeerLost
from flashpoint.rpc import RpcConnection, RpcServer, frames, memory_pair
from flashpoint.rpc.auth import client_handshake, server_handshake

from .conftest import SECRET, Harness

pytestmark = pytest.mark.timeout(20)


async def test_wrong_secret_is_refused_before_any_handler(rpc: Harness) -> None:
    calls = 0
    connects = 0

    async def count(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {}

    def on_connect(conn: RpcConnection) -> None:
        nonlocal connects
        connects += 1

    server, url = await rpc.serve({"count": count}, on_connect=on_connect)
    with pytest.raises(AuthFailed):
        await rpc.connect(url, secret=b"not-the-cluster-secret")
    assert calls == 0
    assert connects == 0
    assert not server.connections
    good = await rpc.connect(url)
    assert await good.call("count", {}, timeout_s=2.0) == {}
    assert calls == 1 and connects == 1


async def test_client_refuses_a_server_without_the_secret() -> None:
    """Mutual proof: a rogue server that accepts any client cannot fake the WELCOME mac."""
    client_end, rogue_end = memory_pair("client", "rogue")

    async def rogue() -> None:
        await rogue_end.send(frames.encode(frames.Hello(frames.PROTOCOL_VERSION, b"n" * 32)))
        await rogue_end.recv()  # the client's proof, unchecked
        await rogue_end.send(frames.encode(frames.Welcome("rogue", b"\x00" * 32)))

    task = asyncio.create_task(rogue())
    with pytest.raises(AuthFailed, match="server does not know"):
        await client_handshake(client_end, SECRET, name="client", timeout_s=2.0)
    await task
    assert client_end.closed


async def test_handshake_round_trip_names() -> None:
    a, b = memory_pair("client", "server")
    server_sees, client_sees = await asyncio.gather(
        server_handshake(b, SECRET, name="controller", timeout_s=2.0),
        client_handshake(a, SECRET, name="host-1", timeout_s=2.0),
    )
    assert (server_sees, client_sees) == ("host-1", "controller")


async def test_silent_client_times_out_quickly() -> None:
    a, b = memory_pair("client", "server")
    started = time.monotonic()
    with pytest.raises(AuthFailed, match="timed out"):
        await server_handshake(b, SECRET, name="server", timeout_s=0.2)
    assert time.monotonic() - started < 1.0
    # the silent peer was told why
    hello = frames.decode(await a.recv())
    assert isinstance(hello, frames.Hello)
    refusal = frames.decode(await a.recv())
    assert isinstance(refusal, frames.Error) and refusal.error["code"] == "auth_failed"


async def test_silent_server_gives_connect_failed() -> None:
    a, _b = memory_pair("client", "server")
    with pytest.raises(ConnectFailed):
        await client_handshake(a, SECRET, name="client", timeout_s=0.2)


async def test_request_before_handshake_is_refused() -> None:
    a, b = memory_pair("client", "server")
    task = asyncio.create_task(server_handshake(b, SECRET, name="server", timeout_s=2.0))
    await a.recv()  # hello
    await a.send(frames.encode(frames.Request(1, "count", {}, 1.0)))
    with pytest.raises(AuthFailed):
        await task


async def test_a_client_that_leaves_mid_handshake_is_peer_lost_not_refused() -> None:
    a, b = memory_pair("client", "server")
    task = asyncio.create_task(server_handshake(b, SECRET, name="server", timeout_s=2.0))
    await a.recv()  # hello; then the client gives up (its connect was cancelled)
    await a.close()
    with pytest.raises(PeerLost, match="left during the handshake"):
        await task
    assert b.closed




async def test_server_logs_a_peer_that_left_as_info_and_a_bad_secret_as_warning(
        rpc: Harness, info_logs: None) -> None:
    server, url = await rpc.serve({})
    with capture_logs() as logs:
        with pytest.raises(AuthFailed):
            await rpc.connect(url, secret=b"not-the-cluster-secret")
        a, b = memory_pair("client", "server")
        server.accept_channel(b)
        await a.recv()
        await a.close()
        for _ in range(100):  # bounded: the server task ends within a few loop steps
            if any(e["event"] == "rpc peer left during handshake" for e in logs):
                break
            await asyncio.sleep(0.01)
    levels = {e["event"]: e["log_level"] for e in logs if e["event"].startswith("rpc peer")}
    assert levels == {"rpc peer refused": "warning", "rpc peer left during handshake": "info"}


def test_short_secret_rejected() -> None:
    with pytest.raises(ValueError):
        RpcServer({}, secret=b"short")


async def test_connect_to_nothing_is_connect_failed(rpc: Harness) -> None:
    url = "ws://127.0.0.1:9/rpc" if rpc.transport == "ws" else "inproc://nobody"
    with pytest.raises(ConnectFailed):
        await rpc.connect(url, connect_timeout_s=1.0)
