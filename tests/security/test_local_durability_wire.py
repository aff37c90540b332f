"""Issue 19, items 8 (local attackers on a host), 9 (durability) and 11 (wire hygiene)."""

from __future__ import annotations

import gzip
import json
import zlib

import aiohttp
import pytest
from aiohttp import web

from flashpoint.gateway.app import RUNNER_KWARGS
from flashpoint.gateway.body import read_body
from flashpoint.gateway.config import GatewayConfig


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
