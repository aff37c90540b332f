"""A buffer cache with two LRU classes and pins (KaaS §4.1.3, digest §5.2-5.3).

The cache only does bookkeeping: values are opaque (device tensors, host arrays) and their
sizes are given by the caller. Eviction, when room is needed, takes the least recently used
unpinned entry of the *single-use* class first, then of the *multi-use* class: a stream of
one-shot inputs must not flush constants that every request of a client reuses. An entry
joins the multi-use class on its ``multi_use_after``-th use (2: used by more than one
request; the authors' code waited for a third use, which lets a client's constants be
flushed between its first two calls). Pinned entries (in use by a running request) are
never evicted; a request whose buffers cannot fit next to the pinned ones is refused with
:class:`~flashpoint.errors.BufferCacheFull` *before* anything is evicted for it.

Not thread-safe: one executor owns its caches and serialises requests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from flashpoint.errors import BufferCacheFull


@dataclass
class CacheEntry:
    key: str
    size_bytes: int
    value: Any
    uses: int = 1
    pins: int = 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "evicted_bytes": self.evicted_bytes}


class BufferCache:
    """``capacity_bytes`` of buffers, evicted single-use-LRU first, then multi-use-LRU."""

    def __init__(self, capacity_bytes: int, *, multi_use_after: int = 2) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = capacity_bytes
        self.multi_use_after = multi_use_after
        self.stats = CacheStats()
        self._entries: dict[str, CacheEntry] = {}
        # LRU order, oldest first; every entry is in exactly one of the two.
        self._single: OrderedDict[str, None] = OrderedDict()
        self._multi: OrderedDict[str, None] = OrderedDict()
        self.used_bytes = 0

    # -------------------------------------------------------------------------- queries
    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> frozenset[str]:
        return frozenset(self._entries)

    def entry(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def eviction_order(self) -> list[str]:
        """Unpinned keys in the order they would be evicted."""
        return [k for k in (*self._single, *self._multi) if self._entries[k].pins == 0]

    @property
    def pinned_bytes(self) -> int:
        return sum(e.size_bytes for e in self._entries.values() if e.pins)

    # -------------------------------------------------------------------------- updates
    def lookup(self, key: str) -> Any | None:
        """The value under ``key`` (a use: counted as a hit and made most recent), or None
        (counted as a miss)."""
        e = self._entries.get(key)
        if e is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        e.uses += 1
        if key in self._single:
            if e.uses >= self.multi_use_after:
                del self._single[key]
                self._multi[key] = None
            else:
                self._single.move_to_end(key)
        else:
            self._multi.move_to_end(key)
        return e.value

    def pin(self, key: str) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: str) -> None:
        e = self._entries[key]
        if e.pins <= 0:
            raise RuntimeError(f"unpin of unpinned buffer {key!r}")
        e.pins -= 1

    def make_room(self, need_bytes: int) -> list[CacheEntry]:
        """Evict until ``need_bytes`` fit; returns the evicted entries (to free them).

        Raises BufferCacheFull, evicting nothing, when even evicting every unpinned entry
        would not make room.
        """
        if need_bytes <= self.free_bytes:
            return []
        evictable = sum(e.size_bytes for e in self._entries.values() if e.pins == 0)
        if need_bytes > self.free_bytes + evictable:
            raise BufferCacheFull(
                f"{need_bytes} bytes do not fit: capacity {self.capacity_bytes}, "
                f"{self.pinned_bytes} pinned by running requests",
                need_bytes=need_bytes, capacity_bytes=self.capacity_bytes)
        evicted: list[CacheEntry] = []
        for lru in (self._single, self._multi):
            for key in list(lru):
                if need_bytes <= self.free_bytes:
                    return evicted
                if self._entries[key].pins == 0:
                    evicted.append(self._drop(key))
                    self.stats.evictions += 1
                    self.stats.evicted_bytes += evicted[-1].size_bytes
        return evicted

    def insert(self, key: str, value: Any, size_bytes: int, *, pinned: bool = True) -> None:
        """Add a new entry (as single-use, most recent); the caller made room first."""
        if key in self._entries:
            raise KeyError(f"buffer {key!r} already cached")
        if size_bytes > self.free_bytes:
            raise BufferCacheFull(f"{size_bytes} bytes do not fit in {self.free_bytes} free",
                                  need_bytes=size_bytes, capacity_bytes=self.capacity_bytes)
        self._entries[key] = CacheEntry(key, size_bytes, value, pins=1 if pinned else 0)
        self._single[key] = None
        self.used_bytes += size_bytes

    def remove(self, key: str) -> CacheEntry | None:
        """Drop an entry (pinned or not) now; None if absent."""
        return self._drop(key) if key in self._entries else None

    def rekey(self, old: str, new: str) -> None:
        """Give an entry a new key (an output that became object ``new``), keeping its class."""
        e = self._entries.pop(old)
        e.key = new
        self._entries[new] = e
        for lru in (self._single, self._multi):
            if old in lru:
                del lru[old]
                lru[new] = None

    def clear(self) -> list[CacheEntry]:
        """Drop every entry (a restarted worker); pinned entries are an error."""
        if any(e.pins for e in self._entries.values()):
            raise RuntimeError("cannot clear a cache with pinned buffers")
        out = [self._drop(k) for k in list(self._entries)]
        return out

    def _drop(self, key: str) -> CacheEntry:
        e = self._entries.pop(key)
        self._single.pop(key, None)
        self._multi.pop(key, None)
        self.used_bytes -= e.size_bytes
        return e
