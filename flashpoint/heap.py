"""Keep start-up objects out of the garbage collector's way.

Before it serves, a process imports torch, numpy, aiohttp and the model code: hundreds of
thousands of long-lived objects. CPython's oldest-generation collection walks every one of
them; in the controller under load we measured those collections at 15–180 ms, a stall that
every request in flight waits out (`bench/invoke.py`'s c=64 runs lost up to half their
throughput to one). ``gc.freeze()`` moves what is alive now into a permanent generation that
collections skip; objects made later are collected as before. The cost: something frozen
that later becomes garbage is never freed, so call this once start-up is done, not while
serving.
"""

from __future__ import annotations

import gc

_settled = False


def settle() -> int:
    """Collect start-up garbage, then freeze the survivors; returns how many are frozen.

    Once per process: the bulk (imports) is frozen by the first actor to start, and a process
    running several actors (a local cluster, a test) must not freeze what its earlier ones
    leave behind.
    """
    global _settled
    if not _settled:
        _settled = True
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
