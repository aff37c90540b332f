"""BufferCache: hits and misses, pins, capacity, eviction single-use LRU then multi-use LRU."""

from __future__ import annotations

import pytest

from flashpoint.errors import BufferCacheFull
from flashpoint.kaas.cache import BufferCache


def filled(cap: int, *keys: str, size: int = 10) -> BufferCache:
    c = BufferCache(cap)
    for k in keys:
        c.make_room(size)
        c.insert(k, k.upper(), size, pinned=False)
    return c


def test_hits_misses_and_capacity():
    c = filled(30, "a", "b")
    assert c.lookup("a") == "A" and c.lookup("zz") is None
    assert (c.stats.hits, c.stats.misses) == (1, 1)
    assert c.used_bytes == 20 and c.free_bytes == 10
    with pytest.raises(BufferCacheFull):
        c.insert("c", "C", 11, pinned=False)  # insert never overfills


def test_eviction_single_use_first_then_lru():
    c = filled(40, "a", "b", "c", "d")  # all single-use, a oldest
    c.lookup("a")  # second use: a becomes multi-use
    c.lookup("c")  # c too; multi-use LRU order is a, c
    assert c.eviction_order() == ["b", "d", "a", "c"]
    evicted = [e.key for e in c.make_room(30)]
    assert evicted == ["b", "d", "a"]  # both single-use first, then the LRU multi-use one
    assert c.keys() == {"c"} and c.stats.evictions == 3


def test_lru_within_single_use_class():
    c = BufferCache(30, multi_use_after=3)
    for k in ("a", "b", "c"):
        c.insert(k, k, 10, pinned=False)
    c.lookup("a")  # second use, still single-use at threshold 3, but now most recent
    assert [e.key for e in c.make_room(10)] == ["b"]


def test_pinned_buffers_are_never_evicted():
    c = filled(30, "a", "b", "c")
    c.pin("a")
    assert [e.key for e in c.make_room(20)] == ["b", "c"]
    c.make_room(20)
    c.insert("big", "BIG", 20)  # pinned on insert
    # Everything left is pinned: refused, and nothing was evicted for it.
    with pytest.raises(BufferCacheFull):
        c.make_room(1)
    assert c.keys() == {"a", "big"}
    c.unpin("big")
    assert [e.key for e in c.make_room(10)] == ["big"]
    c.unpin("a")
    with pytest.raises(RuntimeError):
        c.unpin("a")  # more unpins than pins is a bug, not a no-op


def test_refusal_evicts_nothing():
    c = filled(30, "a", "b")
    c.pin("a")
    with pytest.raises(BufferCacheFull):
        c.make_room(25)  # 10 free + 10 evictable < 25
    assert c.keys() == {"a", "b"} and c.stats.evictions == 0


def test_rekey_and_clear():
    c = filled(30, "a")
    c.rekey("a", "obj:a")
    assert "obj:a" in c and "a" not in c and c.eviction_order() == ["obj:a"]
    c.pin("obj:a")
    with pytest.raises(RuntimeError):
        c.clear()
    c.unpin("obj:a")
    c.clear()
    assert len(c) == 0 and c.used_bytes == 0
