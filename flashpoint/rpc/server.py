"""The accepting side: authenticates each channel, then serves it as an RpcConnection.

Mount on an existing aiohttp application with :meth:`RpcServer.add_to_app` (the controller
serves HTTP from the same app) or run a standalone listener with :meth:`RpcServer.start`.
In-process channels arrive through :class:`~flashpoint.rpc.inproc.InprocHub`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from flashpoint.errors import FlashpointError, PeerLost, Unavailable
from flashpoint.log import get_logger
from flashpoint.rpc import frames
from flashpoint.rpc.auth import HANDSHAKE_TIMEOUT_S, Keyring, check_secret, server_handshake
from flashpoint.rpc.channel import Channel, WebSocketChannel
from flashpoint.rpc.connection import Handler, RpcConnection
from flashpoint.rpc.preauth import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HANDSHAKES,
    PREAUTH_MAX_BYTES,
    REFUSED,
    PreAuthGate,
    install_gate,
)

log = get_logger(__name__)

ConnHook = Callable[[RpcConnection], Awaitable[None] | None]
HEARTBEAT_S = 10.0


class RpcServer:
    """Serves ``handlers`` to every authenticated peer.

    ``on_connect(conn)`` runs after the handshake, once the connection is live (it may call
    the peer); ``on_disconnect(conn)`` runs after it closed. Either may be sync or async.
    At most ``max_handshakes`` peers are authenticating and ``max_connections`` channels are
    open at once (more get a 503); an unauthenticated peer may send ``preauth_max_bytes``
    (see ``rpc/preauth.py``).
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        *,
        secret: bytes | Keyring,
        name: str = "server",
        max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
        on_connect: ConnHook | None = None,
        on_disconnect: ConnHook | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        heartbeat_s: float | None = HEARTBEAT_S,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        preauth_max_bytes: int = PREAUTH_MAX_BYTES,
    ) -> None:
        self._handlers = dict(handlers)
        # A keyring (rpc/roles.py) gives each client name its own key.
        self._secret = secret if callable(secret) else check_secret(secret)
        self.name = name
        self.max_frame_bytes = max_frame_bytes
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._handshake_timeout_s = handshake_timeout_s
        self._heartbeat_s = heartbeat_s
        self._connections: set[RpcConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._accepting = True
        self.max_handshakes = max_handshakes
        self.max_connections = max_connections
        self.preauth_max_bytes = preauth_max_bytes
        self._handshaking = 0
        self._open_channels = 0

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def connections(self) -> frozenset[RpcConnection]:
        return frozenset(self._connections)

    # -- mounting --------------------------------------------------------------------------

    def routes(self, path: str = "/rpc") -> list[web.RouteDef]:
        return [web.get(path, self._handle_ws)]

    def add_to_app(self, app: web.Application, path: str = "/rpc") -> None:
        """Mount on ``app``; connections close when the app shuts down."""
        app.add_routes(self.routes(path))
        app.on_shutdown.append(self._on_app_shutdown)

    async def start(self, host: str = "127.0.0.1", port: int = 0, path: str = "/rpc") -> tuple[str, int]:
        """Listen on ``host:port`` (0 = ephemeral); returns the bound address."""
        if self._runner is not None:
            raise RuntimeError("server already started")
        app = web.Application()
        self.add_to_app(app, path)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._accepting = True
        bound = runner.addresses[0]
        log.info("rpc server listening", name=self.name, host=bound[0], port=bound[1])
        return bound[0], bound[1]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Refuse new peers, close every live connection, stop the listener if started."""
        self._accepting = False
        try:
            async with asyncio.timeout(timeout_s):
                await self.close_connections()
                if self._runner is not None:
                    runner, self._runner = self._runner, None
                    await runner.cleanup()
        except TimeoutError:
            log.warning("rpc server stop timed out", name=self.name, timeout_s=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)

    async def close_connections(self) -> None:
        conns = list(self._connections)
        if conns:
            await asyncio.gather(*(c.close() for c in conns))

    async def _on_app_shutdown(self, app: web.Application) -> None:
        self._accepting = False
        await self.close_connections()

    # -- accepting -------------------------------------------------------------------------

    async def _handle_ws(self, request: web.Request) -> web.StreamResponse:
        if not self._accepting:
            raise web.HTTPServiceUnavailable(text="rpc server is stopping")
        refusal = self._over_capacity()
        if refusal is not None:
            log.warning("rpc peer refused", name=self.name, peer=str(request.remote), error=refusal)
            raise web.HTTPServiceUnavailable(text=refusal, headers={"Retry-After": "1"})
        ws = web.WebSocketResponse(
            max_msg_size=self.max_frame_bytes,
            heartbeat=self._heartbeat_s,
            compress=False,
            timeout=2.0,
        )
        self._handshaking += 1  # counted from here so the prepare's await cannot overshoot
        try:
            await ws.prepare(request)
            gate = install_gate(request, self.preauth_max_bytes)
        except BaseException:
            self._handshaking -= 1
            raise
        await self.serve_channel(WebSocketChannel(ws, peer=str(request.remote)), gate=gate,
                                 counted=True)
        return ws

    def _over_capacity(self) -> str | None:
        if self._handshaking >= self.max_handshakes:
            REFUSED.labels("handshakes").inc()
            return f"{self._handshaking} peers already authenticating (max {self.max_handshakes})"
        if self._open_channels + self._handshaking >= self.max_connections:
            REFUSED.labels("connections").inc()
            return f"rpc server at its {self.max_connections}-connection limit"
        return None

    def accept_channel(self, channel: Channel) -> None:
        """Serve an in-process channel in a task this server owns."""
        if not self._accepting:
            raise RuntimeError("rpc server is not accepting")
        refusal = self._over_capacity()
        if refusal is not None:
            raise Unavailable(refusal, retry_after_s=1.0)
        self._handshaking += 1
        task = asyncio.get_running_loop().create_task(
            self.serve_channel(channel, counted=True), name=f"rpc-serve:{self.name}<-{channel.peer}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def serve_channel(self, channel: Channel, *, gate: PreAuthGate | None = None,
                            counted: bool = False) -> None:
        """Authenticate ``channel`` and serve it until it closes. ``counted``: the caller
        already counted it as authenticating (the connection caps)."""
        if not counted:
            self._handshaking += 1
        try:
            peer_name = await server_handshake(
                channel, self._secret, name=self.name, timeout_s=self._handshake_timeout_s,
                on_verified=gate.open if gate is not None else None,
            )
        except PeerLost as exc:
            # Not a refusal: the client closed first (its connect was cancelled or timed out
            # on its side, e.g. a worker stopped while connecting). Nothing to warn about.
            log.info("rpc peer left during handshake", name=self.name, peer=channel.peer,
                     error=exc.message)
            return
        except FlashpointError as exc:
            log.warning("rpc peer refused", name=self.name, peer=channel.peer, error=exc.message)
            return
        finally:
            self._handshaking -= 1
        self._open_channels += 1
        try:
            await self._serve_authenticated(channel, peer_name)
        finally:
            self._open_channels -= 1

    async def _serve_authenticated(self, channel: Channel, peer_name: str) -> None:
        conn = RpcConnection(
            channel,
            self._handlers,
            name=self.name,
            peer_name=peer_name,
            max_frame_bytes=self.max_frame_bytes,
        )
        self._connections.add(conn)
        conn.start()
        log.info("rpc peer connected", name=self.name, peer=peer_name, remote=channel.peer)
        try:
            if not self._accepting:
                return
            if self._on_connect is not None and not await _run_hook(self._on_connect, conn, "on_connect"):
                return
            await conn.wait_closed()
        finally:
            self._connections.discard(conn)
            await conn.close()
            if self._on_disconnect is not None:
                await _run_hook(self._on_disconnect, conn, "on_disconnect")


async def _run_hook(hook: ConnHook, conn: RpcConnection, what: str) -> bool:
    try:
        result: Any = hook(conn)
        if inspect.isawaitable(result):
            await result
        return True
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception(f"rpc {what} hook failed", peer=conn.peer_name)
        return False
