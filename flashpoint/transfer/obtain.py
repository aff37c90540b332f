"""Model-bytes orchestration on a host: a deploy's model into this host's RAM, and the chains
this host heads or is told to expect.

:class:`ModelObtainer` follows the controller's source plan (a typed
:data:`~flashpoint.messages.controller_host.SourcePlan`, dispatched by type): join a copy held
or being filled, wait for a chain to arrive, head a registry chain, or pull. With a stage's
layers it returns as soon as that byte range is verified (execute-while-load) while the rest
still arrives; that background fill waits on the stage's hold (``host/stage_hold.py``). What
it returns was verified against the manifest the controller pinned, and carries its fetch time
as a value (:class:`Obtained`) — the cache entry is never patched for a caller's timing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from flashpoint.errors import BadRequest, IntegrityError, ModelNotFound
from flashpoint.ids import ModelKey
from flashpoint.log import get_logger
from flashpoint.messages.controller_host import (
    ChainHeadSource,
    ChainSource,
    SourcePlan,
    StartChain,
)
from flashpoint.registry.manifest import Manifest, stage_byte_ranges
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.cache import CacheEntry, HostCache
from flashpoint.transfer.plan import Endpoint

log = get_logger("flashpoint.transfer.obtain")

Ranges = tuple[tuple[int, int], ...]
"""Blob byte ranges ``[start, end)`` a stage needs before it serves."""

# Test-only fault injection (tests/netns/test_cluster_netns.py): when set, a FaultPlan as JSON
# (the keys of flashpoint.transfer.plan.FaultPlan.from_dict, e.g. '{"corrupt_forward": [3]}')
# that this host's data-plane server applies to what it relays, stores and serves as a chain
# receiver/peer. Never set in production; a host started with it logs a warning.
DATAPLANE_FAULT_ENV = "FLASHPOINT_DATAPLANE_FAULT"

Spawn = Callable[[Coroutine[Any, Any, Any], str], Any]


@dataclass(frozen=True)
class Obtained:
    """A model in this host's RAM: its cache entry, where its bytes came from (``local``
    for a copy already held), and how long this host waited for them (0 for ``local``)."""

    entry: CacheEntry
    source: str
    fetch_s: float

    @property
    def hit(self) -> bool:
        return self.source == "local"


@dataclass(frozen=True)
class ObtainOptions:
    """The host's transfer settings ([host] and [controller] config)."""

    deploy_timeout_s: float
    chain_wait_s: float
    chain_stall_timeout_s: float
    orphan_grace_s: float


def pinned_digest(digest: str | None, manifest: Manifest | None) -> str | None:
    """The manifest digest a deploy pins: the one it names (it must match the manifest it
    carries: IntegrityError), else its manifest's; None when it has neither."""
    if manifest is not None:
        if digest is not None and digest != manifest.digest:
            raise IntegrityError(f"deploy of {manifest.key}: its manifest "
                                 "does not have the digest it pins")
        return manifest.digest
    return digest


class ModelObtainer:
    """One host's model-bytes orchestration (the cache, the admission of chains, and the
    background transfers it starts through ``spawn``)."""

    def __init__(self, cache: HostCache, store: Any, registry_source: Any, *, secret: bytes,
                 host_id: str, admission: TransferAdmission, holds: Any, spawn: Spawn,
                 options: ObtainOptions) -> None:
        self.cache = cache
        self.store = store
        self.registry_source = registry_source
        self.secret = secret
        self.host_id = host_id
        self.admission = admission
        self.holds = holds  # host/stage_hold.StageHolds: a stage's background fill waits on it
        self.spawn = spawn
        self.opts = options

    async def start_data_plane(self, listen_host: str, port: int,
                               advertise_host: str = "") -> tuple[Any, Endpoint]:
        """Start this host's data-plane server (peers pull from it, chains arrive at it);
        returns it and the endpoint to advertise."""
        from flashpoint.transfer.dataplane import DataPlaneServer

        fault = None
        if fault_json := os.environ.get(DATAPLANE_FAULT_ENV):
            from flashpoint.transfer.plan import FaultPlan

            fault = FaultPlan.from_dict(json.loads(fault_json))
            log.warning("dataplane_fault_injected", fault=fault_json)
        server = DataPlaneServer(
            self.cache, self.secret, host_id=self.host_id, listen_host=listen_host, port=port,
            registry_source=self.registry_source, fault=fault, admission=self.admission)
        bound = await server.start()
        return server, Endpoint(self.host_id, advertise_host or bound.addr, bound.port)

    # the controller's chain calls ------------------------------------------------------
    def expect(self, transfer_id: str, digest: str) -> None:
        """Chain ``transfer_id`` will bring the model with manifest ``digest``: only then does
        the data plane accept it (transfer/admission.py)."""
        self.admission.announce(transfer_id, digest)

    def start_chain(self, msg: StartChain) -> None:
        """Stream a model this host holds down the chain the controller built."""
        from flashpoint.transfer.chain import send_chain

        key = ModelKey.of(msg.model, msg.version)
        entry = self.cache.get(key)
        if entry is None:
            raise ModelNotFound(f"{key} is not in host {self.host_id}'s RAM")
        if msg.manifest_digest is not None and entry.digest != msg.manifest_digest:
            raise IntegrityError(f"{key} in host {self.host_id}'s RAM is not the pinned manifest")
        chain = [Endpoint.from_wire(list(e)) for e in msg.chain]
        tid = msg.transfer_id
        self.cache.pin(key)  # not evicted while it streams
        self.spawn(self._relay(send_chain(
            entry.segment, chain, secret=self.secret, transfer_id=tid, host_id=self.host_id,
            fallback=self._chain_fallback(msg.fallback),
            stall_timeout_s=self.opts.chain_stall_timeout_s,
            orphan_grace_s=self.opts.orphan_grace_s), tid, key), f"chain:{tid}")

    # a deploy's model --------------------------------------------------------------------
    async def obtain(self, model: str, version: str, plan: SourcePlan | None,
                     manifest: Manifest | None, stage: Any = None,
                     pinned: str | None = None) -> Obtained:
        """The model in this host's RAM, from where ``plan`` says. With ``stage`` (first and
        last layer) it returns once that byte range is verified. Whatever it returns was
        verified against the manifest with digest ``pinned``, or the registry's own when none
        was sent; a cached copy with another digest is never used (HostCache.entry_for)."""
        key = ModelKey.of(model, version)
        timeout_s = self.opts.deploy_timeout_s
        if manifest is None:  # the registry is the root of trust, never a cached copy
            manifest = await self.store.get_manifest(model, version)
        if pinned and manifest.digest != pinned:
            raise IntegrityError(f"{key}: the registry's manifest is not the one the "
                                 "controller pinned")
        need = stage_byte_ranges(manifest, stage[0], stage[1]) if stage is not None else None
        entry = self.cache.entry_for(manifest)
        if entry is not None:  # held, or being filled already: one transfer per host and model
            joined = not entry.complete
            if need is None:  # a whole replica needs the rest now
                self.holds.release(key, "a whole replica needs the model")
            await self._ready(entry.segment, need, timeout_s)
            return (self._done(entry, entry.source) if joined
                    else Obtained(entry, "local", 0.0))
        if isinstance(plan, ChainSource):
            arrived = await self._arrival(plan, key, manifest, need)
            if arrived is not None:
                return arrived
        elif isinstance(plan, ChainHeadSource) and plan.chain:
            return await self._head_chain(plan, key, manifest, need)
        fallback = self._sources(plan.fallback if plan is not None else ())
        if need is None:
            entry, _ = await self.cache.ensure(manifest, fallback, timeout_s=timeout_s)
            return self._done(entry, entry.source)
        for byte_range in need:
            self.registry_source.break_spans_at(manifest, manifest.chunks_for_range(*byte_range))
        self.holds.hold(key)
        self.spawn(self._fill_logged(manifest, fallback, timeout_s, need), f"fill:{key}")
        entry = await self.cache.wait_entry(key, timeout_s)  # opened at the fill's first step
        if entry is None:
            raise ModelNotFound(f"{key}: the fill did not start")
        await self._ready(entry.segment, need, timeout_s)
        return self._done(entry, entry.source)

    async def _arrival(self, plan: ChainSource, key: str, manifest: Manifest,
                       need: Ranges | None) -> Obtained | None:
        """The chain's copy once it has arrived (None: it never did; pull instead)."""
        arrived = await self.cache.wait_entry(key, self.opts.chain_wait_s)
        if arrived is None:
            log.warning("chain_never_arrived", transfer_id=plan.transfer_id, model=key)
            return None
        if arrived.digest != manifest.digest:
            raise IntegrityError(f"{key}: the chain brought another manifest than the "
                                 "pinned one")
        self.cache.set_source(key, f"chain:{plan.sender or '?'}")
        await self._ready(arrived.segment, need, self.opts.deploy_timeout_s)
        # HostCache.on_complete (which sets fetch_s) runs in the data plane only after the
        # upstream's END frame; the segment completes before that: time the fetch here.
        fetch_s = arrived.fetch_s or time.perf_counter() - arrived.started_s
        return Obtained(arrived, arrived.source, fetch_s)

    async def _head_chain(self, plan: ChainHeadSource, key: str, manifest: Manifest,
                          need: Ranges | None) -> Obtained:
        """Pull from ``plan.upstream`` while relaying down ``plan.chain``."""
        from flashpoint.transfer.chain import send_chain

        timeout_s = self.opts.deploy_timeout_s
        chain = [Endpoint.from_wire(list(e)) for e in plan.chain if not isinstance(e, str)]
        segment = self.cache.open_for_receive(manifest, source="chain:registry")
        tid = plan.transfer_id
        self.spawn(self._relay(send_chain(
            segment, chain, secret=self.secret, transfer_id=tid,
            upstream=self._sources(plan.upstream), fallback=self._chain_fallback(plan.fallback),
            host_id=self.host_id, stall_timeout_s=self.opts.chain_stall_timeout_s,
            orphan_grace_s=self.opts.orphan_grace_s), tid, key, pinned=False), f"chain:{tid}")
        self.spawn(self._publish_when_complete(segment, timeout_s), f"publish:{key}")
        await self._ready(segment, need, timeout_s)
        if segment.complete:
            self.cache.on_complete(segment)  # now, so this cold start reports its fetch time
        done = self.cache.entry(key)
        if done is None:
            raise ModelNotFound(f"{key} left the cache as soon as it arrived")
        return self._done(done, "chain:registry")

    @staticmethod
    def _done(entry: CacheEntry, source: str) -> Obtained:
        # A stage starts before its entry completes: its fetch is until now.
        return Obtained(entry, source, entry.fetch_s or time.perf_counter() - entry.started_s)

    # helpers -------------------------------------------------------------------------------
    def _chain_fallback(self, wires: Any) -> list[Any]:
        """A chain header's fallback list: peers as endpoints, the registry as our source."""
        return [self.registry_source if w == "registry" else Endpoint.from_wire(list(w))
                for w in wires or ()] or [self.registry_source]

    def _sources(self, wires: Any) -> list[Any]:
        """Pull sources from a plan's wire list (peer endpoints, "registry"); the registry
        when the list names none."""
        from flashpoint.transfer.sources import sources_from_wire

        items = [w if isinstance(w, str) else list(w) for w in wires or ()]
        if any(not isinstance(w, (str, list)) for w in items):
            raise BadRequest("malformed source list")
        return sources_from_wire(items, secret=self.secret, host_id=self.host_id,
                                 registry=self.registry_source) or [self.registry_source]

    @staticmethod
    async def _ready(segment: Any, need: Ranges | None, timeout_s: float) -> None:
        """Execute-while-load: a stage needs only its own byte ranges, a whole replica all."""
        if need is None:
            await segment.wait_complete(timeout_s)
        else:
            for start, end in need:
                await segment.wait_range(start, end, timeout_s)

    async def _publish_when_complete(self, segment: Any, timeout_s: float) -> None:
        try:
            await segment.wait_complete(timeout_s)
        except Exception as exc:
            self.cache.abort(segment.key, exc)
            return
        self.cache.on_complete(segment)

    async def _fill_logged(self, manifest: Manifest, sources: list[Any], timeout_s: float,
                           first: Ranges | None = None) -> None:
        key = manifest.key
        try:
            await self.cache.ensure(manifest, sources, timeout_s=timeout_s,
                                    first=first[-1] if first else None,
                                    first_also=first[:-1] if first else (),
                                    hold=lambda: self.holds.wait(key))
        except Exception as exc:  # waiters on the segment see it; this is the log line
            log.warning("fill_failed", model=key, error=repr(exc))
            self.holds.release(key, "fill failed")  # nothing left to hold back

    async def _relay(self, coro: Any, transfer_id: str, key: str, *, pinned: bool = True) -> None:
        """Run one chain this host heads; its outcome is logged (receivers report their own)."""
        try:
            result = await coro
            log.info("chain_finished", transfer_id=transfer_id, model=key,
                     completed=result.completed, failed=result.failed,
                     seconds=round(result.seconds, 3))
        except Exception as exc:
            log.warning("chain_failed", transfer_id=transfer_id, model=key, error=repr(exc))
        finally:
            if pinned:
                self.cache.unpin(key)
