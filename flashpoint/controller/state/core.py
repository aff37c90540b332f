"""The controller's logic as a plain state class: events in, commands out.

No I/O and no clock reads: every event carries ``now_s``. The Controller actor executes the
commands (RPC to hosts) and feeds results back as events; tests and the simulator drive this
class directly. Replica ids are chosen here before a host is asked, so a retried deploy is
idempotent on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from flashpoint.controller.state.events import (  # re-exported: the state's interface
    BeginCompletion as BeginCompletion,
)
from flashpoint.controller.state.events import (
    Command as Command,
)
from flashpoint.controller.state.events import (
    DeployKaas as DeployKaas,
)
from flashpoint.controller.state.events import (
    DeployReplica as DeployReplica,
)
from flashpoint.controller.state.events import (
    DeviceRecord as DeviceRecord,
)
from flashpoint.controller.state.events import (
    DissolveStages as DissolveStages,
)
from flashpoint.controller.state.events import (
    Event as Event,
)
from flashpoint.controller.state.events import (
    FailFunction as FailFunction,
)
from flashpoint.controller.state.events import (
    ForgetReplica as ForgetReplica,
)
from flashpoint.controller.state.events import (
    FunctionDeleted as FunctionDeleted,
)
from flashpoint.controller.state.events import (
    FunctionLoad as FunctionLoad,
)
from flashpoint.controller.state.events import (
    FunctionUpserted as FunctionUpserted,
)
from flashpoint.controller.state.events import (
    GpuRecord as GpuRecord,
)
from flashpoint.controller.state.events import (
    GroupAnswered as GroupAnswered,
)
from flashpoint.controller.state.events import (
    GroupLinked as GroupLinked,
)
from flashpoint.controller.state.events import (
    HostDraining as HostDraining,
)
from flashpoint.controller.state.events import (
    HostHeartbeat as HostHeartbeat,
)
from flashpoint.controller.state.events import (
    HostRegistered as HostRegistered,
)
from flashpoint.controller.state.events import (
    LinkGroup as LinkGroup,
)
from flashpoint.controller.state.events import (
    ReplicaFailed as ReplicaFailed,
)
from flashpoint.controller.state.events import (
    ReplicaStopped as ReplicaStopped,
)
from flashpoint.controller.state.events import (
    ReplicaWarmed as ReplicaWarmed,
)
from flashpoint.controller.state.events import (
    RequestHost as RequestHost,
)
from flashpoint.controller.state.events import (
    RouteCanary as RouteCanary,
)
from flashpoint.controller.state.events import (
    ServeGroup as ServeGroup,
)
from flashpoint.controller.state.events import (
    SourceAssignment as SourceAssignment,
)
from flashpoint.controller.state.events import (
    StageReady as StageReady,
)
from flashpoint.controller.state.events import (
    StartChain as StartChain,
)
from flashpoint.controller.state.events import (
    StartFailure as StartFailure,
)
from flashpoint.controller.state.events import (
    StopAccepting as StopAccepting,
)
from flashpoint.controller.state.events import (
    StopReplica as StopReplica,
)
from flashpoint.controller.state.events import (
    Tick as Tick,
)
from flashpoint.ids import ModelKey
from flashpoint.kaas import KAAS_FUNCTION
from flashpoint.policy import autoscale
from flashpoint.policy.partitioning import (
    GroupSnapshot,
    PlanLookup,
    ScaleUpLoad,
    choose_plan,
    place_spread,
    scale_down_order,
    stage_ranges,
)
from flashpoint.policy.placement import PlacementRequest, select_receivers
from flashpoint.policy.rollout import (
    RollPhase,
    RollReplica,
    RollSnapshot,
    canary_active,
    plan_roll,
)
from flashpoint.policy.share_placement import (
    SHARING_MODES,
    ReplicaShare,
    ShareDevice,
    SharedReplica,
    ShareRequest,
    place_shared,
    resolve_share,
)
from flashpoint.policy.snapshot import (
    ClusterSnapshot,
    DeviceSnapshot,
    FunctionLoadSnapshot,
    HostSnapshot,
)
from flashpoint.policy.sourcing import REGISTRY, plan_sourcing
from flashpoint.spec import FunctionSpec

# After this many consecutive failed starts a function backs off (no starts for a while; what
# waits for it fails with ModelLoadFailed) instead of retrying at once; KaaS stops for good.
MAX_CONSECUTIVE_START_FAILURES = 3


def start_backoff_s(rounds: int, initial_s: float, max_s: float) -> float:
    """The ``rounds``-th back-off (0 first) of a function whose starts keep failing:
    ``min(max_s, initial_s * 2**rounds)``."""
    return min(max_s, initial_s * 2.0 ** min(rounds, 62))


class ReplicaPhase(StrEnum):
    STARTING = "starting"
    WARM = "warm"
    STOPPING = "stopping"


class GroupPhase(StrEnum):
    STARTING = "starting"  # its stages load (each only waits for its own bytes)
    LINKING = "linking"  # every stage serves; the actor links them into a pipeline
    SERVING = "serving"  # one dispatch target: requests enter at the first stage
    STOPPING = "stopping"  # no new work; dissolved once nothing is in flight


@dataclass
class HostRecord:
    host_id: str
    devices: dict[str, DeviceRecord]
    ram_bytes: int
    cached_models: set[str]
    last_seen_s: float
    alive: bool = True
    draining: bool = False
    reported: frozenset[str] = frozenset()  # replica ids in its last report
    leaf: str = ""  # the leaf switch (rack) it hangs off, as it reported it
    gpu_sharing: str = "none"  # its [host] gpu_sharing: "mps"/"tokens" enforce shares
    drain_deadline_s: float | None = None  # when a draining host goes away
    gpus: tuple[GpuRecord, ...] = ()  # its physical GPUs (MIG reconfiguration)


@dataclass
class ReplicaRecord:
    replica_id: str
    function: str
    host_id: str
    device_id: str
    device_bytes: int
    phase: ReplicaPhase
    requested_s: float
    warm_s: float | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    # A partition stage: its layers and its group. It turns WARM only once it has completed
    # into a whole replica; until then it serves as one stage of its group's pipeline.
    stage: tuple[int, int] | None = None
    group_id: str | None = None
    compute: float = 0.0  # fraction of its device's compute it reserves
    share: ReplicaShare | None = None  # its GPU share on a sharing host (policy/share_placement.py;
    # the host enforces it, gpu/host_sharing.py)
    # The model version it runs ("name@version"); a function rolling to another version has
    # replicas of both (policy/rollout.py).
    model_key: str = ""


@dataclass
class GroupRecord:
    """A partitioned replica group: ``stages`` (replica ids, first stage first) served as
    one pipeline until every stage has completed into a whole replica (thesis §4.2.5)."""

    group_id: str
    function: str
    stages: tuple[str, ...]
    phase: GroupPhase
    requested_s: float
    ready: set[str] = field(default_factory=set)
    serving_s: float | None = None
    reason: str = ""  # why it stops
    answered: bool = False  # its pipeline answered a request (BeginCompletion was sent)


@dataclass
class FunctionRecord:
    spec: FunctionSpec
    model_bytes: int
    last_request_s: float | None = None
    start_failures: int = 0  # consecutive failed starts (reset when a replica warms)
    start_failure: StartFailure | None = None  # the last of them, while the streak lasts
    backoff_rounds: int = 0  # back-offs in this streak (the next one doubles)
    plans: PlanLookup | None = None  # the model's plan table, when it may be partitioned
    whole_cold_s: float = 0.0  # C(1): the cost model's whole-model cold start
    desired: int = 0  # the autoscaler's last decision (the planned replica count)
    scaler_memory: Any = None  # the autoscaler's memory for this function (windows, delays)
    reason: str = ""  # why the autoscaler decided what it did, last time
    unplaced: str = ""  # why the last scale-up could not place every replica ("" = it could)
    share_reason: str = ""  # where its sm_share came from, when a FaST profile chose it
    # The spec registered before a change of model version, and its model's size: replicas
    # of it keep serving while the roll-out runs, and a canary keeps some (policy/rollout.py).
    # Cleared once every replica runs ``spec``'s version and no canary holds.
    previous: FunctionSpec | None = None
    previous_bytes: int = 0
    rollout: RollPhase = RollPhase.STABLE
    roll_failed: str | None = None  # why replicas of ``spec``'s version kept failing to start

    @property
    def model_key(self) -> str:
        return self.spec.model_key

    @property
    def stable_key(self) -> str | None:
        """The version the rest of the traffic goes to while a canary holds."""
        return self.previous.model_key if self.previous is not None else None

    @property
    def canary(self) -> bool:
        return canary_active(self.model_key, self.stable_key, self.spec.canary_pct)


class ControllerState:
    """Cluster view and scaling decisions. Mutated only through :meth:`handle`."""

    def __init__(self, heartbeat_timeout_s: float = 5.0, replica_overhead_bytes: int = 64 << 20,
                 cold_start_timeout_s: float = 120.0, registry_sends: bool = True,
                 stop_unknown_replicas: bool = True, process_bytes: int = 0,
                 autoscaler: autoscale.Autoscaler | None = None,
                 max_chain_length: int = 8, drain_margin_s: float = 10.0,
                 kaas_replicas: int = 0, kaas_cache_bytes: int = 256 << 20,
                 share_policy: str = "fastgshare", peer_sends: bool = True,
                 max_start_failures: int = MAX_CONSECUTIVE_START_FAILURES,
                 start_backoff_s: float = 10.0, start_backoff_max_s: float = 300.0) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # A function whose replicas failed to start this many times in a row stops starting
        # them for start_backoff_s, doubled each time it happens again, at most
        # start_backoff_max_s; a replica of it warming ends the streak.
        self.max_start_failures = max_start_failures
        self.start_backoff_s = start_backoff_s
        self.start_backoff_max_s = start_backoff_max_s
        self.now_s = 0.0  # the time of the last event that carried one
        self.share_policy = share_policy  # policy/share_placement.py: fastgshare | dilu
        self.stop_unknown_replicas = stop_unknown_replicas
        self.process_bytes = process_bytes  # host RAM of one worker process (placement)
        self.autoscaler = autoscaler or autoscale.make_autoscaler("concurrency")
        self.registry_sends = registry_sends
        # Off: a host's RAM copy serves only that host, never a peer (policy.sourcing; the
        # simulator's GPU-enabled-FaaS baseline). On for every live deployment.
        self.peer_sends = peer_sends
        self.max_chain_length = max_chain_length
        # A draining host's replicas stop taking work this long before its deadline at the
        # latest, so what they hold finishes before the VM goes.
        self.drain_margin_s = drain_margin_s
        # (host_id, model_key) -> when a transfer to that host began; such a host is neither a
        # holder nor a new receiver (its own single flight joins later deploys to it).
        self.receiving: dict[tuple[str, str], float] = {}
        # (host_id, model_key) -> (transfer id, sender) of the peer chain bringing it there:
        # a later deploy to that host is told to wait for that chain, not to start a pull.
        self.inbound: dict[tuple[str, str], tuple[str, str]] = {}
        self._transfer_seq = itertools.count(1)
        self.cold_start_timeout_s = cold_start_timeout_s
        self.replica_overhead_bytes = replica_overhead_bytes
        self.hosts: dict[str, HostRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.functions: dict[str, FunctionRecord] = {}
        self.groups: dict[str, GroupRecord] = {}
        # KaaS executors (issue 10): a fixed number of replicas of the reserved function
        # KAAS_FUNCTION, placed like any replica (they count against device memory and host
        # RAM), never autoscaled: the paper starts one executor per GPU at boot (§4.1.4).
        self.kaas_replicas = kaas_replicas
        self.kaas_cache_bytes = kaas_cache_bytes
        self.kaas_start_failures = 0
        self.kaas_broken: str | None = None  # why, once KaaS starts keep failing
        self.kaas_unplaced = ""  # why the last placement could not place them all
        self._seq = itertools.count(1)
        self.epoch = "r"  # prefix for replica ids; the actor sets a per-boot value
        # (host_id, device_id) of units taken out of service (a GPU drained for a MIG
        # geometry, controller/state/mig_reconfig.py): nothing is placed there, and replicas there
        # are leaving (not capacity), so replacements start elsewhere.
        self.blocked: set[tuple[str, str]] = set()

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
        raise TypeError(f"unknown event {event!r}")

    # ---------------------------------------------------------------------------------
    def _function_upserted(self, ev: FunctionUpserted) -> list[Command]:
        """Register or replace a function. A new model version does not touch its replicas
        here: the ticks roll them over (:meth:`_roll`) while the old version serves."""
        old = self.functions.get(ev.spec.name)
        spec, share_reason = resolve_share(ev.spec)  # FaST profile -> sm_share
        rec = FunctionRecord(spec, ev.model_bytes, plans=ev.plans,
                             whole_cold_s=ev.whole_cold_s, share_reason=share_reason)
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

    def _serving(self, function: str) -> bool:
        """A replica of ``function`` is warm, or a group of it serves."""
        return any(r.function == function and r.phase == ReplicaPhase.WARM
                   for r in self.replicas.values()) or any(
            g.function == function and g.phase == GroupPhase.SERVING
            for g in self.groups.values())

    def backing_off(self, function: str, now_s: float) -> StartFailure | None:
        """The failure ``function`` backs off from at ``now_s`` (no replica is started for
        it until ``retry_at_s``), or None."""
        fn = self.functions.get(function)
        failure = fn.start_failure if fn is not None else None
        if failure is None or failure.retry_at_s is None or now_s >= failure.retry_at_s:
            return None
        return failure

    def not_ready(self, function: str) -> StartFailure | None:
        """Why ``function`` cannot serve now, or None when it can: a replica (or group) of it
        serves, or it scales from zero and its last start did not fail."""
        fn = self.functions.get(function)
        if fn is None or fn.start_failure is None or self._serving(function):
            return None
        return fn.start_failure

    def _retire(self, reps: object) -> list[Command]:
        cmds: list[Command] = []
        for rep in list(reps):  # type: ignore[call-overload]
            group = self.groups.get(rep.group_id) if rep.group_id else None
            if group is not None:
                # A stage may carry pipeline requests: the group stops taking work first
                # and its stages stop when it dissolves (see _dissolve).
                cmds += self._stop_group(group, "retired")
                continue
            if rep.phase == ReplicaPhase.STARTING:
                # Nothing dispatched to it yet: stop at once.
                del self.replicas[rep.replica_id]
                cmds += [ForgetReplica(rep.replica_id), StopReplica(rep.replica_id, rep.host_id)]
            elif rep.phase == ReplicaPhase.WARM:
                rep.phase = ReplicaPhase.STOPPING
                cmds.append(StopAccepting(rep.replica_id))
        return cmds

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

    def _push_models(self, host: HostRecord, now_s: float) -> list[Command]:
        """Stream each model only ``host`` holds (of a registered function) to the live peer
        with the most free RAM for it (none when hosts never send to peers)."""
        if not self.peer_sends:
            return []
        sizes = {f.model_key: f.model_bytes for f in self.functions.values()}
        snap = self.snapshot(now_s)
        cmds: list[Command] = []
        for key in sorted(host.cached_models & set(sizes)):
            held = any(h.alive and not h.draining and key in h.cached_models
                       for h in self.hosts.values() if h.host_id != host.host_id)
            if held or any(k == key for _, k in self.receiving):
                continue
            peers = [h for h in snap.hosts if h.alive and not h.draining
                     and h.host_id != host.host_id and h.ram_free_bytes >= sizes[key]]
            if not peers:
                continue
            target = min(peers, key=lambda h: (-h.ram_free_bytes, h.host_id))
            tid = f"t-{self.epoch}{next(self._transfer_seq)}"
            self.receiving[(target.host_id, key)] = now_s
            self.inbound[(target.host_id, key)] = (tid, host.host_id)
            mk = ModelKey.parse(key)
            cmds.append(StartChain(tid, host.host_id, mk.name, mk.version, (target.host_id,),
                                   (REGISTRY,)))
        return cmds

    def _can_send(self, host: HostRecord, now_s: float) -> bool:
        """A draining host still sends the models it holds until its deadline nears (its RAM
        is the fastest copy; receivers fall back to the registry if it goes mid-stream)."""
        return not host.draining or (host.drain_deadline_s is not None
                                     and now_s < host.drain_deadline_s - self.drain_margin_s)

    def _leaving(self, rep: ReplicaRecord) -> bool:
        if (rep.host_id, rep.device_id) in self.blocked:
            return True
        host = self.hosts.get(rep.host_id)
        return host is not None and host.draining

    # units out of service (MIG reconfiguration, controller/state/mig_reconfig.py) -----------------
    def block(self, host_id: str, device_ids: tuple[str, ...]) -> None:
        self.blocked.update((host_id, d) for d in device_ids)

    def unblock(self, host_id: str, device_ids: tuple[str, ...]) -> None:
        self.blocked.difference_update((host_id, d) for d in device_ids)

    def retire(self, replica_ids: tuple[str, ...]) -> list[Command]:
        """Stop these replicas the usual way: no new work, stopped once idle."""
        return self._retire([self.replicas[r] for r in replica_ids if r in self.replicas])

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

    # partitioned groups ---------------------------------------------------------------
    def _stage_ready(self, ev: StageReady) -> list[Command]:
        rep = self.replicas.get(ev.replica_id)
        group = self.groups.get(rep.group_id) if rep is not None and rep.group_id else None
        if group is None or group.phase != GroupPhase.STARTING:
            return []
        group.ready.add(ev.replica_id)
        if not group.ready >= set(group.stages):
            return []
        group.phase = GroupPhase.LINKING
        return [LinkGroup(group.group_id, group.function,
                          tuple((r, self.replicas[r].host_id) for r in group.stages))]

    def _group_linked(self, ev: GroupLinked) -> list[Command]:
        group = self.groups.get(ev.group_id)
        if group is None or group.phase != GroupPhase.LINKING:
            # Dissolved or stopping meanwhile: close what the actor opened.
            return [ForgetReplica(ev.group_id)] if ev.ok else []
        if not ev.ok:
            return self._stop_group(group, f"link failed: {ev.reason}")
        group.phase, group.serving_s = GroupPhase.SERVING, ev.now_s
        fn = self.functions.get(group.function)
        return [ServeGroup(group.group_id, group.function,
                           fn.spec.replica_concurrency if fn is not None else 1)]

    def _group_answered(self, ev: GroupAnswered) -> list[Command]:
        """Its first answer releases the stages' held background work, once per group."""
        group = self.groups.get(ev.group_id)
        if group is None or group.answered:
            return []
        group.answered = True
        return [BeginCompletion(group.group_id, tuple(
            (r, self.replicas[r].host_id) for r in group.stages if r in self.replicas))]

    def _stop_group(self, group: GroupRecord, reason: str) -> list[Command]:
        """No new work for the group; it dissolves at the first tick with none in flight."""
        if group.phase == GroupPhase.STOPPING:
            return []
        serving = group.phase == GroupPhase.SERVING
        group.phase, group.reason = GroupPhase.STOPPING, reason
        return [StopAccepting(group.group_id)] if serving else []

    def _dissolve(self, group: GroupRecord) -> list[Command]:
        """The pipeline is gone; its stages live on as the replicas they complete into,
        unless the group was retired (then they stop too)."""
        del self.groups[group.group_id]
        members = [self.replicas[r] for r in group.stages if r in self.replicas]
        for rep in members:
            rep.group_id = None
        cmds: list[Command] = [ForgetReplica(group.group_id), DissolveStages(
            group.group_id, tuple((r.replica_id, r.host_id) for r in members))]
        if group.reason == "retired":
            cmds += self._retire(members)
        return cmds

    def _settle_groups(self) -> list[Command]:
        """After every event: a group missing a stage cannot serve; a group whose stages all
        completed into whole replicas is no longer needed (thesis §4.2.5: it dissolves)."""
        cmds: list[Command] = []
        for group in list(self.groups.values()):
            if group.phase == GroupPhase.STOPPING:
                continue
            if any(r not in self.replicas for r in group.stages):
                cmds += self._stop_group(group, "stage lost")
            elif all(self.replicas[r].phase == ReplicaPhase.WARM for r in group.stages):
                cmds += self._stop_group(group, "completed")
        return cmds

    def _partition_plan(self, fn: FunctionRecord, count: int, load: FunctionLoad) -> Any:
        """The plan for ``count`` GPUs on hosts that must fetch the model (Eq 4.14), or None
        for whole replicas: the function must allow stages and have a plan table."""
        if fn.plans is None or fn.spec.max_stages < 2 or count < 2:
            return None
        plan = choose_plan(fn.plans, ScaleUpLoad(load.queued, load.arrival_rate,
                                                 load.service_rate, fn.whole_cold_s),
                           min(count, fn.spec.max_stages))
        return plan if plan.p > 1 else None

    def _settle_receiving(self, host: HostRecord) -> None:
        for key in [k for k in self.receiving if k[0] == host.host_id and k[1] in host.cached_models]:
            del self.receiving[key]
            self.inbound.pop(key, None)

    def _source(self, cmds: list[Command], now_s: float) -> list[Command]:
        """Attach a sourcing plan to this tick's deploys, one plan per model."""
        by_model: dict[str, list[DeployReplica]] = {}
        assigned: dict[str, SourceAssignment] = {}  # replica_id -> source
        for c in cmds:
            if not isinstance(c, DeployReplica):
                continue
            key = c.spec.model_key
            if c.stage is None:
                by_model.setdefault(key, []).append(c)
                continue
            # A stage pulls its own byte range first, then the rest (for completion): a
            # chain would deliver the bytes in file order, and the last stage would wait for
            # all of them.
            holders = tuple(h.host_id for h in self.hosts.values()
                            if h.alive and not h.draining and key in h.cached_models
                            and self.peer_sends)
            assigned[c.replica_id] = SourceAssignment("pull", fallback=(*holders, REGISTRY))
            self.receiving[(c.host_id, key)] = now_s
        extra: list[Command] = []
        for key, deploys in by_model.items():
            holders = [h.host_id for h in self.hosts.values()
                       if h.alive and key in h.cached_models and self._can_send(h, now_s)]
            receivers = [d.host_id for d in deploys if (d.host_id, key) not in self.receiving]
            plan = plan_sourcing(key, receivers, holders, registry_sends=self.registry_sends,
                                 max_chain_length=self.max_chain_length,
                                 peer_sends=self.peer_sends)
            per_host: dict[str, SourceAssignment] = {h: SourceAssignment("local") for h in plan.local}
            for d in deploys:
                if (d.host_id, key) in self.inbound:  # a peer chain is already on its way there
                    tid, sender = self.inbound[(d.host_id, key)]
                    per_host[d.host_id] = SourceAssignment(
                        "chain", tid, sender, fallback=(*plan.fallback,))
            for chain in plan.chains:
                tid = f"t-{self.epoch}{next(self._transfer_seq)}"
                fallback = tuple(h for h in plan.fallback if h not in chain.receivers)
                for i, host in enumerate(chain.receivers):
                    self.receiving[(host, key)] = now_s
                    if chain.sender == REGISTRY and i == 0:
                        per_host[host] = SourceAssignment("chain_head", tid, REGISTRY,
                                                          chain.receivers[1:], (REGISTRY,), fallback)
                    else:
                        per_host[host] = SourceAssignment("chain", tid, chain.sender,
                                                          fallback=fallback)
                if chain.sender != REGISTRY:
                    for host in chain.receivers:
                        self.inbound[(host, key)] = (tid, chain.sender)
                    mk = ModelKey.parse(key)
                    extra.append(StartChain(tid, chain.sender, mk.name, mk.version, chain.receivers,
                                            fallback))
            for d in deploys:
                if d.host_id in per_host:
                    assigned[d.replica_id] = per_host[d.host_id]
        out: list[Command] = []
        for c in cmds:
            if isinstance(c, DeployReplica) and c.replica_id in assigned:
                c = dataclasses.replace(c, source=assigned[c.replica_id])
            out.append(c)
        # Receivers learn their chain (deploys) before the sender starts streaming to them.
        return out + extra

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
        ), fn.scaler_memory)
        current = len(warm) + len(starting)
        fn.desired, fn.reason = decision.desired, decision.reason
        if rolling:
            return self._roll(fn, warm + starting, decision.desired, now_s)
        fn.rollout = RollPhase.STABLE
        if decision.desired > current:
            if self.backing_off(spec.name, now_s) is not None:
                return []  # its starts keep failing: no new one before retry_at_s
            return self._scale_up(fn, decision.desired - current, now_s, load)
        if decision.desired < current:
            excess = current - decision.desired
            cmds: list[Command] = []
            # Partitioned groups first (§4.2.6): a pipeline holds several GPUs for one
            # replica's worth of throughput.
            groups = [g for g in self.groups.values()
                      if g.function == fn.spec.name and g.phase != GroupPhase.STOPPING]
            for gid in scale_down_order([GroupSnapshot(g.group_id, len(g.stages),
                                                       g.serving_s or g.requested_s)
                                         for g in groups]):
                if excess <= 0:
                    break
                group = self.groups[gid]
                excess -= sum(r in self.replicas for r in group.stages)
                cmds += self._stop_group(group, "retired")
            # Then starting replicas (no work on them), then the most recently warmed (the
            # oldest replicas keep the warmest caches and JIT state).
            victims = [r for r in sorted(starting, key=lambda r: -r.requested_s)
                       + sorted(warm, key=lambda r: -(r.warm_s or 0.0))
                       if r.group_id not in self.groups]
            return cmds + self._retire(victims[: max(0, excess)])
        return []

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

    def _place_whole(self, fn: FunctionRecord, count: int, now_s: float,
                     spec: FunctionSpec | None = None,
                     model_bytes: int | None = None) -> list[Command]:
        """Up to ``count`` whole replicas where placement puts them, of ``spec``'s model
        version (default: the registered one; a roll-out passes the previous one)."""
        if count <= 0:
            return []
        spec = spec or fn.spec
        model_bytes = fn.model_bytes if model_bytes is None else model_bytes
        if spec.sm_share > 0 and any(h.alive and not h.draining and h.gpu_sharing
                                     in SHARING_MODES for h in self.hosts.values()):
            return self._place_shared(fn, count, now_s, spec, model_bytes)
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
                      spec: FunctionSpec, model_bytes: int) -> list[Command]:
        """Up to ``count`` replicas of a function with a GPU share on sharing hosts' GPUs, by
        the pure policy of ``share_policy`` (FaST MaxRects or Dilu best fit,
        policy/share_placement.py); each deploy carries its share, which the host enforces."""
        rids = tuple(f"{spec.name}-{self.epoch}{next(self._seq)}" for _ in range(count))
        decision = place_shared(self.share_policy, self._share_devices(), ShareRequest(
            spec.name, rids, spec.sm_share, spec.sm_limit or spec.sm_share,
            spec.time_quota or 1.0,
            spec.gpu_memory_bytes or model_bytes + self.replica_overhead_bytes))
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

    # ---------------------------------------------------------------------------------
    def snapshot(self, now_s: float) -> ClusterSnapshot:
        """A frozen view for the policies."""
        used: dict[tuple[str, str], int] = {}
        count: dict[tuple[str, str], int] = {}
        compute: dict[tuple[str, str], float] = {}
        for r in self.replicas.values():
            key = (r.host_id, r.device_id)
            used[key] = used.get(key, 0) + r.device_bytes
            compute[key] = compute.get(key, 0.0) + r.compute
            count[key] = count.get(key, 0) + 1
        hosts = []
        for h in self.hosts.values():
            cached_bytes = sum(
                f.model_bytes for f in self.functions.values() if f.model_key in h.cached_models
            )
            devs = tuple(
                DeviceSnapshot(h.host_id, d.device_id, d.kind, d.memory_bytes,
                               d.memory_bytes - used.get((h.host_id, d.device_id), 0),
                               count.get((h.host_id, d.device_id), 0),
                               max(0.0, 1.0 - compute.get((h.host_id, d.device_id), 0.0)))
                for d in h.devices.values() if (h.host_id, d.device_id) not in self.blocked
            )
            processes = sum(count.get((h.host_id, d), 0) for d in h.devices) * self.process_bytes
            hosts.append(HostSnapshot(h.host_id, h.alive, h.draining,
                                      h.ram_bytes - cached_bytes - processes,
                                      frozenset(h.cached_models), devs, leaf=h.leaf))
        return ClusterSnapshot(now_s, tuple(hosts))

    def replicas_of(self, function: str) -> list[ReplicaRecord]:
        return [r for r in self.replicas.values() if r.function == function]

    def counts(self, function: str) -> dict[str, Any]:
        """Planned (the autoscaler's last decision), requested (replicas we placed) and
        observed (of those, the ones their hosts last reported running)."""
        fn = self.functions.get(function)
        mine = self.replicas_of(function)
        observed = sum(r.replica_id in self.hosts[r.host_id].reported for r in mine
                       if r.host_id in self.hosts)
        return {"planned": fn.desired if fn is not None else 0, "requested": len(mine),
                "observed": observed, "reason": fn.reason if fn is not None else ""}

    def rollout(self, function: str) -> dict[str, Any]:
        """Where a function's roll-out stands: its phase, the target and previous model
        versions, the canary's percentage, and its replicas per model version and phase."""
        fn = self.functions.get(function)
        if fn is None:
            return {}
        versions: dict[str, dict[str, int]] = {}
        for r in self.replicas_of(function):
            counts = versions.setdefault(r.model_key, {p.value: 0 for p in ReplicaPhase})
            counts[r.phase.value] += 1
        return {"phase": fn.rollout.value, "version": fn.spec.model_version,
                "previous_version": fn.previous.model_version if fn.previous else None,
                "canary_pct": fn.spec.canary_pct if fn.canary else None,
                "reason": fn.roll_failed or "", "replicas": versions}
