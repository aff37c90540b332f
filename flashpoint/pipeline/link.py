"""ActivationLink: one authenticated TCP connection carrying activation frames.

The only code of the pipeline that touches a socket. It reuses the data plane's
:class:`~flashpoint.transfer.wire.DataConn` (raw non-blocking socket, mutual HMAC handshake
on the cluster secret, bounded reads and writes that close the connection when they fail,
time out or are cancelled) and adds the frame format of :mod:`flashpoint.pipeline.frames`:
whole frames are written under a lock (so replies from several tasks never interleave)
and read with the size checked before any body byte is buffered.
"""

from __future__ import annotations

import asyncio

from flashpoint.errors import FlashpointError
from flashpoint.pipeline.frames import (
    HEAD,
    MAX_FRAME_BYTES,
    Frame,
    FrameKind,
    parse_head,
    parse_table,
)
from flashpoint.transfer.plan import Endpoint
from flashpoint.transfer.wire import DataConn


class ActivationLink:
    """Frames over one :class:`DataConn`; readers: one task at a time; writers: any."""

    def __init__(self, conn: DataConn, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.conn = conn
        self.max_frame_bytes = max_frame_bytes
        self._write_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, endpoint: Endpoint, secret: bytes, *, name: str, timeout_s: float,
                      max_frame_bytes: int = MAX_FRAME_BYTES) -> ActivationLink:
        """Connect and authenticate. ConnectFailed (unreachable) or AuthFailed (the peer does
        not prove the secret, or refuses ours)."""
        conn = await DataConn.connect(endpoint, secret, name=name, timeout_s=timeout_s)
        return cls(conn, max_frame_bytes=max_frame_bytes)

    @property
    def peer(self) -> str:
        return self.conn.peer

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def close(self) -> None:
        self.conn.close()

    async def send(self, buffers: list[bytes | memoryview], timeout_s: float) -> None:
        """Write one whole frame; ``timeout_s`` bounds the wait for the lock and each stall.
        PeerLost / DeadlineExceeded close the link (its stream position is unknown)."""
        async with asyncio.timeout(timeout_s):
            await self._write_lock.acquire()
        try:
            await self.conn.sendmsg_all(buffers, timeout_s)
        finally:
            self._write_lock.release()

    async def recv(self, idle_timeout_s: float, stall_timeout_s: float) -> Frame:
        """Read one frame: ``idle_timeout_s`` bounds the wait for its first bytes,
        ``stall_timeout_s`` each later read. ProtocolError / FrameTooLarge close the link;
        PeerLost on EOF; DeadlineExceeded (link closed) when a bound passes."""
        head_buf = await self.conn.recv_exact(HEAD.size, idle_timeout_s)
        try:
            head = parse_head(head_buf, max_frame_bytes=self.max_frame_bytes)
            table_raw = await self.conn.recv_exact(head.table_bytes, stall_timeout_s)
            table = parse_table(head, table_raw) if head.kind is not FrameKind.ERROR else ()
        except FlashpointError:
            self.close()
            raise
        data = bytearray(head.data_bytes)
        if data:
            await self.conn.recv_exact_into(memoryview(data), stall_timeout_s)
        return Frame(head, table_raw, table, data)
