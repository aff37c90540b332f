"""What :class:`~flashpoint.controller.state.core.ControllerState` records per host, replica,
partitioned group and function, their phases, and the start back-off rule. Plain data;
the state class is the only writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from flashpoint.controller.state.events import DeviceRecord, GpuRecord, StartFailure
from flashpoint.policy.partitioning import PlanLookup
from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.rollout import RollPhase, canary_active
from flashpoint.policy.share_placement import ReplicaShare
from flashpoint.spec import FunctionSpec

# After this many consecutive failed starts a function backs off (no starts for a while; what
# waits for it fails with ModelLoadFailed) instead of retrying at once; KaaS stops for good.
MAX_CONSECUTIVE_START_FAILURES = 3
# Weight of the newest measurement in a function's per-source cold-start average: recent
# starts count most (the registry link's share changes with how many fetch at once).
COLD_EWMA = 0.5


def cold_source(kind: str | None, sender: str = "") -> str:
    """A deploy's source of bytes, as the cold-start estimates group them: ``local`` (own
    RAM), ``peer`` (a chain from a holder), ``registry`` (a registry chain or pull)."""
    if kind == "local":
        return "local"
    if kind == "chain" and sender and sender != "registry":
        return "peer"
    return "registry"


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
    # Where its bytes come from (cold_source: local, peer, registry); "" = not sourced yet.
    source: str = ""


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
    # RPR (policy/rpr.py): the FaST profile's configurations when the profile chose the
    # share (each new replica then gets the shape the autoscaler's mix names), and the
    # throughput of the registered one (p_eff), one replica's rate for the governor.
    configs: tuple[ReplicaConfig, ...] = ()
    config_rate_rps: float = 0.0
    # The spec registered before a change of model version, and its model's size: replicas
    # of it keep serving while the roll-out runs, and a canary keeps some (policy/rollout.py).
    # Cleared once every replica runs ``spec``'s version and no canary holds.
    previous: FunctionSpec | None = None
    previous_bytes: int = 0
    rollout: RollPhase = RollPhase.STABLE
    roll_failed: str | None = None  # why replicas of ``spec``'s version kept failing to start
    # Cold start (requested -> warm, controller clock) measured lately per source of the
    # bytes, smoothed (COLD_EWMA): the governor's expected ready times (autoscale.govern).
    cold_s: dict[str, float] = field(default_factory=dict)

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

