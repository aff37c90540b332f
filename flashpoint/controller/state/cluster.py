"""The controller state's data and its read-only queries.

:class:`ClusterRecords` holds what the controller knows of the cluster (hosts, replicas,
groups, functions, model bytes on their way to hosts, units out of service) and answers
questions about it: the frozen snapshot the policies decide over, a function's replicas,
counts and roll-out, whether it serves or backs off. The mix-ins in ``groups.py``,
``placement.py``, ``sourcing.py`` and ``scaling.py`` add the decisions, and
:class:`~flashpoint.controller.state.core.ControllerState` the event dispatch; all of them
change these fields only from ``ControllerState.handle``.
"""

from __future__ import annotations

import itertools
from typing import Any

from flashpoint.controller.state.events import StartFailure
from flashpoint.controller.state.records import (
    MAX_CONSECUTIVE_START_FAILURES,
    FunctionRecord,
    GroupPhase,
    GroupRecord,
    HostRecord,
    ReplicaPhase,
    ReplicaRecord,
)
from flashpoint.policy import autoscale
from flashpoint.policy.snapshot import ClusterSnapshot, DeviceSnapshot, HostSnapshot


class ClusterRecords:
    """The cluster view (``ControllerState``'s fields and constructor) and its queries."""

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
        # geometry, controller/state/mig_reconfig.py; the UnitsBlocked and UnitsUnblocked
        # events): nothing is placed there, and replicas there are leaving (not capacity), so
        # replacements start elsewhere.
        self.blocked: set[tuple[str, str]] = set()

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

    def _leaving(self, rep: ReplicaRecord) -> bool:
        if (rep.host_id, rep.device_id) in self.blocked:
            return True
        host = self.hosts.get(rep.host_id)
        return host is not None and host.draining

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

    def mig_profile(self, host_id: str, device_id: str) -> str:
        """The MIG profile of a host's unit ("4g.20gb"); "" for a whole GPU, a CPU unit or
        a unit the controller does not know."""
        host = self.hosts.get(host_id)
        dev = host.devices.get(device_id) if host is not None else None
        return dev.mig_profile if dev is not None else ""

    def replicas_of(self, function: str) -> list[ReplicaRecord]:
        """Every replica of ``function`` the controller knows, in any phase."""
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
