"""Which partition plan a scale-up uses (thesis §4.2.6, Eq 4.14), and scale-down order.

On a scale-up by ``scale`` new GPUs, the thesis estimates the requests a new replica group
will face while it starts, E(x) = q_l + (λ − μ)·C(1): the queue already waiting plus what
arrives faster than the current replicas serve during one whole-model cold start C(1). It then
takes the precomputed best plan with at most ``scale`` parts for that load. Two corrections:

* (λ − μ) can be negative (the replicas already keep up); the load cannot, so E(x) is floored
  at 1 request — a scale-up is happening, so at least the request that triggered it waits.
* The plan never has more parts than new GPUs (each stage needs its own GPU) nor than layers;
  the table's lookup already bounds parts by ``scale``.

Stage placement: the parts of one pipeline load in parallel only over independent paths
(§4.1.2), so each stage goes to a different host (:func:`place_spread`); two stages on one
host would share its one download, and the later stage would wait for the earlier one's bytes.
Where fewer hosts have room than the plan has parts, the scale-up starts whole replicas
instead. A host that already holds the model in RAM fetches nothing, so the controller puts
whole replicas on holders' GPUs first and plans pipelines only over the GPUs of hosts that
must fetch (their stages then pull from the holders' RAM, thesis LC+MC+MP).

Scale-down (§4.2.6): partitioned replica groups are retired before whole replicas, because a
pipeline holds several GPUs for one replica's worth of concurrency — only groups that fit in
the GPUs still to free (:func:`scale_down_select`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from flashpoint.partition.model import Plan
from flashpoint.policy.placement import Placement, PlacementRequest, place
from flashpoint.policy.snapshot import ClusterSnapshot


class PlanLookup(Protocol):
    def lookup(self, x: float, scale: int) -> Plan: ...


@dataclass(frozen=True)
class ScaleUpLoad:
    """What the autoscaler knows at a scale-up (rates per second, times in seconds)."""

    queued: int  # q_l: requests waiting now
    arrival_rate: float  # λ_t
    service_rate: float  # μ_t: what the current warm replicas complete per second
    whole_cold_start_s: float  # C(1): a whole-model cold start on one GPU


def expected_load(load: ScaleUpLoad) -> float:
    """E(x) = q_l + (λ − μ)·C(1) (Eq 4.14), floored at 1 request."""
    return max(1.0, load.queued + (load.arrival_rate - load.service_rate) * load.whole_cold_start_s)


def choose_plan(table: PlanLookup, load: ScaleUpLoad, new_gpus: int) -> Plan:
    """The best plan with at most ``new_gpus`` parts for the expected load."""
    if new_gpus < 1:
        raise ValueError("a scale-up needs at least one new GPU")
    return table.lookup(expected_load(load), new_gpus)


@dataclass(frozen=True)
class GroupSnapshot:
    """A serving unit: a whole replica (``parts`` = 1) or a pipeline of ``parts`` stages."""

    group_id: str
    parts: int
    warm_since_s: float


def scale_down_order(groups: Sequence[GroupSnapshot]) -> list[str]:
    """Retire partitioned groups first (most parts first), then the newest whole replicas."""
    ranked = sorted(groups, key=lambda g: (-g.parts, -g.warm_since_s, g.group_id))
    return [g.group_id for g in ranked]


def scale_down_select(groups: Sequence[GroupSnapshot], gpus: int) -> list[str]:
    """The groups to retire to free at most ``gpus`` GPUs (thesis §4.2.6).

    "The replicas are sorted by decreasing number of GPUs used. Iterating through this
    sorted list, the autoscaler then removes models with at most the n GPUs to scale down
    by until at most n GPUs have been selected": walk :func:`scale_down_order`, take a
    group only if its parts fit in the GPUs still to free, stop once none are left. A
    pipeline wider than what is left stays (it is not stopped for a one-replica excess).
    """
    left, chosen = gpus, []
    by_id = {g.group_id: g for g in groups}
    for gid in scale_down_order(groups):
        if left <= 0:
            break
        if by_id[gid].parts <= left:
            chosen.append(gid)
            left -= by_id[gid].parts
    return chosen


def place_spread(snapshot: ClusterSnapshot, req: PlacementRequest) -> list[Placement]:
    """Up to ``req.count`` placements on pairwise different hosts, in :func:`place`'s order."""
    out: list[Placement] = []
    used: set[str] = set()
    for _ in range(req.count):
        rest = ClusterSnapshot(snapshot.now_s,
                               tuple(h for h in snapshot.hosts if h.host_id not in used))
        got = place(rest, dataclasses.replace(req, count=1))
        if not got:
            break
        out.append(got[0])
        used.add(got[0].host_id)
    return out


def stage_ranges(plan: Plan) -> tuple[tuple[int, int], ...]:
    """The plan's parts as (first layer, last layer) pairs, first stage first."""
    return tuple((part.first_layer, part.last_layer) for part in plan.parts)
