"""The controller's function table: register, delete, describe functions, and the manifests
and partition plan tables registration needs.

The functions themselves live in :class:`~flashpoint.controller.state.core.ControllerState`
(``FunctionUpserted`` / ``FunctionDeleted`` events); this object does the I/O around those
events (the registry's manifest, the persisted table, the plan table solved off the loop) and
turns a function's state into the gateway's :class:`FunctionInfo`. The
:class:`~flashpoint.controller.actor.Controller` owns one and exposes its public methods to
the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flashpoint.config import ControllerConfig
from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.persist import FunctionTable
from flashpoint.controller.state import events as cs
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.records import FunctionRecord, ReplicaPhase
from flashpoint.errors import BadRequest, FunctionNotFound, ModelLoadFailed
from flashpoint.gateway.backend import FunctionInfo
from flashpoint.ids import ModelKey
from flashpoint.log import get_logger
from flashpoint.partition.cache import PlanCache
from flashpoint.partition.model import CostModel, LayerProfile
from flashpoint.partition.stageable import why_not_staged
from flashpoint.registry.manifest import IoSignature, Manifest
from flashpoint.spec import FunctionSpec

log = get_logger("flashpoint.controller")


class FunctionCatalog:
    """Register, delete and describe functions. ``apply`` feeds an event to the controller's
    state (and executes its commands), ``wake`` wakes the control loop, ``forget`` drops a
    deleted function's queue and request statistics."""

    def __init__(self, cc: ControllerConfig, store: Any, state: ControllerState,
                 dispatcher: Dispatcher, table: FunctionTable,
                 apply: Callable[[cs.Event], None], wake: Callable[[], None],
                 forget: Callable[[str], None]) -> None:
        self.cc = cc
        self.store = store
        self.state = state
        self.dispatcher = dispatcher
        self.table = table
        self._apply = apply
        self._wake = wake
        self._forget = forget
        # "name@version" -> its manifest (immutable): parsed once, its JSON text made once
        # (Manifest.to_json is memoised) and sent as is with every deploy.
        self.manifests: dict[str, Manifest] = {}
        self._plans = PlanCache()
        # name -> the spec as registered (the state's copy has its share resolved from a
        # profile); what a new profile replaces its profile fields of (store_profiles)
        self.registered: dict[str, FunctionSpec] = {}

    async def manifest(self, model: str, version: str) -> Manifest:
        """The registry's manifest of ``model@version``: what every deploy and transfer of
        it pins (versions are immutable: one registry round trip per version)."""
        key = ModelKey.of(model, version)
        manifest = self.manifests.get(key)
        if manifest is None:
            manifest = await self.store.get_manifest(model, version)
            self.manifests[key] = manifest
        return manifest

    async def apply_function(self, spec: FunctionSpec, persist: bool) -> FunctionSpec:
        """Upsert ``spec`` into the state (its model's inputs and outputs filled in from the
        manifest, its plan table solved when it may run in stages); ``persist``: also into
        the function table on disk (False when restoring from it)."""
        manifest = await self.manifest(spec.model, spec.model_version)
        # (a text-generation model declares outputs only: its request tensors are optional)
        if not spec.inputs and not spec.outputs and (manifest.io.inputs or manifest.io.outputs):
            spec = _replace_io(spec, manifest.io)
        plans, whole_cold_s = None, 0.0
        if spec.max_stages > 1:
            plans, whole_cold_s = await self._plan_table(spec, manifest)
        if persist:
            await self.table.upsert(spec)
        self._apply(cs.FunctionUpserted(spec, int(manifest.blob_size), plans, whole_cold_s))
        self.registered[spec.name] = spec
        return spec

    async def _plan_table(self, spec: FunctionSpec, manifest: Manifest) -> tuple[Any, float]:
        """The model version's partition plan table (cached) and C(1) for Eq 4.14."""
        why = why_not_staged(manifest.entry_point, manifest.config)
        if why is not None:
            raise BadRequest(f"model {spec.model_key} cannot run in stages "
                             f"(max_stages > 1): {why}")
        keys = ("bytes", "exec_time_s", "output_bytes")
        if not manifest.layers or any(not all(k in layer.profile for k in keys)
                                      for layer in manifest.layers):
            raise BadRequest(f"model {spec.model_key} has no per-layer profile; "
                             "publish it with profiling (flashpoint model push --profile) "
                             "to allow max_stages > 1")
        cc = self.cc
        cost = CostModel(cc.partition_bandwidth_bps, cc.partition_link_bps,
                         cc.partition_overhead_s, cc.partition_link_latency_s)
        profiles = [LayerProfile.from_manifest(layer.name, layer.profile)
                    for layer in manifest.layers]
        table = await asyncio.to_thread(self._plans.get, spec.model, spec.model_version,
                                        profiles, cost, p_max=64, x_max=3000)
        return table, cost.cold_s(sum(p.bytes for p in profiles))

    async def register(self, spec: FunctionSpec) -> FunctionInfo:
        """Register (or update) ``spec``, persisted, and wake the control loop."""
        spec = await self.apply_function(spec, persist=True)
        log.info("function_registered", function=spec.name, model=spec.model)
        self._wake()
        return self.get(spec.name)

    async def delete(self, name: str) -> None:
        """Delete function ``name`` (FunctionNotFound when it is not registered)."""
        if name not in self.state.functions:
            raise FunctionNotFound(f"function {name!r} is not registered")
        await self.table.delete(name)
        self._apply(cs.FunctionDeleted(name))
        self.registered.pop(name, None)
        self._forget(name)

    def registered_spec(self, name: str) -> FunctionSpec:
        """Function ``name``'s spec as registered, before a profile filled in its share
        (FunctionNotFound when it is not registered)."""
        self._record(name)
        return self.registered.get(name) or self._record(name).spec

    async def store_profiles(self, name: str, **profiles: Any) -> FunctionSpec:
        """Replace the profile fields (``fast_profile``, ``protean_profile``,
        ``dilu_profile``, ``batch_fbr``) of function ``name``'s registered spec with
        ``profiles`` and register it again, persisted: the state resolves its share from
        them as at any registration (its replicas keep theirs; new ones get the new
        share)."""
        if set(profiles) - {"fast_profile", "protean_profile", "dilu_profile", "batch_fbr"}:
            raise BadRequest(f"not profile fields: {sorted(profiles)}")
        spec = dataclasses.replace(self.registered_spec(name), **profiles)
        await self.register(spec)
        return spec

    def info(self, fn: FunctionRecord) -> FunctionInfo:
        """``fn`` as the gateway shows it: readiness, replica counts, queue, rollout."""
        reps = self.state.replicas_of(fn.spec.name)
        failure = self.state.not_ready(fn.spec.name)
        return FunctionInfo(
            fn.spec, ready=failure is None,
            replicas_warm=sum(r.phase == ReplicaPhase.WARM for r in reps),
            replicas_starting=sum(r.phase == ReplicaPhase.STARTING for r in reps),
            queued=self.dispatcher.queued(fn.spec.name),
            reason=None if failure is None else _not_ready_reason(failure, time.monotonic()),
            rollout=self.state.rollout(fn.spec.name),
        )

    def infos(self) -> list[FunctionInfo]:
        """Every registered function's info."""
        return [self.info(fn) for fn in self.state.functions.values()]

    def spec(self, name: str) -> FunctionSpec:
        """Function ``name``'s spec (FunctionNotFound when it is not registered)."""
        return self._record(name).spec

    def get(self, name: str) -> FunctionInfo:
        """Function ``name``'s info (FunctionNotFound when it is not registered)."""
        return self.info(self._record(name))

    def _record(self, name: str) -> FunctionRecord:
        fn = self.state.functions.get(name)
        if fn is None:
            raise FunctionNotFound(f"function {name!r} is not registered")
        return fn


def _replace_io(spec: FunctionSpec, io: IoSignature) -> FunctionSpec:
    """``spec`` with the model's own inputs and outputs (typed values, no dict round trip)."""
    return dataclasses.replace(spec, inputs=io.inputs, outputs=io.outputs)


def _not_ready_reason(failure: cs.StartFailure, now_s: float) -> dict[str, Any]:
    """``reason`` of a function that cannot serve (``/v1/functions``, the OIP ready route):
    the state's monotonic times as wall-clock seconds since the epoch."""
    wall = time.time() - now_s
    reason: dict[str, Any] = {
        "code": ModelLoadFailed.code, "message": failure.message, "error_code": failure.code,
        "failed_starts": failure.failed_starts, "since": round(wall + failure.since_s, 3),
        "last_failure": round(wall + failure.last_s, 3)}
    if failure.retry_at_s is not None:
        reason["retry_in_s"] = round(max(0.0, failure.retry_at_s - now_s), 3)
    return reason
