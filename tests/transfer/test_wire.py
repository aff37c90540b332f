"""Data-plane wire: mutual HMAC handshake, header limits, ops, status."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from flashpoint.errors import AuthFailed, ConnectFailed, ModelNotFound, ProtocolError
from flashpoint.transfer import wire
from flashpoint.transfer.node import fetch_status
from flashpoint.transfer.plan import Endpoint
from flashpoint.transfer.sources import PeerSource
from flashpoint.transfer.wire import DataConn

from .conftest import SECRET


async def raw_connect(ep: Endpoint) -> socket.socket:
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, (ep.addr, ep.port))
    return s


async def read_all(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    async with asyncio.timeout(timeout_s):
        try:
            while chunk := await loop.sock_recv(s, 4096):
                out += chunk
        except ConnectionResetError:  # closed with our unread op still queued: a reset
            pass
    return out


async def test_client_without_secret_is_closed_before_any_op(cluster, blob):
    ep = await cluster.add("a", seed=blob)
    with pytest.raises(AuthFailed):
        await DataConn.connect(ep, b"wrong-secret-123", name="x", timeout_s=2)
    # A raw peer that answers the hello with a forged proof and then sends an op gets nothing.
    s = await raw_connect(ep)
    try:
        loop = asyncio.get_running_loop()
        hello = await loop.sock_recv(s, 20)
        assert hello[:4] == wire.MAGIC
        await loop.sock_sendall(s, b"\x00" * 48 + struct.pack("!I", 2) + b"\x81\xa2")
        assert await read_all(s) == b""  # closed: no welcome, no reply to the op
    finally:
        s.close()
    # A peer with the secret still gets served.
    st = await fetch_status(ep, SECRET)
    assert st["ok"] and st["host_id"] == "a"


async def test_server_without_secret_is_refused_by_client(cluster, blob):
    ep = await cluster.add("impostor", secret=b"not-the-cluster-secret")
    src = PeerSource(ep, SECRET, timeout_s=2)
    try:
        with pytest.raises(AuthFailed):
            await src.read_into(blob.manifest, 0, memoryview(bytearray(len(blob.data[:65536]))))
    finally:
        await src.aclose()


async def test_fake_server_with_bad_welcome(tmp_path):
    """A listener that sends a hello but a forged welcome: the client refuses it."""
    async def handle(reader, writer):
        writer.write(wire.MAGIC + b"\x01" * 16)
        await reader.readexactly(48)
        writer.write(b"\x02" * 32)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(AuthFailed):
            await DataConn.connect(Endpoint("f", "127.0.0.1", port), SECRET, name="x", timeout_s=2)
    finally:
        server.close()
        await server.wait_closed()


async def test_silent_listener_times_out_and_refused_port_fails_fast():
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    try:
        with pytest.raises(ConnectFailed):
            await DataConn.connect(Endpoint("s", "127.0.0.1", port), SECRET, name="x", timeout_s=0.3)
    finally:
        lst.close()
    with pytest.raises(ConnectFailed):
        await DataConn.connect(Endpoint("s", "127.0.0.1", port), SECRET, name="x", timeout_s=1)


async def test_unknown_op_and_oversized_header(cluster):
    ep = await cluster.add("a")
    conn = await DataConn.connect(ep, SECRET, name="x", timeout_s=2)
    try:
        await conn.send_header({"op": "format-disk"}, 2)
        reply = await conn.recv_header(2)
        assert reply["ok"] is False and reply["error"]["code"] == "protocol_error"
    finally:
        conn.close()
    conn = await DataConn.connect(ep, SECRET, name="x", timeout_s=2)
    try:
        await conn.sendall(struct.pack("!I", wire.MAX_HEADER_BYTES + 1), 2)
        with pytest.raises(Exception):  # noqa: B017 - the server just hangs up
            await conn.recv_header(2)
    finally:
        conn.close()
    with pytest.raises(ProtocolError):
        await DataConn.send_header(conn, {"x": b"\0" * (wire.MAX_HEADER_BYTES + 1)}, 1)


async def test_get_reports_missing_model(cluster, blob):
    ep = await cluster.add("a")
    src = PeerSource(ep, SECRET, timeout_s=2)
    try:
        with pytest.raises(ModelNotFound):
            await src.read_into(blob.manifest, 0, memoryview(bytearray(65536)))
    finally:
        await src.aclose()
