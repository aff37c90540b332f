"""ActivationLink: one authenticated TCP connection carrying activation frames.

The only code of the pipeline that touches a socket. It reuses the data plane's
:class:`~flashpoint.transfer.wire.DataConn` (raw non-blocking socket, mutual HMAC handshake
on the cluster secret, bounded reads and writes that close the connection when they fail,
time out or are cancelled) and adds the frame format of :mod:`flashpoint.pipeline.frames`:
whole frames are written under a lock (so replies from several tasks never interleave)
and read with the size checked before any body byte is buffered.

Every frame is followed by a 32-byte tag, HMAC-SHA256 under the connection's session key
(derived by the handshake from the cluster secret and both nonces, never sent) of the
direction, the frame's sequence number on that direction (u64, from 0) and the frame's
bytes. A frame altered, dropped, replayed, reordered or moved to another connection or
direction on the way fails its tag: the reader raises IntegrityError and closes the link
(every request on it then fails as PeerLost, like any lost link). Frames are not
encrypted: run the cluster's links on a private network (deploy/README.md, TLS).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from typing import Any

from flashpoint.errors import FlashpointError, IntegrityError
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

TAG_BYTES = 32
# Frames at least this big are MACed on a thread (hashlib releases the GIL): ~0.5 ms of
# SHA-256 that would otherwise block the event loop.
THREAD_MAC_BYTES = 1 << 20
_SEQ = struct.Struct("!Q")
_TO_SERVER = b"fp-act c>s"
_TO_CLIENT = b"fp-act s>c"


def frame_tag(key: bytes, direction: bytes, seq: int, buffers: list[Any]) -> bytes:
    """HMAC-SHA256(key, direction + seq + the frame's bytes): one frame's tag."""
    mac = hmac.new(key, direction + _SEQ.pack(seq), hashlib.sha256)
    for buf in buffers:
        mac.update(buf)
    return mac.digest()


def _nbytes(buffers: list[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class ActivationLink:
    """Frames over one :class:`DataConn`; readers: one task at a time; writers: any."""

    def __init__(self, conn: DataConn, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not conn.session_key:
            raise ValueError("an activation link needs a connection that passed the handshake")
        self.conn = conn
        self.max_frame_bytes = max_frame_bytes
        self._write_lock = asyncio.Lock()
        self._key = conn.session_key
        self._out, self._in = ((_TO_SERVER, _TO_CLIENT) if conn.initiator
                               else (_TO_CLIENT, _TO_SERVER))
        self._sent = 0  # frames sent / received on this link: the next tag's sequence number
        self._received = 0

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

    async def _tag(self, direction: bytes, seq: int, buffers: list[Any]) -> bytes:
        if _nbytes(buffers) >= THREAD_MAC_BYTES:
            return await asyncio.to_thread(frame_tag, self._key, direction, seq, buffers)
        return frame_tag(self._key, direction, seq, buffers)

    async def send(self, buffers: list[bytes | memoryview], timeout_s: float) -> None:
        """Write one whole frame and its tag; ``timeout_s`` bounds the wait for the lock and
        each stall. PeerLost / DeadlineExceeded close the link (its stream position is
        unknown)."""
        async with asyncio.timeout(timeout_s):
            await self._write_lock.acquire()
        try:
            seq, self._sent = self._sent, self._sent + 1
            try:
                tag = await self._tag(self._out, seq, buffers)
            except BaseException:
                self.close()  # this sequence number is spent: the link cannot go on
                raise
            await self.conn.sendmsg_all([*buffers, tag], timeout_s)
        finally:
            self._write_lock.release()

    async def recv(self, idle_timeout_s: float, stall_timeout_s: float) -> Frame:
        """Read one frame and check its tag: ``idle_timeout_s`` bounds the wait for its first
        bytes, ``stall_timeout_s`` each later read. ProtocolError / FrameTooLarge /
        IntegrityError (a tag that does not verify) close the link; PeerLost on EOF;
        DeadlineExceeded (link closed) when a bound passes."""
        head_buf = await self.conn.recv_exact(HEAD.size, idle_timeout_s)
        try:
            head = parse_head(head_buf, max_frame_bytes=self.max_frame_bytes)
            table_raw = await self.conn.recv_exact(head.table_bytes, stall_timeout_s)
        except FlashpointError:
            self.close()
            raise
        data = bytearray(head.data_bytes)
        if data:
            await self.conn.recv_exact_into(memoryview(data), stall_timeout_s)
        tag = await self.conn.recv_exact(TAG_BYTES, stall_timeout_s)
        seq, self._received = self._received, self._received + 1
        try:
            want = await self._tag(self._in, seq, [head_buf, table_raw, data])
            if not hmac.compare_digest(tag, want):
                raise IntegrityError(f"activation frame {seq} from {self.peer} fails its MAC "
                                     "(altered, replayed or reordered on the way)",
                                     peer=self.peer, seq=seq)
            # Parsed only once authentic: a forged table never reaches the decoder.
            table = parse_table(head, table_raw) if head.kind is not FrameKind.ERROR else ()
        except BaseException:
            self.close()
            raise
        return Frame(head, table_raw, table, data)
