"""ModelObtainer: a deploy's model by its typed source plan, with the fetch time returned as a
value (the cache entry is never patched), a cached copy as ``local``, a chain that never
comes replaced by a pull, and the pinned digest enforced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flashpoint.errors import IntegrityError
from flashpoint.host.stage_hold import StageHolds
from flashpoint.messages import controller_host as ch
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.cache import HostCache
from flashpoint.transfer.obtain import ModelObtainer, ObtainOptions, pinned_digest
from flashpoint.transfer.sources import fill

from .conftest import SECRET, Blob
from .test_cache import MemSource


class Spawned:
    """The obtainer's background tasks, awaited (or cancelled) by the test."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def __call__(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task


@pytest.fixture
async def cache(tmp_path: Path) -> AsyncIterator[HostCache]:
    c = HostCache(tmp_path / "cache", capacity_bytes=10 << 20, host_id="h1")
    c.start()
    yield c
    c.close()


def _obtainer(cache: HostCache, registry: MemSource, spawned: Spawned,
              chain_wait_s: float = 0.1) -> ModelObtainer:
    return ModelObtainer(cache, None, registry, secret=SECRET, host_id="h1",
                         admission=TransferAdmission(ttl_s=30.0), holds=StageHolds(0.0),
                         spawn=spawned, options=ObtainOptions(
                             deploy_timeout_s=30.0, chain_wait_s=chain_wait_s,
                             chain_stall_timeout_s=5.0, orphan_grace_s=1.0))


async def test_a_pull_then_a_local_hit(cache: HostCache, blob: Blob) -> None:
    registry, spawned = MemSource(blob.data, "registry"), Spawned()
    ob = _obtainer(cache, registry, spawned)
    m = blob.manifest
    got = await asyncio.wait_for(ob.obtain(m.name, m.version, ch.PullSource(), m), 30)
    assert got.source == "registry" and not got.hit and got.fetch_s > 0
    assert got.entry.path.read_bytes() == blob.data
    reads = registry.reads
    again = await ob.obtain(m.name, m.version, ch.PullSource(), m)
    assert again.hit and again.source == "local" and again.fetch_s == 0.0
    assert again.entry is got.entry and registry.reads == reads  # nothing fetched twice


async def test_a_chain_that_never_comes_is_replaced_by_a_pull(cache: HostCache,
                                                               blob: Blob) -> None:
    registry, spawned = MemSource(blob.data, "registry"), Spawned()
    ob = _obtainer(cache, registry, spawned)
    m = blob.manifest
    plan = ch.ChainSource(transfer_id="t1", sender="h0", fallback=("registry",))
    got = await asyncio.wait_for(ob.obtain(m.name, m.version, plan, m), 30)
    assert got.source == "registry" and got.entry.path.read_bytes() == blob.data


async def test_a_chains_copy_reports_its_fetch_time_without_patching_the_cache(
        cache: HostCache, blob: Blob) -> None:
    registry, spawned = MemSource(blob.data, "registry"), Spawned()
    ob = _obtainer(cache, registry, spawned, chain_wait_s=30.0)
    m = blob.manifest
    plan = ch.ChainSource(transfer_id="t1", sender="h0")
    obtaining = asyncio.ensure_future(ob.obtain(m.name, m.version, plan, m))
    await asyncio.sleep(0)  # one step: it now waits for the chain (nothing else to await)
    assert not obtaining.done() and cache.keys() == []
    # The data plane receiving chain t1: the segment fills, but the upstream's END (which
    # publishes the entry and sets its fetch_s) has not come.
    segment = cache.open_for_receive(m, source="chain:t1")
    sender = MemSource(blob.data, "chain", delay_s=0.001)
    receiving = asyncio.ensure_future(fill(segment, [sender], timeout_s=30.0))
    got = await asyncio.wait_for(obtaining, 30)
    await receiving
    assert got.source == "chain:h0" and got.fetch_s > 0
    assert got.entry.fetch_s == 0.0  # the value travelled back; the entry is untouched
    assert registry.reads == 0


async def test_the_pinned_digest_is_enforced(cache: HostCache, blob: Blob) -> None:
    m = blob.manifest
    assert pinned_digest(None, m) == m.digest and pinned_digest("d", None) == "d"
    with pytest.raises(IntegrityError):
        pinned_digest("not-" + m.digest, m)
    ob = _obtainer(cache, MemSource(blob.data, "registry"), Spawned())
    with pytest.raises(IntegrityError):
        await ob.obtain(m.name, m.version, None, m, pinned="not-" + m.digest)
    assert cache.keys() == []  # nothing fetched for a manifest that is not the pinned one
