"""Fill a model mapping's page tables on a spare core while the module is built and warmed.

A worker maps the host's cache file (a tmpfs file with 4 KiB pages) and builds its module
over it without copying; the first inference then touches every weight page, and each
touch is a page fault (the kernel maps 16 pages per fault: ~6,500 faults for BERT base,
~25-30 ms of the warm-up's CPU on the dev VM, measured with ``time.thread_time``).
``MADV_POPULATE_READ`` (Linux 5.14) maps the same pages ahead of use, for about the same
kernel work (~35 ms of CPU there); on its own thread it does so beside the module build and
the warm-up instead of inside them. That is a gain only where a core is idle: on the loaded
2-vCPU VM the cold start got slower (bench/RESULTS.md), hence ``[host] prefault_weights``
is opt-in.

It walks the mapping from the end backwards, while the warm-up walks the layers forwards
(the blob is in layer order), so the two meet in the middle rather than fault the same
pages; the token embedding (first in the blob, touched a few rows per request) comes last.
It is stopped once the warm-up is done, so it never competes with the first request.
Best effort: an old kernel, a non-Linux system or any refusal leaves the pages to be
faulted in on first touch, as before; it never fails a load. Pages are mapped read-only
(copy-on-write stays as ``MAP_PRIVATE`` made it): no byte is copied.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any

from flashpoint.log import get_logger

log = get_logger("flashpoint.worker")

MADV_POPULATE_READ = 22  # linux/mman.h (5.14); Python 3.11's mmap module lacks the name
CHUNK_BYTES = 16 << 20  # one madvise call: ~1 ms of page-table work; the stop latency

_madvise: Any = None


def _libc_madvise() -> Any:
    """libc's ``madvise`` through ctypes (which releases the GIL for the call); None off
    Linux."""
    global _madvise
    if _madvise is None and sys.platform.startswith("linux"):
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def populate(mapping: mmap.mmap, stop: threading.Event | None = None, *,
             chunk_bytes: int = CHUNK_BYTES) -> int:
    """Map ``mapping``'s pages into this process's page tables, last chunk first, until done
    or ``stop`` is set; returns the bytes populated (0 where the kernel cannot)."""
    madvise = _libc_madvise()
    size = len(mapping)
    if madvise is None or size == 0:
        return 0
    if chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"chunk_bytes must be a positive multiple of {mmap.PAGESIZE}")
    # The address only: the temporary export is released at once, so the mapping can still
    # be closed; the caller keeps it mapped until this returns (Prefault.stop joins).
    anchor = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(anchor)
    del anchor
    done = 0
    end = size
    while end > 0 and not (stop is not None and stop.is_set()):
        start = (end - 1) // chunk_bytes * chunk_bytes  # chunk-aligned, hence page-aligned
        if madvise(base + start, end - start, MADV_POPULATE_READ) != 0:
            # EINVAL: a kernel before 5.14; EFAULT: the file shrank under the mapping.
            log.debug("prefault_refused", errno=ctypes.get_errno(), populated_bytes=done)
            break
        done += end - start
        end = start
    return done


class Prefault:
    """:func:`populate` on a thread of its own, from :meth:`start` until :meth:`stop`."""

    def __init__(self, mapping: mmap.mmap, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._mapping = mapping
        self._chunk_bytes = chunk_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.populated_bytes = 0

    def start(self) -> Prefault:
        """Begin populating in the background; returns self."""
        self._thread = threading.Thread(target=self._run, name="fp-prefault", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.populated_bytes = populate(self._mapping, self._stop,
                                            chunk_bytes=self._chunk_bytes)
        except Exception as e:  # never fails a load: the pages fault in on first touch
            log.warning("prefault_failed", error=repr(e))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the chunk in progress (about a millisecond) and wait for the thread
        (at most ``timeout_s``: one that is still running only maps pages, and the mapping
        stays open while the module it backs lives)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("prefault_still_running", timeout_s=timeout_s)
