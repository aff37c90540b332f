"""The connecting side: ``connect()`` for one connection, ``ReconnectingClient`` to keep one
alive, ``RpcPool`` for one shared connection per url.

Urls are ``ws://host:port/rpc`` (aiohttp WebSocket) or ``inproc://name`` (an
:class:`~flashpoint.rpc.inproc.InprocHub`). Connections are symmetric: the ``handlers`` given
here serve calls the peer makes back over the same connection.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from flashpoint.errors import ConnectFailed, FlashpointError
from flashpoint.log import get_logger
from flashpoint.rpc import frames
from flashpoint.rpc.auth import HANDSHAKE_TIMEOUT_S, check_secret, client_handshake
from flashpoint.rpc.backoff import Backoff
from flashpoint.rpc.channel import Channel, WebSocketChannel
from flashpoint.rpc.connection import Handler, RpcConnection
from flashpoint.rpc.inproc import InprocHub, default_hub

log = get_logger(__name__)

CONNECT_TIMEOUT_S = 5.0
HEARTBEAT_S = 10.0
INPROC_SCHEME = "inproc://"
RECONNECT_BACKOFF = Backoff(initial_s=0.05, max_s=2.0)


async def connect(
    url: str,
    handlers: Mapping[str, Handler] | None = None,
    *,
    secret: bytes,
    name: str = "client",
    max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    heartbeat_s: float | None = HEARTBEAT_S,
    hub: InprocHub | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> RpcConnection:
    """Open, authenticate and start a connection to ``url``.

    Raises ConnectFailed (retryable) when the peer cannot be reached in ``connect_timeout_s``
    and AuthFailed when the handshake is refused.
    """
    check_secret(secret)
    if url.startswith(INPROC_SCHEME):
        channel: Channel = (hub or default_hub()).open_channel(url[len(INPROC_SCHEME) :], client_name=name)
    elif url.startswith(("ws://", "wss://")):
        channel = await _open_ws(url, max_frame_bytes, connect_timeout_s, heartbeat_s,
                                 ssl_context)
    else:
        raise ValueError(f"unsupported rpc url {url!r}")
    try:
        peer_name = await client_handshake(
            channel, secret, name=name, timeout_s=min(connect_timeout_s, HANDSHAKE_TIMEOUT_S)
        )
    except asyncio.CancelledError:
        await channel.close()
        raise
    conn = RpcConnection(
        channel, handlers or {}, name=name, peer_name=peer_name or url, max_frame_bytes=max_frame_bytes
    )
    conn.start()
    return conn


# TLS: a ``wss://`` url is verified against the system's trust store, or against the CA
# file named by this variable (a cluster with its own CA; hosts set it for their workers).
TLS_CA_ENV = "FLASHPOINT_TLS_CA"


def client_ssl(url: str, context: ssl.SSLContext | None = None) -> ssl.SSLContext | bool:
    """How to verify ``url``'s server: ``context`` when given, else True (defaults; plain
    ws:// ignores it) or a context trusting the cluster's CA."""
    if context is not None:
        return context
    ca = os.environ.get(TLS_CA_ENV)
    if url.startswith("wss://") and ca:
        return ssl.create_default_context(cafile=ca)
    return True


async def _open_ws(
    url: str, max_frame_bytes: int, connect_timeout_s: float, heartbeat_s: float | None,
    ssl_context: ssl.SSLContext | None = None,
) -> WebSocketChannel:
    session = aiohttp.ClientSession()
    try:
        async with asyncio.timeout(connect_timeout_s):
            ws = await session.ws_connect(
                url,
                ssl=client_ssl(url, ssl_context),
                max_msg_size=max_frame_bytes,
                heartbeat=heartbeat_s,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0),
                autoping=True,
            )
    except TimeoutError:
        await session.close()
        raise ConnectFailed(f"connecting to {url} timed out after {connect_timeout_s}s", url=url) from None
    except (aiohttp.ClientError, OSError) as exc:
        await session.close()
        raise ConnectFailed(f"cannot connect to {url}: {type(exc).__name__}: {exc}", url=url) from None
    except BaseException:
        await session.close()
        raise
    return WebSocketChannel(ws, peer=url, session=session)


OnConnected = Callable[[RpcConnection], Awaitable[None] | None]


class ReconnectingClient:
    """Keeps one connection to ``url`` alive.

    After every (re)connect ``on_connected(conn)`` runs before the connection is offered to
    ``call``/``notify`` (so the caller can re-register); if it raises, the connection is
    dropped and retried. Reconnects back off with jitter, bounded by ``backoff.max_s``.
    """

    def __init__(
        self,
        url: str,
        handlers: Mapping[str, Handler] | None = None,
        *,
        secret: bytes,
        name: str = "client",
        on_connected: OnConnected | None = None,
        backoff: Backoff = RECONNECT_BACKOFF,
        max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        heartbeat_s: float | None = HEARTBEAT_S,
        hub: InprocHub | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url
        self._ssl_context = ssl_context
        self._handlers = dict(handlers or {})
        self._secret = check_secret(secret)
        self.name = name
        self._on_connected = on_connected
        self._backoff = backoff
        self._max = max_frame_bytes
        self._connect_timeout_s = connect_timeout_s
        self._heartbeat_s = heartbeat_s
        self._hub = hub
        self._conn: RpcConnection | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.last_error: FlashpointError | None = None
        self.connects = 0

    @property
    def connection(self) -> RpcConnection | None:
        """The live connection, or None while (re)connecting."""
        conn = self._conn
        return conn if conn is not None and not conn.closed else None

    async def start(self) -> None:
        """Start the background connect loop; returns at once (see ``wait_connected``)."""
        if self._task is not None:
            raise RuntimeError("client already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"rpc-reconnect:{self.url}")

    async def stop(self, timeout_s: float = 5.0) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=timeout_s)
        conn, self._conn = self._conn, None
        self._ready.clear()
        if conn is not None:
            await conn.close()

    async def wait_connected(self, timeout_s: float) -> RpcConnection:
        """The live connection, waiting up to ``timeout_s``; raises ConnectFailed otherwise."""
        conn = self.connection
        if conn is not None:
            return conn
        if self._task is None:
            raise ConnectFailed(f"client for {self.url} is not started", url=self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    await self._ready.wait()
            except TimeoutError:
                last = self.last_error.message if self.last_error else "no attempt finished"
                raise ConnectFailed(
                    f"not connected to {self.url} within {timeout_s}s ({last})", url=self.url
                ) from None
            conn = self.connection
            if conn is not None:
                return conn
            await asyncio.sleep(0)  # the loop has not cleared ``_ready`` yet

    async def call(
        self, method: str, payload: dict[str, Any], *, timeout_s: float, trace: str | None = None
    ) -> dict[str, Any]:
        """Call over the live connection, waiting for one within the same deadline."""
        conn = self.connection
        if conn is None:
            started = time.monotonic()
            conn = await self.wait_connected(timeout_s)
            timeout_s = max(timeout_s - (time.monotonic() - started), 1e-3)
        return await conn.call(method, payload, timeout_s=timeout_s, trace=trace)

    async def notify(self, method: str, payload: dict[str, Any], *, timeout_s: float = 10.0) -> None:
        conn = self.connection or await self.wait_connected(timeout_s)
        await conn.notify(method, payload, timeout_s=timeout_s)

    async def _run(self) -> None:
        delays = self._backoff.delays()
        while True:
            try:
                conn = await connect(
                    self.url,
                    self._handlers,
                    secret=self._secret,
                    name=self.name,
                    max_frame_bytes=self._max,
                    connect_timeout_s=self._connect_timeout_s,
                    heartbeat_s=self._heartbeat_s,
                    hub=self._hub,
                    ssl_context=self._ssl_context,
                )
            except FlashpointError as exc:
                self.last_error = exc
                delay = next(delays)
                log.info("rpc connect failed", url=self.url, error=exc.message, retry_in_s=round(delay, 3))
                await asyncio.sleep(delay)
                continue
            try:
                if self._on_connected is not None:
                    result: Any = self._on_connected(conn)
                    if inspect.isawaitable(result):
                        await result
            except asyncio.CancelledError:
                await conn.close()
                raise
            except Exception as exc:
                log.exception("rpc on_connected failed; reconnecting", url=self.url)
                self.last_error = FlashpointError(f"on_connected failed: {type(exc).__name__}")
                await conn.close()
                await asyncio.sleep(next(delays))
                continue
            delays = self._backoff.delays()
            self.connects += 1
            self._conn = conn
            self._ready.set()
            log.info("rpc connected", url=self.url, peer=conn.peer_name, connects=self.connects)
            try:
                await conn.wait_closed()
            finally:
                self._ready.clear()
            self.last_error = conn.close_reason
            log.info("rpc connection lost; reconnecting", url=self.url)
            await asyncio.sleep(next(delays))


class RpcPool:
    """One shared connection per url, opened on first use and reopened when it has died.

    Failures are not retried here; wrap calls in :func:`~flashpoint.rpc.backoff.retry`.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler] | None = None,
        *,
        secret: bytes,
        name: str = "client",
        max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        heartbeat_s: float | None = HEARTBEAT_S,
        hub: InprocHub | None = None,
    ) -> None:
        self._handlers = dict(handlers or {})
        self._secret = check_secret(secret)
        self.name = name
        self._max = max_frame_bytes
        self._connect_timeout_s = connect_timeout_s
        self._heartbeat_s = heartbeat_s
        self._hub = hub
        self._conns: dict[str, RpcConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def get(self, url: str, *, connect_timeout_s: float | None = None) -> RpcConnection:
        """The live connection to ``url``, connecting if there is none."""
        conn = self._conns.get(url)
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise ConnectFailed("rpc pool is closed", url=url)
        lock = self._locks.setdefault(url, asyncio.Lock())
        timeout_s = min(connect_timeout_s or self._connect_timeout_s, self._connect_timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                async with lock:
                    conn = self._conns.get(url)
                    if conn is not None and not conn.closed:
                        return conn
                    conn = await connect(
                        url,
                        self._handlers,
                        secret=self._secret,
                        name=self.name,
                        max_frame_bytes=self._max,
                        connect_timeout_s=timeout_s,
                        heartbeat_s=self._heartbeat_s,
                        hub=self._hub,
                    )
                    self._conns[url] = conn
                    return conn
        except TimeoutError:
            raise ConnectFailed(f"connecting to {url} timed out after {timeout_s}s", url=url) from None

    async def call(
        self, url: str, method: str, payload: dict[str, Any], *, timeout_s: float, trace: str | None = None
    ) -> dict[str, Any]:
        conn = self._conns.get(url)
        if conn is None or conn.closed:
            started = time.monotonic()
            conn = await self.get(url, connect_timeout_s=timeout_s)
            timeout_s = max(timeout_s - (time.monotonic() - started), 1e-3)
        return await conn.call(method, payload, timeout_s=timeout_s, trace=trace)

    async def notify(
        self, url: str, method: str, payload: dict[str, Any], *, timeout_s: float = 10.0
    ) -> None:
        conn = await self.get(url, connect_timeout_s=timeout_s)
        await conn.notify(method, payload, timeout_s=timeout_s)

    async def close_all(self) -> None:
        self._closed = True
        conns = list(self._conns.values())
        self._conns.clear()
        if conns:
            await asyncio.gather(*(c.close() for c in conns))
