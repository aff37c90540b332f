"""In-process transport: ``inproc://name`` urls reach a server registered on a hub.

The channel is a :func:`~flashpoint.rpc.channel.memory_pair`; frames are still msgpack-encoded
and the handshake still runs, so cluster tests in one event loop exercise the same code paths
as the WebSocket transport.
"""

from __future__ import annotations

from flashpoint.errors import ConnectFailed
from flashpoint.rpc.channel import Channel, memory_pair
from flashpoint.rpc.server import RpcServer


class InprocHub:
    """Names to servers within one process. A later ``register`` of a name replaces it."""

    def __init__(self) -> None:
        self._servers: dict[str, RpcServer] = {}

    def register(self, name: str, server: RpcServer) -> None:
        self._servers[name] = server

    def unregister(self, name: str, server: RpcServer | None = None) -> None:
        if server is None or self._servers.get(name) is server:
            self._servers.pop(name, None)

    def open_channel(self, name: str, *, client_name: str = "client") -> Channel:
        """A client channel to the server called ``name``; its server side is being served."""
        server = self._servers.get(name)
        if server is None or not server.accepting:
            raise ConnectFailed(f"no in-process server named {name!r}", url=f"inproc://{name}")
        client_end, server_end = memory_pair(client_name, name)
        server.accept_channel(server_end)
        return client_end


_default_hub = InprocHub()


def default_hub() -> InprocHub:
    """The process-wide hub used when ``connect`` is given no hub."""
    return _default_hub
