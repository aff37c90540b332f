"""The registry interface: where model manifests and weight blobs live.

One async protocol with several backends (``LocalStore`` today, an S3 store behind the same
methods later). Contract every backend keeps:

* ``put`` is atomic: a reader sees either no model or a complete blob with its manifest
  (the manifest is published last); a failed or crashed upload leaves nothing visible.
  Versions are immutable: putting an identical manifest again is a no-op (idempotent),
  a different one is :class:`~flashpoint.errors.Conflict`.
* ``put`` verifies the blob against the manifest's chunk hashes before publishing.
* ``read_chunk`` verifies the chunk's sha256 and raises
  :class:`~flashpoint.errors.IntegrityError` on a mismatch; ``read_range`` returns raw bytes.
* A missing model is :class:`~flashpoint.errors.ModelNotFound`; a bad name or version is
  :class:`~flashpoint.errors.InvalidName`; storage failures are
  :class:`~flashpoint.errors.RegistryError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from flashpoint.registry.chunks import verify_chunk
from flashpoint.registry.manifest import Manifest


@runtime_checkable
class ModelStore(Protocol):
    async def put(self, manifest: Manifest, blob_path: str | Path) -> None:
        """Publish ``blob_path``'s bytes under ``manifest.name``/``manifest.version``."""
        ...

    async def get_manifest(self, name: str, version: str) -> Manifest: ...

    async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
        """Blob bytes ``[start, end)``, unverified."""
        ...

    async def read_chunk(self, name: str, version: str, index: int) -> bytes:
        """Chunk ``index`` of the blob, verified against the manifest."""
        ...

    async def list_models(self) -> list[tuple[str, str]]:
        """Every published ``(name, version)``, sorted."""
        ...

    async def delete(self, name: str, version: str) -> None: ...

    async def exists(self, name: str, version: str) -> bool: ...


async def read_verified(store: ModelStore, name: str, version: str, start: int, end: int) -> bytes:
    """Blob bytes ``[start, end)`` read as whole chunks, each verified, then trimmed."""
    manifest = await store.get_manifest(name, version)
    indices = manifest.chunks_for_range(start, end)
    if not indices:
        return b""
    first = manifest.chunk_range(indices[0])[0]
    buf = bytearray()
    for i in indices:
        chunk = await store.read_range(name, version, *manifest.chunk_range(i))
        verify_chunk(manifest, i, chunk)
        buf += chunk
    return bytes(buf[start - first:end - first])
