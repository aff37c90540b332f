"""What goes into and out of :class:`~flashpoint.controller.state.core.ControllerState`.

Events (what happened: a host registered, a replica warmed, a tick with the measured loads)
and commands (what the actor or the simulator must do: deploy, stop, link a group, start a
chain), plus the device records hosts report. All are frozen or plain dataclasses with no
behaviour. Pure like the state class (the simulator imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flashpoint.policy.partitioning import PlanLookup
from flashpoint.policy.share_placement import ReplicaShare
from flashpoint.policy.snapshot import TokenLoad
from flashpoint.spec import FunctionSpec


@dataclass
class DeviceRecord:
    device_id: str
    kind: str
    memory_bytes: int
    gpu_index: int = -1  # the physical GPU it is (a part of); -1: a CPU unit
    mig_profile: str = ""  # "3g.20gb" for a MIG slice


@dataclass(frozen=True)
class GpuRecord:
    """A physical GPU of a host (MIG slices are its units in ``devices``): its MIG table
    name ("" = none known) and whether MIG is on. A MIG GPU without instances has no units."""

    gpu_index: int
    model: str
    mig: bool


# Events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostRegistered:
    host_id: str
    devices: tuple[DeviceRecord, ...]
    ram_bytes: int
    cached_models: frozenset[str]
    # replicas the host already runs: (replica_id, function, device_id, warm)
    replicas: tuple[tuple[str, str, str, bool], ...]
    now_s: float
    leaf: str = ""
    gpu_sharing: str = "none"
    shares: dict[str, ReplicaShare] = field(default_factory=dict)  # replica id -> its share
    gpus: tuple[GpuRecord, ...] = ()
    models: dict[str, str] = field(default_factory=dict)  # replica id -> its model version key


@dataclass(frozen=True)
class HostHeartbeat:
    host_id: str
    cached_models: frozenset[str]
    now_s: float
    # The replicas the host runs (ids), when it reports them: the controller reconciles its
    # records against them (observed vs requested).
    replicas: frozenset[str] | None = None


@dataclass(frozen=True)
class HostDraining:
    """The host received an eviction notice: it is gone at ``deadline_s``."""

    host_id: str
    deadline_s: float
    now_s: float


@dataclass(frozen=True)
class FunctionUpserted:
    spec: FunctionSpec
    model_bytes: int
    plans: PlanLookup | None = None
    whole_cold_s: float = 0.0


@dataclass(frozen=True)
class FunctionDeleted:
    name: str


@dataclass(frozen=True)
class ReplicaWarmed:
    replica_id: str
    timings_s: dict[str, float]
    now_s: float


@dataclass(frozen=True)
class ReplicaFailed:
    replica_id: str
    reason: str
    during_start: bool
    code: str = "start_failed"  # the failure's error code (registry_error, worker_exited, ...)
    now_s: float | None = None  # None: the time of the last event that carried one


@dataclass(frozen=True)
class StartFailure:
    """The last failed start of a function's replicas, and its streak: ``failed_starts``
    in a row since ``since_s`` (reset when a replica of it warms). ``retry_at_s`` is when the
    back-off that began after too many ends (None while starts are still being retried)."""

    code: str  # the failure's own error code (registry_error, worker_exited, ...)
    message: str
    failed_starts: int
    since_s: float  # the streak's first failure
    last_s: float  # this failure
    retry_at_s: float | None = None


@dataclass(frozen=True)
class ReplicaStopped:
    replica_id: str


@dataclass(frozen=True)
class StageReady:
    """A partition stage serves its layers (its pipeline endpoint is the actor's to keep)."""

    replica_id: str
    now_s: float


@dataclass(frozen=True)
class GroupLinked:
    """The actor linked (``ok``) or failed to link a group's stages into one pipeline."""

    group_id: str
    ok: bool
    reason: str
    now_s: float


@dataclass(frozen=True)
class FunctionLoad:
    queued: int
    inflight: int
    last_request_s: float | None
    arrival_rate: float = 0.0  # λ: requests per second arriving lately
    service_rate: float = 0.0  # μ: requests per second completed lately
    exec_time_s: float = 0.0  # mean service time of one request (0 = not measured yet)
    queue_latency_s: float = 0.0  # age of the oldest queued request
    invocations_total: int = 0  # requests accepted since the controller started
    tokens: TokenLoad | None = None  # a text-generation function's load in tokens
    # Requests per second each of its replicas (id) completed lately; a replica missing has
    # completed none (RPR ranks replicas of one configuration by it, policy/rpr.py).
    replica_rates: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Tick:
    now_s: float
    loads: dict[str, FunctionLoad]
    # replicas and groups in STOPPING with no request in flight; the actor knows in-flight
    # counts
    idle_replicas: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GroupAnswered:
    """A serving group's pipeline answered its first request."""

    group_id: str


# Units out of service (MIG reconfiguration, controller/state/mig_reconfig.py): the
# reconfigurator's BlockDevices, UnblockDevices and RetireReplicas, as they reach this state.
@dataclass(frozen=True)
class UnitsBlocked:
    """A GPU's units are being drained for a new MIG geometry: nothing is placed on them,
    and replicas there are leaving (not capacity), so replacements start elsewhere."""

    host_id: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class UnitsUnblocked:
    """The units are back in service (the reconfiguration finished or failed)."""

    host_id: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReplicasRetired:
    """The reconfigurator retired these replicas (a drained GPU's): they take no new work
    and stop once idle, as any retired replica."""

    replica_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaShareChanged:
    """A replica's host accepted a new share for it, live (``set_replica_share``: the
    profiler's trials on a tokens host); placement accounts for the new one from now on."""

    replica_id: str
    share: ReplicaShare


Event = (HostRegistered | HostHeartbeat | HostDraining | FunctionUpserted | FunctionDeleted
         | ReplicaWarmed | ReplicaFailed | ReplicaStopped | StageReady | GroupLinked
         | GroupAnswered | Tick | UnitsBlocked | UnitsUnblocked | ReplicasRetired
         | ReplicaShareChanged)


# Commands ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceAssignment:
    """Where a deploy's host gets the model bytes (see :mod:`flashpoint.policy.sourcing`).

    ``kind``: ``local`` (its own RAM); ``chain`` (bytes arrive on chain ``transfer_id``; if the
    chain breaks, pull from ``fallback``); ``chain_head`` (the host heads a registry chain:
    it pulls from ``upstream`` and relays to ``chain``). Hosts are named by id; the actor
    resolves them to data-plane endpoints.
    """

    kind: str
    transfer_id: str = ""
    sender: str = ""  # the chain's sender: a holder's host id or "registry"
    chain: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    fallback: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeployReplica:
    replica_id: str
    host_id: str
    device_id: str
    spec: FunctionSpec
    source: SourceAssignment | None = None
    stage: tuple[int, int] | None = None  # a partition stage's (first, last) layer
    group_id: str | None = None
    share: ReplicaShare | None = None  # its GPU share, enforced by the host (MPS / tokens)


@dataclass(frozen=True)
class DeployKaas:
    """Start a KaaS executor replica (no model: a worker whose executor's device cache is
    ``cache_bytes``; ``device_bytes`` is what it reserves on the device, cache included)."""

    replica_id: str
    host_id: str
    device_id: str
    device_bytes: int
    cache_bytes: int


@dataclass(frozen=True)
class StartChain:
    """A host holding the model in RAM streams it down ``receivers`` (one chain)."""

    transfer_id: str
    sender: str
    model: str
    version: str
    receivers: tuple[str, ...]
    fallback: tuple[str, ...] = ()  # where receivers pull from if this sender dies


@dataclass(frozen=True)
class StopAccepting:
    """Take a replica out of dispatch; it finishes what it holds."""

    replica_id: str


@dataclass(frozen=True)
class StopReplica:
    replica_id: str
    host_id: str


@dataclass(frozen=True)
class ForgetReplica:
    """The replica is gone (host lost, crash): drop its handle and re-dispatch its work."""

    replica_id: str


@dataclass(frozen=True)
class FailFunction:
    """Fail everything queued for a function (deleted, or backing off after its replicas
    kept failing to start: ``failure`` says why and until when)."""

    name: str
    code: str
    reason: str
    failure: StartFailure | None = None


@dataclass(frozen=True)
class LinkGroup:
    """Point every stage of a group at the next one and open the pipeline (the actor then
    reports :class:`GroupLinked`). ``stages``: (replica id, host id), first stage first."""

    group_id: str
    function: str
    stages: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ServeGroup:
    """Dispatch to the group's pipeline, with ``credits`` requests in flight at most."""

    group_id: str
    function: str
    credits: int


@dataclass(frozen=True)
class DissolveStages:
    """Stop the pipeline servers of these stage replicas (replica id, host id); a stage that
    completed keeps serving as a whole replica."""

    group_id: str
    stages: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RequestHost:
    """Ask the provider for a host to replace ``replacing`` (spot first, then on-demand)."""

    replacing: str


@dataclass(frozen=True)
class RouteCanary:
    """Send ``pct`` percent of ``function``'s requests to its replicas of ``model_key``
    and the rest to its other replicas (policy/rollout.py); ``model_key`` "" ends the split."""

    function: str
    model_key: str
    pct: float


@dataclass(frozen=True)
class BeginCompletion:
    """The stages' hosts may complete the model now (flashpoint/host/stage_hold.py): the
    group has answered its first request."""

    group_id: str
    stages: tuple[tuple[str, str], ...]  # (replica id, host id)


Command = (DeployReplica | DeployKaas | StartChain | StopAccepting | StopReplica | ForgetReplica
           | FailFunction | LinkGroup | ServeGroup | DissolveStages | BeginCompletion
           | RequestHost | RouteCanary)
