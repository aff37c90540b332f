"""Calls over both transports: round trips, typed errors, deadlines, cancellation, notify,
frame limits, peer death, unknown methods and reverse calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from flashpoint.errors import (
    DeadlineExceeded,
    FlashpointError,
    FrameTooLarge,
    FunctionNotFound,
    PeerLost,
    ProtocolError,
)
from flashpoint.rpc import RpcConnection, RpcPool, frames, memory_pair

from .conftest import SECRET, Harness

pytestmark = pytest.mark.timeout(20)


async def echo(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
    return payload


class Slow:
    """A handler that blocks until cancelled, recording that it started and was cleaned up."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = asyncio.Event()
        self.cancelled = False

    async def __call__(self, conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.finished.set()
        return {}


async def test_round_trip(rpc: Harness) -> None:
    _, url = await rpc.serve({"echo": echo})
    conn = await rpc.connect(url)
    payload = {"n": 1, "blob": b"\x00\xff" * 100, "nested": {"list": [1, 2.5, None, "s"]}}
    assert await conn.call("echo", payload, timeout_s=2.0) == payload
    assert conn.peer_name.startswith("server")


async def test_handler_returning_none_gives_empty_dict(rpc: Harness) -> None:
    async def nothing(conn: RpcConnection, payload: dict[str, Any]) -> None:
        return None

    _, url = await rpc.serve({"nothing": nothing})
    conn = await rpc.connect(url)
    assert await conn.call("nothing", {}, timeout_s=2.0) == {}


async def test_many_concurrent_calls_match_their_replies(rpc: Harness) -> None:
    async def slow_echo(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.001 * (payload["i"] % 5))
        return {"i": payload["i"]}

    _, url = await rpc.serve({"echo": slow_echo})
    conn = await rpc.connect(url)
    replies = await asyncio.gather(*(conn.call("echo", {"i": i}, timeout_s=5.0) for i in range(200)))
    assert [r["i"] for r in replies] == list(range(200))


async def test_typed_remote_error(rpc: Harness) -> None:
    async def missing(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        raise FunctionNotFound("no function 'resnet'", function="resnet", known=["bert"])

    _, url = await rpc.serve({"invoke": missing})
    conn = await rpc.connect(url)
    with pytest.raises(FunctionNotFound) as info:
        await conn.call("invoke", {}, timeout_s=2.0)
    assert info.value.message == "no function 'resnet'"
    assert info.value.details == {"function": "resnet", "known": ["bert"]}
    with pytest.raises(FunctionNotFound):  # the connection survives a remote error
        await conn.call("invoke", {}, timeout_s=2.0)


async def test_foreign_exception_becomes_internal_error(rpc: Harness) -> None:
    async def broken(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("secret-internal-detail")

    _, url = await rpc.serve({"broken": broken, "echo": echo})
    conn = await rpc.connect(url)
    with pytest.raises(FlashpointError) as info:
        await conn.call("broken", {}, timeout_s=2.0)
    err = info.value
    assert type(err) is FlashpointError
    assert err.code == "internal"
    assert "ValueError" in err.message
    assert "secret-internal-detail" not in str(err.to_wire())
    assert "Traceback" not in str(err.to_wire())
    assert await conn.call("echo", {"still": "alive"}, timeout_s=2.0) == {"still": "alive"}


async def test_deadline_exceeded_cancels_remote_handler(rpc: Harness) -> None:
    slow = Slow()
    _, url = await rpc.serve({"slow": slow})
    conn = await rpc.connect(url)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await conn.call("slow", {}, timeout_s=0.2)
    elapsed = time.monotonic() - started
    assert 0.15 <= elapsed < 1.0
    await asyncio.wait_for(slow.finished.wait(), 2.0)
    assert slow.cancelled


async def test_server_side_deadline_applies_to_handler() -> None:
    """Even without a CANCEL from the caller, the handler runs under the request deadline."""
    raw, served = memory_pair("caller", "server")
    slow = Slow()
    conn = RpcConnection(served, {"slow": slow}, name="server")
    conn.start()
    try:
        await raw.send(frames.encode(frames.Request(1, "slow", {}, 0.2)))
        reply = frames.decode(await asyncio.wait_for(raw.recv(), 2.0))
        assert isinstance(reply, frames.Error) and reply.id == 1
        assert reply.error["code"] == "deadline_exceeded"
        assert slow.cancelled
    finally:
        await conn.close()


async def test_malformed_frame_drops_the_connection_with_a_reason() -> None:
    raw, served = memory_pair("caller", "server")
    conn = RpcConnection(served, {"echo": echo}, name="server")
    conn.start()
    await raw.send(b"\xc1 definitely not msgpack")
    reply = frames.decode(await asyncio.wait_for(raw.recv(), 2.0))
    assert isinstance(reply, frames.Error) and reply.id == 0
    assert reply.error["code"] == "protocol_error"
    await asyncio.wait_for(conn.wait_closed(), 2.0)
    assert isinstance(conn.close_reason, PeerLost)


async def test_cancelling_the_caller_cancels_the_remote_handler(rpc: Harness) -> None:
    slow = Slow()
    _, url = await rpc.serve({"slow": slow})
    conn = await rpc.connect(url)
    task = asyncio.create_task(conn.call("slow", {}, timeout_s=10.0))
    await asyncio.wait_for(slow.started.wait(), 2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(slow.finished.wait(), 2.0)
    assert slow.cancelled


async def test_notify_delivers(rpc: Harness) -> None:
    got: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def tick(conn: RpcConnection, payload: dict[str, Any]) -> None:
        got.put_nowait(payload)

    _, url = await rpc.serve({"tick": tick})
    conn = await rpc.connect(url)
    await conn.notify("tick", {"n": 1})
    await conn.notify("unknown-method", {"n": 2})  # logged and dropped by the peer
    await conn.notify("tick", {"n": 3})
    assert await asyncio.wait_for(got.get(), 2.0) == {"n": 1}
    assert await asyncio.wait_for(got.get(), 2.0) == {"n": 3}


async def test_unknown_method_is_protocol_error(rpc: Harness) -> None:
    _, url = await rpc.serve({"echo": echo})
    conn = await rpc.connect(url)
    with pytest.raises(ProtocolError, match="nope"):
        await conn.call("nope", {}, timeout_s=2.0)
    assert await conn.call("echo", {"a": 1}, timeout_s=2.0) == {"a": 1}


async def test_invalid_calls_fail_locally_and_keep_the_connection(rpc: Harness) -> None:
    _, url = await rpc.serve({"echo": echo})
    conn = await rpc.connect(url)
    with pytest.raises(ProtocolError):
        await conn.call("", {}, timeout_s=1.0)
    with pytest.raises(ProtocolError):
        await conn.call("echo", ["not", "a", "dict"], timeout_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        await conn.call("echo", {"x": object()}, timeout_s=1.0)
    with pytest.raises(DeadlineExceeded):
        await conn.call("echo", {}, timeout_s=0.0)
    assert await conn.call("echo", {"ok": 1}, timeout_s=2.0) == {"ok": 1}


async def test_oversized_request_fails_at_sender_before_sending(rpc: Harness) -> None:
    calls = 0

    async def count(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {}

    _, url = await rpc.serve({"count": count}, max_frame_bytes=64 * 1024)
    conn = await rpc.connect(url, max_frame_bytes=64 * 1024)
    with pytest.raises(FrameTooLarge):
        await conn.call("count", {"blob": b"x" * 100_000}, timeout_s=2.0)
    with pytest.raises(FrameTooLarge):
        await conn.notify("count", {"blob": b"x" * 100_000})
    assert calls == 0
    assert await conn.call("count", {}, timeout_s=2.0) == {}
    assert calls == 1


async def test_oversized_reply_becomes_frame_too_large_at_caller(rpc: Harness) -> None:
    async def big(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        return {"blob": b"x" * 100_000}

    _, url = await rpc.serve({"big": big, "echo": echo}, max_frame_bytes=64 * 1024)
    conn = await rpc.connect(url, max_frame_bytes=64 * 1024)
    with pytest.raises(FrameTooLarge):
        await conn.call("big", {}, timeout_s=2.0)
    assert await conn.call("echo", {}, timeout_s=2.0) == {}


async def test_peer_sending_oversized_frame_is_disconnected(rpc: Harness) -> None:
    calls = 0

    async def count(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {}

    server, url = await rpc.serve({"count": count}, max_frame_bytes=64 * 1024)
    rogue = await rpc.connect(url, max_frame_bytes=1024 * 1024)  # bypasses the sender-side check
    with pytest.raises(PeerLost):
        await rogue.call("count", {"blob": b"x" * 200_000}, timeout_s=5.0)
    await asyncio.wait_for(rogue.wait_closed(), 2.0)
    assert calls == 0
    # the server still serves everyone else
    good = await rpc.connect(url, max_frame_bytes=64 * 1024)
    assert await good.call("count", {}, timeout_s=2.0) == {}
    assert calls == 1
    assert len(server.connections) == 1


async def test_server_stop_fails_pending_calls_with_peer_lost(rpc: Harness) -> None:
    slow = Slow()
    server, url = await rpc.serve({"slow": slow})
    conn = await rpc.connect(url)
    task = asyncio.create_task(conn.call("slow", {}, timeout_s=10.0))
    await asyncio.wait_for(slow.started.wait(), 2.0)
    started = time.monotonic()
    await server.stop(timeout_s=2.0)
    with pytest.raises(PeerLost):
        await asyncio.wait_for(task, 2.0)
    assert time.monotonic() - started < 1.5
    assert slow.cancelled
    await asyncio.wait_for(conn.wait_closed(), 2.0)
    with pytest.raises(PeerLost):
        await conn.call("slow", {}, timeout_s=1.0)


async def test_client_close_fails_its_own_pending_calls(rpc: Harness) -> None:
    slow = Slow()
    _, url = await rpc.serve({"slow": slow})
    conn = await rpc.connect(url)
    task = asyncio.create_task(conn.call("slow", {}, timeout_s=10.0))
    await asyncio.wait_for(slow.started.wait(), 2.0)
    await conn.close()
    with pytest.raises(PeerLost):
        await asyncio.wait_for(task, 2.0)
    await asyncio.wait_for(slow.finished.wait(), 2.0)  # the server noticed and cancelled


async def test_reverse_calls_over_the_same_connection(rpc: Harness) -> None:
    connected: asyncio.Queue[RpcConnection] = asyncio.Queue()

    async def register(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        # call back into the client while serving its request
        who = await conn.call("whoami", {}, timeout_s=2.0)
        return {"registered": who["name"]}

    async def whoami(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        return {"name": "host-7"}

    _, url = await rpc.serve({"register": register}, on_connect=connected.put_nowait)
    client = await rpc.connect(url, {"whoami": whoami}, name="host-7")
    server_side = await asyncio.wait_for(connected.get(), 2.0)
    assert server_side.peer_name == "host-7"
    assert await server_side.call("whoami", {}, timeout_s=2.0) == {"name": "host-7"}
    assert await client.call("register", {}, timeout_s=2.0) == {"registered": "host-7"}
    with pytest.raises(ProtocolError):
        await server_side.call("register", {}, timeout_s=2.0)  # not in the client's table


async def test_on_disconnect_runs(rpc: Harness) -> None:
    gone = asyncio.Event()
    _, url = await rpc.serve({"echo": echo}, on_disconnect=lambda conn: gone.set())
    conn = await rpc.connect(url)
    await conn.close()
    await asyncio.wait_for(gone.wait(), 2.0)


async def test_trace_id_reaches_the_handler(rpc: Harness) -> None:
    import structlog

    async def trace(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
        return {"request_id": structlog.contextvars.get_contextvars().get("request_id")}

    _, url = await rpc.serve({"trace": trace})
    conn = await rpc.connect(url)
    assert await conn.call("trace", {}, timeout_s=2.0, trace="req-42") == {"request_id": "req-42"}


async def test_pool_shares_and_reopens_connections(rpc: Harness) -> None:
    server, url = await rpc.serve({"echo": echo})
    pool = RpcPool(secret=SECRET, hub=rpc.hub)
    try:
        a, b = await asyncio.gather(pool.get(url), pool.get(url))
        assert a is b
        assert await pool.call(url, "echo", {"x": 1}, timeout_s=2.0) == {"x": 1}
        await server.close_connections()
        await asyncio.wait_for(a.wait_closed(), 2.0)
        assert await pool.call(url, "echo", {"x": 2}, timeout_s=2.0) == {"x": 2}
        assert (await pool.get(url)) is not a
    finally:
        await pool.close_all()


async def test_metrics_count_calls(rpc: Harness) -> None:
    _, url = await rpc.serve({"echo": echo})
    conn = await rpc.connect(url)
    labels = {"method": "echo", "outcome": "ok"}
    before = REGISTRY.get_sample_value("flashpoint_rpc_calls_total", labels) or 0.0
    await conn.call("echo", {}, timeout_s=2.0)
    assert REGISTRY.get_sample_value("flashpoint_rpc_calls_total", labels) == before + 1
