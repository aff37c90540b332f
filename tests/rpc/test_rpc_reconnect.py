"""ReconnectingClient and retry/backoff."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest

from flashpoint.errors import ConnectFailed, FunctionNotFound, Overloaded, PeerLost
from flashpoint.rpc import Backoff, ReconnectingClient, RpcConnection, retry

from .conftest import SECRET, Harness

pytestmark = pytest.mark.timeout(30)


async def echo(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
    return payload


async def test_reconnects_after_server_restart(rpc: Harness) -> None:
    server, url = await rpc.serve({"echo": echo}, name="controller")
    port = int(url.rsplit(":", 1)[1].split("/")[0]) if rpc.transport == "ws" else 0
    registered: asyncio.Queue[RpcConnection] = asyncio.Queue()

    async def on_connected(conn: RpcConnection) -> None:
        await conn.call("echo", {"register": True}, timeout_s=2.0)
        registered.put_nowait(conn)

    client = ReconnectingClient(
        url,
        secret=SECRET,
        name="host-1",
        on_connected=on_connected,
        backoff=Backoff(initial_s=0.02, max_s=0.2),
        hub=rpc.hub,
    )
    await client.start()
    try:
        first = await asyncio.wait_for(registered.get(), 5.0)
        assert await client.call("echo", {"n": 1}, timeout_s=2.0) == {"n": 1}

        await server.stop(timeout_s=2.0)
        await asyncio.wait_for(first.wait_closed(), 2.0)
        with pytest.raises(ConnectFailed):
            await client.call("echo", {"n": 2}, timeout_s=0.2)  # nobody there yet

        await rpc.serve({"echo": echo}, name="controller", port=port)
        second = await asyncio.wait_for(registered.get(), 5.0)
        assert second is not first
        assert client.connects == 2
        assert await client.call("echo", {"n": 3}, timeout_s=2.0) == {"n": 3}
    finally:
        await client.stop()


async def test_call_waits_for_the_first_connection(rpc: Harness) -> None:
    port = 0
    if rpc.transport == "ws":
        with socket.socket() as sock:  # a port nobody listens on yet; the server takes it later
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"ws://127.0.0.1:{port}/rpc"
    else:
        url = "inproc://late"
    client = ReconnectingClient(
        url, secret=SECRET, backoff=Backoff(initial_s=0.02, max_s=0.05), hub=rpc.hub
    )
    await client.start()
    try:
        call = asyncio.create_task(client.call("echo", {"n": 1}, timeout_s=3.0))
        await asyncio.sleep(0.1)
        await rpc.serve({"echo": echo}, name="late", port=port)
        assert await asyncio.wait_for(call, 3.0) == {"n": 1}
    finally:
        await client.stop()


def test_backoff_delays_are_jittered_and_bounded() -> None:
    b = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.5)
    gen = b.delays(random.Random(1))
    delays = [next(gen) for _ in range(20)]
    assert all(0 < d <= 1.0 for d in delays)
    assert 0.05 <= delays[0] <= 0.1
    assert all(0.5 <= d for d in delays[5:])  # reached the cap, jitter at most halves it
    assert len(set(delays)) > 1


async def test_retry_retries_only_retryable_errors() -> None:
    attempts = 0

    async def flaky() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise PeerLost("gone")
        return "ok"

    fast = Backoff(initial_s=0.001, max_s=0.01)
    assert await retry(flaky, attempts=5, backoff=fast) == "ok"
    assert attempts == 3

    attempts = 0

    async def fatal() -> str:
        nonlocal attempts
        attempts += 1
        raise FunctionNotFound("nope")

    with pytest.raises(FunctionNotFound):
        await retry(fatal, attempts=5, backoff=fast)
    assert attempts == 1


async def test_retry_is_bounded_in_attempts_and_time() -> None:
    attempts = 0

    async def always() -> None:
        nonlocal attempts
        attempts += 1
        raise PeerLost("gone")

    with pytest.raises(PeerLost):
        await retry(always, attempts=4, backoff=Backoff(initial_s=0.001, max_s=0.01))
    assert attempts == 4

    attempts = 0

    async def overloaded() -> None:
        nonlocal attempts
        attempts += 1
        raise Overloaded("busy", retry_after_s=10.0)

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Overloaded):
        await retry(overloaded, attempts=10, total_timeout_s=0.5, backoff=Backoff(initial_s=0.01, max_s=1.0))
    assert loop.time() - started < 0.6


async def test_retry_until_deadline_cuts_the_last_wait_and_tries_once_more() -> None:
    loop = asyncio.get_running_loop()
    calls: list[float] = []
    seen: list[BaseException] = []

    async def down() -> None:
        calls.append(loop.time())
        raise ConnectFailed("no controller")

    started = loop.time()
    # Every wait (0.2-0.4 s) is longer than what is left of 0.3 s: the default gives up after
    # one attempt, until_deadline waits only what is left and tries again at the deadline.
    slow = Backoff(initial_s=0.4, max_s=0.4)
    with pytest.raises(ConnectFailed):
        await retry(down, attempts=50, total_timeout_s=0.1, backoff=slow)
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ConnectFailed):
        await retry(down, attempts=50, total_timeout_s=0.3, backoff=slow, until_deadline=True,
                    on_retry=seen.append)
    assert len(calls) >= 2 and len(seen) == len(calls) - 1
    assert all(isinstance(e, ConnectFailed) for e in seen)
    assert calls[-1] - calls[0] <= 0.3 + 0.05  # the last try came at the deadline, no later
    assert loop.time() - started < 1.0
