"""Issue 19, item 5 (TLS): the stand-alone gateway serves HTTPS and reaches a wss://
controller trusting a configured CA; TLS files are checked at start-up with typed errors;
deploy/README.md's openssl commands make certificates that work; pipeline activation frames
carry a per-connection MAC, so a frame altered or replayed on the way closes the link."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from flashpoint.errors import BadRequest, IntegrityError
from flashpoint.pipeline.frames import FrameKind, encode_frame
from flashpoint.pipeline.link import TAG_BYTES, ActivationLink
from flashpoint.rpc.client import TLS_CA_ENV
from flashpoint.rpc.tls import client_context, server_context
from flashpoint.testing.harness import ClusterFactory
from flashpoint.transfer.plan import Endpoint
from flashpoint.transfer.wire import DataConn, listen_socket

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
SECRET = b"security-test-secret"
PROOF_BYTES = 16 + 32  # the data-plane handshake's client proof: nonce_c + HMAC


def _openssl_block() -> str:
    text = (REPO / "deploy" / "README.md").read_text()
    m = re.search(r"<!-- tls-openssl.*?-->\s*```bash\n(.*?)```", text, re.S)
    assert m, "deploy/README.md has no tls-openssl block"
    return m.group(1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster CA and a controller certificate for 127.0.0.1, made by the very commands
    deploy/README.md gives operators."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is missing (.ci/run installs it)")
    d = tmp_path_factory.mktemp("tls")
    script = _openssl_block().replace('SAN="DNS:controller.example,IP:10.0.0.10"',
                                      'SAN="IP:127.0.0.1"')
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=d, check=True,
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    return d


def test_tls_files_are_checked_at_start(certs: Path, tmp_path: Path) -> None:
    assert server_context("", "", setting="gateway") is None
    ctx = server_context(str(certs / "controller.pem"), str(certs / "controller.key"),
                         setting="gateway")
    assert ctx is not None and ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    with pytest.raises(BadRequest, match=r"\[gateway\] tls_key_path is set without"):
        server_context("", str(certs / "controller.key"), setting="gateway")
    with pytest.raises(BadRequest, match="tls_cert_path"):
        server_context(str(tmp_path / "absent.pem"), "", setting="controller")
    with pytest.raises(BadRequest, match="tls_cert_path"):  # the CA's key: not this cert's
        server_context(str(certs / "controller.pem"), str(certs / "ca.key"), setting="controller")
    with pytest.raises(BadRequest, match="tls_ca_path"):
        client_context(str(tmp_path / "absent.pem"), setting="gateway")


async def test_standalone_gateway_over_https_to_a_wss_controller(make_cluster: ClusterFactory,
        certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpoint.gateway.standalone import StandaloneGateway
    from flashpoint.testing.harness import cluster_config

    monkeypatch.setenv(TLS_CA_ENV, "")  # restored after the test (the host sets it)
    cert, key, ca = (str(certs / n) for n in ("controller.pem", "controller.key", "ca.pem"))
    cfg = cluster_config(tmp_path, tls_ca_path=ca)
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, tls_cert_path=cert, tls_key_path=key))
    c = await make_cluster(config=cfg)
    gw = None
    try:
        monkeypatch.setenv(TLS_CA_ENV, "")  # the gateway trusts its own tls_ca_path only
        cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(
            cfg.gateway, controller_url=c.controller.rpc_url, refresh_s=0.1,
            tls_cert_path=cert, tls_key_path=key, tls_ca_path=ca))
        gw = await asyncio.wait_for(StandaloneGateway.start(cfg, port=0), 30)
        assert gw.url.startswith("https://")
        trust = ssl.create_default_context(cafile=ca)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as s:
            async with s.post(f"{gw.url}/v1/functions", json={"name": "f", "model": "noop"}) as r:
                assert r.status == 201, await r.text()
                inputs = (await r.json())["spec"]["inputs"]
            body = {"inputs": {t["name"]: {"data": [1.0] * 4, "shape": [1, 4],
                                           "datatype": t["datatype"]} for t in inputs}}
            async with s.post(f"{gw.url}/v1/functions/f/invoke", json=body) as r:
                assert r.status == 200, await r.text()
        async with aiohttp.ClientSession() as s:  # plain HTTP on the gateway's port: refused
            with pytest.raises(aiohttp.ClientError):
                async with s.get(gw.url.replace("https://", "http://") + "/healthz") as r:
                    await r.read()
    finally:
        if gw is not None:
            await asyncio.wait_for(gw.stop(), 30)
        await asyncio.wait_for(c.stop(), 30)


class _Proxy:
    """An on-path attacker between a link's client and server: forwards both ways, and on
    the client-to-server stream applies ``edit(offset, chunk)`` to the bytes after the
    handshake proof; :meth:`replay` re-sends everything the client sent after its proof."""

    def __init__(self, upstream: tuple[str, int],
                 edit: Callable[[int, bytes], bytes] = lambda off, b: b) -> None:
        self.upstream, self.edit = upstream, edit
        self.seen = bytearray()
        self._to_server: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return Endpoint("proxy", "127.0.0.1", port)

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.upstream)
        self._to_server = sw
        self._tasks += [asyncio.create_task(self._pump(cr, sw, True)),
                        asyncio.create_task(self._pump(sr, cw, False))]

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, c2s: bool) -> None:
        try:
            while chunk := await r.read(65536):
                if c2s:
                    start = len(self.seen)
                    self.seen += chunk
                    if start + len(chunk) > PROOF_BYTES:
                        cut = max(PROOF_BYTES - start, 0)
                        chunk = chunk[:cut] + self.edit(start + cut - PROOF_BYTES, chunk[cut:])
                w.write(chunk)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def replay(self) -> None:
        assert self._to_server is not None
        self._to_server.write(bytes(self.seen[PROOF_BYTES:]))
        await self._to_server.drain()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _link_through(proxy: _Proxy) -> tuple[ActivationLink, ActivationLink, object]:
    """A client link through ``proxy`` to a server link on a fresh listener."""
    listener = await listen_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    proxy.upstream = listener.getsockname()[:2]

    async def accept() -> DataConn:
        sock, addr = await loop.sock_accept(listener)
        conn = DataConn(sock, f"{addr[0]}:{addr[1]}")
        await conn.server_handshake(SECRET, 5)
        return conn

    endpoint = await proxy.start()
    conn, client = await asyncio.wait_for(asyncio.gather(
        accept(), ActivationLink.connect(endpoint, SECRET, name="c", timeout_s=5)), 10)
    return client, ActivationLink(conn), listener


def _frame(seed: int) -> list:
    x = np.arange(64, dtype=np.float32) + seed
    return encode_frame(FrameKind.REQUEST, seed, 7, [x])


def _flip_first_data_byte(offset: int, chunk: bytes) -> bytes:
    at = 32 + 80  # HEAD + one table entry: the first byte of the tensor
    if offset <= at < offset + len(chunk):
        i = at - offset
        return chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1:]
    return chunk


async def test_an_altered_activation_frame_is_refused() -> None:
    proxy = _Proxy(("", 0), _flip_first_data_byte)
    client, server, listener = await _link_through(proxy)
    try:
        await client.send(_frame(1), 5)
        with pytest.raises(IntegrityError):
            await server.recv(5, 5)
        assert server.closed
    finally:
        client.close()
        server.close()
        listener.close()  # type: ignore[attr-defined]
        await proxy.stop()


async def test_a_replayed_activation_frame_is_refused() -> None:
    proxy = _Proxy(("", 0))
    client, server, listener = await _link_through(proxy)
    try:
        await client.send(_frame(1), 5)
        first = await server.recv(5, 5)
        np.testing.assert_array_equal(first.tensors_numpy()[0], np.arange(64) + 1)
        await proxy.replay()  # the same bytes again, as if the client had sent them twice
        with pytest.raises(IntegrityError):
            await server.recv(5, 5)
    finally:
        client.close()
        server.close()
        listener.close()  # type: ignore[attr-defined]
        await proxy.stop()


async def test_frames_flow_both_ways_under_their_macs() -> None:
    proxy = _Proxy(("", 0))
    client, server, listener = await _link_through(proxy)
    try:
        sent = 0
        for i in range(3):
            sent += sum(memoryview(b).nbytes for b in _frame(i))
            await client.send(_frame(i), 5)
            got = await server.recv(5, 5)
            await server.send(encode_frame(FrameKind.RESULT, got.head.request_id, 7,
                                           got.tensors_numpy()), 5)
            back = await client.recv(5, 5)
            np.testing.assert_array_equal(back.tensors_numpy()[0], np.arange(64) + i)
        assert len(proxy.seen) - PROOF_BYTES == sent + 3 * TAG_BYTES  # a tag behind each frame
    finally:
        client.close()
        server.close()
        listener.close()  # type: ignore[attr-defined]
        await proxy.stop()
