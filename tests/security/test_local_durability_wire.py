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
