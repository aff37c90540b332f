"""Pull sources and the verified fill."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashpoint.errors import IntegrityError, NotFound, PeerLost, TransferFailed
from flashpoint.registry.local import LocalStore
from flashpoint.transfer.node import DirSegmentProvider
from flashpoint.transfer.plan import FaultPlan
from flashpoint.transfer.segment import Segment
from flashpoint.transfer.sources import ChunkSource, PeerSource, RegistrySource, fill
from flashpoint.transfer.wire import VERIFY_FAILURES

from .conftest import CHUNK, SECRET


class FlakySource:
    """Fails (or serves bad bytes) for some chunks; counts calls."""

    def __init__(self, name: str, data: bytes, *, fail: set[int] = frozenset(),
                 corrupt: set[int] = frozenset(), error: Exception | None = None) -> None:
        self.name = name
        self.data = data
        self.fail = fail
        self.corrupt = corrupt
        self.error = error or PeerLost("flaky")
        self.calls: list[int] = []

    async def read_into(self, manifest, index, dest):
        self.calls.append(index)
        if index in self.fail:
            raise self.error
        start, end = manifest.chunk_range(index)
        dest[:] = self.data[start:end]
        if index in self.corrupt:
            dest[0] ^= 0xFF


@pytest.fixture
def seg(tmp_path, blob):
    s = Segment(tmp_path / "dst", blob.manifest)
    yield s
    s.close()


async def test_fill_falls_back_when_first_source_fails(seg, blob):
    first = FlakySource("peer:a", blob.data, fail={0, 5}, corrupt={7})
    second = FlakySource("registry", blob.data)
    assert isinstance(first, ChunkSource)
    before = VERIFY_FAILURES.labels("peer")._value.get()
    stats = await fill(seg, [first, second], concurrency=3)
    assert seg.complete and bytes(seg.view) == blob.data
    assert sorted(second.calls) == [0, 5, 7]
    assert stats == {"peer:a": blob.manifest.blob_size - 3 * CHUNK, "registry": 3 * CHUNK}
    assert VERIFY_FAILURES.labels("peer")._value.get() == before + 1


async def test_fill_only_given_indices(seg, blob):
    src = FlakySource("registry", blob.data)
    await fill(seg, [src], indices=[3, 1, 3])
    assert seg.missing() == [i for i in range(blob.manifest.num_chunks) if i not in (1, 3)]
    assert sorted(src.calls) == [1, 3]
    await fill(seg, [src], indices=[1])  # already verified: not fetched again
    assert sorted(src.calls) == [1, 3]


async def test_no_source_has_good_bytes_is_an_integrity_error(seg, blob):
    a = FlakySource("peer:a", blob.data, corrupt={4})
    b = FlakySource("registry", blob.data, corrupt={4})
    with pytest.raises(IntegrityError) as ei:
        await fill(seg, [a, b], indices=[2, 4])
    assert ei.value.details["chunk"] == 4 and "chunk 4" in ei.value.message
    assert not seg.has(4) and seg.received(4) == 0


async def test_no_source_reachable_is_transfer_failed(seg, blob):
    a = FlakySource("peer:a", blob.data, fail={1})
    with pytest.raises(TransferFailed) as ei:
        await fill(seg, [a], indices=[1])
    assert ei.value.details["chunk"] == 1 and not seg.has(1)
    with pytest.raises(TransferFailed):
        await fill(seg, [], indices=[0])


async def test_registry_source(tmp_path, blob, seg):
    store = LocalStore(tmp_path / "reg")
    await store.put(blob.manifest, blob.path)
    stats = await fill(seg, [RegistrySource(store)])
    assert seg.complete and bytes(seg.view) == blob.data
    assert stats["registry"] == blob.manifest.blob_size


async def test_peer_source_serves_only_verified_chunks(cluster, blob, tmp_path):
    # A peer holding a partial segment: chunks 0..9 verified, the rest not.
    ep = await cluster.add("partial")
    part = cluster.providers["partial"].open_for_receive(blob.manifest)
    await fill(part, [FlakySource("registry", blob.data)], indices=range(10))
    part.note_received(10, 100)  # landed bytes that are not verified are never served
    src = PeerSource(ep, SECRET, timeout_s=5)
    try:
        buf = bytearray(CHUNK)
        await src.read_into(blob.manifest, 3, memoryview(buf))
        assert bytes(buf) == blob.data[3 * CHUNK:4 * CHUNK]
        with pytest.raises(NotFound):
            await src.read_into(blob.manifest, 10, memoryview(buf))
        # The connection is reused across gets.
        await src.read_into(blob.manifest, 4, memoryview(buf))
        assert len(src._idle) == 1
        # fill: the partial peer first, a seed second.
        seed_ep = await cluster.add("seed", seed=blob)
        seed = PeerSource(seed_ep, SECRET)
        dst = Segment(tmp_path / "dst2", blob.manifest)
        try:
            stats = await fill(dst, [src, seed])
            assert dst.complete and bytes(dst.view) == blob.data
            assert stats == {"peer:partial": 10 * CHUNK,
                             "peer:seed": blob.manifest.blob_size - 10 * CHUNK}
        finally:
            dst.close()
            await seed.aclose()
    finally:
        await src.aclose()


async def test_corrupt_peer_then_good_peer(cluster, blob, tmp_path):
    bad_ep = await cluster.add("bad", seed=blob, fault=FaultPlan(corrupt_serve=frozenset({2, 6})))
    good_ep = await cluster.add("good", seed=blob)
    bad, good = PeerSource(bad_ep, SECRET), PeerSource(good_ep, SECRET)
    dst = Segment(tmp_path / "dst", blob.manifest)
    try:
        stats = await fill(dst, [bad, good])
        assert dst.complete and bytes(dst.view) == blob.data
        assert stats["peer:good"] == 2 * CHUNK
    finally:
        dst.close()
        await bad.aclose()
        await good.aclose()


def test_dir_provider_round_trip(tmp_path, blob):
    p = DirSegmentProvider(tmp_path / "d")
    seg = p.open_for_receive(blob.manifest)
    assert p.open_for_receive(blob.manifest) is seg and p.lookup(seg.key) is seg
    seg.view[:] = blob.data
    for i in range(blob.manifest.num_chunks):
        seg.mark(i)
    p.on_complete(seg)
    p.close()
    q = DirSegmentProvider(tmp_path / "d")
    assert q.load_existing() == [seg.key]
    assert q.lookup(seg.key).complete
    q.close()


async def test_registry_source_reads_consecutive_chunks_in_shared_spans(tmp_path: Path, blob) -> None:
    """Several chunks per ranged GET; concurrent readers of a span share it; bytes exact."""
    from flashpoint.transfer.sources import RegistrySource

    calls: list[tuple[int, int]] = []

    class CountingStore:
        async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
            calls.append((start, end))
            await asyncio.sleep(0.01)
            return blob.data[start:end]

    m = blob.manifest
    src = RegistrySource(CountingStore(), span_bytes=8 * m.chunk_size)
    bufs = {i: bytearray(m.chunk_range(i)[1] - m.chunk_range(i)[0]) for i in range(m.num_chunks)}
    await asyncio.gather(*(src.read_into(m, i, memoryview(bufs[i])) for i in range(m.num_chunks)))
    assert b"".join(bytes(bufs[i]) for i in range(m.num_chunks)) == blob.data
    assert len(calls) == -(-m.num_chunks // 8)  # one GET per span of 8 chunks


async def test_registry_spans_never_cross_a_stage_edge(blob) -> None:
    """A partition stage's chunks start their own span: its first GET carries none of the
    previous stage's bytes, and no span runs past its end."""
    from flashpoint.transfer.sources import RegistrySource

    calls: list[tuple[int, int]] = []

    class CountingStore:
        async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
            calls.append((start, end))
            return blob.data[start:end]

    m = blob.manifest
    assert m.num_chunks >= 6
    stage = range(3, 5)
    src = RegistrySource(CountingStore(), span_bytes=8 * m.chunk_size)
    src.break_spans_at(m, stage)
    buf = bytearray(m.chunk_range(3)[1] - m.chunk_range(3)[0])
    await src.read_into(m, 3, memoryview(buf))
    assert bytes(buf) == blob.data[slice(*m.chunk_range(3))]
    assert calls == [(m.chunk_range(3)[0], m.chunk_range(4)[1])]
    # The rest of the blob: spans before the stage and after it, none crossing its edges.
    bufs = {i: bytearray(m.chunk_range(i)[1] - m.chunk_range(i)[0]) for i in range(m.num_chunks)}
    for i in range(m.num_chunks):
        await src.read_into(m, i, memoryview(bufs[i]))
    assert b"".join(bytes(bufs[i]) for i in range(m.num_chunks)) == blob.data
    edges = {m.chunk_range(3)[0], m.chunk_range(4)[1]}
    assert all(not (a < e < b) for a, b in calls for e in edges), calls
