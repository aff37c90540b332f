"""heap.settle: start-up objects leave the collector's scans; later garbage is still freed."""

from __future__ import annotations

import gc
import weakref

from flashpoint import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_settle_freezes_survivors_and_later_cycles_are_still_collected(monkeypatch) -> None:
    kept = _Node()
    monkeypatch.setattr(heap, "_settled", False)
    threshold = gc.get_threshold()
    gc.set_threshold(700, *threshold[1:])
    try:
        frozen = heap.settle()
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *threshold[1:])
        assert heap.settle() == frozen  # once per process
        assert frozen >= 1 and gc.get_freeze_count() == frozen
        assert not any(o is kept for o in gc.get_objects())  # frozen objects are not scanned
        late = _Node()
        ref = weakref.ref(late)
        del late
        gc.collect()
        assert ref() is None  # made after the freeze: collected as usual
        gc.set_threshold(heap.YOUNG_THRESHOLD * 2, *threshold[1:])
        monkeypatch.setattr(heap, "_settled", False)
        heap.settle()
        assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD * 2  # never lowered
    finally:
        gc.unfreeze()  # leave the test process as it was
        gc.set_threshold(*threshold)
