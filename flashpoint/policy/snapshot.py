"""Frozen snapshots of the cluster that policies decide over.

The controller builds them from its live state each loop; the simulator builds them from a
simulated cluster. "now" is a field, never a clock read inside a policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.policy.replica_config import ReplicaConfig


@dataclass(frozen=True)
class DeviceSnapshot:
    host_id: str
    device_id: str
    kind: str  # "cpu" | "cuda"
    memory_total_bytes: int
    memory_free_bytes: int  # after replicas placed and reservations
    replicas: int
    # Fraction of the device's compute not yet reserved: 1.0 = idle (the default, for callers
    # that do not track compute); each replica reserves its profiled average (thesis §5.2.1).
    compute_free: float = 1.0


@dataclass(frozen=True)
class HostSnapshot:
    host_id: str
    alive: bool
    draining: bool
    ram_free_bytes: int
    cached_models: frozenset[str]  # "name@version"
    devices: tuple[DeviceSnapshot, ...]
    leaf: str = ""  # leaf switch (rack) the host hangs off; "" = unknown, matches no other host
    hops: int = 0  # switch hops to the model registry (cloud egress); 0 = unknown or all equal


@dataclass(frozen=True)
class ClusterSnapshot:
    now_s: float
    hosts: tuple[HostSnapshot, ...]


@dataclass(frozen=True)
class TokenLoad:
    """A text-generation function's load in tokens (issue 21 item 4; ``policy/token_load.py``).

    A sequence counts its prompt until its first token, then the ``max_tokens`` it has not
    generated yet: the work it may still ask of a replica.
    """

    queued_tokens: int = 0  # tokens of requests not yet sent to a replica
    inflight_tokens: int = 0  # tokens still to come of the requests on replicas
    # Tokens (prompt + max_tokens) per second arriving lately, smoothed.
    arrival_token_rate: float = 0.0
    # Tokens per second (prompt + generated) the busiest replica has served (a peak seen,
    # so a lower bound on what one replica sustains); 0 = not measured yet.
    replica_token_rate: float = 0.0
    sequences: int = 0  # requests queued and in flight (a sequence runs on one replica)


@dataclass(frozen=True)
class FunctionLoadSnapshot:
    """One function's load as the autoscaler sees it.

    The first eleven fields are what every policy needs; the rest feed the research
    policies (flashpoint/policy/autoscalers.py, rpr.py) and default to "not measured", so a
    policy that lacks its input falls back to the concurrency rule rather than guessing.
    Rates are requests per second.
    """

    name: str
    now_s: float
    queued: int
    inflight: int
    replicas_warm: int
    replicas_starting: int
    last_request_s: float | None  # last arrival; None = never invoked
    min_replicas: int
    max_replicas: int
    replica_concurrency: int
    keep_alive_s: float
    # λ: arrivals per second lately (the controller's smoothed RateMeter).
    arrival_rate: float = 0.0
    # Mean execution time of one request on a warm replica (profile or moving average);
    # 0 = not known yet.
    exec_time_s: float = 0.0
    # Requests per second one replica sustains (profiled); 0 = derive it as
    # replica_concurrency / exec_time_s. Capacity μ = replicas × this, never the observed
    # completion rate, which cannot exceed λ and so would never show a surplus.
    replica_rate: float = 0.0
    # Age of the oldest queued request; 0 when the queue is empty.
    queue_latency_s: float = 0.0
    # Busy fraction of the warm replicas, 0..1 (GPU compute utilisation where measured);
    # None = estimate it as inflight / (replicas_warm × replica_concurrency).
    utilisation: float | None = None
    # Requests accepted for this function since the controller started: a monotonic counter
    # (a decrease reads as a restart), so windows survive skipped or uneven ticks.
    invocations_total: int = 0
    # Latency objective for RPR's configuration filter; 0 = none.
    slo_s: float = 0.0
    # RPR: the profiled configurations this function may run in, and the configuration name
    # of each current replica (warm and starting; shorter than the replica count = the rest
    # are unknown).
    configs: tuple[ReplicaConfig, ...] = ()
    replica_configs: tuple[str, ...] = ()
    # Requests per second each of those replicas completed lately (measured, same order as
    # replica_configs; shorter = the rest unknown). Not capacity (it cannot exceed λ): it
    # only ranks replicas whose profiled RPR is equal (rpr.choose_changes).
    replica_rates: tuple[float, ...] = ()
    # A text-generation function's load in tokens; None for other functions.
    tokens: TokenLoad | None = None
    # The scale-up governor (autoscale.govern): when each starting replica is expected to
    # serve, on this snapshot's clock (its request time plus the cold start measured lately
    # for its source; shorter than replicas_starting = the rest unknown), and when a replica
    # ordered now would (None = not known: the governor then leaves the count alone).
    starting_ready_s: tuple[float, ...] = ()
    new_ready_s: float | None = None
