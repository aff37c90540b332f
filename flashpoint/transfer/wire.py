"""Data-plane framing over raw non-blocking TCP sockets (the data port).

    server -> client   HELLO    magic "FPD1" + nonce_s (16 B)
    client -> server   PROOF    nonce_c (16 B) + HMAC(secret, b"dp-client" + nonce_s + nonce_c)
    server -> client   WELCOME  HMAC(secret, b"dp-server" + nonce_c + nonce_s)
                                (a bad proof: the server closes without a word)
    then               HEADER   u32 length + msgpack dict ({"op": "get"|"chain"|"status", ...})
    bulk               FRAME    struct (index u32, offset u32, length u32, flags u32) + raw bytes

The handshake is lighter than the RPC one (fixed-size binary, no msgpack) because it runs
once per data connection and must not cost a round of framing; it is still mutual, so a
node never streams model bytes to, or accepts them from, a peer without the cluster secret.
Both ends also derive a per-connection session key, HMAC(secret, b"dp-session" + nonce_s +
nonce_c) (never sent), which pipeline activation links use to MAC every frame
(:mod:`flashpoint.pipeline.link`); model chunks need none: they are checked against the
manifest's sha256 per chunk.

Bulk bytes never pass through msgpack or a ``bytes`` object: :meth:`DataConn.recv_into`
reads straight into the caller's memoryview (a segment's mmap) and :meth:`send_frame`
writes a memoryview slice with one ``sendmsg`` when the socket has room. Every await is
bounded by a timeout; a connection whose read or write was cancelled or timed out is
closed, because its stream position is unknown.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import math
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
from prometheus_client import Counter

from flashpoint.errors import AuthFailed, ConnectFailed, DeadlineExceeded, PeerLost, ProtocolError
from flashpoint.log import get_logger
from flashpoint.transfer.plan import Endpoint

log = get_logger(__name__)

MAGIC = b"FPD1"
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_HEADER_BYTES = 8 * 1024 * 1024  # a manifest with thousands of tensors fits; more is abuse
MAX_HEADER_DEPTH = 32  # a manifest nests a few levels; msgpack alone would allow about 1000
SOCK_BUF_BYTES = 4 * 1024 * 1024
RCVLOWAT_MAX_BYTES = 256 * 1024

FRAME = struct.Struct("!IIII")  # chunk index, offset within chunk, length, flags
FLAG_DATA = 0
FLAG_END = 1  # no more frames: the sender delivered everything it meant to
FLAG_ABORT = 2  # the sender cannot deliver the rest: pull it from fallback sources now
FLAG_KEEPALIVE = 4  # nothing to send yet; proves the sender is alive (no payload)

_U32 = struct.Struct("!I")

BYTES_SENT = Counter("flashpoint_transfer_sent_bytes_total",
                     "Model bytes sent on the data plane, by role (head, relay, serve)", ["role"])
BYTES_RECEIVED = Counter("flashpoint_transfer_received_bytes_total",
                         "Model bytes received on the data plane, by role (chain, pull)", ["role"])
VERIFY_FAILURES = Counter("flashpoint_transfer_chunk_verify_failures_total",
                          "Chunks whose bytes failed their sha256, by where they came from", ["role"])
CHAIN_SPLICES = Counter("flashpoint_transfer_chain_splices_total",
                        "Dead hops spliced out of a chain (the chain repaired around them)")


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


async def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A tuned, listening TCP socket on ``host:port`` (0 = any free port)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock)  # accepted sockets inherit the window set before listen()
        sock.bind(sockaddr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


async def accept_loop(listener: socket.socket,
                      on_conn: Callable[[socket.socket, str], None], event: str) -> None:
    """Accept connections on ``listener`` forever, tune each and hand it to ``on_conn`` with
    its ``addr:port``. Accept errors (EMFILE and friends) are logged as ``event`` and retried
    after a pause: the server keeps serving."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock, addr = await loop.sock_accept(listener)
        except OSError as exc:
            log.warning(event, error=repr(exc))
            await asyncio.sleep(0.1)
            continue
        tune_socket(sock)
        on_conn(sock, f"{addr[0]}:{addr[1]}")


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle, big kernel buffers (a 4 MiB window keeps a fast link full)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF_BYTES)
        except OSError:
            pass  # capped by net.core.*mem_max; the kernel keeps its default


class DataConn:
    """One authenticated data-plane connection: the only code that touches its socket."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.peer_name = ""
        self._loop = asyncio.get_running_loop()
        self._frame_buf = bytearray(FRAME.size)
        self.closed = False
        self._pending = 0
        self._read_broken = False
        self._lowat = 1
        # Set by the handshake: this connection's session key, and whether we opened it.
        self.session_key = b""
        self.initiator = False

    # -- opening --------------------------------------------------------------------------

    @classmethod
    async def connect(cls, endpoint: Endpoint, secret: bytes, *, name: str,
                      timeout_s: float) -> DataConn:
        """Connect and authenticate (both bounded by ``timeout_s``). ConnectFailed when the
        peer cannot be reached, AuthFailed when it does not prove the secret."""
        loop = asyncio.get_running_loop()
        try:
            # A numeric address needs no resolver thread (a hop's setup is on the critical
            # path of a chain: every link runs at the same rate, so a delay is never made up).
            family = socket.AF_INET6 if ipaddress.ip_address(endpoint.addr).version == 6 else socket.AF_INET
            sockaddr: Any = (endpoint.addr, endpoint.port)
        except ValueError:
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(endpoint.addr, endpoint.port, type=socket.SOCK_STREAM), timeout_s)
            except (OSError, TimeoutError) as exc:
                raise ConnectFailed(f"cannot resolve {endpoint}: {exc}", peer=str(endpoint)) from None
            family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune_socket(sock)
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, sockaddr)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectFailed(f"cannot connect to {endpoint}: {exc!r}", peer=str(endpoint)) from None
        except BaseException:
            sock.close()
            raise
        conn = cls(sock, str(endpoint))
        try:
            await conn._client_handshake(secret, name, timeout_s)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _client_handshake(self, secret: bytes, name: str, timeout_s: float) -> None:
        try:
            hello = await self.recv_exact(len(MAGIC) + NONCE_BYTES, timeout_s)
        except (PeerLost, DeadlineExceeded) as exc:
            raise ConnectFailed(f"handshake with {self.peer} failed: {exc.message}") from None
        if hello[:4] != MAGIC:
            raise ProtocolError(f"{self.peer} is not a data-plane port")
        nonce_s = hello[4:]
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        await self.sendall(nonce_c + _mac(secret, b"dp-client", nonce_s, nonce_c), timeout_s)
        try:
            welcome = await self.recv_exact(MAC_BYTES, timeout_s)
        except PeerLost:
            raise AuthFailed(f"{self.peer} refused our proof (cluster secret differs)") from None
        if not hmac.compare_digest(welcome, _mac(secret, b"dp-server", nonce_c, nonce_s)):
            raise AuthFailed(f"{self.peer} does not know the cluster secret")
        self.peer_name = name
        self.session_key = _mac(secret, b"dp-session", nonce_s, nonce_c)
        self.initiator = True

    async def server_handshake(self, secret: bytes, timeout_s: float) -> None:
        """Server side; raises AuthFailed (the caller closes) on a bad or missing proof."""
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        try:
            await self.sendall(MAGIC + nonce_s, timeout_s)
            proof = await self.recv_exact(NONCE_BYTES + MAC_BYTES, timeout_s)
        except (PeerLost, DeadlineExceeded) as exc:
            raise AuthFailed(f"handshake with {self.peer} failed: {exc.message}") from None
        nonce_c, mac = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(secret, b"dp-client", nonce_s, nonce_c)):
            raise AuthFailed(f"{self.peer} does not know the cluster secret")
        await self.sendall(_mac(secret, b"dp-server", nonce_c, nonce_s), timeout_s)
        self.session_key = _mac(secret, b"dp-session", nonce_s, nonce_c)

    # -- raw bytes ------------------------------------------------------------------------

    async def recv_into(self, buf: memoryview, timeout_s: float) -> int:
        """Read at least one byte into ``buf`` (returns the count). PeerLost on EOF or a
        reset, DeadlineExceeded when nothing arrives within ``timeout_s``."""
        if self.closed or self._read_broken:
            raise PeerLost(f"{self.peer}: connection closed")
        try:
            n = self.sock.recv_into(buf)  # fast path: data already waiting, no timer needed
        except BlockingIOError:
            # Wake only once a useful amount has arrived (never more than the caller wants,
            # so a short frame can never wait for bytes that are not coming): on a capped
            # link this cuts the per-packet-burst wakeups of a relay by about an order.
            lowat = min(len(buf), RCVLOWAT_MAX_BYTES)
            if lowat != self._lowat:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                self._lowat = lowat
            n = await self._wait_io(self._loop.sock_recv_into(self.sock, buf), timeout_s,
                                    "nothing received", reading=True)
        except OSError as exc:
            self.close()
            raise PeerLost(f"{self.peer}: {exc!r}") from None
        if n == 0:
            self.close()
            raise PeerLost(f"{self.peer} closed the connection")
        return n

    async def _wait_io(self, op: Any, timeout_s: float, what: str, reading: bool = False) -> Any:
        """Await one loop socket op, bounded; any failure closes the connection (its stream
        position is unknown). The fd is only closed once no op is pending on it, so a loop
        callback can never touch a later socket that reuses the fd number."""
        self._pending += 1
        try:
            async with asyncio.timeout(timeout_s):
                return await op
        except TimeoutError:
            self.close()
            raise DeadlineExceeded(f"{self.peer}: {what} for {timeout_s}s") from None
        except OSError as exc:
            self.close()
            raise PeerLost(f"{self.peer}: {exc!r}") from None
        except BaseException:
            if reading:
                # A cancelled read leaves the read side at an unknown position, but the write
                # side is intact: the owner may still say goodbye ("superseded") on it.
                self._read_broken = True
            else:
                self.close()
            raise
        finally:
            self._pending -= 1
            if self.closed and self._pending == 0 and self.sock.fileno() >= 0:
                self.sock.close()

    async def recv_exact_into(self, buf: memoryview, timeout_s: float) -> None:
        pos = 0
        while pos < len(buf):
            pos += await self.recv_into(buf[pos:], timeout_s)

    async def recv_exact(self, n: int, timeout_s: float) -> bytes:
        buf = bytearray(n)
        await self.recv_exact_into(memoryview(buf), timeout_s)
        return bytes(buf)

    async def sendall(self, data: bytes | memoryview, timeout_s: float) -> None:
        await self.sendmsg_all([data], timeout_s)

    async def sendmsg_all(self, bufs: list[Any], timeout_s: float) -> None:
        """Send every buffer; one ``sendmsg`` when the socket has room, else the loop's
        ``sock_sendall`` for what is left, bounded by ``timeout_s`` (the stall timeout)."""
        if self.closed:
            raise PeerLost(f"{self.peer}: connection closed")
        try:
            sent = self.sock.sendmsg(bufs)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.close()
            raise PeerLost(f"{self.peer}: {exc!r}") from None
        for b in bufs:
            mv = memoryview(b).cast("B")
            if sent >= len(mv):
                sent -= len(mv)
                continue
            rest = mv[sent:]
            sent = 0
            await self._wait_io(self._loop.sock_sendall(self.sock, rest), timeout_s, "send stalled")

    # -- headers --------------------------------------------------------------------------

    async def send_header(self, header: dict[str, Any], timeout_s: float) -> None:
        body = msgpack.packb(header, use_bin_type=True)
        if len(body) > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {len(body)} bytes over the limit {MAX_HEADER_BYTES}")
        await self.sendmsg_all([_U32.pack(len(body)), body], timeout_s)

    async def recv_header(self, timeout_s: float) -> dict[str, Any]:
        (n,) = _U32.unpack(await self.recv_exact(4, timeout_s))
        if n > MAX_HEADER_BYTES:
            self.close()
            raise ProtocolError(f"{self.peer}: header of {n} bytes over the limit {MAX_HEADER_BYTES}")
        body = await self.recv_exact(n, timeout_s)
        try:
            return decode_header(body)
        except ProtocolError as exc:
            self.close()
            raise ProtocolError(f"{self.peer}: {exc.message}") from None

    # -- frames ---------------------------------------------------------------------------

    async def send_frame(self, index: int, offset: int, payload: memoryview | bytes | None,
                         flags: int, timeout_s: float) -> None:
        n = 0 if payload is None else len(payload)
        head = FRAME.pack(index, offset, n, flags)
        await self.sendmsg_all([head] if payload is None else [head, payload], timeout_s)

    async def recv_frame_header(self, timeout_s: float) -> tuple[int, int, int, int]:
        await self.recv_exact_into(memoryview(self._frame_buf), timeout_s)
        return FRAME.unpack(self._frame_buf)

    def close(self) -> None:
        """Close now, or (an op still pending) shut it down so that op wakes and fails, and
        close the fd when it has."""
        if self.closed:
            return
        self.closed = True
        if self._pending:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            self.sock.close()


# Header fields that are durations or positions: bounded like the RPC codec's request
# ``timeout_s`` (rpc/frames.py), so a peer cannot send NaN, a negative or a week-plus wait.
MAX_HEADER_TIMEOUT_S = 7 * 24 * 3600.0
_DURATION_FIELDS = ("timeout_s", "stall_timeout_s", "orphan_grace_s")
_COUNT_FIELDS = ("position",)
_MAX_COUNT = 2**32


def decode_header(body: bytes) -> dict[str, Any]:
    """A header's msgpack body as a dict nested at most MAX_HEADER_DEPTH levels;
    ProtocolError for anything else.

    ``skip`` first: it builds nothing and fails on lengths the body cannot back, which msgpack
    would otherwise start allocating for (as in ``rpc.frames._check_claims``). Like the RPC
    codec, ext types are refused, lengths are bounded by the body, every float must be
    finite, and the duration and position fields must be in range.
    """
    limit = max(len(body), 1)
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=limit)
        unpacker.feed(body)
        unpacker.skip()
        header = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=limit,
                                 max_str_len=limit, max_array_len=limit, max_map_len=limit,
                                 max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed header: {type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    stack: list[tuple[Any, int]] = [(header, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_HEADER_DEPTH:
            raise ProtocolError(f"header nested deeper than {MAX_HEADER_DEPTH} levels")
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif isinstance(child, float) and not math.isfinite(child):
                raise ProtocolError("header numbers must be finite")
    for name in _DURATION_FIELDS:
        v = header.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v <= MAX_HEADER_TIMEOUT_S):
            raise ProtocolError(f"header {name} must be a positive number of seconds "
                                f"up to {MAX_HEADER_TIMEOUT_S:.0f}")
    for name in _COUNT_FIELDS:
        v = header.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not 0 <= v < _MAX_COUNT):
            raise ProtocolError(f"header {name} must be an integer in [0, 2**32)")
    return header


async def refuse(conn: DataConn) -> None:
    """Close without a word: a peer that failed authentication learns nothing."""
    conn.close()
