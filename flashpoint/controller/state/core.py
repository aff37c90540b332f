"""The controller's logic as a plain state class: events in, commands out.

No I/O and no clock reads: every event carries ``now_s``. The Controller actor executes the
commands (RPC to hosts) and feeds results back as events; tests and the simulator drive this
class directly. Replica ids are chosen here before a host is asked, so a retried deploy is
idempotent on the host.

This module holds :meth:`ControllerState.handle` and what each event does to hosts,
functions and replicas; the rest of the state's logic is in its mix-ins (``cluster.py``: the
fields and queries, ``groups.py``, ``placement.py``, ``sourcing.py``, ``scaling.py``) and
its records in ``records.py``.
"""

from __future__ import annotations

import dataclasses

from flashpoint.controller.state.events import (
    Command,
    Event,
    FailFunction,
    ForgetReplica,
    FunctionDeleted,
    FunctionLoad,
    FunctionUpserted,
    GroupAnswered,
    GroupLinked,
    HostDraining,
    HostHeartbeat,
    HostRegistered,
    ReplicaFailed,
    ReplicaShareChanged,
    ReplicasRetired,
    ReplicaStopped,
    ReplicaWarmed,
    RequestHost,
    RouteCanary,
    StageReady,
    StartFailure,
    StopReplica,
    Tick,
    UnitsBlocked,
    UnitsUnblocked,
)
from flashpoint.controller.state.records import (
    COLD_EWMA,
    FunctionRecord,
    GroupPhase,
    HostRecord,
    ReplicaPhase,
    ReplicaRecord,
    start_backoff_s,
)
from flashpoint.controller.state.scaling import Scaling
from flashpoint.controller.state.sourcing import Sourcing
from flashpoint.kaas import KAAS_FUNCTION
from flashpoint.policy.rollout import RollPhase
from flashpoint.policy.rpr import config_of
from flashpoint.policy.share_placement import profile_configs, resolve_share


class ControllerState(Scaling, Sourcing):
    """Cluster view and scaling decisions. Mutated only through :meth:`handle`.

    Its constructor and fields are :class:`~flashpoint.controller.state.cluster.ClusterRecords`'.
    """

    # ---------------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Command]:
        now_s = getattr(event, "now_s", None)
        if now_s is not None:
            self.now_s = max(self.now_s, now_s)
        cmds = self._handle(event)
        return cmds + self._settle_groups()

    def _handle(self, event: Event) -> list[Command]:
        match event:
            case HostRegistered():
                return self._host_registered(event)
            case HostHeartbeat():
                host = self.hosts.get(event.host_id)
                if host is None:
                    return []
                host.last_seen_s = event.now_s
                host.cached_models = set(event.cached_models)
                host.alive = True
                self._settle_receiving(host)
                return self._reconcile(host, event.replicas, event.now_s)
            case HostDraining():
                return self._host_draining(event)
            case FunctionUpserted():
                return self._function_upserted(event)
            case FunctionDeleted():
                self.functions.pop(event.name, None)
                cmds = self._retire(r for r in self.replicas.values() if r.function == event.name)
                return [*cmds, FailFunction(event.name, "function_not_found", "function deleted")]
            case ReplicaWarmed():
                rep = self.replicas.get(event.replica_id)
                if rep is None or rep.phase != ReplicaPhase.STARTING:
                    return []
                rep.phase, rep.warm_s, rep.timings_s = ReplicaPhase.WARM, event.now_s, dict(event.timings_s)
                if rep.function == KAAS_FUNCTION:
                    self.kaas_start_failures = 0
                fn = self.functions.get(rep.function)
                if fn is not None:
                    fn.start_failures, fn.start_failure, fn.backoff_rounds = 0, None, 0
                    _measure_cold(fn, rep, event.now_s)
                    # A warm whole replica was built from its host's complete cached copy:
                    # that host is a holder now, not only from its next heartbeat on.
                    if (host := self.hosts.get(rep.host_id)) is not None:
                        host.cached_models.add(rep.model_key or fn.model_key)
                        self._settle_receiving(host)
                return []
            case ReplicaFailed():
                return self._replica_failed(event)
            case ReplicaStopped():
                if self.replicas.pop(event.replica_id, None) is not None:
                    return [ForgetReplica(event.replica_id)]
                return []
            case StageReady():
                return self._stage_ready(event)
            case GroupLinked():
                return self._group_linked(event)
            case GroupAnswered():
                return self._group_answered(event)
            case Tick():
                return self._tick(event)
            case UnitsBlocked():
                self.blocked.update((event.host_id, d) for d in event.device_ids)
                return []
            case UnitsUnblocked():
                self.blocked.difference_update((event.host_id, d) for d in event.device_ids)
                return []
            case ReplicaShareChanged():
                if (rep := self.replicas.get(event.replica_id)) is not None:
                    rep.share = event.share
                return []
            case ReplicasRetired():
                return self._retire([self.replicas[r] for r in event.replica_ids
                                     if r in self.replicas])
        raise TypeError(f"unknown event {event!r}")

    def _function_upserted(self, ev: FunctionUpserted) -> list[Command]:
        """Register or replace a function. A new model version does not touch its replicas
        here: the ticks roll them over (:meth:`_roll`) while the old version serves."""
        old = self.functions.get(ev.spec.name)
        spec, share_reason = resolve_share(ev.spec, self.share_policy)  # profile -> sm_share
        configs = profile_configs(ev.spec)  # RPR then shapes each replica (scaling.py)
        rec = FunctionRecord(spec, ev.model_bytes, plans=ev.plans,
                             whole_cold_s=ev.whole_cold_s, share_reason=share_reason,
                             configs=configs, config_rate_rps=next(
                                 (c.throughput_rps for c in configs if c.name == config_of(
                                     spec.sm_share, spec.time_quota, configs)), 0.0))
        if old is not None:
            rec.last_request_s = old.last_request_s
            rec.scaler_memory = old.scaler_memory
            rec.desired = old.desired
            if old.model_key != rec.model_key:
                rec.previous, rec.previous_bytes = old.spec, old.model_bytes
            else:  # same version, other settings (or the canary's percentage)
                rec.previous, rec.previous_bytes = old.previous, old.previous_bytes
        self.functions[ev.spec.name] = rec
        # What the next tick's plan will say, visible at once (GET /v1/functions/{name})
        mixed = any(r.model_key != rec.model_key and r.phase != ReplicaPhase.STOPPING
                    for r in self.replicas_of(spec.name))
        rec.rollout = RollPhase.ROLLING if mixed or rec.canary else RollPhase.STABLE
        if rec.canary:
            return [RouteCanary(spec.name, rec.model_key, spec.canary_pct)]
        if old is not None and old.canary:
            return [RouteCanary(spec.name, "", 100.0)]
        return []

    def _host_registered(self, ev: HostRegistered) -> list[Command]:
        self.hosts[ev.host_id] = HostRecord(
            ev.host_id, {d.device_id: d for d in ev.devices}, ev.ram_bytes,
            set(ev.cached_models), ev.now_s, leaf=ev.leaf, gpu_sharing=ev.gpu_sharing,
            gpus=ev.gpus,
        )
        self._settle_receiving(self.hosts[ev.host_id])
        cmds: list[Command] = []
        reported = set()
        for replica_id, function, device_id, warm in ev.replicas:
            reported.add(replica_id)
            fn = self.functions.get(function)
            known = self.replicas.get(replica_id)
            kaas = function == KAAS_FUNCTION and self.kaas_replicas > 0
            if (fn is None and not kaas) or device_id not in self.hosts[ev.host_id].devices:
                # A replica we have no function for (deleted while we were away): stop it.
                if self.replicas.pop(replica_id, None) is not None:
                    cmds.append(ForgetReplica(replica_id))
                cmds.append(StopReplica(replica_id, ev.host_id))
                continue
            if known is None:
                # Adopt it (controller restart): no duplicate will be started for it.
                self.replicas[replica_id] = ReplicaRecord(
                    replica_id, function, ev.host_id, device_id,
                    self._kaas_device_bytes() if fn is None
                    else fn.model_bytes + self.replica_overhead_bytes,
                    ReplicaPhase.WARM if warm else ReplicaPhase.STARTING, ev.now_s,
                    ev.now_s if warm else None, compute=fn.spec.compute if fn else 0.0,
                    share=ev.shares.get(replica_id),
                    # as its host reports it (else the registered version): a roll-out under
                    # way before the restart goes on
                    model_key=ev.models.get(replica_id) or (fn.model_key if fn else ""),
                )
        # Replicas we believed on this host that it no longer has are gone.
        for rep in [r for r in self.replicas.values() if r.host_id == ev.host_id]:
            if rep.replica_id not in reported:
                del self.replicas[rep.replica_id]
                cmds.append(ForgetReplica(rep.replica_id))
        return cmds

    def _reconcile(self, host: HostRecord, reported: frozenset[str] | None,
                   now_s: float) -> list[Command]:
        """Requested vs observed: a replica we placed on ``host`` that it does not run (its
        deploy was lost, or the host restarted) is forgotten, so the autoscaler replaces it;
        one it runs that we do not know (we stopped it and the stop was lost) is stopped.
        A deploy younger than the grace may simply not have reached the host yet."""
        if reported is None:
            return []
        host.reported = reported
        grace_s = max(2.0 * self.heartbeat_timeout_s, 5.0)
        cmds: list[Command] = []
        for rep in [r for r in self.replicas.values() if r.host_id == host.host_id]:
            if rep.replica_id not in reported and now_s - rep.requested_s > grace_s:
                del self.replicas[rep.replica_id]
                cmds.append(ForgetReplica(rep.replica_id))
        if self.stop_unknown_replicas:
            for rid in sorted(reported - set(self.replicas)):
                cmds.append(StopReplica(rid, host.host_id))
        return cmds

    def _replica_failed(self, ev: ReplicaFailed) -> list[Command]:
        rep = self.replicas.pop(ev.replica_id, None)
        if rep is None:
            return []
        cmds: list[Command] = [ForgetReplica(rep.replica_id)]
        if rep.function == KAAS_FUNCTION and ev.during_start:
            self.kaas_start_failures += 1
            if self.kaas_start_failures >= self.max_start_failures:
                self.kaas_broken = ev.reason
        fn = self.functions.get(rep.function)
        if fn is not None and ev.during_start:
            if (fn.start_failures + 1 >= self.max_start_failures and fn.previous is not None
                    and rep.model_key == fn.model_key and any(
                        r.phase == ReplicaPhase.WARM and r.model_key != fn.model_key
                        for r in self.replicas_of(fn.spec.name))):
                # A roll-out to a version that does not start: the previous version keeps
                # serving (and takes its replicas back) until the next deploy.
                fn.roll_failed, fn.rollout, fn.start_failures = ev.reason, RollPhase.FAILED, 0
                fn.start_failure, fn.backoff_rounds = None, 0
            else:
                cmds += self._start_failed(fn, ev)
        return cmds

    def _start_failed(self, fn: FunctionRecord, ev: ReplicaFailed) -> list[Command]:
        """Count a failed start of ``fn``; the ``max_start_failures``-th in a row (and every
        one after it until a replica warms) begins a back-off, and when none of its replicas
        is warm what waits for it fails at once (FailFunction carries the failure)."""
        now_s = ev.now_s if ev.now_s is not None else self.now_s
        fn.start_failures += 1
        last = fn.start_failure
        failure = StartFailure(ev.code, ev.reason, fn.start_failures,
                               last.since_s if last is not None else now_s, now_s)
        if fn.start_failures < self.max_start_failures:
            fn.start_failure = failure
            return []
        delay_s = start_backoff_s(fn.backoff_rounds, self.start_backoff_s,
                                  self.start_backoff_max_s)
        fn.backoff_rounds += 1
        fn.start_failure = dataclasses.replace(failure, retry_at_s=now_s + delay_s)
        if self._serving(fn.spec.name):
            return []  # its warm replicas keep serving what is queued
        return [FailFunction(fn.spec.name, "model_load_failed",
                             f"replicas of {fn.spec.name!r} failed to start "
                             f"{fn.start_failures} times in a row (next try in "
                             f"{delay_s:.0f}s): {ev.reason}", fn.start_failure)]

    def _tick(self, ev: Tick) -> list[Command]:
        cmds: list[Command] = []
        # Silent hosts: their replicas are gone; autoscaling below replaces them.
        for host in self.hosts.values():
            if host.alive and ev.now_s - host.last_seen_s > self.heartbeat_timeout_s:
                host.alive = False
                for rep in [r for r in self.replicas.values() if r.host_id == host.host_id]:
                    del self.replicas[rep.replica_id]
                    cmds.append(ForgetReplica(rep.replica_id))
        # A cold start that never finished (hung load, lost report) is a failed start: free its
        # device and count it, so a stuck replica cannot hold capacity or queued work forever.
        for rep in [r for r in self.replicas.values() if r.phase == ReplicaPhase.STARTING
                    and ev.now_s - r.requested_s > self.cold_start_timeout_s]:
            cmds += self._replica_failed(ReplicaFailed(
                rep.replica_id, f"cold start exceeded {self.cold_start_timeout_s}s",
                during_start=True, code="deadline_exceeded", now_s=ev.now_s))
            cmds.append(StopReplica(rep.replica_id, rep.host_id))
        # Groups and replicas drained of work finish stopping (a group's stages first).
        for gid in ev.idle_replicas:
            group = self.groups.get(gid)
            if group is not None and group.phase == GroupPhase.STOPPING:
                cmds += self._dissolve(group)
        for rid in ev.idle_replicas:
            rep = self.replicas.get(rid)
            if rep is not None and rep.phase == ReplicaPhase.STOPPING \
                    and rep.group_id not in self.groups:
                del self.replicas[rid]
                cmds += [ForgetReplica(rid), StopReplica(rid, rep.host_id)]
        cmds += self._drain(ev.now_s)
        for name, fn in self.functions.items():
            load = ev.loads.get(name, FunctionLoad(0, 0, None))
            if load.last_request_s is not None:
                fn.last_request_s = load.last_request_s
            cmds += self._scale(fn, load, ev.now_s)
        cmds += self._place_kaas(ev.now_s)
        for key, began in list(self.receiving.items()):
            host = self.hosts.get(key[0])
            if host is None or not host.alive or ev.now_s - began > self.cold_start_timeout_s:
                del self.receiving[key]
                self.inbound.pop(key, None)
        return self._source(cmds, ev.now_s)

    # draining (spot eviction) --------------------------------------------------------
    def _host_draining(self, ev: HostDraining) -> list[Command]:
        """A host got an eviction notice: no more placements there, replacements elsewhere
        (its replicas stop counting as capacity, so the autoscaler places new ones), its
        warm replicas keep serving until replacements are warm or the deadline nears (see
        :meth:`_drain`), a replacement host is requested, and models only it holds are pushed
        to a peer so warm state survives the eviction."""
        host = self.hosts.get(ev.host_id)
        if host is None or host.draining:
            return []
        host.draining, host.drain_deadline_s = True, ev.deadline_s
        cmds: list[Command] = [RequestHost(host.host_id)]
        for rep in [r for r in self.replicas.values()
                    if r.host_id == host.host_id and r.phase == ReplicaPhase.STARTING
                    and r.group_id is None]:
            del self.replicas[rep.replica_id]  # it would barely serve: start it elsewhere
            cmds += [ForgetReplica(rep.replica_id), StopReplica(rep.replica_id, rep.host_id)]
        return cmds + self._push_models(host, ev.now_s)


def _measure_cold(fn: FunctionRecord, rep: ReplicaRecord, now_s: float) -> None:
    """Fold a whole replica's cold start into its function's per-source average (the
    governor's expected ready times). Stages and unsourced deploys are not a source's
    whole cold start; a replica warm the moment it was asked for (prewarmed) is no cold
    start at all."""
    took = now_s - rep.requested_s
    if rep.stage is not None or not rep.source or took <= 0:
        return
    old = fn.cold_s.get(rep.source)
    fn.cold_s[rep.source] = took if old is None else COLD_EWMA * took + (1 - COLD_EWMA) * old
