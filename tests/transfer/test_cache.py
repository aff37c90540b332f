"""HostCache: reservations, eviction before process memory, one fill per model, waiting."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from flashpoint.errors import IntegrityError, NoCapacity
from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.cache import HostCache

from .conftest import Blob


class MemSource:
    """A chunk source over bytes in memory; counts reads, can corrupt or go slow."""

    def __init__(self, data: bytes, name: str = "mem", *, corrupt: bool = False,
                 delay_s: float = 0.0) -> None:
        self.data, self.name, self.corrupt, self.delay_s = data, name, corrupt, delay_s
        self.reads = 0

    async def read_into(self, manifest: Manifest, index: int, dest: memoryview) -> None:
        self.reads += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        start, end = manifest.chunk_range(index)
        dest[:] = self.data[start:end]
        if self.corrupt:
            dest[0] ^= 0xFF


def renamed(manifest: Manifest, name: str) -> Manifest:
    return replace(manifest, name=name)


@pytest.fixture
def cache(tmp_path: Path) -> HostCache:
    c = HostCache(tmp_path / "cache", capacity_bytes=10 << 20, host_id="h")
    c.start()
    yield c
    c.close()


async def test_fill_once_then_hit(cache: HostCache, blob: Blob) -> None:
    src = MemSource(blob.data)
    entry, hit = await cache.ensure(blob.manifest, [src])
    assert not hit and entry.complete and entry.source == "mem"
    assert entry.path.read_bytes() == blob.data
    assert cache.keys() == [entry.key]
    reads = src.reads
    again, hit = await cache.ensure(blob.manifest, [src])
    assert hit and again is entry and src.reads == reads


async def test_a_held_fill_fetches_its_first_range_then_waits_for_the_hold(
        cache: HostCache, blob: Blob) -> None:
    src = MemSource(blob.data)
    first = blob.manifest.chunks_for_range(0, 1)
    gate = asyncio.Event()
    fill = asyncio.ensure_future(cache.ensure(blob.manifest, [src], first=(0, 1),
                                              hold=gate.wait))
    entry = await asyncio.wait_for(cache.wait_entry(blob.manifest.name + "@"
                                                    + blob.manifest.version, 5.0), 5.0)
    assert entry is not None
    await asyncio.wait_for(entry.segment.wait_range(0, 1, 5.0), 5.0)
    await asyncio.sleep(0.1)
    assert src.reads == len(first) < blob.manifest.num_chunks and not fill.done()
    gate.set()
    entry, hit = await asyncio.wait_for(fill, 5.0)
    assert not hit and entry.complete and src.reads == blob.manifest.num_chunks
    assert entry.path.read_bytes() == blob.data


async def test_concurrent_requests_share_one_transfer(cache: HostCache, blob: Blob) -> None:
    src = MemSource(blob.data, delay_s=0.001)
    results = await asyncio.gather(*(cache.ensure(blob.manifest, [src]) for _ in range(4)))
    assert [hit for _, hit in results].count(False) == 1
    assert len({id(e) for e, _ in results}) == 1
    assert src.reads == blob.manifest.num_chunks


async def test_bad_bytes_never_enter_the_cache_and_waiters_see_the_error(cache: HostCache,
                                                                         blob: Blob) -> None:
    bad = MemSource(blob.data, "bad", corrupt=True)
    first = asyncio.ensure_future(cache.ensure(blob.manifest, [bad]))
    await asyncio.sleep(0)
    joined = asyncio.ensure_future(cache.ensure(blob.manifest, [bad]))
    for fut in (first, joined):
        with pytest.raises(IntegrityError):
            await asyncio.wait_for(fut, 10)
    assert cache.keys() == [] and cache.entry(f"{blob.manifest.name}@{blob.manifest.version}") is None
    assert cache.used_bytes == 0
    # A good second source behind the bad one fills it.
    entry, _ = await cache.ensure(blob.manifest, [bad, MemSource(blob.data, "good")])
    assert entry.source == "good" and entry.path.read_bytes() == blob.data


async def test_lru_eviction_spares_pinned_models(tmp_path: Path, blob: Blob) -> None:
    size = blob.manifest.blob_size
    c = HostCache(tmp_path / "c", capacity_bytes=2 * size + 1, host_id="h")
    c.start()
    try:
        a, b, d = (renamed(blob.manifest, n) for n in ("a", "b", "d"))
        src = MemSource(blob.data)
        await c.ensure(a, [src])
        await c.ensure(b, [src])
        c.pin(f"b@{b.version}")
        await c.ensure(a, [src])  # touch a: b is now least recently used, but pinned
        await c.ensure(d, [src])
        assert sorted(c.keys()) == [f"b@{b.version}", f"d@{d.version}"]
        c.pin(f"d@{d.version}")
        with pytest.raises(NoCapacity):
            await c.ensure(a, [src])
    finally:
        c.close()


async def test_process_memory_evicts_cached_models_first(tmp_path: Path, blob: Blob) -> None:
    size = blob.manifest.blob_size
    c = HostCache(tmp_path / "c", capacity_bytes=4 * size, host_id="h", memory_bytes=3 * size)
    c.start()
    try:
        src = MemSource(blob.data)
        for n in ("a", "b"):
            await c.ensure(renamed(blob.manifest, n), [src])
        c.reserve_process(size)  # fits beside both models
        assert len(c.keys()) == 2
        c.reserve_process(size // 2)  # needs one model gone
        assert c.keys() == [f"b@{blob.manifest.version}"]
        c.pin(f"b@{blob.manifest.version}")
        with pytest.raises(NoCapacity):
            c.reserve_process(size)  # only pinned data left: refuse, reserve nothing
        assert c.stats()["process_bytes"] == size + size // 2
        c.release_process(size + size // 2)
        assert c.stats()["process_bytes"] == 0
    finally:
        c.close()


async def test_a_fill_reserves_its_bytes_when_it_begins(cache: HostCache, blob: Blob) -> None:
    src = MemSource(blob.data, delay_s=0.01)
    task = asyncio.ensure_future(cache.ensure(blob.manifest, [src]))
    await asyncio.sleep(0.05)
    stats = cache.stats()
    assert stats["filling_bytes"] == blob.manifest.blob_size and stats["models"] == []
    await asyncio.wait_for(task, 20)
    assert cache.stats()["filling_bytes"] == 0


async def test_wait_entry_and_execute_while_load(cache: HostCache, blob: Blob) -> None:
    key = f"{blob.manifest.name}@{blob.manifest.version}"
    assert await cache.wait_entry(key, 0.05) is None
    waiter = asyncio.ensure_future(cache.wait_entry(key, 5))
    src = MemSource(blob.data, delay_s=0.005)
    fill = asyncio.ensure_future(cache.ensure(blob.manifest, [src]))
    entry = await asyncio.wait_for(waiter, 5)
    assert entry is not None
    # The first chunk's range is usable before the whole model has arrived.
    start, end = blob.manifest.chunk_range(0)
    await entry.segment.wait_range(start, end, 5)
    assert not entry.complete
    assert bytes(entry.segment.view[start:end]) == blob.data[start:end]
    await asyncio.wait_for(fill, 20)
    assert entry.complete


async def test_a_held_fill_fetches_every_first_range_before_the_hold(
        cache: HostCache, blob: Blob) -> None:
    """A generation model's last stage: its own range and the carried files' (first_also)."""
    m = blob.manifest
    assert m.num_chunks >= 3
    last = (m.blob_size - 1, m.blob_size)
    src = MemSource(blob.data)
    gate = asyncio.Event()
    fill = asyncio.ensure_future(cache.ensure(m, [src], first=last, first_also=[(0, 1)],
                                              hold=gate.wait))
    entry = await asyncio.wait_for(cache.wait_entry(m.name + "@" + m.version, 5.0), 5.0)
    assert entry is not None
    await asyncio.wait_for(entry.segment.wait_range(0, 1, 5.0), 5.0)
    await asyncio.wait_for(entry.segment.wait_range(*last, 5.0), 5.0)
    # both ranges' chunks and nothing else: the rest waits for the hold
    assert src.reads == 2 and not fill.done()
    gate.set()
    entry, hit = await asyncio.wait_for(fill, 5.0)
    assert not hit and entry.complete and src.reads == m.num_chunks
    assert entry.path.read_bytes() == blob.data
