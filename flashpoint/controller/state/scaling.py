"""Scaling a function to what the autoscaler decides: scale-up (whole replicas on holders'
GPUs first, pipelines of stages on hosts that must fetch, Eq 4.14), scale-down (groups
first, §4.2.6), roll-outs between model versions (policy/rollout.py), and retiring a
draining host's replicas once replacements serve."""

from __future__ import annotations

from typing import Any

from flashpoint.controller.state.events import Command, DeployReplica, FunctionLoad
from flashpoint.controller.state.groups import GroupLifecycle
from flashpoint.controller.state.placement import Placement
from flashpoint.controller.state.records import (
    FunctionRecord,
    GroupPhase,
    GroupRecord,
    ReplicaPhase,
    ReplicaRecord,
)
from flashpoint.policy.partitioning import (
    GroupSnapshot,
    ScaleUpLoad,
    choose_plan,
    place_spread,
    scale_down_select,
    stage_ranges,
)
from flashpoint.policy.placement import select_receivers
from flashpoint.policy.rollout import RollPhase, RollReplica, RollSnapshot, plan_roll
from flashpoint.policy.rpr import LiveReplica, choose_changes, config_of
from flashpoint.policy.snapshot import ClusterSnapshot, FunctionLoadSnapshot


class Scaling(GroupLifecycle, Placement):
    """The autoscaler's decision per function, carried out."""

    def _scale(self, fn: FunctionRecord, load: FunctionLoad, now_s: float) -> list[Command]:
        # Stages of a retired group are on their way out: they are not capacity any more.
        leaving = {r for g in self.groups.values() if g.function == fn.spec.name
                   and g.phase == GroupPhase.STOPPING and g.reason == "retired" for r in g.stages}
        mine = [r for r in self.replicas.values()
                if r.function == fn.spec.name and r.replica_id not in leaving
                and not self._leaving(r)]
        warm = [r for r in mine if r.phase == ReplicaPhase.WARM]
        starting = [r for r in mine if r.phase == ReplicaPhase.STARTING]
        spec = fn.spec
        rolling = fn.previous is not None or any(r.model_key != fn.model_key
                                                 for r in warm + starting)
        seen_warm, seen_starting = len(warm), len(starting)
        if rolling:
            # A roll-out's surge (policy/rollout.py) is not capacity the autoscaler asked for:
            # shown to it, a keep-alive would hold it and the roll would never end.
            surge = max(0, seen_warm + seen_starting - fn.desired)
            hidden = min(surge, seen_starting)
            seen_starting, seen_warm = seen_starting - hidden, seen_warm - (surge - hidden)
        decision, fn.scaler_memory = self.autoscaler.decide(FunctionLoadSnapshot(
            spec.name, now_s, load.queued, load.inflight, seen_warm, seen_starting,
            fn.last_request_s, spec.min_replicas, spec.max_replicas, spec.replica_concurrency,
            spec.keep_alive_s, arrival_rate=load.arrival_rate, exec_time_s=load.exec_time_s,
            queue_latency_s=load.queue_latency_s, invocations_total=load.invocations_total,
            tokens=load.tokens,
            starting_ready_s=self._starting_ready(fn, starting)[:seen_starting],
            new_ready_s=self._new_ready(fn, now_s),
            # RPR (policy/rpr.py): the profile's configurations, the SLO, each replica's
            # shape and measured rate, and p_eff's throughput as one replica's rate
            slo_s=spec.slo_ms / 1000.0, configs=fn.configs,
            replica_configs=tuple(self._config_of(fn, r) for r in warm + starting)
            if fn.configs else (),
            replica_rates=tuple(load.replica_rates.get(r.replica_id, 0.0)
                                for r in warm + starting) if fn.configs else (),
            replica_rate=fn.config_rate_rps,
        ), fn.scaler_memory)
        current = len(warm) + len(starting)
        fn.desired, fn.reason = decision.desired, decision.reason
        if rolling:
            return self._roll(fn, warm + starting, decision.desired, now_s)
        fn.rollout = RollPhase.STABLE
        if decision.desired > current:
            if self.backing_off(spec.name, now_s) is not None:
                return []  # its starts keep failing: no new one before retry_at_s
            if self._shaped(fn) and decision.mix:
                return self._scale_to_mix(fn, warm + starting, decision.mix,
                                          decision.desired, now_s, load)
            return self._scale_up(fn, decision.desired - current, now_s, load)
        if decision.desired < current:
            excess = current - decision.desired
            cmds: list[Command] = []
            # Partitioned groups first (§4.2.6): a pipeline holds several GPUs for one
            # replica's worth of throughput.
            groups = [g for g in self.groups.values()
                      if g.function == fn.spec.name and g.phase != GroupPhase.STOPPING]
            # Only groups that fit in the replicas still to free (thesis §4.2.6): a
            # one-replica excess does not stop a four-stage pipeline.
            for gid in scale_down_select([GroupSnapshot(g.group_id, sum(
                    r in self.replicas for r in g.stages), g.serving_s or g.requested_s)
                    for g in groups], excess):
                group = self.groups[gid]
                excess -= sum(r in self.replicas for r in group.stages)
                cmds += self._stop_group(group, "retired")
            if self._shaped(fn) and decision.mix and excess > 0:
                # RPR's mix says which shapes go: lowest RPR first (policy/rpr.py)
                whole = [r for r in warm + starting if r.group_id not in self.groups]
                return cmds + self._scale_to_mix(fn, whole, decision.mix,
                                                 len(whole) - excess, now_s, load)
            # Then starting replicas (no work on them), then the most recently warmed (the
            # oldest replicas keep the warmest caches and JIT state).
            victims = [r for r in sorted(starting, key=lambda r: -r.requested_s)
                       + sorted(warm, key=lambda r: -(r.warm_s or 0.0))
                       if r.group_id not in self.groups]
            return cmds + self._retire(victims[: max(0, excess)])
        return []

    def _shaped(self, fn: FunctionRecord) -> bool:
        """Whether ``fn``'s replicas take the shapes of RPR's mix: it has profiled
        configurations and placement is FaST's, whose rectangles are (SM share × quota).
        Dilu reserves an SM request and limit but no quota, so a shape could not be read
        back from its share: there every replica keeps the registered share."""
        return bool(fn.configs) and self.share_policy == "fastgshare"

    def _config_of(self, fn: FunctionRecord, rep: ReplicaRecord) -> str:
        """The name of the profiled configuration ``rep`` runs in, read from its share
        ("" = none of ``fn``'s, or no share)."""
        if rep.share is None:
            return ""
        return config_of(rep.share.sm_share, rep.share.time_request, fn.configs)

    def replica_config(self, rep: ReplicaRecord) -> str:
        """The RPR configuration a replica runs in, for status ("" = none)."""
        fn = self.functions.get(rep.function)
        return self._config_of(fn, rep) if fn is not None else ""

    def _scale_to_mix(self, fn: FunctionRecord, mine: list[ReplicaRecord],
                      mix: tuple[tuple[str, int], ...], desired: int, now_s: float,
                      load: FunctionLoad) -> list[Command]:
        """Bring ``mine`` to ``desired`` replicas in RPR's configuration mix: each new
        replica gets the shape (SM share, quota) the mix names for it, placed as that shape;
        a scale-down retires the lowest-RPR replicas (rpr.choose_changes, pure)."""
        by_name = {c.name: c for c in fn.configs}
        change = choose_changes([LiveReplica(
            r.replica_id, name, by_name[name].resource if name in by_name else 0.0,
            load.replica_rates.get(r.replica_id, 0.0), r.phase == ReplicaPhase.WARM,
            r.warm_s if r.warm_s is not None else r.requested_s)
            for r in mine for name in (self._config_of(fn, r),)], mix, desired, fn.configs)
        if change.retire:
            return self._retire([self.replicas[r] for r in change.retire])
        cmds: list[Command] = []
        for name in dict.fromkeys(change.start):  # one placement per shape, in mix order
            count = change.start.count(name)
            cmds += self._place_whole(fn, count, now_s, shape=by_name[name])
            if fn.unplaced:
                return cmds  # no room for this shape: the next tick tries again
        rest = desired - len(mine) - len(change.start)
        return cmds + (self._scale_up(fn, rest, now_s, load) if rest > 0 else [])

    def _expected_cold_s(self, fn: FunctionRecord, sources: tuple[str, ...]) -> float | None:
        """The shortest cold start measured lately from any of ``sources``; else the mean
        over the sources measured; else the cost model's C(1); None = nothing known."""
        known = [fn.cold_s[s] for s in sources if s in fn.cold_s]
        if known:
            return min(known)
        if fn.cold_s:
            return sum(fn.cold_s.values()) / len(fn.cold_s)
        return fn.whole_cold_s or None

    def _starting_ready(self, fn: FunctionRecord,
                        starting: list[ReplicaRecord]) -> tuple[float, ...]:
        """When each starting replica is expected to serve (its request time plus its
        source's cold start), earliest first; one whose time has passed serves any moment.
        Empty when no cold start is known yet."""
        out = []
        for rep in starting:
            cold = self._expected_cold_s(fn, (rep.source or "registry",))
            if cold is None:
                return ()
            out.append(rep.requested_s + cold)
        return tuple(sorted(out))

    def _new_ready(self, fn: FunctionRecord, now_s: float) -> float | None:
        """When a replica ordered now is expected to serve: placement puts it on a host
        holding the model if one has room (own RAM, else a peer's chain), else it comes
        from the registry."""
        holders = any(h.alive and not h.draining and fn.model_key in h.cached_models
                      for h in self.hosts.values())
        cold = self._expected_cold_s(fn, ("local", "peer") if holders else ("registry",))
        return None if cold is None else now_s + cold

    def _roll(self, fn: FunctionRecord, mine: list[ReplicaRecord], desired: int,
              now_s: float) -> list[Command]:
        """A function whose replicas run more than one model version, or that holds a canary:
        the pure roll-out plan (policy/rollout.py) says which versions to start and which
        replicas to retire; retired ones drain (no new work, stopped once idle)."""
        target, stable, pct = fn.model_key, fn.stable_key, fn.spec.canary_pct
        if fn.roll_failed is not None and fn.previous is not None:
            # The new version would not start: back to the previous one until the next deploy.
            target, stable, pct = fn.previous.model_key, None, 100.0
        decision = plan_roll(RollSnapshot(target, stable, pct, desired, tuple(
            RollReplica(r.replica_id, r.model_key, r.phase == ReplicaPhase.WARM,
                        r.warm_s if r.warm_s is not None else r.requested_s) for r in mine)))
        fn.rollout = RollPhase.FAILED if fn.roll_failed is not None else decision.phase
        cmds = self._retire([self.replicas[r] for r in decision.retire if r in self.replicas])
        for key, count in decision.start:
            if key == fn.model_key:
                cmds += self._place_whole(fn, count, now_s)
            elif fn.previous is not None and key == fn.previous.model_key:
                cmds += self._place_whole(fn, count, now_s, fn.previous, fn.previous_bytes)
        if fn.rollout == RollPhase.STABLE:
            fn.previous, fn.previous_bytes = None, 0  # the roll-out is complete
        return cmds

    def _scale_up(self, fn: FunctionRecord, count: int, now_s: float,
                  load: FunctionLoad) -> list[Command]:
        need = fn.model_bytes + self.replica_overhead_bytes
        cmds: list[Command] = []
        # Partitioning speeds up fetching; a host that holds the model in RAM fetches
        # nothing. So whole replicas go on holders' GPUs first (placement's stage 1, LC),
        # and only the GPUs on hosts that must fetch are planned as pipelines (MP), their
        # stages pulling from the holders' RAM (MC) or the registry.
        holders = {h.host_id for h in self.hosts.values()
                   if h.alive and not h.draining and fn.model_key in h.cached_models}
        plan = None
        if fn.plans is not None and fn.spec.max_stages > 1 and count > 1:
            snap = self.snapshot(now_s)
            on_holders = len(select_receivers(ClusterSnapshot(snap.now_s, tuple(
                h for h in snap.hosts if h.host_id in holders)), self._request(fn, count)
            ).placements) if holders else 0
            plan = self._partition_plan(fn, count - on_holders, load)
            if plan is not None:
                cmds += self._place_whole(fn, on_holders, now_s)
                count -= on_holders
        if plan is not None:
            for _ in range(count // plan.p):
                snap = self.snapshot(now_s)
                spots = place_spread(ClusterSnapshot(snap.now_s, tuple(
                    h for h in snap.hosts if h.host_id not in holders)), self._request(fn, plan.p))
                if len(spots) < plan.p:
                    break  # too few hosts with room: whole replicas below
                gid = f"{fn.spec.name}-{self.epoch}g{next(self._seq)}"
                rids = []
                # Each stage reserves a whole replica's device memory: it completes into one.
                for stage, p in zip(stage_ranges(plan), spots, strict=True):
                    rid = f"{fn.spec.name}-{self.epoch}{next(self._seq)}"
                    rids.append(rid)
                    self.replicas[rid] = ReplicaRecord(rid, fn.spec.name, p.host_id, p.device_id,
                                                       need, ReplicaPhase.STARTING, now_s,
                                                       stage=stage, group_id=gid,
                                                       compute=fn.spec.compute,
                                                       model_key=fn.model_key)
                    cmds.append(DeployReplica(rid, p.host_id, p.device_id, fn.spec,
                                              stage=stage, group_id=gid))
                self.groups[gid] = GroupRecord(gid, fn.spec.name, tuple(rids),
                                               GroupPhase.STARTING, now_s)
                count -= plan.p
        return cmds + self._place_whole(fn, count, now_s)

    def _partition_plan(self, fn: FunctionRecord, count: int, load: FunctionLoad) -> Any:
        """The plan for ``count`` GPUs on hosts that must fetch the model (Eq 4.14), or None
        for whole replicas: the function must allow stages and have a plan table."""
        if fn.plans is None or fn.spec.max_stages < 2 or count < 2:
            return None
        plan = choose_plan(fn.plans, ScaleUpLoad(load.queued, load.arrival_rate,
                                                 load.service_rate, fn.whole_cold_s),
                           min(count, fn.spec.max_stages))
        return plan if plan.p > 1 else None

    def _drain(self, now_s: float) -> list[Command]:
        """Retire a draining host's warm replicas once their function has as many warm
        replicas elsewhere as it wants (or at least one), or when the deadline is near:
        queued work then goes to the other replicas, what they hold finishes."""
        cmds: list[Command] = []
        for host in self.hosts.values():
            if not host.draining or host.drain_deadline_s is None:
                continue
            late = now_s >= host.drain_deadline_s - self.drain_margin_s
            for rep in [r for r in self.replicas.values()
                        if r.host_id == host.host_id and r.phase == ReplicaPhase.WARM]:
                fn = self.functions.get(rep.function)
                elsewhere = sum(r.phase == ReplicaPhase.WARM and not self._leaving(r)
                                for r in self.replicas_of(rep.function))
                if late or fn is None or elsewhere >= max(1, fn.desired):
                    cmds += self._retire([rep])
        return cmds
