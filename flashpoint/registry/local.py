"""``LocalStore``: the embedded registry backend, a directory on a local filesystem.

Layout::

    root/<name>/<version>/weights.safetensors
    root/<name>/<version>/manifest.json
    root/.tmp/put-<id>/...        uploads in progress (and leftovers of crashed ones)

A ``put`` writes the blob (verified chunk by chunk while copying) and then the manifest
into a fresh directory under ``root/.tmp``, fsyncs both files and the directory, and
renames the directory into place, so the model appears atomically, manifest and all.
``.tmp`` can never collide with a model: model names start with a letter or digit.
Every blocking file operation runs in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import time
import uuid
from pathlib import Path

from flashpoint.errors import BadRequest, Conflict, ModelNotFound, RegistryError
from flashpoint.ids import validate_name, validate_version
from flashpoint.registry.blob_header import check_header, parse_header
from flashpoint.registry.chunks import verify_chunk
from flashpoint.registry.manifest import Manifest
from flashpoint.registry.store import read_verified

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
TMP_DIR = ".tmp"
_COPY_PIECE_BYTES = 8 * 1024 * 1024


def _fsync_file(f) -> None:  # noqa: ANN001 - any file object with fileno()
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        _fsync_file(f)


def read_exact(f, start: int, n: int) -> bytes:  # noqa: ANN001
    """Exactly ``n`` bytes of file ``f`` from ``start`` (RegistryError on a short file)."""
    f.seek(start)
    out = bytearray()
    while len(out) < n:
        piece = f.read(n - len(out))
        if not piece:
            raise RegistryError(f"short read: wanted {n} bytes at {start}, got {len(out)}")
        out += piece
    return bytes(out)


def _copy_verified(src: Path, dst: Path, manifest: Manifest) -> None:
    """Copy ``src`` to ``dst`` (fsynced), checking size, header and every chunk hash."""
    with open(src, "rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        if size != manifest.blob_size:
            raise BadRequest(f"blob is {size} bytes, manifest says {manifest.blob_size}")
        # The header must describe the manifest's tensors (the data offset bounds its size).
        header, data_offset = parse_header(read_exact(fin, 0, manifest.data_offset))
        check_header(manifest, header, data_offset)
        with open(dst, "wb") as fout:
            for index in range(manifest.num_chunks):
                start, end = manifest.chunk_range(index)
                chunk = read_exact(fin, start, end - start)
                verify_chunk(manifest, index, chunk)
                fout.write(chunk)
            _fsync_file(fout)


class LocalStore:
    """A :class:`~flashpoint.registry.store.ModelStore` over a local directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._manifests: dict[tuple[str, str], tuple[tuple[int, int, int], Manifest]] = {}

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # -- paths ------------------------------------------------------------------------------

    def model_dir(self, name: str, version: str) -> Path:
        """The directory of one model version (validated names; it may not exist)."""
        return self.root / validate_name(name, "model name") / validate_version(version)

    def blob_path(self, name: str, version: str) -> Path:
        """Where the weights blob of a model version lives (for mmap by a local host)."""
        return self.model_dir(name, version) / WEIGHTS_FILE

    @property
    def _tmp_root(self) -> Path:
        return self.root / TMP_DIR

    # -- ModelStore -----------------------------------------------------------------------

    async def put(self, manifest: Manifest, blob_path: str | Path) -> None:
        if not isinstance(manifest, Manifest):
            raise BadRequest("put needs a Manifest")
        self.model_dir(manifest.name, manifest.version)  # validates before any I/O
        await asyncio.to_thread(self._put_sync, manifest, Path(blob_path))

    async def get_manifest(self, name: str, version: str) -> Manifest:
        path = self.model_dir(name, version) / MANIFEST_FILE
        return await asyncio.to_thread(self._get_manifest_sync, name, version, path)

    async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
        path = self.blob_path(name, version)
        return await asyncio.to_thread(self._read_range_sync, name, version, path, start, end)

    async def read_chunk(self, name: str, version: str, index: int) -> bytes:
        manifest = await self.get_manifest(name, version)
        start, end = manifest.chunk_range(index)
        data = await self.read_range(name, version, start, end)
        await asyncio.to_thread(verify_chunk, manifest, index, data)
        return data

    async def read_verified(self, name: str, version: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` read as whole verified chunks."""
        return await read_verified(self, name, version, start, end)

    async def list_models(self) -> list[tuple[str, str]]:
        return await asyncio.to_thread(self._list_sync)

    async def delete(self, name: str, version: str) -> None:
        final = self.model_dir(name, version)
        await asyncio.to_thread(self._delete_sync, name, version, final)

    async def exists(self, name: str, version: str) -> bool:
        path = self.model_dir(name, version) / MANIFEST_FILE
        return await asyncio.to_thread(path.is_file)

    async def cleanup_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove leftovers of crashed uploads older than ``older_than_s``; returns a count."""
        return await asyncio.to_thread(self._cleanup_sync, older_than_s)

    # -- blocking halves ----------------------------------------------------------------------

    def _put_sync(self, manifest: Manifest, blob_path: Path) -> None:
        final = self.model_dir(manifest.name, manifest.version)
        if (final / MANIFEST_FILE).is_file():
            self._check_same(manifest, final)
            return
        self._tmp_root.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_root / f"put-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            try:
                _copy_verified(blob_path, tmp / WEIGHTS_FILE, manifest)
            except FileNotFoundError:
                raise BadRequest(f"blob file {str(blob_path)!r} does not exist") from None
            _write_file_synced(tmp / MANIFEST_FILE, manifest.to_json().encode())  # last
            _fsync_dir(tmp)
            self._publish(tmp, final, manifest)
        except OSError as e:
            raise RegistryError(f"put {manifest.name}:{manifest.version} failed: {e}") from e
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _publish(self, tmp: Path, final: Path, manifest: Manifest) -> None:
        for _ in range(3):  # a concurrent delete may remove the (empty) parent under us
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    self._check_same(manifest, final)  # a concurrent identical put won
                    return
                raise
            _fsync_dir(final.parent)
            _fsync_dir(self.root)
            return
        raise RegistryError(f"could not publish {manifest.name}:{manifest.version}")

    def _check_same(self, manifest: Manifest, final: Path) -> None:
        existing = self._get_manifest_sync(
            manifest.name, manifest.version, final / MANIFEST_FILE
        )
        if existing != manifest:
            raise Conflict(
                f"model {manifest.name}:{manifest.version} exists with different content; "
                "versions are immutable", name=manifest.name, version=manifest.version,
            )

    def _get_manifest_sync(self, name: str, version: str, path: Path) -> Manifest:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                cached = self._manifests.get((name, version))
                if cached is not None and cached[0] == key:
                    return cached[1]
                text = f.read()
        except FileNotFoundError:
            raise ModelNotFound(f"model {name}:{version} not found", name=name,
                                version=version) from None
        except OSError as e:
            raise RegistryError(f"reading manifest of {name}:{version}: {e}") from e
        try:
            manifest = Manifest.from_json(text)
        except BadRequest as e:
            raise RegistryError(f"stored manifest of {name}:{version} is invalid: {e}") from e
        if (manifest.name, manifest.version) != (name, version):
            raise RegistryError(f"stored manifest at {name}:{version} names "
                                f"{manifest.name}:{manifest.version}")
        self._manifests[(name, version)] = (key, manifest)
        return manifest

    def _read_range_sync(self, name: str, version: str, path: Path, start: int, end: int) -> bytes:
        for v in (start, end):
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadRequest("byte offsets must be integers")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if not 0 <= start <= end <= size:
                    raise BadRequest(f"byte range [{start}, {end}) outside the blob of {size}")
                return read_exact(f, start, end - start)
        except FileNotFoundError:
            raise ModelNotFound(f"model {name}:{version} not found", name=name,
                                version=version) from None
        except OSError as e:
            raise RegistryError(f"reading {name}:{version}: {e}") from e

    def _list_sync(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if not self.root.is_dir():
            return out
        for name_dir in self.root.iterdir():
            if name_dir.name == TMP_DIR or not name_dir.is_dir():
                continue
            for version_dir in name_dir.iterdir():
                try:
                    validate_name(name_dir.name)
                    validate_version(version_dir.name)
                except BadRequest:
                    continue
                if (version_dir / MANIFEST_FILE).is_file():
                    out.append((name_dir.name, version_dir.name))
        return sorted(out)

    def _delete_sync(self, name: str, version: str, final: Path) -> None:
        self._tmp_root.mkdir(parents=True, exist_ok=True)
        trash = self._tmp_root / f"del-{uuid.uuid4().hex}"
        try:
            os.rename(final, trash)  # disappears atomically, then is removed at leisure
        except FileNotFoundError:
            raise ModelNotFound(f"model {name}:{version} not found", name=name,
                                version=version) from None
        except OSError as e:
            raise RegistryError(f"deleting {name}:{version}: {e}") from e
        self._manifests.pop((name, version), None)
        shutil.rmtree(trash, ignore_errors=True)
        try:
            final.parent.rmdir()  # only succeeds when no other version is left
        except OSError:
            pass

    def _cleanup_sync(self, older_than_s: float) -> int:
        if not self._tmp_root.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in self._tmp_root.iterdir():
            try:
                if entry.stat().st_mtime <= cutoff:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
