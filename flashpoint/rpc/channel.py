"""Byte channels: one message in, one message out, no knowledge of frames.

:class:`WebSocketChannel` wraps an aiohttp WebSocket (client or server side);
:func:`memory_pair` gives two connected in-process ends for tests and the in-process hub.
``recv`` raises :class:`PeerLost` once the peer is gone and :class:`FrameTooLarge` when the
peer sent a message over the limit (the channel is then unusable).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

import aiohttp
from aiohttp import web

from flashpoint.errors import FrameTooLarge, PeerLost, ProtocolError

CLOSE_TIMEOUT_S = 2.0


class Channel(ABC):
    """An ordered, message-framed, bidirectional byte channel."""

    peer: str = ""

    @abstractmethod
    async def send(self, data: bytes) -> None:
        """Send one message; raises PeerLost if the channel is closed."""

    @abstractmethod
    async def recv(self) -> bytes:
        """Receive one message; raises PeerLost when closed, FrameTooLarge when oversized."""

    @abstractmethod
    async def close(self) -> None:
        """Close; idempotent, bounded in time."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...


class WebSocketChannel(Channel):
    """An aiohttp WebSocket (``ClientWebSocketResponse`` or ``WebSocketResponse``).

    ``session``, when given, is owned by the channel and closed with it (client side).
    """

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
        *,
        peer: str = "",
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._ws = ws
        self._session = session
        self._closed = False
        self.peer = peer

    @property
    def closed(self) -> bool:
        return self._closed or self._ws.closed

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise PeerLost(f"channel to {self.peer} is closed", peer=self.peer)
        try:
            await self._ws.send_bytes(data)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            raise PeerLost(f"send to {self.peer} failed: {type(exc).__name__}", peer=self.peer) from None

    async def recv(self) -> bytes:
        msg = await self._ws.receive()
        if msg.type is aiohttp.WSMsgType.BINARY:
            return msg.data
        if msg.type is aiohttp.WSMsgType.ERROR:
            exc: Any = msg.data
            if isinstance(exc, aiohttp.WebSocketError) and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                raise FrameTooLarge(f"{self.peer} sent a message over the frame limit", peer=self.peer)
            raise PeerLost(f"channel to {self.peer} failed: {type(exc).__name__}", peer=self.peer)
        if msg.type is aiohttp.WSMsgType.TEXT:
            raise ProtocolError(f"{self.peer} sent a text message", peer=self.peer)
        raise PeerLost(f"channel to {self.peer} closed ({msg.type.name})", peer=self.peer)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._ws.close()
        except (TimeoutError, ConnectionError, aiohttp.ClientError, RuntimeError):
            pass
        finally:
            if self._session is not None:
                await self._session.close()


_EOF = None


class MemoryChannel(Channel):
    """One end of an in-process pair; build with :func:`memory_pair`."""

    def __init__(self, inbox: asyncio.Queue[bytes | None], *, peer: str) -> None:
        self._inbox = inbox
        self._other: MemoryChannel | None = None
        self._closed = False
        self.peer = peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, data: bytes) -> None:
        other = self._other
        if self._closed or other is None or other._closed:
            raise PeerLost(f"channel to {self.peer} is closed", peer=self.peer)
        other._inbox.put_nowait(bytes(data))

    async def recv(self) -> bytes:
        if self._closed and self._inbox.empty():
            raise PeerLost(f"channel to {self.peer} is closed", peer=self.peer)
        data = await self._inbox.get()
        if data is _EOF:
            self._inbox.put_nowait(_EOF)  # every later recv sees EOF too
            raise PeerLost(f"channel to {self.peer} closed", peer=self.peer)
        return data

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put_nowait(_EOF)
        if self._other is not None and not self._other._closed:
            self._other._inbox.put_nowait(_EOF)


def memory_pair(name_a: str = "a", name_b: str = "b") -> tuple[MemoryChannel, MemoryChannel]:
    """Two connected in-process channel ends; ``a.peer == name_b`` and vice versa."""
    a = MemoryChannel(asyncio.Queue(), peer=name_b)
    b = MemoryChannel(asyncio.Queue(), peer=name_a)
    a._other, b._other = b, a
    return a, b
