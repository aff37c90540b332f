"""HostState: the host manager's decisions, with no I/O (STYLE §1).

Events in, commands out: :meth:`HostState.handle` takes one event and returns the commands the
actor (``host/actor.py``) must carry out; the actor feeds outcomes back as events. It holds

* the **device reservations**: a cold start reserves its device memory (and its worker's host
  RAM, which the actor takes from the cache's budget) from the moment it begins, so
  concurrent starts can never overcommit a device;
* the **replicas** this host runs, as plain records: what a registration, a status reply and
  a restarted controller's adoption report (function, device, warm, stage, share, version);
* the **warm pool**: which idle worker a start takes, and when and how many to spawn;
* the **stage holds' decisions**: which model's held work a controller's word releases, and
  whether a finished cold start's pool refill waits for a hold or for a first answer
  (``host/stage_hold.py`` runs the waits themselves).

Nothing here reads a clock, imports asyncio, or touches a process or socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashpoint.errors import BadRequest, NoCapacity


# Records ------------------------------------------------------------------------------------
@dataclass
class ReplicaRecord:
    """One replica on this host, as the host reports it."""

    replica_id: str
    function: str
    device_id: str
    model_key: str = ""  # the model version it runs ("name@version"); "" for KaaS
    stage: tuple[Any, Any] | None = None  # a partition stage's (first, last) layer
    pipeline: bool = False  # a stage serving a pipeline server
    pipeline_endpoint: Any = None  # its server's endpoint (wire form), once it listens
    whole: bool = False  # a stage that has completed into a whole replica
    warm: bool = False  # its worker has loaded it
    assigned: bool = False  # a worker has been taken for it
    share: Any = None  # its GpuShare (opaque here), as the deploy asked
    device_bytes: int = 0  # reserved on its device
    process_bytes: int = 0  # host RAM reserved for its worker process
    weight_slot: Any = None  # where its weights are shared (CUDA IPC), if they are
    weights_role: str = ""  # "exporter" / "reader" once loaded with a weight slot

    @property
    def serving_whole(self) -> bool:
        """Warm as a whole replica (a stage only once completed: a restarted controller
        must not dispatch whole requests to a stage)."""
        return self.warm and (self.stage is None or self.whole)


# Events (past tense) --------------------------------------------------------------------------
@dataclass(frozen=True)
class DevicesReported:
    """The host's placement units: (device_id, memory_bytes) each."""

    devices: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ReplicaRequested:
    """A deploy arrived: reserve ``device_bytes`` of ``device_id`` and ``process_bytes`` of
    host RAM for it (NoCapacity when the device is short; BadRequest for an unknown one)."""

    replica_id: str
    function: str
    device_id: str
    device_bytes: int
    process_bytes: int
    model_key: str = ""
    stage: tuple[Any, Any] | None = None
    pipeline: bool = False
    share: Any = None


@dataclass(frozen=True)
class HostMemoryRefused:
    """The cache refused the worker's host RAM: the request is dropped, its device freed."""

    replica_id: str


@dataclass(frozen=True)
class WorkerAssigned:
    replica_id: str
    weight_slot: Any = None


@dataclass(frozen=True)
class ReplicaLoaded:
    """Its worker loaded it (a stage's pipeline server listens at ``pipeline_endpoint``)."""

    replica_id: str
    weights_role: str = ""
    pipeline_endpoint: Any = None


@dataclass(frozen=True)
class StageCompleted:
    replica_id: str
    whole: bool


@dataclass(frozen=True)
class StageDissolved:
    replica_id: str


@dataclass(frozen=True)
class ShareChanged:
    replica_id: str
    share: Any


@dataclass(frozen=True)
class ReplicaGone:
    """Stopped, failed to start, or its worker died."""

    replica_id: str


@dataclass(frozen=True)
class ColdStartEnded:
    """A cold start's worker call returned (loaded or not)."""

    replica_id: str


@dataclass(frozen=True)
class CompletionAsked:
    """The controller's ``begin_completion``: the stage's group answered its first request."""

    replica_id: str


@dataclass(frozen=True)
class WorkerWanted:
    replica_id: str


@dataclass(frozen=True)
class WorkerIdle:
    """A worker spawned for the pool said hello and waits for a replica."""

    worker_id: str


@dataclass(frozen=True)
class WorkerExited:
    worker_id: str


@dataclass(frozen=True)
class PoolRefillDue:
    """Time to top the warm pool up (one spawn at a time)."""


@dataclass(frozen=True)
class PoolSpawnEnded:
    """A pool spawn finished (``worker_id`` empty: it failed; stop refilling for now)."""

    worker_id: str = ""


@dataclass(frozen=True)
class Stopping:
    """The host is stopping: no more spawns."""


Event = (DevicesReported | ReplicaRequested | HostMemoryRefused | WorkerAssigned
         | ReplicaLoaded | StageCompleted | StageDissolved | ShareChanged | ReplicaGone
         | ColdStartEnded | CompletionAsked | WorkerWanted | WorkerIdle | WorkerExited
         | PoolRefillDue | PoolSpawnEnded | Stopping)


# Commands (imperative) ----------------------------------------------------------------------
@dataclass(frozen=True)
class ReserveHostMemory:
    replica_id: str
    process_bytes: int


@dataclass(frozen=True)
class ReleaseReplica:
    """Give back a replica's GPU attachment and its worker's host RAM."""

    replica_id: str
    process_bytes: int
    orphaned_readers: tuple[str, ...] = ()  # replicas that read the exporter's CUDA IPC weights


@dataclass(frozen=True)
class UseWorker:
    worker_id: str


@dataclass(frozen=True)
class SpawnWorker:
    """Spawn a worker (for ``replica_id``, or for the pool when empty)."""

    replica_id: str = ""


@dataclass(frozen=True)
class RefillPool:
    """Refill the warm pool, first waiting for ``after_hold``'s stage hold and/or for the
    replica's first answer (``after_first_answer``)."""

    after_hold: str | None = None
    after_first_answer: bool = False


@dataclass(frozen=True)
class ReleaseHold:
    model_key: str
    why: str


Command = ReserveHostMemory | ReleaseReplica | UseWorker | SpawnWorker | RefillPool | ReleaseHold


@dataclass
class HostState:
    """One host's reservations, replicas and warm pool (see the module docstring)."""

    host_id: str
    warm_pool_size: int = 0
    devices: dict[str, int] = field(default_factory=dict)  # device id -> memory bytes
    device_used: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    idle: list[str] = field(default_factory=list)  # warm pool worker ids, oldest first
    spawning: int = 0  # pool spawns in progress
    stopping: bool = False

    def handle(self, ev: Event) -> list[Command]:
        """Apply one event; return what the actor must do."""
        method = getattr(self, "_on_" + type(ev).__name__, None)
        if method is None:
            raise TypeError(f"HostState has no handler for {type(ev).__name__}")
        return method(ev)  # type: ignore[no-any-return]

    # reservations and replicas -------------------------------------------------------------
    def _on_DevicesReported(self, ev: DevicesReported) -> list[Command]:
        self.devices = dict(ev.devices)
        return []

    def _on_ReplicaRequested(self, ev: ReplicaRequested) -> list[Command]:
        if ev.replica_id in self.replicas:
            return []  # idempotent by replica id
        total = self.devices.get(ev.device_id)
        if total is None:
            raise BadRequest(f"unknown device {ev.device_id!r} on host {self.host_id}")
        used = self.device_used.get(ev.device_id, 0)
        if used + ev.device_bytes > total:
            raise NoCapacity(f"device {ev.device_id} on {self.host_id}: {ev.device_bytes} bytes "
                             f"needed, {total - used} free", retry_after_s=5.0)
        self.device_used[ev.device_id] = used + ev.device_bytes
        self.replicas[ev.replica_id] = ReplicaRecord(
            ev.replica_id, ev.function, ev.device_id, model_key=ev.model_key, stage=ev.stage,
            pipeline=ev.pipeline, share=ev.share, device_bytes=ev.device_bytes,
            process_bytes=ev.process_bytes)
        return [ReserveHostMemory(ev.replica_id, ev.process_bytes)]

    def _on_HostMemoryRefused(self, ev: HostMemoryRefused) -> list[Command]:
        rec = self.replicas.get(ev.replica_id)
        if rec is not None:
            rec.process_bytes = 0  # never reserved: nothing to give back
        return self._on_ReplicaGone(ReplicaGone(ev.replica_id))

    def _on_WorkerAssigned(self, ev: WorkerAssigned) -> list[Command]:
        if (rec := self.replicas.get(ev.replica_id)) is not None:
            rec.assigned, rec.weight_slot = True, ev.weight_slot
        return []

    def _on_ReplicaLoaded(self, ev: ReplicaLoaded) -> list[Command]:
        if (rec := self.replicas.get(ev.replica_id)) is not None:
            rec.warm, rec.weights_role = True, ev.weights_role
            if ev.pipeline_endpoint is not None:
                rec.pipeline_endpoint = ev.pipeline_endpoint
        return []

    def _on_StageCompleted(self, ev: StageCompleted) -> list[Command]:
        if (rec := self.replicas.get(ev.replica_id)) is not None:
            rec.whole = ev.whole
        return []

    def _on_StageDissolved(self, ev: StageDissolved) -> list[Command]:
        if (rec := self.replicas.get(ev.replica_id)) is not None:
            rec.pipeline_endpoint = None
        return []

    def _on_ShareChanged(self, ev: ShareChanged) -> list[Command]:
        if (rec := self.replicas.get(ev.replica_id)) is not None:
            rec.share = ev.share
        return []

    def _on_ReplicaGone(self, ev: ReplicaGone) -> list[Command]:
        rec = self.replicas.pop(ev.replica_id, None)
        if rec is None:
            return []
        if rec.device_bytes:
            left = self.device_used.get(rec.device_id, 0) - rec.device_bytes
            self.device_used[rec.device_id] = max(0, left)
        readers: tuple[str, ...] = ()
        if rec.weights_role == "exporter" and rec.weight_slot is not None:
            # CUDA IPC memory is the exporter's: its readers lose their weights with it.
            readers = tuple(r.replica_id for r in self.replicas.values()
                            if r.weight_slot == rec.weight_slot)
        return [ReleaseReplica(rec.replica_id, rec.process_bytes, readers)]

    def _on_ColdStartEnded(self, ev: ColdStartEnded) -> list[Command]:
        """Refill the pool only now: a Python+torch start during a cold start steals the CPU
        it waits for. A stage's refill waits for its hold; a whole replica's for its first
        answer (the request that waited for this cold start)."""
        rec = self.replicas.get(ev.replica_id)
        if rec is None or not rec.model_key:
            return [RefillPool()]
        if rec.stage is not None:
            return [RefillPool(after_hold=rec.model_key)]
        return [RefillPool(after_first_answer=rec.warm)]

    def _on_CompletionAsked(self, ev: CompletionAsked) -> list[Command]:
        rec = self.replicas.get(ev.replica_id)
        if rec is None or not rec.assigned or not rec.model_key:
            return []
        return [ReleaseHold(rec.model_key, "group answered")]

    # the warm pool ---------------------------------------------------------------------------
    def _on_WorkerWanted(self, ev: WorkerWanted) -> list[Command]:
        if self.idle:
            return [UseWorker(self.idle.pop(0))]
        return [SpawnWorker(ev.replica_id)]

    def _on_WorkerIdle(self, ev: WorkerIdle) -> list[Command]:
        self.idle.append(ev.worker_id)
        return []

    def _on_WorkerExited(self, ev: WorkerExited) -> list[Command]:
        if ev.worker_id in self.idle:
            self.idle.remove(ev.worker_id)
        return []

    def _on_PoolRefillDue(self, ev: PoolRefillDue) -> list[Command]:
        if self.stopping or len(self.idle) + self.spawning >= self.warm_pool_size:
            return []
        self.spawning += 1
        return [SpawnWorker()]

    def _on_PoolSpawnEnded(self, ev: PoolSpawnEnded) -> list[Command]:
        self.spawning = max(0, self.spawning - 1)
        if ev.worker_id:
            self.idle.append(ev.worker_id)
        return []

    def _on_Stopping(self, ev: Stopping) -> list[Command]:
        self.stopping = True
        return []

    # reports ------------------------------------------------------------------------------
    def pool_full(self) -> bool:
        return len(self.idle) >= self.warm_pool_size
