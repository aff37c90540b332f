"""Chunks of a model's weights blob: their byte ranges, verifying one against the manifest's
sha256, and hashing a stream into chunk digests (pure Python, no torch).

The manifest (:mod:`flashpoint.registry.manifest`) records ``chunk_size`` and one sha256 per
chunk; stores verify every chunk they read here, and publishers hash blobs here as they write
them.
"""

from __future__ import annotations

import hashlib

from flashpoint.errors import BadRequest, IntegrityError
from flashpoint.registry.manifest import DEFAULT_CHUNK_SIZE, Manifest


def chunk_ranges(blob_size: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[tuple[int, int]]:
    """``[start, end)`` of every chunk of a blob (the last one may be short)."""
    if chunk_size <= 0:
        raise BadRequest("chunk_size must be positive")
    return [(s, min(s + chunk_size, blob_size)) for s in range(0, blob_size, chunk_size)]


def verify_chunk(manifest: Manifest, index: int, data: bytes | bytearray | memoryview) -> None:
    """Raise :class:`IntegrityError` unless ``data`` is exactly chunk ``index`` of the blob."""
    start, end = manifest.chunk_range(index)
    mv = memoryview(data).cast("B")
    if len(mv) != end - start:
        raise IntegrityError(
            f"{manifest.name}:{manifest.version} chunk {index}: {len(mv)} bytes, "
            f"expected {end - start}", chunk=index,
        )
    digest = hashlib.sha256(mv).hexdigest()
    if digest != manifest.chunk_sha256[index]:
        raise IntegrityError(
            f"{manifest.name}:{manifest.version} chunk {index}: sha256 mismatch", chunk=index
        )


class ChunkHasher:
    """sha256 of every ``chunk_size`` piece of a byte stream fed in arbitrary pieces."""

    def __init__(self, chunk_size: int) -> None:
        if chunk_size <= 0:
            raise BadRequest("chunk_size must be positive")
        self._chunk_size = chunk_size
        self._hash = hashlib.sha256()
        self._filled = 0
        self.size_bytes = 0
        self.digests: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        self.size_bytes += len(mv)
        while len(mv):
            take = min(self._chunk_size - self._filled, len(mv))
            self._hash.update(mv[:take])
            self._filled += take
            mv = mv[take:]
            if self._filled == self._chunk_size:
                self.digests.append(self._hash.hexdigest())
                self._hash = hashlib.sha256()
                self._filled = 0

    def finish(self) -> list[str]:
        if self._filled:
            self.digests.append(self._hash.hexdigest())
            self._hash = hashlib.sha256()
            self._filled = 0
        return self.digests
