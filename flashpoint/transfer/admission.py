"""Which incoming chain transfers a host accepts: only those the controller announced.

The controller pins the registry manifest's digest (:attr:`Manifest.digest`) in every deploy
and transfer it orders; a host records ``transfer_id -> digest`` here when it learns of one
(a deploy whose source is a chain, or the controller's ``expect_transfer`` before a chain it
starts towards this host). The data plane asks :meth:`TransferAdmission.admit` before it
opens a segment for a ``chain`` op: a transfer nobody announced is :class:`Forbidden`, one
that carries another manifest than the pinned one is :class:`IntegrityError`. A peer that
has the cluster secret can therefore push nothing of its own; a relay that corrupts chunks
fails their sha256 against the pinned manifest, so it can cause a refetch, never a load.

An announcement may arrive just after the chain's first hop (the controller sends deploys
and chain orders concurrently): ``admit`` waits a bounded time for it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from flashpoint.errors import Forbidden, IntegrityError
from flashpoint.log import get_logger
from flashpoint.registry.manifest import Manifest

log = get_logger(__name__)

ANNOUNCE_WAIT_S = 2.0  # how long a chain's first hop waits for the controller's word
MAX_ANNOUNCED = 4096  # oldest announcements are forgotten beyond this many


class TransferAdmission:
    """Announced transfers (``transfer_id -> manifest digest``), each kept ``ttl_s``."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = MAX_ANNOUNCED) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._announced: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._changed = asyncio.Event()

    def announce(self, transfer_id: str, digest: str) -> None:
        """The controller ordered ``transfer_id`` carrying the manifest of ``digest``."""
        if not transfer_id or not digest:
            return
        self._prune()
        self._announced[transfer_id] = (digest, time.monotonic() + self.ttl_s)
        self._announced.move_to_end(transfer_id)
        while len(self._announced) > self.max_entries:
            self._announced.popitem(last=False)
        self._changed.set()
        self._changed = asyncio.Event()

    def expected(self, transfer_id: str) -> str | None:
        """The digest announced for ``transfer_id``, or None."""
        item = self._announced.get(transfer_id)
        if item is None or item[1] < time.monotonic():
            return None
        return item[0]

    def _prune(self) -> None:
        now = time.monotonic()
        for tid in [t for t, (_, until) in self._announced.items() if until < now]:
            del self._announced[tid]

    async def admit(self, transfer_id: str, manifest: Manifest,
                    wait_s: float = ANNOUNCE_WAIT_S) -> None:
        """Return if ``transfer_id`` was announced with ``manifest``'s digest (waiting up to
        ``wait_s`` for the announcement); Forbidden if it never was, IntegrityError if it
        was announced with another manifest."""
        deadline = time.monotonic() + wait_s
        while (digest := self.expected(transfer_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("transfer_unannounced", transfer_id=transfer_id[:100],
                            model=manifest.key)
                raise Forbidden(f"transfer {transfer_id[:100]!r} was not announced by the "
                                "controller; refusing it")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue
        if digest != manifest.digest:
            log.warning("transfer_manifest_mismatch", transfer_id=transfer_id[:100],
                        model=manifest.key,
                        pinned=digest[:16], got=manifest.digest[:16])
            raise IntegrityError(f"transfer {transfer_id[:100]!r} carries a manifest of "
                                 f"{manifest.key} other than the one the "
                                 "controller pinned; refusing it")
