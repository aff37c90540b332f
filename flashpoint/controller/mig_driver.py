"""The controller's I/O side of MIG reconfiguration (the logic is in ``mig_reconfig.py``).

Owned by the Controller when ``[controller] mig_reconfigure`` is on. Every control loop it
builds a :class:`~flashpoint.controller.state.mig_reconfig.MigObserved` from the controller's state
(GPUs with MIG on and a known profile table, the replicas on their units, each function's
warm replicas elsewhere and its outstanding best-effort requests), feeds it to
:class:`MigReconfigState` and executes the commands: blocking and unblocking units and
retiring replicas become events for :meth:`ControllerState.handle` (``UnitsBlocked``,
``UnitsUnblocked``, ``ReplicasRetired``; their commands run like any other), and
``apply_mig`` goes to the host over RPC, whose outcome comes back as an event.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from flashpoint.audit import AuditAction, AuditLog
from flashpoint.config import ControllerConfig
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    Command,
    ReplicasRetired,
    UnitsBlocked,
    UnitsUnblocked,
)
from flashpoint.controller.state.mig_reconfig import (
    ApplyMig,
    BlockDevices,
    FunctionView,
    MigApplied,
    MigCommand,
    MigEvent,
    MigFailed,
    MigGpuView,
    MigObserved,
    MigReconfigState,
    ReplicaView,
    RetireReplicas,
    UnblockDevices,
)
from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.errors import FlashpointError
from flashpoint.log import get_logger
from flashpoint.policy.protean import ReconfigParams

log = get_logger("flashpoint.controller.mig")

RECONFIGS = Counter("flashpoint_mig_reconfigurations_total",
                    "MIG reconfigurations the controller finished, by outcome "
                    "(applied, or the failure's code)", ["outcome"])
RECONFIGURING = Gauge("flashpoint_mig_reconfiguring_gpus",
                      "GPUs being drained or reconfigured now")


def observe(state: ControllerState, be_outstanding: Mapping[str, float],
            now_s: float) -> MigObserved:
    """The snapshot the reconfigurator decides over, from the controller's state."""
    gpus: list[MigGpuView] = []
    on: dict[tuple[str, str], list[ReplicaView]] = {}  # (host, unit) -> its replicas
    for r in state.replicas.values():
        on.setdefault((r.host_id, r.device_id), []).append(
            ReplicaView(r.replica_id, r.function, str(r.phase)))
    for h in state.hosts.values():
        for g in h.gpus:
            if not g.mig or not g.model:
                continue
            units = sorted((d for d in h.devices.values() if d.gpu_index == g.gpu_index
                            and d.kind == "cuda"), key=lambda d: d.device_id)
            gpus.append(MigGpuView(
                h.host_id, g.gpu_index, g.model,
                tuple(d.mig_profile.split(".")[0] for d in units if d.mig_profile),
                tuple(d.device_id for d in units),
                tuple(v for d in units for v in on.get((h.host_id, d.device_id), ())),
                h.reported, h.alive, h.draining))
    functions: list[FunctionView] = []
    leaving_hosts = {h.host_id for h in state.hosts.values() if h.draining}
    counts: dict[tuple[str, str], int] = {}  # (function, phase) -> replicas
    for r in state.replicas.values():
        if r.host_id not in leaving_hosts:
            counts[(r.function, r.phase)] = counts.get((r.function, r.phase), 0) + 1
    for name, fn in state.functions.items():
        spec = fn.spec
        functions.append(FunctionView(
            name, counts.get((name, ReplicaPhase.WARM), 0),
            counts.get((name, ReplicaPhase.STARTING), 0), fn.desired,
            bool(fn.unplaced), be_outstanding.get(name, 0), spec.max_batch_size,
            spec.batch_memory_bytes or fn.model_bytes + state.replica_overhead_bytes))
    return MigObserved(now_s, tuple(gpus), tuple(functions))


class MigDriver:
    """Runs :class:`MigReconfigState` for the controller."""

    def __init__(self, cc: ControllerConfig, state: ControllerState,
                 hosts: Mapping[str, Any],
                 execute: Callable[[list[Command]], None],
                 spawn: Callable[[Coroutine[Any, Any, None], str], Any],
                 clock: Callable[[], float], audit: AuditLog | None = None) -> None:
        self.cc = cc
        self.audit = audit or AuditLog()  # every apply_mig, as controller:mig
        self.state = state
        self.hosts = hosts  # host id -> HostHandle (its ``conn`` calls the host)
        self.execute = execute
        self.spawn = spawn
        self.clock = clock
        self.mig = MigReconfigState(
            ReconfigParams(alpha=cc.mig_alpha, wait_limit=cc.mig_wait_limit,
                           fleet_fraction=cc.mig_fleet_fraction, t_low=cc.protean_t_low,
                           t_high=cc.protean_t_high),
            interval_s=cc.mig_interval_s, drain_grace_s=cc.mig_drain_grace_s,
            drain_timeout_s=cc.mig_drain_timeout_s)
        self.be_outstanding: dict[str, int] = {}  # function -> BE requests queued/in flight
        # Their time integral since the last decision: the decision sees the mean queue over
        # its interval, not whatever the queue held at one instant (with fast requests, the
        # instant is mostly between a client's requests, and reads as no demand).
        self._be_area: dict[str, float] = {}
        self._be_since_s = self._be_last_s = clock()

    # best-effort demand (called from the request path) --------------------------------
    def _accrue(self, now_s: float) -> None:
        dt = max(0.0, now_s - self._be_last_s)
        for f, n in self.be_outstanding.items():
            self._be_area[f] = self._be_area.get(f, 0.0) + n * dt
        self._be_last_s = now_s

    def be_began(self, function: str) -> None:
        self._accrue(self.clock())
        self.be_outstanding[function] = self.be_outstanding.get(function, 0) + 1

    def be_ended(self, function: str) -> None:
        self._accrue(self.clock())
        n = self.be_outstanding.get(function, 0) - 1
        if n > 0:
            self.be_outstanding[function] = n
        else:
            self.be_outstanding.pop(function, None)

    def be_mean(self, now_s: float) -> dict[str, float]:
        """Mean BE requests outstanding per function since the last decision."""
        self._accrue(now_s)
        span = now_s - self._be_since_s
        if span <= 0:
            return {f: float(n) for f, n in self.be_outstanding.items()}
        return {f: a / span for f, a in self._be_area.items() if a > 0}

    def busy(self) -> bool:
        """A GPU is being drained or reconfigured (its capacity is coming back)."""
        return self.mig.busy()

    def status(self) -> dict[str, Any]:
        return self.mig.status()

    # loop --------------------------------------------------------------------------------
    def step(self, now_s: float) -> None:
        """One control-loop step (the controller's tick)."""
        self._handle(observe(self.state, self.be_mean(now_s), now_s))
        if self.mig.last_decision_s == now_s:  # a decision took this interval's demand
            self._be_area.clear()
            self._be_since_s = now_s

    def _handle(self, event: MigEvent) -> None:
        cmds = self.mig.handle(event)
        for what, fields in self.mig.drain_log():
            (log.warning if what == "mig_reconfigure_failed" else log.info)(what, **fields)
            if what == "mig_reconfigure_failed":
                RECONFIGS.labels(str(fields.get("code"))).inc()
            elif what == "mig_reconfigured":
                RECONFIGS.labels("applied").inc()
        self._run(cmds)
        RECONFIGURING.set(len(self.mig.inflight))

    def _run(self, cmds: list[MigCommand]) -> None:
        for cmd in cmds:
            match cmd:
                case BlockDevices():
                    self.execute(self.state.handle(UnitsBlocked(cmd.host_id, cmd.device_ids)))
                case UnblockDevices():
                    self.execute(self.state.handle(UnitsUnblocked(cmd.host_id, cmd.device_ids)))
                case RetireReplicas():
                    self.execute(self.state.handle(ReplicasRetired(cmd.replica_ids)))
                case ApplyMig():
                    self.spawn(self._apply(cmd), f"apply_mig:{cmd.host_id}/{cmd.gpu_index}")

    async def _apply(self, cmd: ApplyMig) -> None:
        host = self.hosts.get(cmd.host_id)
        try:
            if host is None:
                raise FlashpointError(f"host {cmd.host_id} has no connection")
            await host.apply_mig(cmd.gpu_index, tuple(cmd.geometry),
                                 timeout_s=self.cc.mig_apply_timeout_s)
        except Exception as exc:  # any failure returns the GPU to service (mig_reconfig.py)
            err = exc if isinstance(exc, FlashpointError) else FlashpointError(repr(exc))
            self._audit(cmd, err.code)
            self._handle(MigFailed(cmd.host_id, cmd.gpu_index, err.code, err.message,
                                   self.clock()))
            return
        self._audit(cmd, "ok")
        self._handle(MigApplied(cmd.host_id, cmd.gpu_index, self.clock()))

    def _audit(self, cmd: ApplyMig, outcome: str) -> None:
        self.audit.record(AuditAction.MIG_CHANGE, "controller:mig",
                          f"{cmd.host_id}/gpu{cmd.gpu_index}", outcome=outcome,
                          geometry=list(cmd.geometry))
