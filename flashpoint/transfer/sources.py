"""Pull sources for model chunks, and the verified fill of a segment from them.

A :class:`ChunkSource` writes the raw bytes of one chunk into a destination buffer (a slice
of the segment's mmap) and vouches for nothing; :func:`fill` verifies every chunk it gets
and only then marks it, trying the next source on a bad or failed read. Sources, in the
sourcing order of the design: a peer's RAM (:class:`PeerSource`, the data plane's ``get``
op) before the registry (:class:`RegistrySource`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from flashpoint.errors import (
    AuthFailed,
    BadRequest,
    ConnectFailed,
    DeadlineExceeded,
    FlashpointError,
    IntegrityError,
    ModelNotFound,
    NotFound,
    ProtocolError,
    TransferFailed,
    from_wire,
)
from flashpoint.log import get_logger
from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.plan import Endpoint, FaultPlan
from flashpoint.transfer.segment import Segment, segment_key
from flashpoint.transfer.wire import (
    BYTES_RECEIVED,
    BYTES_SENT,
    FLAG_DATA,
    FLAG_END,
    VERIFY_FAILURES,
    DataConn,
)

__all__ = ["ChunkSource", "Endpoint", "PeerSource", "RegistrySource", "fill", "sources_from_wire"]

log = get_logger(__name__)

# A source that cannot even be reached is skipped for the rest of a fill rather than paying
# a connect timeout per chunk; a source that merely lacks a chunk or sent bad bytes is not.
_UNREACHABLE = (ConnectFailed, AuthFailed)
MAX_GET_CHUNKS = 65536
GET_PIECE_BYTES = 1024 * 1024


@runtime_checkable
class ChunkSource(Protocol):
    """Where raw chunk bytes can be pulled from."""

    name: str  # "registry" or "peer:<host_id>"

    async def read_into(self, manifest: Manifest, index: int, dest: memoryview) -> None:
        """Write chunk ``index``'s raw, unverified bytes into ``dest`` (exactly its size)."""
        ...


class RegistrySource:
    """Any ModelStore (LocalStore, S3Store), read through ``store.read_range``.

    Chunks are fetched in spans of ``span_bytes`` (one ranged GET for several consecutive
    chunks): object stores are far better at a few large ranges than at many small ones
    (AWS S3 wants 8-16 MB requests; moto's server re-reads the whole object per request).
    Concurrent readers of one span share its GET; at most ``max_spans`` spans are held, so
    memory stays bounded when only a few chunks of a span are wanted (a refetch).
    """

    name = "registry"

    def __init__(self, store: Any, *, span_bytes: int = 32 << 20, max_spans: int = 6) -> None:
        self.store = store
        self.span_bytes = span_bytes
        self.max_spans = max_spans
        self._spans: OrderedDict[tuple[str, str, int], asyncio.Future[bytes]] = OrderedDict()
        self._breaks: dict[tuple[str, str], list[int]] = {}

    def break_spans_at(self, manifest: Manifest, chunks: range) -> None:
        """No span of ``manifest`` crosses the edges of ``chunks`` (a partition stage's
        chunks): a stage then waits for its own bytes only, not for a span that starts in
        the previous stage's range."""
        edges = self._breaks.setdefault((manifest.name, manifest.version), [0])
        for edge in (chunks.start, chunks.stop):
            if 0 < edge < manifest.num_chunks and edge not in edges:
                bisect.insort(edges, edge)

    def _span_of(self, manifest: Manifest, index: int) -> tuple[int, int]:
        """First and last chunk of the span holding chunk ``index``."""
        per_span = max(1, self.span_bytes // manifest.chunk_size)
        edges = self._breaks.get((manifest.name, manifest.version), [0])
        i = bisect.bisect_right(edges, index) - 1
        base = edges[i]
        stop = edges[i + 1] if i + 1 < len(edges) else manifest.num_chunks
        first = base + (index - base) // per_span * per_span
        return first, min(first + per_span, stop) - 1

    async def read_into(self, manifest: Manifest, index: int, dest: memoryview) -> None:
        start, end = manifest.chunk_range(index)
        first, last = self._span_of(manifest, index)
        group = first  # spans are named by their first chunk
        if first == last:
            data = await self.store.read_range(manifest.name, manifest.version, start, end)
            offset = 0
        else:
            span_start = manifest.chunk_range(first)[0]
            data = await self._span(manifest, group, span_start, manifest.chunk_range(last)[1])
            offset = start - span_start
        if len(data) < offset + len(dest) or end - start != len(dest):
            raise IntegrityError(f"registry returned too few bytes for chunk {index}", chunk=index)
        dest[:] = memoryview(data)[offset:offset + len(dest)]

    async def _span(self, manifest: Manifest, group: int, start: int, end: int) -> bytes:
        key = (manifest.name, manifest.version, group)
        fut = self._spans.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self.store.read_range(manifest.name, manifest.version,
                                                              start, end))
            self._spans[key] = fut
            while len(self._spans) > self.max_spans:
                self._spans.popitem(last=False)
        else:
            self._spans.move_to_end(key)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if self._spans.get(key) is fut:
                del self._spans[key]  # a failed span is fetched again by the next reader
            raise

    async def aclose(self) -> None:
        return None


class PeerSource:
    """A peer's data-plane server: reads only chunks the peer has verified.

    Keeps up to ``max_idle`` authenticated connections for reuse (a handshake per chunk would
    cost more than a small chunk); call :meth:`aclose` when done with it.
    """

    def __init__(self, endpoint: Endpoint, secret: bytes, *, timeout_s: float = 30.0,
                 max_idle: int = 4, client_name: str = "") -> None:
        self.endpoint = endpoint
        self.name = f"peer:{endpoint.host_id}"
        self._secret = secret
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        self._client_name = client_name
        self._idle: list[DataConn] = []
        self._closed = False

    async def read_into(self, manifest: Manifest, index: int, dest: memoryview) -> None:
        conn = self._idle.pop() if self._idle else await DataConn.connect(
            self.endpoint, self._secret, name=self._client_name, timeout_s=min(self._timeout_s, 10.0))
        try:
            await self._get(conn, manifest, index, dest)
        except BaseException:
            conn.close()
            raise
        if self._closed or len(self._idle) >= self._max_idle:
            conn.close()
        else:
            self._idle.append(conn)

    async def _get(self, conn: DataConn, manifest: Manifest, index: int, dest: memoryview) -> None:
        t = self._timeout_s
        await conn.send_header({"op": "get", "key": segment_key(manifest), "chunks": [index],
                                "digest": manifest.digest}, t)
        reply = await conn.recv_header(t)
        if not reply.get("ok"):
            raise from_wire(reply.get("error"))
        if index in reply.get("missing", ()):
            raise NotFound(f"{self.name} has no verified chunk {index} of {segment_key(manifest)}",
                           chunk=index)
        pos = 0
        while True:
            i, offset, n, flags = await conn.recv_frame_header(t)
            if flags & FLAG_END:
                break
            if flags != FLAG_DATA or i != index or offset != pos or pos + n > len(dest):
                raise ProtocolError(f"{self.name}: unexpected frame {(i, offset, n, flags)}")
            await conn.recv_exact_into(dest[pos:pos + n], t)
            pos += n
        if pos != len(dest):
            raise ProtocolError(f"{self.name}: chunk {index} ended after {pos} of {len(dest)} bytes")

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def __repr__(self) -> str:
        return f"PeerSource({self.endpoint})"


def sources_from_wire(wire: Sequence[Any], *, secret: bytes, host_id: str,
                      registry: ChunkSource | None) -> list[ChunkSource]:
    """A chain header's fallback list as sources: peers (never this host itself) and
    ``"registry"`` as this host's own registry client (dropped when it has none)."""
    out: list[ChunkSource] = []
    for item in wire:
        if item == "registry":
            if registry is not None:
                out.append(registry)
            continue
        ep = Endpoint.from_wire(item)
        if ep.host_id != host_id:
            out.append(PeerSource(ep, secret, client_name=host_id))
    return out


async def fill(segment: Segment, sources: Sequence[ChunkSource], *,
               indices: Iterable[int] | None = None, concurrency: int = 4,
               timeout_s: float = 600.0) -> dict[str, int]:
    """Fetch every missing chunk (or ``indices``), verify each, try the next source on a bad
    or failed read; returns bytes per source name.

    Chunks are taken in ascending order (a relay forwarding the segment is never kept
    waiting on a late one). :class:`IntegrityError` naming the chunk when a source served
    bad bytes and no source had good ones; :class:`TransferFailed` naming it when no source
    could deliver it at all; :class:`DeadlineExceeded` after ``timeout_s``. A chunk is marked
    only after its sha256 matched.
    """
    todo = sorted(set(segment.missing() if indices is None else indices))
    todo = [i for i in todo if not segment.has(i)]
    stats: dict[str, int] = {s.name: 0 for s in sources}
    if not todo:
        return stats
    queue = iter(todo)
    unreachable: set[str] = set()
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    async def fetch_one(index: int) -> None:
        tried: dict[str, str] = {}
        bad_bytes = False
        await segment.wait_allocated(segment.manifest.chunk_range(index)[1], timeout_s)
        for src in sources:
            if src.name in unreachable:
                continue
            try:
                await src.read_into(segment.manifest, index, segment.chunk_view(index))
            except _UNREACHABLE as exc:
                unreachable.add(src.name)
                tried[src.name] = exc.code
                continue
            except (FlashpointError, OSError) as exc:
                tried[src.name] = getattr(exc, "code", type(exc).__name__)
                bad_bytes |= isinstance(exc, IntegrityError)
                continue
            if await asyncio.to_thread(segment.verify, index):
                segment.mark(index)
                n = segment.chunk_len(index)
                stats[src.name] += n
                BYTES_RECEIVED.labels("pull").inc(n)
                return
            bad_bytes = True
            tried[src.name] = "sha256_mismatch"
            VERIFY_FAILURES.labels(src.name.split(":")[0]).inc()
            log.warning("chunk_verify_failed", model=segment.key, chunk=index, source=src.name)
        segment.unmark_received(index)
        what = f"{segment.key} chunk {index}: no source had good bytes (tried {tried or 'none'})"
        if bad_bytes:
            raise IntegrityError(what, chunk=index, tried=tried)
        raise TransferFailed(what, chunk=index, tried=tried)

    async def worker() -> None:
        for index in queue:
            if errors:
                return
            if segment.has(index):
                continue
            try:
                await fetch_one(index)
            except Exception as exc:
                errors.append(exc)
                return

    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo))))))
    except TimeoutError:
        raise DeadlineExceeded(f"{segment.key}: fill took over {timeout_s}s") from None
    if errors:
        raise errors[0]
    log.debug("fill_done", model=segment.key, chunks=len(todo), stats=stats,
              seconds=round(time.perf_counter() - t0, 4))
    return stats


# --------------------------------------------------------------------------------------
# The serving side of "get" (run by DataPlaneServer)
# --------------------------------------------------------------------------------------


async def reply_error(conn: DataConn, err: FlashpointError, timeout_s: float = 10.0) -> None:
    """Best effort: the peer may already be gone."""
    try:
        await conn.send_header({"ok": False, "error": err.to_wire()}, timeout_s)
    except FlashpointError:
        pass


async def serve_get(conn: DataConn, header: dict[str, Any],
                    lookup: Callable[[str], Segment | None], host_id: str,
                    fault: FaultPlan | None = None, timeout_s: float = 30.0) -> None:
    """Answer one ``get``: name the requested chunks this host has not verified, then stream
    the verified ones (straight from the segment's mapping) and END."""
    key, chunks = header.get("key"), header.get("chunks")
    seg = lookup(key) if isinstance(key, str) else None
    digest = header.get("digest")
    if seg is not None and digest is not None and seg.manifest.digest != digest:
        seg = None  # another manifest of that version: not what the asker pinned
    if seg is None:
        await reply_error(conn, ModelNotFound(f"{host_id} holds no segment {key!r:.100}"))
        return
    n_chunks = seg.manifest.num_chunks
    if (not isinstance(chunks, list) or len(chunks) > MAX_GET_CHUNKS
            or not all(isinstance(i, int) and 0 <= i < n_chunks for i in chunks)):
        await reply_error(conn, BadRequest("chunks must be a list of chunk indices"))
        return
    have = [i for i in chunks if seg.has(i)]
    await conn.send_header({"ok": True, "missing": [i for i in chunks if not seg.has(i)]}, timeout_s)
    for i in have:
        start, end = seg.manifest.chunk_range(i)
        pos = 0
        while pos < end - start:
            upto = min(end - start, pos + GET_PIECE_BYTES)
            piece: memoryview | bytes = seg.view[start + pos:start + upto]
            if fault is not None and i in fault.corrupt_serve and pos == 0:
                bad = bytearray(piece)
                bad[0] ^= 0xFF
                piece = bytes(bad)
            await conn.send_frame(i, pos, piece, FLAG_DATA, timeout_s)
            pos = upto
        BYTES_SENT.labels("serve").inc(end - start)
    await conn.send_frame(0, 0, None, FLAG_END, timeout_s)
