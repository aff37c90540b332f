"""Host RAM model cache: one shared-memory segment per model version, mapped by workers.

A model lives in ``<cache_dir>/<name>@<version>`` (a tmpfs file, i.e. shared memory) as a
:class:`~flashpoint.transfer.segment.Segment`: the bytes plus a bitmap of verified chunks.
Workers map the file copy-on-write (``MAP_PRIVATE``): weights are viewed in place with no
copy, and a worker can never scribble on the shared bytes.

Memory rules (issue 3):

* **Reservations.** A cold start reserves the whole blob when its transfer *begins*
  (:meth:`HostCache.open_for_receive`), so two concurrent fills can never overcommit RAM.
* **Cache before processes.** The cache and worker processes share ``memory_bytes``. When a
  worker's process memory is reserved (:meth:`reserve_process`), unpinned cached models are
  evicted LRU to make room; process memory is never refused while evictable cache remains.
* **One transfer per host and model.** Whoever arrives while a segment is being filled (a
  pull, a chain, another deploy) waits on that segment; nothing is fetched twice.
* **Only verified bytes count.** A segment is published (listed in :meth:`keys`, offered to
  peers as complete) only when every chunk's sha256 matched; a failed fill deletes it.
* **Only the pinned manifest counts** (issue 19). Lookups by manifest compare its digest:
  a held copy of the same version with another digest is a miss (dropped and refetched),
  never a hit, so bytes verified against a peer's own manifest are never loaded.

Eviction unlinks the file; a worker's existing mapping survives the unlink, so eviction never
breaks a running replica (pins still keep models that replicas are starting from).
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from flashpoint.errors import IntegrityError, NoCapacity, UnsafePath
from flashpoint.log import get_logger
from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.segment import Segment
from flashpoint.transfer.sources import ChunkSource, fill

log = get_logger(__name__)

CACHE_HITS = Counter("flashpoint_cache_hits_total", "Model cache hits")
CACHE_MISSES = Counter("flashpoint_cache_misses_total", "Model cache misses (fills)")
CACHE_EVICTIONS = Counter("flashpoint_cache_evictions_total", "Model cache evictions")
CACHE_FILLED_BYTES = Counter("flashpoint_cache_filled_bytes_total",
                             "Verified bytes that entered the cache, by source", ["source"])
CACHE_BYTES = Gauge("flashpoint_cache_bytes", "Bytes held in the host model cache", ["host"])
CACHE_RESERVED = Gauge("flashpoint_cache_reserved_bytes",
                       "Bytes reserved by fills in progress and worker processes", ["host", "kind"])
CACHE_CAPACITY = Gauge("flashpoint_cache_capacity_bytes", "Host cache capacity", ["host"])


@dataclass
class CacheEntry:
    key: str  # "name@version"
    segment: Segment
    started_s: float = field(default_factory=time.perf_counter)
    fetch_s: float = 0.0
    source: str = ""  # where the bytes came from: "local", "registry", "peer:<host>", "chain:<id>"
    pins: int = 0
    last_used_s: float = field(default_factory=time.monotonic)
    published: bool = False  # on_complete ran (it is called by whoever sees completion first)

    @property
    def path(self) -> Path:
        return self.segment.path

    @property
    def size_bytes(self) -> int:
        return self.segment.manifest.blob_size

    @property
    def digest(self) -> str:
        """The digest of the manifest its bytes were verified against."""
        return self.segment.manifest.digest

    @property
    def manifest_json(self) -> str:
        return self.segment.manifest.to_json()

    @property
    def complete(self) -> bool:
        return self.segment.complete


def default_cache_dir(host_id: str) -> Path:
    """``/dev/shm/flashpoint-<uid>-<host_id>`` (else under the temp dir); :func:`private_dir`
    makes sure it is ours and private before anything goes in it."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"flashpoint-{os.geteuid()}-{host_id}"
    return Path(tempfile.gettempdir()) / f"flashpoint-cache-{os.geteuid()}-{host_id}"


def private_dir(path: Path) -> Path:
    """Create ``path`` mode 0700, or check an existing one: a real directory (not a symlink)
    owned by this user; group and other access is removed. :class:`UnsafePath` otherwise.

    ``/dev/shm`` and the temp dir are world-writable and the names are predictable, so another
    local user could create the directory (or a symlink) first and read or swap model bytes.
    The checks run on an ``O_NOFOLLOW`` descriptor, so the path cannot change under them.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
        raise UnsafePath(f"cache directory {path} is not a plain directory: {exc.strerror}",
                         path=str(path)) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"cache directory {path} belongs to uid {st.st_uid}, not to this "
                             f"user ({os.geteuid()}); remove it or set [host] cache_dir",
                             path=str(path))
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


class HostCache:
    """Model bytes in host RAM, keyed by ``name@version`` and manifest digest (a lookup by
    manifest finds only a copy of that digest: :meth:`entry_for`); also the data plane's
    segment provider."""

    def __init__(self, directory: Path, capacity_bytes: int, host_id: str = "", *,
                 memory_bytes: int | None = None) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.memory_bytes = memory_bytes if memory_bytes is not None else capacity_bytes
        self.host_id = host_id
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._process_bytes = 0
        self._entry_waiters: dict[str, list[asyncio.Future[CacheEntry]]] = {}
        CACHE_CAPACITY.labels(host_id).set(capacity_bytes)

    def start(self) -> None:
        private_dir(self.directory)
        # Leftovers from a previous run are not trusted (no bitmap kept with them).
        for p in self.directory.iterdir():
            if p.is_symlink() or not p.is_dir():
                p.unlink(missing_ok=True)

    def close(self) -> None:
        for entry in self._entries.values():
            entry.segment.close()
            entry.path.unlink(missing_ok=True)
        self._entries.clear()
        try:
            self.directory.rmdir()
        except OSError:
            pass

    # accounting ------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of cached and reserved (being filled) model data."""
        return sum(e.size_bytes for e in self._entries.values())

    def stats(self) -> dict[str, Any]:
        filling = [e for e in self._entries.values() if not e.complete]
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "filling_bytes": sum(e.size_bytes for e in filling),
                "process_bytes": self._process_bytes, "models": self.keys(),
                "filling": [e.key for e in filling]}

    def progress(self) -> dict[str, list[int]]:
        """Fills in progress: ``{key: [verified_bytes, blob_bytes]}`` (heartbeats carry it)."""
        return {e.key: [e.segment.valid_bytes, e.size_bytes]
                for e in self._entries.values() if not e.complete}

    def _limit(self) -> int:
        return min(self.capacity_bytes, self.memory_bytes - self._process_bytes)

    def _publish_metrics(self) -> None:
        CACHE_BYTES.labels(self.host_id).set(self.used_bytes)
        filling = sum(e.size_bytes for e in self._entries.values() if not e.complete)
        CACHE_RESERVED.labels(self.host_id, "fill").set(filling)
        CACHE_RESERVED.labels(self.host_id, "process").set(self._process_bytes)

    def _make_room(self, size: int) -> None:
        while self.used_bytes + size > self._limit():
            victim = next((e for e in self._entries.values() if e.pins == 0 and e.complete), None)
            if victim is None:
                raise NoCapacity(
                    f"host {self.host_id} cache full: need {size} bytes, "
                    f"{max(self._limit() - self.used_bytes, 0)} free", retry_after_s=5.0)
            self._drop(victim)
            CACHE_EVICTIONS.inc()
            log.info("cache_evicted", model=victim.key, size_bytes=victim.size_bytes)

    def _drop(self, entry: CacheEntry) -> None:
        self._entries.pop(entry.key, None)
        entry.segment.close()
        entry.path.unlink(missing_ok=True)
        self._publish_metrics()

    def reserve_process(self, nbytes: int) -> None:
        """Reserve host memory for a worker process, evicting cached models first if needed."""
        self._process_bytes += nbytes
        try:
            self._make_room(0)
        except NoCapacity:
            self._process_bytes -= nbytes
            raise NoCapacity(f"host {self.host_id} has no memory for a worker of {nbytes} bytes",
                             retry_after_s=5.0) from None
        finally:
            self._publish_metrics()

    def release_process(self, nbytes: int) -> None:
        self._process_bytes = max(0, self._process_bytes - nbytes)
        self._publish_metrics()

    # lookups ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Models held complete and verified."""
        return [k for k, e in self._entries.items() if e.complete]

    def get(self, key: str) -> CacheEntry | None:
        """The complete entry for ``key``, or None."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.complete else None

    def entry(self, key: str) -> CacheEntry | None:
        """The entry for ``key``, complete or still being filled."""
        return self._entries.get(key)

    def pin(self, key: str) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def entry_for(self, manifest: Manifest) -> CacheEntry | None:
        """The entry (complete or filling) of ``manifest``'s exact version: keyed by
        ``name@version`` *and* the manifest's digest. A held entry of the same version with
        another digest is never returned: unpinned, it is dropped (the caller refetches);
        in use, IntegrityError."""
        key = manifest.key
        entry = self._entries.get(key)
        if entry is None or entry.digest == manifest.digest:
            return entry
        if entry.pins > 0:
            raise IntegrityError(f"{key}: the cached copy has another manifest than the pinned "
                                 "one and is in use; refusing it")
        log.warning("cache_digest_mismatch", model=key, held=entry.digest[:16],
                    pinned=manifest.digest[:16])
        if not entry.complete:
            entry.segment.fail(IntegrityError(f"{key}: superseded by the pinned manifest"))
        self._drop(entry)
        CACHE_EVICTIONS.inc()
        return None

    # the data plane's SegmentProvider --------------------------------------------------
    def lookup(self, key: str) -> Segment | None:
        entry = self._entries.get(key)
        return entry.segment if entry is not None else None

    def open_for_receive(self, manifest: Manifest, source: str = "") -> Segment:
        """The segment to fill for ``manifest``: the existing one, or a new one with its RAM reserved."""
        key = manifest.key
        entry = self.entry_for(manifest)
        if entry is not None:
            return entry.segment
        self._make_room(manifest.blob_size)
        private_dir(self.directory)
        segment = Segment(self.directory / key, manifest)
        entry = self._entries[key] = CacheEntry(key, segment, source=source)
        for fut in self._entry_waiters.pop(key, []):
            if not fut.done():
                fut.set_result(entry)
        CACHE_MISSES.inc()
        self._publish_metrics()
        log.info("cache_fill_started", model=key, size_bytes=manifest.blob_size, source=source)
        return segment

    def on_complete(self, segment: Segment) -> None:
        entry = self._entries.get(segment.key)
        if entry is None or entry.segment is not segment or entry.published:
            return
        entry.published = True
        entry.fetch_s = time.perf_counter() - entry.started_s
        self._entries.move_to_end(segment.key)
        CACHE_FILLED_BYTES.labels(entry.source.split(":")[0] or "unknown").inc(entry.size_bytes)
        self._publish_metrics()
        log.info("cache_filled", model=segment.key, size_bytes=entry.size_bytes,
                 source=entry.source, fetch_s=round(entry.fetch_s, 4))

    def set_source(self, key: str, source: str) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.source = source

    def abort(self, key: str, exc: BaseException) -> None:
        """A fill failed: wake its waiters with ``exc`` and free the reservation."""
        entry = self._entries.get(key)
        if entry is None or entry.complete:
            return
        entry.segment.fail(exc)
        self._drop(entry)
        log.warning("cache_fill_failed", model=key, error=repr(exc))

    # the cold-start path -----------------------------------------------------------------
    async def wait_entry(self, key: str, timeout_s: float) -> CacheEntry | None:
        """The entry for ``key`` once a fill of it begins (a chain reaching this host), or
        None if none began within ``timeout_s``."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        fut: asyncio.Future[CacheEntry] = asyncio.get_running_loop().create_future()
        self._entry_waiters.setdefault(key, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None
        finally:
            waiters = self._entry_waiters.get(key)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._entry_waiters[key]

    async def ensure(self, manifest: Manifest, sources: Sequence[ChunkSource], *,
                     timeout_s: float = 600.0,
                     first: tuple[int, int] | None = None,
                     first_also: Sequence[tuple[int, int]] = (),
                     hold: Callable[[], Awaitable[None]] | None = None,
                     ) -> tuple[CacheEntry, bool]:
        """The complete entry for ``manifest``'s model, filling it from ``sources`` if absent.

        ``first`` (a byte range): fetch the chunks covering it before the others (a partition
        stage serves as soon as its own range is in), with ``first_also`` (more such ranges:
        a generation model's last stage needs the carried tokenizer too); ``hold``: awaited
        between those ranges
        and the rest (a stage's completion waits for its pipeline's first answer).
        Returns ``(entry, hit)``; ``hit`` is True when no bytes had to move for this call
        (held already, or another caller's fill was joined).
        """
        key = manifest.key
        entry = self.entry_for(manifest)
        if entry is not None:
            if not entry.complete:
                await entry.segment.wait_complete(timeout_s)
            self._entries.move_to_end(key)
            entry.last_used_s = time.monotonic()
            CACHE_HITS.inc()
            return entry, True
        segment = self.open_for_receive(manifest, source=",".join(s.name for s in sources))
        entry = self._entries[key]
        try:
            per_source: dict[str, int] = {}
            if first is not None:
                indices = sorted({i for r in (*first_also, first)
                                  for i in manifest.chunks_for_range(*r)})
                per_source = await fill(segment, sources, indices=indices, timeout_s=timeout_s)
                if hold is not None:
                    await hold()
            rest = await fill(segment, sources, timeout_s=timeout_s)
            per_source = {k: per_source.get(k, 0) + rest.get(k, 0) for k in {*per_source, *rest}}
        except BaseException as exc:
            self.abort(key, exc)
            raise
        used = [name for name, n in per_source.items() if n > 0]
        entry.source = "+".join(used) if used else entry.source
        self.on_complete(segment)
        return entry, False
