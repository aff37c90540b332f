"""Placing new replicas: whole replicas by ``policy/placement.py``, replicas with a GPU
share on sharing hosts by ``policy/share_placement.py``, and the fixed set of KaaS
executors. Each placed replica is recorded STARTING with an id chosen here, and a deploy
command names it, so a retried deploy is idempotent on the host."""

from __future__ import annotations

from flashpoint.controller.state.cluster import ClusterRecords
from flashpoint.controller.state.events import Command, DeployKaas, DeployReplica
from flashpoint.controller.state.records import FunctionRecord, ReplicaPhase, ReplicaRecord
from flashpoint.kaas import KAAS_FUNCTION
from flashpoint.policy.klc import TenantClass
from flashpoint.policy.placement import PlacementRequest, select_receivers
from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.share_placement import (
    SHARING_MODES,
    ShareDevice,
    SharedReplica,
    ShareRequest,
    place_shared,
)
from flashpoint.spec import FunctionSpec


class Placement(ClusterRecords):
    """Whole, shared and KaaS replica placement."""

    def _place_whole(self, fn: FunctionRecord, count: int, now_s: float,
                     spec: FunctionSpec | None = None,
                     model_bytes: int | None = None,
                     shape: ReplicaConfig | None = None) -> list[Command]:
        """Up to ``count`` whole replicas where placement puts them, of ``spec``'s model
        version (default: the registered one; a roll-out passes the previous one). On
        sharing hosts each gets ``shape``'s SM share and quota when given (RPR's mix), else
        the spec's share."""
        if count <= 0:
            return []
        spec = spec or fn.spec
        model_bytes = fn.model_bytes if model_bytes is None else model_bytes
        if spec.sm_share > 0 and any(h.alive and not h.draining and h.gpu_sharing
                                     in SHARING_MODES for h in self.hosts.values()):
            return self._place_shared(fn, count, now_s, spec, model_bytes, shape)
        decision = select_receivers(self.snapshot(now_s),
                                    self._request(fn, count, spec, model_bytes))
        fn.unplaced = decision.reason if decision.unplaced else ""
        cmds: list[Command] = []
        for p in decision.placements:
            rid = f"{fn.spec.name}-{self.epoch}{next(self._seq)}"
            self.replicas[rid] = ReplicaRecord(rid, fn.spec.name, p.host_id, p.device_id,
                                               model_bytes + self.replica_overhead_bytes,
                                               ReplicaPhase.STARTING, now_s,
                                               compute=spec.compute, model_key=spec.model_key)
            cmds.append(DeployReplica(rid, p.host_id, p.device_id, spec))
        return cmds

    def _place_shared(self, fn: FunctionRecord, count: int, now_s: float,
                      spec: FunctionSpec, model_bytes: int,
                      shape: ReplicaConfig | None = None) -> list[Command]:
        """Up to ``count`` replicas of a function with a GPU share on sharing hosts' GPUs, by
        the pure policy of ``share_policy`` (FaST MaxRects or Dilu best fit,
        policy/share_placement.py); each deploy carries its share, which the host enforces
        (its tenant class too: a tokens host's KLC throttles best-effort shares).
        ``shape``: the SM share and quota of one of RPR's configurations instead of the
        spec's (an ``sm_limit`` below its share is raised to it)."""
        rids = tuple(f"{spec.name}-{self.epoch}{next(self._seq)}" for _ in range(count))
        sm_share = shape.sm_share if shape is not None else spec.sm_share
        quota = shape.quota if shape is not None else (spec.time_quota or 1.0)
        decision = place_shared(self.share_policy, self._share_devices(), ShareRequest(
            spec.name, rids, sm_share, max(spec.sm_limit, sm_share), quota,
            spec.gpu_memory_bytes or model_bytes + self.replica_overhead_bytes,
            slo_sensitive=spec.tenant_class is TenantClass.SLO))
        fn.unplaced = decision.reason if decision.unplaced else ""
        cmds: list[Command] = []
        for p in decision.placements:
            self.replicas[p.replica_id] = ReplicaRecord(
                p.replica_id, fn.spec.name, p.host_id, p.device_id, p.share.memory_bytes,
                ReplicaPhase.STARTING, now_s, compute=spec.compute, share=p.share,
                model_key=spec.model_key)
            cmds.append(DeployReplica(p.replica_id, p.host_id, p.device_id, spec,
                                      share=p.share))
        return cmds

    def _share_devices(self) -> tuple[ShareDevice, ...]:
        """GPUs of live, non-draining sharing hosts with their shared replicas; a GPU that
        runs an unshared replica is exclusive to it and left out."""
        on: dict[tuple[str, str], list[SharedReplica]] = {}
        exclusive: set[tuple[str, str]] = set()
        for r in self.replicas.values():
            key = (r.host_id, r.device_id)
            if r.share is None:
                exclusive.add(key)
            else:
                on.setdefault(key, []).append(SharedReplica(r.replica_id, r.function, r.share))
        return tuple(
            ShareDevice(h.host_id, d.device_id, d.memory_bytes, tuple(on.get((h.host_id, d.device_id), ())))
            for h in sorted(self.hosts.values(), key=lambda h: h.host_id)
            if h.alive and not h.draining and h.gpu_sharing in SHARING_MODES
            for d in sorted(h.devices.values(), key=lambda d: d.device_id)
            if d.kind == "cuda" and (h.host_id, d.device_id) not in exclusive
            and (h.host_id, d.device_id) not in self.blocked)

    def _kaas_device_bytes(self) -> int:
        # The executor's cache plus what any replica needs beyond its bytes (CUDA context,
        # allocator rounding): the host reserves the same, so both agree on what fits.
        return self.kaas_cache_bytes + self.replica_overhead_bytes

    def _place_kaas(self, now_s: float) -> list[Command]:
        """Keep ``kaas_replicas`` KaaS executor replicas placed (replacing lost ones), by the
        same placement as model replicas; after repeated failed starts, stop trying."""
        if self.kaas_replicas <= 0 or self.kaas_broken is not None:
            return []
        count = self.kaas_replicas - sum(r.function == KAAS_FUNCTION and not self._leaving(r)
                                         for r in self.replicas.values())
        if count <= 0:
            return []
        need = self._kaas_device_bytes()
        decision = select_receivers(self.snapshot(now_s), PlacementRequest(
            KAAS_FUNCTION, "", count, device_bytes=need, host_bytes=0,
            process_bytes=self.process_bytes))
        self.kaas_unplaced = decision.reason if decision.unplaced else ""
        cmds: list[Command] = []
        for p in decision.placements:
            rid = f"{KAAS_FUNCTION}-{self.epoch}{next(self._seq)}"
            self.replicas[rid] = ReplicaRecord(rid, KAAS_FUNCTION, p.host_id, p.device_id,
                                               need, ReplicaPhase.STARTING, now_s)
            cmds.append(DeployKaas(rid, p.host_id, p.device_id, need, self.kaas_cache_bytes))
        return cmds

    def _request(self, fn: FunctionRecord, count: int, spec: FunctionSpec | None = None,
                 model_bytes: int | None = None) -> PlacementRequest:
        spec = spec or fn.spec
        model_bytes = fn.model_bytes if model_bytes is None else model_bytes
        return PlacementRequest(spec.name, spec.model_key, count,
                                device_bytes=model_bytes + self.replica_overhead_bytes,
                                host_bytes=model_bytes, process_bytes=self.process_bytes,
                                compute=spec.compute)
