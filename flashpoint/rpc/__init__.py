"""Actor RPC: symmetric, authenticated, msgpack-framed connections over aiohttp WebSockets
(``ws://host:port/rpc``) or an in-process hub (``inproc://name``).

    server = RpcServer({"ping": ping}, secret=secret)
    host, port = await server.start("127.0.0.1", 0)
    conn = await connect(f"ws://{host}:{port}/rpc", {"echo": echo}, secret=secret)
    reply = await conn.call("ping", {"n": 1}, timeout_s=1.0)

Remote errors re-raise as the same :mod:`flashpoint.errors` class; see ``connection.py`` for
deadlines and cancellation, ``auth.py`` for the handshake.
"""

from flashpoint.rpc.backoff import Backoff, is_retryable, retry
from flashpoint.rpc.channel import Channel, MemoryChannel, WebSocketChannel, memory_pair
from flashpoint.rpc.client import ReconnectingClient, RpcPool, connect
from flashpoint.rpc.connection import Handler, RpcConnection
from flashpoint.rpc.frames import DEFAULT_MAX_FRAME_BYTES
from flashpoint.rpc.inproc import InprocHub, default_hub
from flashpoint.rpc.server import RpcServer

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "Backoff",
    "Channel",
    "Handler",
    "InprocHub",
    "MemoryChannel",
    "ReconnectingClient",
    "RpcConnection",
    "RpcPool",
    "RpcServer",
    "WebSocketChannel",
    "connect",
    "default_hub",
    "is_retryable",
    "memory_pair",
    "retry",
]
