"""Where a scale-from-zero request's time went: consecutive phases that add up to its wall.

Each process times its own part with its own clock and sends durations, never timestamps
(hosts' clocks are not the controller's):

- the **controller** marks, per replica it deploys, when the step that decided it began
  (``decided_s``), when the deploy command left the state (``placed_s``), when the host
  acknowledged the deploy (``deployed_s``) and when the worker's ``replica_ready`` arrived
  (``ready_s``); per request, when it was sent to the replica and when its reply came back;
- the **host** times ``obtain`` (the model in its RAM: a cache hit, a join or the whole
  fill) and ``assign`` (a warm-pool worker taken, bound and sent ``load_replica``);
- the **worker** times ``worker_prepare`` (the load call parsed, its env applied, the load
  thread started), ``load`` (module built over the mapped bytes), ``to_device``,
  ``first_inference`` (warm-up) and ``announce`` (serving set up, connected to the
  controller, ``replica_ready`` sent).

``handoff`` is what the controller saw between the host's acknowledgement and the
worker's announcement that neither the host nor the worker timed (the ``load_replica``
and ``replica_ready`` hops); it is never negative. The host starts its part as soon as it
has the deploy, while its acknowledgement is still on the way back: when that overlap
shows (host and worker timed more than the controller's window after the
acknowledgement), ``deploy_rpc`` counts only the time before the host's part began, so the
phases never count one interval twice.

Pure: no clock is read here; :func:`cold_start_phases` gets every mark as an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The phases of one scale-from-zero request, in order; together they are its wall time.
# ``fetch`` (where the bytes came from, and how long that took) stays a separate key: it is
# part of ``obtain`` (or, for a request that joined a start in progress, before it).
CONTROLLER_PHASES = ("decision", "placement", "deploy_rpc")
HOST_PHASES = ("obtain", "assign")
WORKER_PHASES = ("worker_prepare", "load", "to_device", "first_inference", "announce")
COLD_PHASES = (*CONTROLLER_PHASES, *HOST_PHASES, *WORKER_PHASES, "handoff",
               "ready_to_dispatch", "request")


@dataclass
class ColdStartMarks:
    """The controller's clock readings (``time.monotonic``) for one replica's start."""

    decided_s: float  # the control step that deployed it began
    placed_s: float  # its DeployReplica left the state
    deployed_s: float = 0.0  # the host acknowledged the deploy (0: not yet)
    ready_s: float = 0.0  # its worker's replica_ready arrived (0: not yet)


def cold_start_phases(marks: ColdStartMarks, replica_s: Mapping[str, float], *,
                      arrived_s: float, sent_s: float, done_s: float) -> dict[str, float]:
    """The phases of a request that arrived at ``arrived_s`` before ``marks``'s replica was
    decided, was sent to it at ``sent_s`` and answered at ``done_s`` (controller clock);
    ``replica_s``: the durations its host and worker reported. Empty when the request came
    after the decision (it joined a start in progress: only its wait is known) or a mark
    is missing."""
    if not (arrived_s <= marks.decided_s <= marks.placed_s <= marks.deployed_s
            <= marks.ready_s <= sent_s <= done_s):
        return {}
    out = {"decision": marks.decided_s - arrived_s,
           "placement": marks.placed_s - marks.decided_s}
    timed = 0.0
    for k in (*HOST_PHASES, *WORKER_PHASES):
        v = float(replica_s.get(k, 0.0))
        out[k] = v
        timed += v
    deploy_s = marks.deployed_s - marks.placed_s
    window_s = marks.ready_s - marks.placed_s  # deploy_rpc + host + worker + handoff
    out["deploy_rpc"] = min(deploy_s, max(0.0, window_s - timed))
    out["handoff"] = max(0.0, window_s - timed - deploy_s)
    out["ready_to_dispatch"] = sent_s - marks.ready_s
    out["request"] = done_s - sent_s
    return out


def phases_sum_s(timings: Mapping[str, float]) -> float:
    """The sum of the cold-start phases present in ``timings``."""
    return sum(float(timings.get(k, 0.0)) for k in COLD_PHASES)
