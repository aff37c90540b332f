"""The object store: immutable key -> bytes, the data layer of KaaS inputs and outputs.

Immutability is what makes executor caching safe (a cached copy of a key can never go
stale): putting the same bytes again is a no-op, other bytes under an existing key are
:class:`~flashpoint.errors.ObjectExists`. :func:`content_key` gives a content address for
callers that want one.

The interface is synchronous because executors call it from their own thread; a registry-
or S3-backed store implements the same four methods (and may keep a RAM tier in front).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Protocol, runtime_checkable

from flashpoint.errors import ObjectExists, ObjectNotFound, PayloadTooLarge
from flashpoint.kaas.spec import check_key


def content_key(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``: the same bytes always get the same key."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@runtime_checkable
class ObjectStore(Protocol):
    def get(self, key: str) -> bytes:
        """The object's bytes; raises ObjectNotFound."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Publish ``data`` under ``key``; idempotent, ObjectExists for other bytes."""
        ...

    def size(self, key: str) -> int:
        """The object's size in bytes; raises ObjectNotFound."""
        ...

    def exists(self, key: str) -> bool: ...


class MemoryObjectStore:
    """Objects in this process's RAM, up to ``capacity_bytes`` (0 = unbounded)."""

    def __init__(self, capacity_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self._objects: dict[str, bytes] = {}
        self._used_bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def get(self, key: str) -> bytes:
        try:
            return self._objects[key]
        except KeyError:
            raise ObjectNotFound(f"no object {key[:256]!r}", key=key[:256]) from None

    def size(self, key: str) -> int:
        return len(self.get(key))

    def exists(self, key: str) -> bool:
        return key in self._objects

    def discard(self, key: str) -> None:
        """Drop ``key`` if present. Only for a *staging* store (a KaaS worker's copy of the
        objects shipped with one request), never for the data layer, whose keys are
        immutable and permanent."""
        with self._lock:
            data = self._objects.pop(key, None)
            if data is not None:
                self._used_bytes -= len(data)

    def keys(self) -> list[str]:
        return list(self._objects)

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        data = bytes(data)
        with self._lock:
            old = self._objects.get(key)
            if old is not None:
                if old != data:
                    raise ObjectExists(f"object {key!r} already holds other bytes; objects "
                                       "are immutable, use a new key", key=key)
                return
            if self.capacity_bytes and self._used_bytes + len(data) > self.capacity_bytes:
                raise PayloadTooLarge(f"object store full ({self.capacity_bytes} bytes)")
            self._objects[key] = data
            self._used_bytes += len(data)
