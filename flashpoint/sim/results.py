"""One simulated run's result row: what :mod:`flashpoint.sim.experiments` produces and
:mod:`~flashpoint.sim.explain` and :mod:`~flashpoint.sim.plots` read (kept apart from the
experiment driver so those two need not import it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpoint.sim.cluster_config import Technique
from flashpoint.sim.metrics import RunMetrics

__all__ = ["RunResult"]


@dataclass(frozen=True)
class RunResult:
    trace: str
    model: str
    autoscaler: str
    technique: Technique
    metrics: RunMetrics = field(compare=False)
    #: Fairness tuning (None when not tuned): the parameters and values the row ran with,
    #: its replica-seconds over BL's, how many runs the search took, and why it missed ±5%.
    tuned: tuple[tuple[str, float], ...] | None = field(default=None, compare=False)
    resource_ratio: float | None = field(default=None, compare=False)
    tuning_runs: int = field(default=0, compare=False)
    #: Every run of the search: (threshold, scale-down delay, ratio).
    tuning_trace: tuple[tuple[float, float, float], ...] = field(default=(), compare=False)
    fairness_note: str = field(default="", compare=False)

    @property
    def avg_replicas(self) -> float:
        """The thesis's resource figure: replica-seconds over the served duration."""
        span = self.metrics.sim_end_s or 1.0
        return self.metrics.replica_s / span
