"""Keep start-up objects out of the garbage collector's way.

Before it serves, a process imports torch, numpy, aiohttp and the model code: hundreds of
thousands of long-lived objects. CPython's oldest-generation collection walks every one of
them; in the controller under load we measured those collections at 15–180 ms, a stall that
every request in flight waits out (`bench/invoke.py`'s c=64 runs lost up to half their
throughput to one). ``gc.freeze()`` moves what is alive now into a permanent generation that
collections skip; objects made later are collected as before. The cost: something frozen
that later becomes garbage is never freed, so call this once start-up is done, not while
serving.

The youngest generation gets a larger threshold too. A serving process holds every
in-flight request's objects (tasks, futures, frames, decoded tensors); with CPython's default
of 700 net allocations the collector walks that whole in-flight set every few dozen
requests, and it is mostly alive, so each walk frees little. In the controller at
concurrency 64 that was 5-9 us of CPU per request (5-8 % of the process). At
``YOUNG_THRESHOLD`` the set rises and falls between collections; cyclic garbage waits for
10 000 net allocations instead of 700 before it is freed.
"""

from __future__ import annotations

import gc

_settled = False
YOUNG_THRESHOLD = 10_000


def settle() -> int:
    """Collect start-up garbage, then freeze the survivors; returns how many are frozen.
    Raises the youngest generation's threshold to ``YOUNG_THRESHOLD`` (never lowers it).

    Once per process: the bulk (imports) is frozen by the first actor to start, and a process
    running several actors (a local cluster, a test) must not freeze what its earlier ones
    leave behind.
    """
    global _settled
    if not _settled:
        _settled = True
        gc.collect()
        gc.freeze()
        young, *older = gc.get_threshold()
        if 0 < young < YOUNG_THRESHOLD:  # 0: collection is off; leave it so
            gc.set_threshold(YOUNG_THRESHOLD, *older)
    return gc.get_freeze_count()
