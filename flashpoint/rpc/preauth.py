"""What a peer that has not proved the cluster secret can make the RPC server hold.

The WebSocket frame limit (``max_frame_bytes``, 16 MiB by default) is for authenticated
peers; before the handshake completes a peer may send only :data:`PREAUTH_MAX_BYTES` in all
(the handshake's proof is about 100 bytes), and the server runs at most ``max_handshakes``
handshakes and ``max_connections`` connections at once (more are refused with a 503 before
the upgrade).

aiohttp fixes a WebSocket's message limit when the response is prepared and has no way to
raise it later, so :class:`PreAuthGate` sits in front of the frame parser aiohttp feeds the
connection's bytes to, counts them until the handshake opens the gate, and closes the
connection when the count goes over. Installing it touches one aiohttp attribute; if that is
missing (another aiohttp), :func:`install_gate` says so once and the connection caps still hold.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from flashpoint.log import get_logger

log = get_logger(__name__)

PREAUTH_MAX_BYTES = 64 * 1024
DEFAULT_MAX_HANDSHAKES = 64
DEFAULT_MAX_CONNECTIONS = 1024

REFUSED = Counter("flashpoint_rpc_preauth_refused_total",
                  "RPC peers cut off before authenticating, by reason "
                  "(preauth_bytes, handshakes, connections)", ["reason"])

_warned = False


class PreAuthGate:
    """A byte budget in front of a connection's WebSocket parser until :meth:`open`."""

    def __init__(self, inner: Any, transport: asyncio.BaseTransport | None, max_bytes: int,
                 peer: str) -> None:
        self._inner = inner
        self._transport = transport
        self.max_bytes = max_bytes
        self.peer = peer
        self.received_bytes = 0
        self.is_open = False
        self.tripped = False

    def open(self) -> None:
        """The peer proved the secret: pass everything from now on."""
        self.is_open = True

    def feed_data(self, data: Any) -> tuple[bool, bytes]:
        if not self.is_open:
            self.received_bytes += len(data)
            if self.received_bytes > self.max_bytes:
                if not self.tripped:
                    self.tripped = True
                    REFUSED.labels("preauth_bytes").inc()
                    log.warning("rpc peer sent too much before authenticating", peer=self.peer,
                                received_bytes=self.received_bytes, max_bytes=self.max_bytes)
                    if self._transport is not None:
                        self._transport.close()
                return True, b""
        return self._inner.feed_data(data)

    def feed_eof(self) -> Any:
        return self._inner.feed_eof()


def install_gate(request: web.Request, max_bytes: int = PREAUTH_MAX_BYTES) -> PreAuthGate | None:
    """Put a :class:`PreAuthGate` in front of the prepared WebSocket ``request``'s parser."""
    global _warned
    protocol = request.protocol
    inner = getattr(protocol, "_payload_parser", None)
    if inner is None or not hasattr(inner, "feed_data") or not hasattr(inner, "feed_eof"):
        if not _warned:
            _warned = True
            log.warning("rpc pre-auth byte budget unavailable with this aiohttp; "
                        "connection caps still apply")
        return None
    gate = PreAuthGate(inner, request.transport, max_bytes, str(request.remote))
    protocol._payload_parser = gate  # noqa: SLF001 - see the module docstring
    return gate
