"""First-cut autoscaling: concurrency target, scale from zero, keep-alive, scale to zero.

The research policies (ATL, TSK, OWK, SM*, Eq 4.12, Dilu) plug in later behind the same
signature; the bounds, keep-alive and scale-to-zero rules here are the common wrapper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashpoint.policy.snapshot import FunctionLoadSnapshot


@dataclass(frozen=True)
class ScaleDecision:
    function: str
    desired: int
    reason: str


def concurrency_target(load: FunctionLoadSnapshot) -> int:
    """Replicas needed so each holds at most ``replica_concurrency`` requests."""
    demand = load.queued + load.inflight
    return math.ceil(demand / load.replica_concurrency) if demand else 0


def decide(load: FunctionLoadSnapshot) -> ScaleDecision:
    """Desired replica count for one function.

    - Any demand with no replica at all scales from zero at once (first request).
    - Scaling up follows demand; scaling down waits for ``keep_alive_s`` of idleness so a
      short lull does not throw warm replicas away.
    - Bounds ``min_replicas``..``max_replicas`` are applied last.
    """
    current = load.replicas_warm + load.replicas_starting
    want = concurrency_target(load)
    idle_for = math.inf if load.last_request_s is None else load.now_s - load.last_request_s
    if want >= current:
        desired, reason = want, "demand"
    elif idle_for < load.keep_alive_s:
        desired, reason = current, "keep_alive"
    else:
        desired, reason = want, "idle" if want == 0 else "demand"
    bounded = max(load.min_replicas, min(load.max_replicas, desired))
    if bounded != desired:
        reason = f"{reason}+bounds"
    return ScaleDecision(load.name, bounded, reason)
