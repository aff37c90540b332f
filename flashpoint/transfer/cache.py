"""Host RAM model cache: one file per model version on a tmpfs, mapped by workers.

The host fetches a model once (verified chunk by chunk) into ``<cache_dir>/<name>@<version>``
and every local worker maps that file copy-on-write (``MAP_PRIVATE``): weights are viewed in
place with no copy, and a worker can never scribble on the shared bytes. Concurrent requests
for the same model share one fetch (single flight). Unpinned entries are evicted LRU when
capacity is needed; a worker's existing mapping survives the unlink, so eviction never breaks
a running replica.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from flashpoint.errors import NoCapacity
from flashpoint.log import get_logger

log = get_logger(__name__)

CACHE_HITS = Counter("flashpoint_cache_hits_total", "Model cache hits")
CACHE_MISSES = Counter("flashpoint_cache_misses_total", "Model cache misses (fetches)")
CACHE_EVICTIONS = Counter("flashpoint_cache_evictions_total", "Model cache evictions")
CACHE_BYTES = Gauge("flashpoint_cache_bytes", "Bytes held in the host model cache", ["host"])


@dataclass
class CacheEntry:
    key: str  # "name@version"
    path: Path
    size_bytes: int
    manifest_json: str
    fetch_s: float
    pins: int = 0
    last_used_s: float = field(default_factory=time.monotonic)


def default_cache_dir(host_id: str) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"flashpoint-{host_id}"
    return Path(tempfile.gettempdir()) / f"flashpoint-cache-{host_id}"


class HostCache:
    """Model bytes in host RAM, keyed by ``name@version``."""

    def __init__(self, directory: Path, capacity_bytes: int, host_id: str = "") -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.host_id = host_id
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[CacheEntry]] = {}
        self._reserved = 0

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Leftovers from a previous run are not trusted (no manifest kept with them).
        for p in self.directory.iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)

    def close(self) -> None:
        for entry in self._entries.values():
            entry.path.unlink(missing_ok=True)
        self._entries.clear()
        try:
            self.directory.rmdir()
        except OSError:
            pass

    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self._entries.values()) + self._reserved

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    async def ensure(self, store: Any, name: str, version: str) -> tuple[CacheEntry, bool]:
        """The cached entry for a model, fetching it once if absent. Returns (entry, hit)."""
        key = f"{name}@{version}"
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.last_used_s = time.monotonic()
            CACHE_HITS.inc()
            return entry, True
        fut = self._inflight.get(key)
        if fut is not None:
            return await asyncio.shield(fut), True
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            entry = await self._fetch(store, name, version, key)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
            raise
        finally:
            self._inflight.pop(key, None)
        fut.set_result(entry)
        CACHE_MISSES.inc()
        return entry, False

    def pin(self, key: str) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def _make_room(self, size: int) -> None:
        while self.used_bytes + size > self.capacity_bytes:
            victim = next((e for e in self._entries.values() if e.pins == 0), None)
            if victim is None:
                raise NoCapacity(
                    f"host cache full: need {size} bytes, {self.capacity_bytes - self.used_bytes} free",
                    retry_after_s=5.0,
                )
            del self._entries[victim.key]
            victim.path.unlink(missing_ok=True)
            CACHE_EVICTIONS.inc()
            log.info("cache_evicted", model=victim.key, size_bytes=victim.size_bytes)

    async def _fetch(self, store: Any, name: str, version: str, key: str) -> CacheEntry:
        t0 = time.perf_counter()
        manifest = await store.get_manifest(name, version)
        size = manifest.blob_size
        self._make_room(size)
        self._reserved += size  # a cold start reserves its RAM when it begins
        path = self.directory / key
        tmp = self.directory / f".{key}.partial"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            try:
                for index in range(len(manifest.chunk_sha256)):
                    data = await store.read_chunk(name, version, index)  # verified by the store
                    await asyncio.to_thread(os.pwrite, fd, data, index * manifest.chunk_size)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self._reserved -= size
        entry = CacheEntry(key, path, size, manifest.to_json(), time.perf_counter() - t0)
        self._entries[key] = entry
        CACHE_BYTES.labels(self.host_id).set(self.used_bytes)
        log.info("cache_filled", model=key, size_bytes=size, fetch_s=round(entry.fetch_s, 4))
        return entry
