"""Issue 19, items 8 (local attackers on a host), 9 (durability) and 11 (wire hygiene)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import struct
import zlib

import aiohttp
import pytest
from aiohttp import web

from flashpoint.config import GatewayConfig
from flashpoint.gateway.app import RUNNER_KWARGS
from flashpoint.gateway.body import read_body

# -- 11. wire hygiene: a body must be what its Content-Encoding says ------------------------

async def _body_server(auto_decompress: bool) -> tuple[web.AppRunner, str]:
    config = GatewayConfig()

    async def echo(request: web.Request) -> web.Response:
        from flashpoint.errors import FlashpointError

        try:
            data = await read_body(request, config)
        except FlashpointError as exc:
            return web.json_response({"code": exc.code}, status=exc.http_status)
        return web.Response(body=data)

    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None,
                           **{**RUNNER_KWARGS, "auto_decompress": auto_decompress})
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/echo"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_body_labelled_compressed_but_plain_is_400(encoding: str):
    """The gateway's runner (RUNNER_KWARGS) leaves inflating to the gateway; with aiohttp's
    auto_decompress its own parser drops such a request before the gateway sees it."""
    plain = json.dumps({"inputs": {"x": [1, 2]}}).encode()
    packed = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    runner, url = await _body_server(auto_decompress=False)
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(url, data=plain, headers={"Content-Encoding": encoding}) as r:
                assert r.status == 400, await r.text()
            async with s.post(url, data=packed, headers={"Content-Encoding": encoding}) as r:
                assert r.status == 200
                assert await r.read() == plain
    finally:
        await runner.cleanup()


# -- 11. wire hygiene: the data-plane header decoder is as strict as the RPC codec ---------

def test_data_plane_header_refuses_ext_types_and_out_of_range_values():
    import msgpack

    from flashpoint.errors import ProtocolError
    from flashpoint.rpc import frames
    from flashpoint.transfer.wire import decode_header

    ext = msgpack.packb({"op": "get", "key": msgpack.ExtType(5, b"\x00" * 8)}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        frames.decode(msgpack.packb([frames.RESPONSE, 1, {"x": msgpack.ExtType(5, b"1")}]))
    with pytest.raises(ProtocolError):
        decode_header(ext)
    # a timestamp is an ext type too (-1)
    with pytest.raises(ProtocolError):
        decode_header(msgpack.packb({"op": "status", "t": msgpack.Timestamp(1, 0)},
                                    datetime=False))
    bad = [{"op": "chain", "stall_timeout_s": float("nan")},
           {"op": "chain", "timeout_s": float("inf")},
           {"op": "chain", "timeout_s": -1.0},
           {"op": "chain", "orphan_grace_s": 1e300},
           {"op": "chain", "position": -1},
           {"op": "chain", "position": 2**40},
           {"op": "chain", "position": 1.5},
           {"op": "chain", "timeout_s": True},
           {"op": "get", "chunks": [float("nan")]}]
    for header in bad:
        with pytest.raises(ProtocolError):
            decode_header(msgpack.packb(header, use_bin_type=True))
    good = {"op": "chain", "transfer_id": "t1", "stall_timeout_s": 10.0, "orphan_grace_s": 2,
            "timeout_s": 3600.0, "position": 2, "bitmap": b"\xff", "chunks": [0, 1]}
    assert decode_header(msgpack.packb(good, use_bin_type=True)) == good


# -- 11. wire hygiene: before authentication the RPC server holds little ------------------

async def _raw_ws_upgrade(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A bare WebSocket upgrade on /rpc; returns the stream and the server's first frame."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /rpc HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
    await writer.drain()
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def _read_to_eof(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Until the server closes (EOF or a reset: it may close with our bytes unread)."""
    async with asyncio.timeout(timeout_s):
        try:
            while await reader.read(65536):
                pass
        except ConnectionResetError:
            pass


async def test_rpc_server_cuts_off_a_big_message_before_authentication():
    from prometheus_client import REGISTRY

    from flashpoint.rpc.server import RpcServer

    def refused() -> float:
        return REGISTRY.get_sample_value("flashpoint_rpc_preauth_refused_total",
                                         {"reason": "preauth_bytes"}) or 0.0

    before = refused()
    # A long handshake timeout: only the byte budget can end this connection quickly.
    server = RpcServer({}, secret=b"s" * 32, handshake_timeout_s=60.0, heartbeat_s=None)
    _, port = await server.start()
    try:
        reader, writer, head = await _raw_ws_upgrade(port)
        assert head.startswith(b"HTTP/1.1 101"), head
        # A binary frame claiming 8 MiB (masked, as from a client), then 1 MiB of it.
        size = 8 << 20
        writer.write(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", size) + b"\0\0\0\0")
        for _ in range(16):
            writer.write(b"\0" * (64 << 10))
        try:
            await writer.drain()
        except ConnectionError:
            pass
        await _read_to_eof(reader, timeout_s=10.0)  # closed long before the 60 s handshake
        writer.close()
        assert refused() == before + 1
    finally:
        await server.stop()


async def test_rpc_server_caps_handshakes_and_connections():
    from flashpoint.rpc.client import connect
    from flashpoint.rpc.server import RpcServer

    async def ping(conn: object, payload: dict) -> dict:
        return {"pong": True}

    secret = b"s" * 32
    # Handshakes: two peers that never prove anything hold both slots; a third gets a 503.
    server = RpcServer({"ping": ping}, secret=secret, handshake_timeout_s=60.0,
                       heartbeat_s=None, max_handshakes=2)
    _, port = await server.start()
    writers = []
    try:
        for _ in range(2):
            _, writer, head = await _raw_ws_upgrade(port)
            writers.append(writer)
            assert head.startswith(b"HTTP/1.1 101"), head
        _, writer, head = await _raw_ws_upgrade(port)
        writers.append(writer)
        assert head.startswith(b"HTTP/1.1 503"), head
    finally:
        for w in writers:
            w.close()
        await server.stop()
    # Connections: three authenticated peers fill the server; a fourth gets a 503.
    server = RpcServer({"ping": ping}, secret=secret, heartbeat_s=None, max_connections=3)
    _, port = await server.start()
    url = f"ws://127.0.0.1:{port}/rpc"
    conns = []
    try:
        for _ in range(3):
            conns.append(await connect(url, secret=secret, name="peer", connect_timeout_s=5.0))
        _, writer, head = await _raw_ws_upgrade(port)
        writer.close()
        assert head.startswith(b"HTTP/1.1 503"), head
        assert (await conns[0].call("ping", {}, timeout_s=5.0)) == {"pong": True}
    finally:
        for c in conns:
            await c.close()
        await server.stop()


# -- 9. durability: registrations are durable when acknowledged; bad rows are skipped ------

async def test_function_table_is_durable_and_skips_bad_rows(tmp_path):
    import sqlite3

    from prometheus_client import REGISTRY

    from flashpoint.controller.persist import FunctionTable
    from flashpoint.spec import FunctionSpec

    table = FunctionTable(tmp_path / "state.db")
    await table.open()
    with table._connect() as conn:
        # 2 = FULL: a commit is fsynced before upsert returns and the registration is acked.
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    good = FunctionSpec(name="fine", model="m", model_version="1")
    await table.upsert(good)
    raw = sqlite3.connect(tmp_path / "state.db")
    with raw:
        raw.execute("INSERT INTO functions(name, spec_json) VALUES('broken', '{not json')")
        raw.execute("INSERT INTO functions(name, spec_json) VALUES('wrong', ?)", ('{"name": 3}',))
        raw.execute("INSERT INTO functions(name, spec_json) VALUES('blob', x'00ff')")
    raw.close()
    before = REGISTRY.get_sample_value("flashpoint_controller_function_rows_skipped_total") or 0
    specs = await table.load()
    assert [s.name for s in specs] == ["fine"]
    after = REGISTRY.get_sample_value("flashpoint_controller_function_rows_skipped_total")
    assert after == before + 3


async def test_failed_imds_polls_are_warned_and_counted():
    from prometheus_client import REGISTRY
    from structlog.testing import capture_logs

    from flashpoint.spot.notice import WARN_EVERY_FAILURES, EvictionNotice, ImdsWatcher, watch

    class BlockedImds(ImdsWatcher):
        """Times out ``fail`` times, then reports an eviction (which ends ``watch``)."""

        def __init__(self, fail: int) -> None:
            super().__init__("http://169.254.169.254")
            self.left = fail

        async def poll(self, session):
            if self.left:
                self.left -= 1
                raise TimeoutError("metadata service blocked")
            return EvictionNotice("terminate", 0.0, "imds")

    def failures() -> float:
        return REGISTRY.get_sample_value("flashpoint_spot_notice_poll_failures_total",
                                         {"watcher": "imds"}) or 0.0

    async def on_notice(notice) -> None:
        pass

    before = failures()
    n = WARN_EVERY_FAILURES + 2
    with capture_logs() as logs:
        await asyncio.wait_for(watch([BlockedImds(n)], on_notice, interval_s=0.0), 10)
    assert failures() == before + n
    warned = [e for e in logs if e["event"] == "eviction_poll_failed"]
    assert [e["log_level"] for e in warned] == ["warning", "warning"]  # 1st and 31st, not 32
    assert any(e["event"] == "eviction_poll_recovered" for e in logs)


# -- 8. local attackers: the host cache directory is private and its files our own ----------

def _foreign_owned_dir(tmp_path):
    """A directory owned by another user: chown'd when we are root, else the temp dir's
    parent-of-all (root-owned) as seen by an ordinary user."""
    import tempfile

    if os.geteuid() == 0:
        d = tmp_path / "foreign"
        d.mkdir(mode=0o777)
        os.chown(d, 12345, 12345)
        return d
    return __import__("pathlib").Path(tempfile.gettempdir())


def test_cache_dir_is_created_private_and_checked(tmp_path):
    from flashpoint.errors import UnsafePath
    from flashpoint.transfer.cache import HostCache, default_cache_dir, private_dir

    assert f"-{os.geteuid()}-" in default_cache_dir("h1").name
    d = tmp_path / "cache" / "h1"
    cache = HostCache(d, 1 << 20, "h1")
    cache.start()
    assert (os.stat(d).st_mode & 0o777) == 0o700
    os.chmod(d, 0o777)  # loosened by someone: tightened again
    private_dir(d)
    assert (os.stat(d).st_mode & 0o777) == 0o700
    cache.close()
    # A symlink planted where the directory goes (to a place the attacker reads) is refused.
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "planted"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath):
        HostCache(link, 1 << 20, "h2").start()
    with pytest.raises(UnsafePath):
        private_dir(_foreign_owned_dir(tmp_path))


def test_segment_files_never_follow_a_planted_symlink(tmp_path):
    from flashpoint.transfer.node import make_synthetic
    from flashpoint.transfer.segment import Segment

    manifest = make_synthetic(tmp_path / "blob", tmp_path / "blob.json", size_bytes=1 << 20,
                              chunk_size=256 << 10, seed=3)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    target = d / "segment"
    target.symlink_to(victim)
    seg = Segment(target, manifest)
    try:
        assert not target.is_symlink()
        assert victim.read_bytes() == b"precious"  # neither truncated nor written through
        assert (os.stat(target).st_mode & 0o777) == 0o600
    finally:
        seg.close()
    target.unlink()
    target.symlink_to(tmp_path / "blob")
    with pytest.raises(OSError):  # ELOOP: a reader never maps through a symlink either
        Segment.open_complete(target, manifest)


# -- 8. local attackers: the token socket charges a process to its own tenant only ---------

async def test_token_socket_charges_the_bound_tenant_whatever_hello_claims(tmp_path):
    from flashpoint.gpu import token_protocol as proto
    from flashpoint.gpu.tokens import TokenManager

    mgr = TokenManager(tmp_path / "tokens.sock", name="sec-test", verify_peers=True)
    await mgr.start()
    me = os.getpid()

    async def hello(claimed: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "tokens.sock"))
        writer.write(proto.pack(proto.TokenMsg(proto.MsgType.HELLO, tenant=claimed, pid=me)))
        await writer.drain()
        return reader, writer

    async def recv(reader: asyncio.StreamReader) -> proto.TokenMsg:
        async with asyncio.timeout(5):
            return proto.unpack(await reader.readexactly(proto.MSG_SIZE))

    writers = []
    try:
        mgr.bind_pid(me, 7)
        reader, writer = await hello(claimed=3)  # pretends to be tenant 3
        writers.append(writer)
        assert (await recv(reader)).type is proto.MsgType.MEM  # its memory cap
        for seq, used_ns in ((1, 0), (2, 5_000_000)):
            writer.write(proto.pack(proto.TokenMsg(proto.MsgType.REQUEST, seq=seq,
                                                   used_ns=used_ns)))
            grant = await recv(reader)
            assert grant.type is proto.MsgType.GRANT and grant.seq == seq
        usage = mgr.usage_by_tenant()
        assert usage.get(7, 0) > 0 and 3 not in usage, usage
        # A process bound to no tenant is refused: the manager closes on it.
        mgr.unbind_pid(me)
        reader, writer = await hello(claimed=7)
        writers.append(writer)
        async with asyncio.timeout(5):
            assert await reader.read() == b""
    finally:
        for w in writers:
            w.close()
        await mgr.stop()
