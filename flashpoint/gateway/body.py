"""Reading request bodies under hard limits: size, decompressed size, and time.

aiohttp's server inflates ``Content-Encoding: gzip/deflate`` bodies itself by default
(``auto_decompress=True``), streaming and in bounded chunks, so the capped read below stops a
zip bomb at ``max_decompressed_bytes``. When a runner turns that off, the body arrives still
compressed and :func:`decompress` inflates it with ``zlib.decompressobj(max_length=...)``,
never holding more than the cap.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from aiohttp import web

from flashpoint.config import GatewayConfig
from flashpoint.errors import BadRequest, FlashpointError, PayloadTooLarge

_CHUNK_BYTES = 256 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_ENCODINGS = ("gzip", "x-gzip", "deflate")


def decompress(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """Inflate a gzip / deflate (zlib or raw) body, refusing to produce over ``max_bytes``."""
    if encoding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        # "deflate" means zlib-wrapped (RFC 9110) but raw deflate is common; sniff the header.
        zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] * 256 + data[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        raise BadRequest(f"unsupported Content-Encoding {encoding[:40]!r}; use gzip or deflate")
    d = zlib.decompressobj(wbits)
    out: list[bytes] = []
    produced = 0
    pending = data
    try:
        while not d.eof:
            chunk = d.decompress(pending, max_bytes - produced + 1)
            produced += len(chunk)
            if produced > max_bytes:
                raise PayloadTooLarge(
                    f"request body inflates past the {max_bytes}-byte limit")
            out.append(chunk)
            pending = d.unconsumed_tail
            if not chunk and not pending:
                break
    except zlib.error as e:
        raise BadRequest(f"corrupt {encoding} request body: {e}") from None
    if not d.eof:
        raise BadRequest(f"truncated {encoding} request body")
    if d.unused_data:
        raise BadRequest(f"{len(d.unused_data)} trailing bytes after the {encoding} stream")
    return b"".join(out)


def _looks_compressed(data: bytes, encoding: str) -> bool:
    """Whether aiohttp left the body compressed (else it already inflated it)."""
    stripped = data[:64].lstrip()
    if encoding in ("gzip", "x-gzip"):
        return data[:2] == _GZIP_MAGIC
    # Our bodies are JSON (binary tensors only follow a JSON header): inflated ones open '{'.
    return not stripped.startswith((b"{", b"["))


def _inflated_by_aiohttp(request: web.Request) -> bool:
    """Whether the server inflates encoded bodies itself (its ``auto_decompress``, aiohttp's
    default True). aiohttp has no public accessor: its ``Server`` keeps the runner's keyword
    arguments; anything unexpected there counts as True, which keeps the sniffing below."""
    server_kwargs = getattr(getattr(request.protocol, "_manager", None), "_kwargs", None)
    if not isinstance(server_kwargs, dict):
        return True
    return bool(server_kwargs.get("auto_decompress", True))


def body_if_complete(request: web.Request, config: GatewayConfig) -> bytes | None:
    """The body of the common small request, without a coroutine: an uncompressed body of a
    declared length within ``max_body_bytes`` that came whole with the headers. None for
    every other request (:func:`read_body` reads those); errors are read_body's."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return None
    declared = request.content_length
    if declared is None or declared > config.max_body_bytes:
        return None
    content = request.content
    if not content.is_eof():
        return None
    return _take_buffered(content, config.max_body_bytes)


def _take_buffered(content: Any, cap: int) -> bytes:
    """A body that came whole with the headers, from aiohttp's buffer: no wait, so no timer
    to arm on the hot path."""
    try:
        data = content.read_nowait(-1)
    except Exception as e:  # aiohttp payload / content-encoding errors
        raise BadRequest(f"could not read the request body: {type(e).__name__}") from None
    if len(data) > cap:
        raise PayloadTooLarge(f"request body is over the {cap}-byte limit")
    return data


async def read_body(request: web.Request, config: GatewayConfig) -> bytes:
    """The whole request body, inflated, within the configured limits.

    413 when the declared or streamed size is over ``max_body_bytes`` or the inflated size is
    over ``max_decompressed_bytes``; 400 for corrupt encodings or a body that does not arrive
    within ``body_read_timeout_s``.
    """
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    declared = request.content_length
    if declared is not None and declared > config.max_body_bytes:
        raise PayloadTooLarge(
            f"request body of {declared} bytes is over the {config.max_body_bytes}-byte limit")
    identity = encoding in ("", "identity")
    if not identity and encoding not in _ENCODINGS:
        raise BadRequest(f"unsupported Content-Encoding {encoding[:40]!r}; use gzip or deflate")
    # The stream may already be inflated by aiohttp, so it is capped by the larger limit.
    cap = config.max_body_bytes if identity else max(config.max_body_bytes,
                                                     config.max_decompressed_bytes)
    try:
        content = request.content
        if content.is_eof():
            data = _take_buffered(content, cap)
        else:
            data = await _read_stream(content, cap, config.body_read_timeout_s)
    except TimeoutError:
        raise BadRequest(
            f"request body not received within {config.body_read_timeout_s} s") from None
    except FlashpointError:
        raise
    except Exception as e:  # aiohttp payload / content-encoding errors
        raise BadRequest(f"could not read the request body: {type(e).__name__}") from None
    if identity:
        return data
    if not _inflated_by_aiohttp(request) or _looks_compressed(data, encoding):
        # Not inflated by aiohttp: the body must be what its Content-Encoding says (a body
        # labelled gzip that is not gzip is a 400, never served as if it were plain).
        if len(data) > config.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is over the {config.max_body_bytes}-byte limit")
        return await _inflate(data, encoding, config.max_decompressed_bytes)
    if len(data) > config.max_decompressed_bytes:
        raise PayloadTooLarge(
            f"request body inflates past the {config.max_decompressed_bytes}-byte limit")
    return data


async def _inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    if len(data) < 64 * 1024:
        return decompress(data, encoding, max_bytes)
    return await asyncio.to_thread(decompress, data, encoding, max_bytes)


async def _read_stream(content: Any, cap: int, timeout_s: float) -> bytes:
    """Read a body still arriving, chunk by chunk, within ``timeout_s`` and ``cap`` bytes."""
    chunks: list[bytes] = []
    total = 0
    async with asyncio.timeout(timeout_s):
        while chunk := await content.read(_CHUNK_BYTES):
            total += len(chunk)
            if total > cap:
                raise PayloadTooLarge(f"request body is over the {cap}-byte limit")
            chunks.append(chunk)
    return b"".join(chunks)
