"""Segment: bitmap, cut-through progress, verify/mark/unmark, waits with deadlines."""

from __future__ import annotations

import asyncio

import pytest

from flashpoint.errors import BadRequest, DeadlineExceeded, TransferFailed
from flashpoint.transfer.segment import Segment

from .conftest import CHUNK, make_blob


@pytest.fixture
def seg(tmp_path):
    b = make_blob(tmp_path / "src", size_bytes=5 * CHUNK + 100)
    s = Segment(tmp_path / "seg", b.manifest)
    yield s, b
    s.close()


def fill_chunk(s: Segment, data: bytes, i: int) -> None:
    start, end = s.manifest.chunk_range(i)
    s.chunk_view(i)[:] = data[start:end]


def test_new_segment_is_empty_and_sized(seg, tmp_path):
    s, b = seg
    assert s.key == "synthetic@1"
    assert (tmp_path / "seg").stat().st_size == b.manifest.blob_size
    assert s.missing() == list(range(6)) and s.first_missing() == 0
    assert not s.complete and s.valid_bytes == 0 and not any(s.has(i) for i in range(6))
    assert len(s.chunk_view(5)) == 100


def test_verify_mark_unmark(seg):
    s, b = seg
    assert not s.verify(2)  # zeros
    fill_chunk(s, b.data, 2)
    assert s.verify(2)
    s.mark(2)
    assert s.has(2) and s.received(2) == CHUNK and s.valid_bytes == CHUNK
    assert s.first_missing(2) == 3 and s.missing() == [0, 1, 3, 4, 5]
    with pytest.raises(BadRequest):
        s.unmark_received(2)  # verified chunks stay verified
    s.note_received(3, 1000)
    assert s.received(3) == 1000 and not s.has(3)  # progress is never "present"
    s.unmark_received(3)
    assert s.received(3) == 0
    for i in (0, 1, 3, 4, 5):
        fill_chunk(s, b.data, i)
        s.mark(i)
    assert s.complete and s.first_missing() is None and s.valid_bytes == b.manifest.blob_size
    assert bytes(s.view) == b.data


async def test_wait_received_wakes_on_progress(seg):
    s, _ = seg
    waiter = asyncio.create_task(s.wait_received(1, 500, timeout_s=5))
    await asyncio.sleep(0)
    s.note_received(1, 300)
    await asyncio.sleep(0)
    assert not waiter.done()
    s.note_received(1, 300)
    assert await waiter == 600
    assert await s.wait_received(1, 10, timeout_s=0) == 600  # already there: no wait


async def test_wait_range_counts_only_verified(seg):
    s, b = seg
    start, end = CHUNK + 10, 3 * CHUNK - 10  # chunks 1 and 2
    with pytest.raises(DeadlineExceeded):
        await s.wait_range(start, end, timeout_s=0.05)
    waiter = asyncio.create_task(s.wait_range(start, end, timeout_s=5))
    fill_chunk(s, b.data, 1)
    s.mark(1)
    s.note_received(2, CHUNK)  # landed but unverified: not enough
    await asyncio.sleep(0.01)
    assert not waiter.done()
    fill_chunk(s, b.data, 2)
    s.mark(2)
    await asyncio.wait_for(waiter, 1)
    await s.wait_range(5, 5, timeout_s=0)  # empty range


async def test_wait_complete_and_fail(seg):
    s, _ = seg
    with pytest.raises(DeadlineExceeded):
        await s.wait_complete(timeout_s=0.02)
    w1 = asyncio.create_task(s.wait_complete(timeout_s=5))
    w2 = asyncio.create_task(s.wait_received(0, 0, timeout_s=5))
    await asyncio.sleep(0)
    s.fail(TransferFailed("gone"))
    for w in (w1, w2):
        with pytest.raises(TransferFailed):
            await w


def test_open_complete_is_read_only_and_marked(tmp_path):
    b = make_blob(tmp_path / "src", size_bytes=3 * CHUNK)
    s = Segment.open_complete(b.path, b.manifest, verify=True)
    try:
        assert s.complete and s.view.readonly and bytes(s.view) == b.data
    finally:
        s.close()
    b.path.write_bytes(b.data[:-1] + b"\x00")
    with pytest.raises(BadRequest):
        Segment.open_complete(b.path, b.manifest, verify=True)


async def test_preallocate_publishes_progress_and_writers_wait(seg):
    s, _ = seg
    assert s.allocated_bytes == s.manifest.blob_size  # nothing started: page faults allocate
    task = asyncio.create_task(s.preallocate(first_step=CHUNK, step=2 * CHUNK))
    await s.wait_allocated(s.manifest.blob_size, timeout_s=5)
    await task
    assert s.allocated_bytes == s.manifest.blob_size
    await s.preallocate()  # idempotent


async def test_preallocate_failure_is_no_capacity(seg, monkeypatch):
    import errno
    import os

    from flashpoint.errors import NoCapacity

    s, _ = seg

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NoCapacity):
        await s.preallocate()
    with pytest.raises(NoCapacity):
        await s.wait_allocated(10, timeout_s=1)
