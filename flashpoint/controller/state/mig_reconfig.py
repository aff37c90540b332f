"""Controller-driven MIG reconfiguration (PROTEAN Alg. 2 driving the hosts' ``apply_mig``).

A plain state class, events in, commands out (STYLE §1); no I/O and no clock reads. The
decision is the pure :func:`flashpoint.policy.protean.reconfigure` over a snapshot; this
class owns what happens around it, per GPU:

``idle`` --(Alg. 2 says reconfigure)--> ``draining`` --(no replica left on it, as the host
reports)--> ``applying`` --(``MigApplied``)--> ``idle``, the new slices placement units.

- **Draining.** :class:`BlockDevices` first: the controller stops placing on the GPU's
  units and stops counting the replicas there as capacity, so the autoscaler starts their
  replacements elsewhere. Each replica on the GPU is retired (:class:`RetireReplicas`:
  no new work, stopped once its in-flight requests are done) once its function has as many
  warm replicas elsewhere as it wants (at least one), at once when no replacement can be
  had (nothing starting elsewhere and the last scale-up could not place), and at the
  latest after ``drain_grace_s``. Starting replicas hold no work and go at once.
- **Applying.** Only once the host's own report shows none of the GPU's replicas (a stop
  in flight still holds the GPU; the host would answer ``gpu_busy``) is
  :class:`ApplyMig` sent. The host re-registers with the new slices before it answers,
  so :class:`UnblockDevices` after ``MigApplied`` puts them into service.
- **Failures.** An apply that fails (``invalid_geometry``, ``gpu_busy``, ``mig_failed``,
  a lost connection), a host lost meanwhile, or a drain past ``drain_timeout_s``: the GPU
  is unblocked (returned to service), the failure is counted by code, and nothing else is
  touched: replicas moved away stay where they went.
- **Demand.** The controller queues per function, not per GPU, so each MIG GPU is given an
  equal share of the fleet's best-effort batches (PROTEAN's distributor spreads BE work
  over the GPUs): a function's batches are ⌈its outstanding BE requests (their mean over
  the interval) / its max_batch_size⌉. The *current BE model* is the function with the most BE batches, its
  per-batch memory its ``batch_memory_bytes`` (else its replica footprint). Until any BE
  request has been seen there is no BE model, and no decision is taken: Alg. 2 has
  nothing to size the BE slices by.
- At most ``fleet_fraction`` of the GPUs reconfigure at once: GPUs in flight here are
  ``reconfiguring`` in the policy's snapshot, and the policy applies the cap.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from flashpoint.policy.protean import (
    GpuReconfigSnapshot,
    ReconfigMemory,
    ReconfigParams,
    ReconfigSnapshot,
    reconfigure,
)

# The phases of a replica as the controller tracks them (controller/state/records.py ReplicaPhase).
STARTING, WARM = "starting", "warm"


class MigPhase(StrEnum):
    DRAINING = "draining"
    APPLYING = "applying"


# Snapshot (built by the actor from ControllerState and its dispatcher) -------------------
@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    function: str
    phase: str  # "starting" | "warm" | "stopping"


@dataclass(frozen=True)
class MigGpuView:
    """One MIG-enabled GPU with a known profile table, as the controller sees it."""

    host_id: str
    gpu_index: int
    model: str  # MIG table name, "A100-40GB"
    geometry: tuple[str, ...]  # short profile names of its slices ("4g", "2g", "1g")
    device_ids: tuple[str, ...]  # its placement units
    replicas: tuple[ReplicaView, ...]  # the controller's replicas on its units
    host_reported: frozenset[str]  # replica ids its host reported last (all its GPUs)
    alive: bool = True
    draining_host: bool = False  # the host is going away (spot eviction): leave it be

    @property
    def gpu_id(self) -> str:
        return f"{self.host_id}/{self.gpu_index}"


@dataclass(frozen=True)
class FunctionView:
    """A function's replicas (on hosts that are not going away) and BE demand; those on
    GPUs being drained are subtracted here, since which GPUs those are is this class's."""

    name: str
    warm: int
    starting: int
    desired: int  # the autoscaler's last decision
    unplaced: bool  # the last scale-up could not place every replica
    be_outstanding: float  # best-effort requests queued or in flight (mean over the interval)
    max_batch_size: int
    batch_memory_bytes: int  # one batch's device memory (PROTEAN's footprint)


# Events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MigObserved:
    """Every controller loop: the GPUs and functions now; a decision at most every
    ``interval_s``, the drains advanced every time."""

    now_s: float
    gpus: tuple[MigGpuView, ...]
    functions: tuple[FunctionView, ...]


@dataclass(frozen=True)
class MigApplied:
    host_id: str
    gpu_index: int
    now_s: float


@dataclass(frozen=True)
class MigFailed:
    host_id: str
    gpu_index: int
    code: str  # the typed error's code ("gpu_busy", "invalid_geometry", "peer_lost", ...)
    reason: str
    now_s: float


MigEvent = MigObserved | MigApplied | MigFailed


# Commands ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockDevices:
    """Place nothing more on these units; their replicas stop counting as capacity."""

    host_id: str
    gpu_index: int
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class UnblockDevices:
    host_id: str
    gpu_index: int
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class RetireReplicas:
    """Take these replicas out of dispatch; they stop once their in-flight work is done."""

    replica_ids: tuple[str, ...]


@dataclass(frozen=True)
class ApplyMig:
    host_id: str
    gpu_index: int
    geometry: tuple[str, ...]


MigCommand = BlockDevices | UnblockDevices | RetireReplicas | ApplyMig


@dataclass
class GpuReconfig:
    """One GPU in flight."""

    host_id: str
    gpu_index: int
    target: tuple[str, ...]
    device_ids: tuple[str, ...]
    started_s: float
    phase: MigPhase = MigPhase.DRAINING
    seen: set[str] = field(default_factory=set)  # replicas ever seen on it while draining
    apply_s: float | None = None  # when ApplyMig was sent
    retired: set[str] = field(default_factory=set)


@dataclass
class MigCounters:
    decided: int = 0
    applied: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by code


class MigReconfigState:
    """PROTEAN's reconfigurator as a controller loop. Mutated only through :meth:`handle`."""

    def __init__(self, params: ReconfigParams | None = None, interval_s: float = 5.0,
                 drain_grace_s: float = 30.0, drain_timeout_s: float = 120.0) -> None:
        self.params = params or ReconfigParams()
        self.interval_s = interval_s
        self.drain_grace_s = drain_grace_s
        self.drain_timeout_s = drain_timeout_s
        self.memory = ReconfigMemory()
        self.inflight: dict[tuple[str, int], GpuReconfig] = {}
        self.be_model: str | None = None  # the current BE model (function name)
        self.be_batch_mem_bytes = 0
        self.be_batches_per_gpu = 0.0  # what the last decision was fed
        self.last_decision_s: float | None = None
        self.targets: dict[str, tuple[str, ...]] = {}  # gpu_id -> what Alg. 2 wants, last time
        self.counters = MigCounters()
        self.log: list[tuple[str, dict[str, object]]] = []  # (event, fields) for the actor to log
        self.history: deque[dict[str, object]] = deque(maxlen=32)  # finished ones, newest last

    def busy(self) -> bool:
        return bool(self.inflight)

    def handle(self, event: MigEvent) -> list[MigCommand]:
        match event:
            case MigObserved():
                return self._observed(event)
            case MigApplied():
                rec = self.inflight.pop((event.host_id, event.gpu_index), None)
                if rec is None:
                    return []
                self.counters.applied += 1
                drained = (rec.apply_s or event.now_s) - rec.started_s
                self.history.append({"host_id": rec.host_id, "gpu": rec.gpu_index,
                                     "target": list(rec.target), "moved": len(rec.seen),
                                     "drain_s": round(drained, 3),
                                     "total_s": round(event.now_s - rec.started_s, 3)})
                self._note("mig_reconfigured", rec, seconds=round(event.now_s - rec.started_s, 3))
                return [UnblockDevices(rec.host_id, rec.gpu_index, rec.device_ids)]
            case MigFailed():
                rec = self.inflight.get((event.host_id, event.gpu_index))
                return [] if rec is None else self._fail(rec, event.code, event.reason)
        raise TypeError(f"unknown event {event!r}")

    # ---------------------------------------------------------------------------------
    def _observed(self, ev: MigObserved) -> list[MigCommand]:
        gpus = {(g.host_id, g.gpu_index): g for g in ev.gpus}
        fns = {f.name: f for f in ev.functions}
        cmds: list[MigCommand] = []
        for key, rec in list(self.inflight.items()):
            g = gpus.get(key)
            if g is None or not g.alive:
                cmds += self._fail(rec, "host_lost", "the host is gone or silent")
        if self.last_decision_s is None or ev.now_s - self.last_decision_s >= self.interval_s:
            self.last_decision_s = ev.now_s
            cmds += self._decide(ev, gpus, fns)
        # Drains advance after the decision, so a GPU decided now counts as drained
        # (its replicas are not "elsewhere") for every function.
        draining = [(rec, gpus[key]) for key, rec in list(self.inflight.items())
                    if rec.phase is MigPhase.DRAINING]
        leaving = [r for _, g in draining for r in g.replicas]
        for rec, g in draining:
            cmds += self._advance(rec, g, fns, leaving, ev.now_s)
        return cmds

    def _decide(self, ev: MigObserved, gpus: dict[tuple[str, int], MigGpuView],
                fns: dict[str, FunctionView]) -> list[MigCommand]:
        batches = {f.name: math.ceil(f.be_outstanding / max(1, f.max_batch_size))
                   for f in fns.values() if f.be_outstanding > 0}
        if batches:  # the current BE model: most batches, then the larger footprint
            top = max(batches, key=lambda n: (batches[n], fns[n].batch_memory_bytes, n))
            if top != self.be_model:
                self.log.append(("mig_be_model", {"function": top, "previous": self.be_model,
                                                  "batch_bytes": fns[top].batch_memory_bytes}))
            self.be_model, self.be_batch_mem_bytes = top, fns[top].batch_memory_bytes
        eligible = [g for g in gpus.values() if g.alive and not g.draining_host]
        if self.be_model is None or not eligible:
            return []
        per_gpu = self.be_batches_per_gpu = sum(batches.values()) / len(eligible)
        snap = ReconfigSnapshot(tuple(
            GpuReconfigSnapshot(g.gpu_id, g.model, g.geometry, per_gpu, self.be_batch_mem_bytes,
                                reconfiguring=(g.host_id, g.gpu_index) in self.inflight)
            for g in sorted(eligible, key=lambda g: g.gpu_id)))
        decision, self.memory = reconfigure(snap, self.params, self.memory)
        self.targets = dict(decision.targets)
        by_id = {g.gpu_id: g for g in eligible}
        cmds: list[MigCommand] = []
        for gpu_id, geometry in decision.reconfigure:
            g = by_id[gpu_id]
            rec = GpuReconfig(g.host_id, g.gpu_index, tuple(geometry), g.device_ids, ev.now_s)
            self.inflight[(g.host_id, g.gpu_index)] = rec
            self.counters.decided += 1
            self._note("mig_reconfigure_decided", rec, current=list(g.geometry),
                       be_model=self.be_model, be_batches_per_gpu=round(per_gpu, 2))
            cmds.append(BlockDevices(g.host_id, g.gpu_index, g.device_ids))
        return cmds

    def _advance(self, rec: GpuReconfig, g: MigGpuView, fns: dict[str, FunctionView],
                 leaving: list[ReplicaView], now_s: float) -> list[MigCommand]:
        """One drain step: retire what may go, apply once the host runs nothing there.
        ``leaving``: the replicas on every GPU being drained (not capacity)."""
        if now_s - rec.started_s > self.drain_timeout_s:
            return self._fail(rec, "drain_timeout",
                              f"not drained after {self.drain_timeout_s:.0f} s")
        late = now_s - rec.started_s >= self.drain_grace_s
        retire: list[str] = []
        for r in g.replicas:
            rec.seen.add(r.replica_id)
            if r.replica_id in rec.retired or r.phase not in (STARTING, WARM):
                continue
            f = fns.get(r.function)
            warm = starting = 0
            if f is not None:
                warm = f.warm - sum(x.function == f.name and x.phase == WARM for x in leaving)
                starting = f.starting - sum(x.function == f.name and x.phase == STARTING
                                            for x in leaving)
            if (r.phase == STARTING or late or f is None or f.desired == 0
                    or warm >= max(1, f.desired) or (f.unplaced and starting <= 0)):
                retire.append(r.replica_id)
        rec.retired.update(retire)
        cmds: list[MigCommand] = [RetireReplicas(tuple(retire))] if retire else []
        if not g.replicas and not (rec.seen & g.host_reported):
            rec.phase, rec.apply_s = MigPhase.APPLYING, now_s
            self._note("mig_apply", rec, drained_s=round(now_s - rec.started_s, 3))
            cmds.append(ApplyMig(rec.host_id, rec.gpu_index, rec.target))
        return cmds

    def _fail(self, rec: GpuReconfig, code: str, reason: str) -> list[MigCommand]:
        del self.inflight[(rec.host_id, rec.gpu_index)]
        self.counters.failed[code] = self.counters.failed.get(code, 0) + 1
        self._note("mig_reconfigure_failed", rec, code=code, reason=reason,
                   phase=str(rec.phase))
        return [UnblockDevices(rec.host_id, rec.gpu_index, rec.device_ids)]

    def _note(self, what: str, rec: GpuReconfig, **fields: object) -> None:
        self.log.append((what, {"host_id": rec.host_id, "gpu": rec.gpu_index,
                                "target": list(rec.target), **fields}))

    def drain_log(self) -> list[tuple[str, dict[str, object]]]:
        """What happened since the last call, for the actor to log (this class logs nothing)."""
        out, self.log = self.log, []
        return out

    def status(self) -> dict[str, object]:
        return {"be_model": self.be_model, "be_batch_mem_bytes": self.be_batch_mem_bytes,
                "be_batches_per_gpu": self.be_batches_per_gpu,
                "targets": {k: list(v) for k, v in sorted(self.targets.items())},
                "inflight": [{"host_id": r.host_id, "gpu": r.gpu_index, "phase": str(r.phase),
                              "target": list(r.target)} for r in self.inflight.values()],
                "decided": self.counters.decided, "applied": self.counters.applied,
                "failed": dict(self.counters.failed), "history": list(self.history)}
