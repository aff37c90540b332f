"""A profiled replica configuration: the unit FaST-GShare's RPR autoscaler chooses between.

Seed 001 §3–4: each function is profiled offline in several configurations (SM share S,
time quota Q, batch size), giving a sustained throughput T and a tail latency per
configuration. RPR ("RPS per resource") = T / (S · Q) ranks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashpoint.errors import BadRequest


@dataclass(frozen=True)
class ReplicaConfig:
    """One profiled configuration of a function's replica.

    ``sm_share`` and ``quota`` are fractions of one GPU's SMs and of its time; ``batch`` is
    the inference batch size the profile ran with; ``throughput_rps`` the requests per second
    one replica sustained; ``p99_latency_s`` its tail latency at that load.
    """

    name: str
    sm_share: float
    quota: float
    batch: int
    throughput_rps: float
    p99_latency_s: float

    def __post_init__(self) -> None:
        if not self.name:
            raise BadRequest("replica config needs a name")
        for field, value in (("sm_share", self.sm_share), ("quota", self.quota)):
            if not (math.isfinite(value) and 0 < value <= 1):
                raise BadRequest(f"replica config {self.name!r}: {field} must be in (0, 1]")
        if self.batch < 1:
            raise BadRequest(f"replica config {self.name!r}: batch must be >= 1")
        if not (math.isfinite(self.throughput_rps) and self.throughput_rps > 0):
            raise BadRequest(f"replica config {self.name!r}: throughput_rps must be > 0")
        if not (math.isfinite(self.p99_latency_s) and self.p99_latency_s >= 0):
            raise BadRequest(f"replica config {self.name!r}: p99_latency_s must be >= 0")

    @property
    def resource(self) -> float:
        """GPU share held: S · Q (fraction of one GPU)."""
        return self.sm_share * self.quota

    @property
    def rpr(self) -> float:
        """Requests per second per unit of GPU held, T / (S · Q) (seed 001 §4.1)."""
        return self.throughput_rps / self.resource
