"""What one simulated run measured (:class:`RunMetrics`) and, for parity checks, every
decision it recorded (:class:`DecisionRecord`); times in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["DecisionRecord", "RunMetrics"]


@dataclass(frozen=True)
class DecisionRecord:
    """One ``ControllerState.handle`` call: the event and the commands it returned (parity)."""

    event: object
    commands: tuple[object, ...]


@dataclass
class RunMetrics:
    """What a run measured; times in seconds."""

    cold_starts_s: list[float] = field(default_factory=list)
    cold_start_sources: list[str] = field(default_factory=list)  # where each one's bytes came from
    latencies_s: list[float] = field(default_factory=list)
    replica_s: float = 0.0
    requests: int = 0
    unserved: int = 0
    failed: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    decisions: int = 0
    pipelines: int = 0  # partitioned groups that served
    completions: int = 0  # stages that completed into whole replicas
    decision_wall_s: float = 0.0
    events: int = 0
    wall_s: float = 0.0
    sim_end_s: float = 0.0
    bytes_moved: float = 0.0
    peak_starting: int = 0  # most replicas cold-starting at once
    peak_registry_flows: int = 0  # most flows sharing the registry link at once

    @property
    def avg_cold_start_s(self) -> float:
        return sum(self.cold_starts_s) / len(self.cold_starts_s) if self.cold_starts_s else 0.0

    @property
    def avg_latency_s(self) -> float:
        return sum(self.latencies_s) / len(self.latencies_s) if self.latencies_s else 0.0

    @property
    def p99_latency_s(self) -> float:
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered), max(1, math.ceil(0.99 * len(ordered)))) - 1]

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0
