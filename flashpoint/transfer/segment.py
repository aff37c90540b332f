"""A model blob being assembled in host RAM: one file (tmpfs), mapped shared, plus a bitmap.

Two kinds of progress are tracked per chunk, and kept apart on purpose:

* ``received(i)``: bytes of chunk ``i`` a streaming receiver has written so far. It only
  drives cut-through relaying (a relay forwards bytes as soon as they land) and is never
  reported as "present".
* the bitmap: chunk ``i`` verified against the manifest's sha256. ``has``, ``complete``,
  ``missing``, ``valid_bytes`` and ``wait_range`` count only marked chunks, so nothing
  unverified is ever handed to a consumer.

Forwarders wait on per-chunk thresholds (woken only when theirs is reached: progress is
noted once per socket read); other waiters share one "progress" event that is replaced on
every verified/failed change, cheap for the handful of them a segment has.
A segment belongs to one event loop; only :meth:`verify` may run in a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
from pathlib import Path
from typing import Protocol

from flashpoint.errors import BadRequest, DeadlineExceeded, NoCapacity
from flashpoint.ids import ModelKey
from flashpoint.registry.manifest import Manifest


def segment_key(manifest: Manifest) -> ModelKey:
    return manifest.key


class Segment:
    """File of ``blob_size`` bytes (tmpfs), mmap ``MAP_SHARED`` read/write, plus a chunk bitmap."""

    def __init__(self, path: Path, manifest: Manifest, *, _readonly: bool = False) -> None:
        """Create (or truncate) ``path`` to ``blob_size`` bytes and map it."""
        self.manifest = manifest
        self.path = Path(path)
        self.key = segment_key(manifest)
        n = manifest.num_chunks
        self._marked = bytearray(n)
        self._received = [0] * n
        self._num_marked = 0
        self._valid_bytes = 0
        self._failure: BaseException | None = None
        self._progress = asyncio.Event()
        self._waiters = 0
        self._chunk_waiters: dict[int, list[tuple[int, asyncio.Future[int]]]] = {}
        self._allocated = manifest.blob_size  # until preallocate() starts: page faults allocate
        self._alloc_started = False
        self._alloc_error: NoCapacity | None = None
        self._closed = False
        if _readonly:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_size != manifest.blob_size:
                    raise BadRequest(f"{self.path}: size differs from the manifest's blob_size")
                self._mmap = mmap.mmap(fd, manifest.blob_size, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
        else:
            # A fresh file of our own, never one (or a symlink) someone else put there first.
            self.path.unlink(missing_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, manifest.blob_size)
                self._mmap = mmap.mmap(fd, manifest.blob_size, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        self.view: memoryview = memoryview(self._mmap)

    @property
    def allocated_bytes(self) -> int:
        """Bytes ``[0, n)`` backed by allocated pages (safe to write without a SIGBUS)."""
        return self._allocated

    async def preallocate(self, first_step: int = 4 << 20, step: int = 64 << 20) -> None:
        """Allocate the file's pages in a worker thread, a small first step and then big
        ones, publishing progress as it goes; writers call :meth:`wait_allocated` first.

        On tmpfs a write into a hole of a full filesystem is a SIGBUS that kills the process;
        allocating first turns that into a clean NoCapacity, and it takes page allocation
        off the receive path. It runs concurrently with the stream (never before the first
        reply: a chain would pay it once per hop), and it stays ahead of any network."""
        if self.view.readonly or self._alloc_started:
            return
        self._alloc_started = True
        self._allocated = 0
        loop = asyncio.get_running_loop()
        size = self.manifest.blob_size

        def progress(pos: int) -> None:
            self._allocated = pos
            self._wake()

        def work() -> None:  # owns its fd: a cancelled await never closes it under the thread
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                pos, n = 0, first_step
                while pos < size and not self._closed:
                    n = min(n, size - pos)
                    os.posix_fallocate(fd, pos, n)
                    pos += n
                    loop.call_soon_threadsafe(progress, pos)
                    n = step
            finally:
                os.close(fd)

        try:
            await asyncio.to_thread(work)
        except OSError as exc:
            err = NoCapacity(f"{self.path}: cannot allocate {size} bytes: {exc}", retry_after_s=5.0)
            self._alloc_error = err
            self._wake()
            raise err from None

    async def wait_allocated(self, end: int, timeout_s: float) -> None:
        """Wait until bytes ``[0, end)`` are allocated; NoCapacity if allocation failed."""
        if end > self._allocated:
            await self._wait(lambda: end <= self._allocated or self._alloc_error is not None,
                             lambda: None, timeout_s, f"allocation of {end} bytes")
        if self._alloc_error is not None and end > self._allocated:
            raise self._alloc_error

    @classmethod
    def open_complete(cls, path: Path, manifest: Manifest, *, verify: bool = False) -> Segment:
        """An existing complete file, all chunks marked, mapped read-only (nothing ever
        writes a complete segment). The caller vouches for the bytes (the cache verified them
        when it filled); ``verify=True`` checks every chunk first (BadRequest if one is bad)."""
        seg = cls(path, manifest, _readonly=True)
        for i in range(manifest.num_chunks):
            if verify and not seg.verify(i):
                seg.close()
                raise BadRequest(f"{path}: chunk {i} does not match the manifest")
            seg.mark(i)
        return seg

    # -- layout ---------------------------------------------------------------------------

    def chunk_len(self, index: int) -> int:
        start, end = self.manifest.chunk_range(index)
        return end - start

    def chunk_view(self, index: int) -> memoryview:
        start, end = self.manifest.chunk_range(index)
        return self.view[start:end]

    # -- bitmap (verified chunks only) ----------------------------------------------------

    def has(self, index: int) -> bool:
        return bool(self._marked[index])

    def marked_flags(self) -> bytes:
        """One byte per chunk, 1 where verified (for bitmaps on the wire)."""
        return bytes(self._marked)

    def missing(self) -> list[int]:
        return [i for i, m in enumerate(self._marked) if not m]

    def first_missing(self, start: int = 0) -> int | None:
        """First index >= ``start`` not marked; None if none."""
        i = self._marked.find(0, start)
        return None if i < 0 else i

    @property
    def complete(self) -> bool:
        return self._num_marked == self.manifest.num_chunks

    @property
    def valid_bytes(self) -> int:
        return self._valid_bytes

    @property
    def received_bytes(self) -> int:
        """Bytes written by streams or fills so far, verified or not (progress reports)."""
        return sum(self._received)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # -- cut-through progress -------------------------------------------------------------

    def received(self, index: int) -> int:
        """Bytes of chunk ``index`` written so far by a streaming receiver."""
        return self._received[index]

    def note_received(self, index: int, nbytes: int) -> None:
        """A streaming receiver wrote ``nbytes`` more of chunk ``index``: wake the forwarders
        whose threshold it reached (only those: this runs once per socket read)."""
        got = self._received[index] + nbytes
        self._received[index] = got
        if index in self._chunk_waiters:
            self._release(index, got)

    async def wait_received(self, index: int, more_than: int, timeout_s: float) -> int:
        """Wait until more than ``more_than`` bytes of chunk ``index`` have landed; returns
        the count. DeadlineExceeded after ``timeout_s``; the segment's failure if it fails."""
        got = self._received[index]
        if got > more_than:
            return got
        if self._failure is not None:
            raise self._failure
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (more_than, fut)
        self._chunk_waiters.setdefault(index, []).append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise DeadlineExceeded(f"{self.key}: waited {timeout_s}s for chunk {index} past "
                                   f"{more_than} bytes") from None
        finally:
            waiters = self._chunk_waiters.get(index)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._chunk_waiters[index]

    def _release(self, index: int, got: int) -> None:
        waiters = self._chunk_waiters[index]
        keep = []
        for more_than, fut in waiters:
            if fut.done():
                continue
            if got > more_than:
                fut.set_result(got)
            else:
                keep.append((more_than, fut))
        if keep:
            waiters[:] = keep
        else:
            del self._chunk_waiters[index]

    # -- verification ---------------------------------------------------------------------

    def verify(self, index: int) -> bool:
        """sha256 of the bytes in place vs the manifest. Blocking: call it through
        ``asyncio.to_thread`` (hashlib releases the GIL on large buffers)."""
        digest = hashlib.sha256(self.chunk_view(index)).hexdigest()
        return digest == self.manifest.chunk_sha256[index]

    def mark(self, index: int) -> None:
        """Chunk verified: set its bit (its bytes count as fully received) and wake waiters."""
        if not self._marked[index]:
            self._marked[index] = 1
            self._num_marked += 1
            self._valid_bytes += self.chunk_len(index)
        self._received[index] = self.chunk_len(index)
        if index in self._chunk_waiters:
            self._release(index, self._received[index])
        self._wake()

    def unmark_received(self, index: int) -> None:
        """Chunk failed verification (or a partial write is abandoned): reset its progress
        to 0 so it is fetched again. Never called on a marked chunk."""
        if self._marked[index]:
            raise BadRequest(f"chunk {index} is verified; it cannot be unmarked")
        self._received[index] = 0
        self._wake()

    def reset_partial(self) -> None:
        """Forget partial progress on every unmarked chunk (before a new writer starts)."""
        for i in self.missing():
            self._received[i] = 0
        self._wake()

    # -- waiting --------------------------------------------------------------------------

    async def wait_range(self, start: int, end: int, timeout_s: float) -> None:
        """Execute-while-load: wait until blob bytes ``[start, end)`` are all verified."""
        indices = self.manifest.chunks_for_range(start, end)
        await self._wait(lambda: all(self._marked[i] for i in indices), lambda: None, timeout_s,
                         f"bytes [{start}, {end})")

    async def wait_complete(self, timeout_s: float) -> None:
        await self._wait(lambda: self.complete, lambda: None, timeout_s, "the whole blob")

    def fail(self, exc: BaseException) -> None:
        """Wake every waiter with ``exc`` (the assembly failed for good)."""
        self._failure = exc
        for waiters in self._chunk_waiters.values():
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(exc)
        self._wake()

    def clear_failure(self) -> None:
        """A new writer takes over after a failure (waiters may wait again)."""
        self._failure = None

    def close(self) -> None:
        """Unmap (the file stays). Views still held elsewhere keep the mapping alive."""
        self._closed = True
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a chunk_view is still exported (a send in flight); the GC unmaps later

    # -- internals ------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiters:
            ev, self._progress = self._progress, asyncio.Event()
            ev.set()

    async def _wait(self, done, value, timeout_s: float, what: str):  # noqa: ANN001, ANN202
        if done():
            return value()
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout_s):
                while not done():
                    if self._failure is not None:
                        raise self._failure
                    await self._progress.wait()
        except TimeoutError:
            raise DeadlineExceeded(f"{self.key}: waited {timeout_s}s for {what}") from None
        finally:
            self._waiters -= 1
        return value()


class SegmentProvider(Protocol):
    """Where a data-plane server finds and creates segments."""

    def lookup(self, key: str) -> Segment | None:
        """A segment to serve ``get`` from (complete or partial)."""
        ...

    def open_for_receive(self, manifest: Manifest) -> Segment:
        """An existing partial/complete one, or a new one."""
        ...

    def on_complete(self, segment: Segment) -> None:
        """All chunks verified (the cache publishes it)."""
        ...
