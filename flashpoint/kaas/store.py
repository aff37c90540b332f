"""The object store: key -> bytes, the data layer of KaaS inputs and outputs.

Immutability is what makes executor caching safe (a cached copy of a key can never go
stale): putting the same bytes again is a no-op, other bytes under an existing key are
:class:`~flashpoint.errors.ObjectExists`. :func:`content_key` gives a content address for
callers that want one.

Tenants, quotas, deletion, expiry (issue 19, item 7):

* **Namespaces.** The gateway stores a caller's key ``k`` as ``t-<16 hex>/k``
  (:func:`scoped_key`), the hex from the caller's API-key fingerprint
  (:func:`tenant_namespace`), so one API key can neither read nor overwrite another's
  objects; without auth every caller is the one ``anonymous`` tenant.
* **Quotas** (default on): ``capacity_bytes`` bounds the whole store and
  ``tenant_quota_bytes`` each namespace's bytes (:class:`~flashpoint.errors.ObjectQuotaExceeded`).
* **Deletion and TTL.** ``delete`` removes an object; an object put with ``ttl_s`` (or the
  store's ``default_ttl_s``) expires then. Both free the key, so a later put may give it
  other bytes: listeners (:meth:`MemoryObjectStore.add_removal_listener`) hear every removed
  key so executors drop their cached copies before that can happen.

The interface is synchronous because executors call it from their own thread; a registry-
or S3-backed store implements the same methods (and may keep a RAM tier in front).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from flashpoint.errors import BadRequest, ObjectExists, ObjectNotFound, ObjectQuotaExceeded
from flashpoint.kaas.spec import check_key

MAX_KEY_CHARS = 256  # spec.KEY_RE: a stored (scoped) key fits it, namespace included
_NS_PREFIX = "t-"
_NS_HEX = 16

RemovalListener = Callable[[list[str]], None]


def content_key(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``: the same bytes always get the same key."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tenant_namespace(principal: str) -> str:
    """The namespace of a caller (its API-key fingerprint, or ``anonymous``)."""
    return _NS_PREFIX + hashlib.sha256(principal.encode()).hexdigest()[:_NS_HEX]


def scoped_key(namespace: str, key: str) -> str:
    """A caller's ``key`` inside its ``namespace``; BadRequest when the whole is too long."""
    check_key(key)
    full = f"{namespace}/{key}"
    if len(full) > MAX_KEY_CHARS:
        raise BadRequest(f"object keys are at most {MAX_KEY_CHARS - len(namespace) - 1} "
                         "characters")
    return full


def unscoped_key(namespace: str, full: str) -> str:
    """The caller's view of a stored key of its own ``namespace``."""
    prefix = f"{namespace}/"
    return full[len(prefix):] if full.startswith(prefix) else full


def namespace_of(key: str) -> str:
    """The namespace a stored key belongs to ("" for a key outside every namespace)."""
    head, sep, _ = key.partition("/")
    if sep and head.startswith(_NS_PREFIX) and len(head) == len(_NS_PREFIX) + _NS_HEX:
        return head
    return ""


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


@runtime_checkable
class DataLayer(ObjectStore, Protocol):
    """The KaaS service's store: an :class:`ObjectStore` with TTLs, deletion and removal
    listeners (what a worker's staging store never needs)."""

    def put(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None: ...

    def delete(self, key: str) -> None: ...

    def add_removal_listener(self, listener: RemovalListener) -> None: ...


class MemoryObjectStore:
    """Objects in this process's RAM, up to ``capacity_bytes`` in all and
    ``tenant_quota_bytes`` per namespace (0 = unbounded; the controller's store has both
    on by default, a worker's staging store neither). ``default_ttl_s``: objects expire
    after it, or after the shorter ``ttl_s`` of their put (0 = never, unless put asks)."""

    def __init__(self, capacity_bytes: int = 0, *, tenant_quota_bytes: int = 0,
                 default_ttl_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.tenant_quota_bytes = tenant_quota_bytes
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._objects: dict[str, bytes] = {}
        self._expires_s: dict[str, float] = {}  # key -> monotonic expiry (absent = never)
        self._expiry: list[tuple[float, str]] = []  # heap; stale entries are skipped
        self._tenant_bytes: dict[str, int] = {}
        self._used_bytes = 0
        self._listeners: list[RemovalListener] = []
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def tenant_used_bytes(self, namespace: str) -> int:
        return self._tenant_bytes.get(namespace, 0)

    def add_removal_listener(self, listener: RemovalListener) -> None:
        """``listener(keys)`` hears every key deleted or expired (outside the store's lock)."""
        self._listeners.append(listener)

    def get(self, key: str) -> bytes:
        self._expire_due()
        try:
            return self._objects[key]
        except KeyError:
            raise ObjectNotFound(f"no object {key[:256]!r}", key=key[:256]) from None

    def size(self, key: str) -> int:
        return len(self.get(key))

    def exists(self, key: str) -> bool:
        self._expire_due()
        return key in self._objects

    def expires_in_s(self, key: str) -> float | None:
        """Seconds until ``key`` expires (None = never); ObjectNotFound."""
        self.get(key)
        at = self._expires_s.get(key)
        return None if at is None else max(0.0, at - self._clock())

    def delete(self, key: str) -> None:
        """Remove ``key``; ObjectNotFound when absent (or expired)."""
        self._expire_due()
        with self._lock:
            found = self._drop(key)
        if not found:
            raise ObjectNotFound(f"no object {key[:256]!r}", key=key[:256])
        self._notify([key])

    def discard(self, key: str) -> None:
        """Drop ``key`` if present, telling no listener. Only for a *staging* store (a KaaS
        worker's copy of the objects shipped with one request)."""
        with self._lock:
            self._drop(key)

    def keys(self) -> list[str]:
        self._expire_due()
        return list(self._objects)

    def put(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        check_key(key)
        if ttl_s is not None and not (0 < ttl_s < math.inf):
            raise BadRequest("ttl_s must be a positive number of seconds")
        data = bytes(data)
        self._expire_due()
        with self._lock:
            old = self._objects.get(key)
            if old is not None:
                if old != data:
                    raise ObjectExists(f"object {key!r} already holds other bytes; objects "
                                       "are immutable, use a new key or delete it first",
                                       key=key)
                return
            ns = namespace_of(key)
            size = len(data)
            if self.capacity_bytes and self._used_bytes + size > self.capacity_bytes:
                raise ObjectQuotaExceeded(
                    f"the object store is full ({self._used_bytes} of {self.capacity_bytes} "
                    "bytes used); delete objects or wait for them to expire",
                    capacity_bytes=self.capacity_bytes)
            used = self._tenant_bytes.get(ns, 0)
            if ns and self.tenant_quota_bytes and used + size > self.tenant_quota_bytes:
                raise ObjectQuotaExceeded(
                    f"this API key's objects use {used} of its {self.tenant_quota_bytes}-byte "
                    "quota; delete objects or wait for them to expire",
                    quota_bytes=self.tenant_quota_bytes, used_bytes=used)
            self._objects[key] = data
            self._used_bytes += size
            self._tenant_bytes[ns] = used + size
            ttl = self.default_ttl_s  # also the longest lifetime a put may ask for
            if ttl_s is not None:
                ttl = min(ttl_s, ttl) if ttl > 0 else ttl_s
            if ttl > 0:
                at = self._clock() + ttl
                self._expires_s[key] = at
                heapq.heappush(self._expiry, (at, key))

    # internals ------------------------------------------------------------------------------
    def _drop(self, key: str) -> bool:
        """Remove ``key`` (the lock held); whether it was there."""
        data = self._objects.pop(key, None)
        if data is None:
            return False
        self._expires_s.pop(key, None)
        self._used_bytes -= len(data)
        ns = namespace_of(key)
        left = self._tenant_bytes[ns] - len(data)
        if left:
            self._tenant_bytes[ns] = left
        else:
            del self._tenant_bytes[ns]
        return True

    def _expire_due(self) -> None:
        if not self._expiry or self._expiry[0][0] > self._clock():
            return
        gone: list[str] = []
        with self._lock:
            now = self._clock()
            while self._expiry and self._expiry[0][0] <= now:
                at, key = heapq.heappop(self._expiry)
                if self._expires_s.get(key) == at and self._drop(key):  # not a stale entry
                    gone.append(key)
        if gone:
            self._notify(gone)

    def _notify(self, keys: list[str]) -> None:
        for listener in self._listeners:
            listener(keys)
