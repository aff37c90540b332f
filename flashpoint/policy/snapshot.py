"""Frozen snapshots of the cluster that policies decide over.

The controller builds them from its live state each loop; the simulator builds them from a
simulated cluster. "now" is a field, never a clock read inside a policy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSnapshot:
    host_id: str
    device_id: str
    kind: str  # "cpu" | "cuda"
    memory_total_bytes: int
    memory_free_bytes: int  # after replicas placed and reservations
    replicas: int


@dataclass(frozen=True)
class HostSnapshot:
    host_id: str
    alive: bool
    draining: bool
    ram_free_bytes: int
    cached_models: frozenset[str]  # "name@version"
    devices: tuple[DeviceSnapshot, ...]


@dataclass(frozen=True)
class ClusterSnapshot:
    now_s: float
    hosts: tuple[HostSnapshot, ...]


@dataclass(frozen=True)
class FunctionLoadSnapshot:
    """One function's load as the autoscaler sees it."""

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
