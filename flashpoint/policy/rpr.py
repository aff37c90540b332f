"""RPR: FaST-GShare's resource-per-request autoscaler (seed 001 §4.1, Algorithm 1), fixed.

Each function has profiled configurations (SM share S, time quota Q, batch) with a sustained
throughput T and a tail latency (:class:`ReplicaConfig`). For a load R the algorithm adds
replicas in the configuration with the most throughput per GPU share held, RPR = T / (S·Q),
then one "just sufficient" replica for the remainder; on a surplus it removes the least
efficient replicas while capacity stays at or above the load.

Corrections to the paper (seed 001 §4.1, §9 items 10–11):

- ΔRPS = 0 scaled up (the paper tests ``ΔRPS ≥ 0``): no change now.
- The scale-down ``while`` never ended when the lowest-RPR replica could not be removed
  without dropping below the load. We walk the replicas once, lowest RPR first, and remove
  each one whose removal keeps capacity ≥ load: it always ends, and it still removes a small
  efficient replica that a large inefficient one in front of it would have blocked.
- The paper has no SLO filter although it promises SLOs: only configurations whose
  profiled p99 latency is within ``slo_s`` are eligible (if none is, the fastest one).
- T is about linear in Q, so RPR ties across quotas up to measurement noise: configurations
  within ``tie_tolerance`` of the best RPR tie, and the tie goes to the lowest latency, then
  the higher throughput (fewer replicas), then the name. The just-sufficient replica ties
  on the smallest S·Q, then the name.
- R is FaST-GShare's "predicted load"; there is no predictor here, so R = λ, the smoothed
  arrival rate.

The decision is a count and a mix (replicas per configuration); :func:`choose_changes`
turns a mix into the replicas to start (each in its configuration's SM share and quota) or
retire (lowest RPR first), which ``controller/state/scaling.py`` carries out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flashpoint.errors import BadRequest
from flashpoint.policy.autoscalers import Proposal, concurrency_target, current
from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.snapshot import FunctionLoadSnapshot

_EPS = 1e-9


@dataclass(frozen=True)
class RprParams:
    tie_tolerance: float = 0.02  # relative RPR difference still counted as a tie

    def __post_init__(self) -> None:
        if not 0 <= self.tie_tolerance < 1:
            raise BadRequest("rpr: tie_tolerance must be in [0, 1)")


def eligible_configs(configs: Sequence[ReplicaConfig],
                     slo_s: float) -> tuple[tuple[ReplicaConfig, ...], bool]:
    """Configurations meeting the SLO (all if ``slo_s`` is 0), and whether any does.

    If none does, the fastest one alone: serving late beats not serving.
    """
    ok = tuple(c for c in configs if slo_s <= 0 or c.p99_latency_s <= slo_s)
    return (ok, True) if ok else ((min(configs, key=lambda c: (c.p99_latency_s, c.name)),), False)


def most_efficient(configs: Sequence[ReplicaConfig], tie_tolerance: float) -> ReplicaConfig:
    """p_eff: the highest RPR, ties (within ``tie_tolerance``) to the lowest latency."""
    best = max(c.rpr for c in configs)
    tied = [c for c in configs if c.rpr >= best * (1 - tie_tolerance) - _EPS]
    return min(tied, key=lambda c: (c.p99_latency_s, -c.throughput_rps, c.name))


def just_sufficient(configs: Sequence[ReplicaConfig], residual_rps: float) -> ReplicaConfig:
    """p_ideal: the least throughput still covering the residual, then the least S·Q."""
    covering = [c for c in configs if c.throughput_rps >= residual_rps - _EPS]
    return min(covering, key=lambda c: (c.throughput_rps - residual_rps, c.resource, c.name))


Pod = tuple[str, ReplicaConfig]  # (configuration name as reported, its profile)


def plan(load_rps: float, pods: Sequence[Pod], configs: Sequence[ReplicaConfig],
         tie_tolerance: float) -> list[Pod]:
    """Algorithm 1 for one function: the replicas to keep and add, lowest RPR first.

    ``pods`` are the current replicas; ``configs`` the eligible configurations (non-empty).
    """
    order = sorted(pods, key=lambda p: (p[1].rpr, p[1].throughput_rps, p[0]))
    eff = most_efficient(configs, tie_tolerance)
    delta = load_rps - sum(p[1].throughput_rps for p in order)
    tol = _EPS * max(1.0, load_rps)
    if delta > tol:
        n = math.floor(delta / eff.throughput_rps + _EPS)
        residual = delta - n * eff.throughput_rps
        adds = [eff] * n
        if residual > tol:
            adds.append(just_sufficient(configs, residual))
        order += [(c.name, c) for c in adds]
        order.sort(key=lambda p: (p[1].rpr, p[1].throughput_rps, p[0]))
    elif delta < -tol:
        kept = []
        for pod in order:  # one pass: always ends (the paper's while loop did not)
            if delta + pod[1].throughput_rps <= tol:
                delta += pod[1].throughput_rps
            else:
                kept.append(pod)
        order = kept
    return order


def rpr(load: FunctionLoadSnapshot, params: RprParams, memory: None) -> tuple[Proposal, None]:
    """Replica count and configuration mix from Algorithm 1 at load λ.

    Current replicas are ``load.replica_configs`` (warm and starting); replicas without a
    known configuration (the list is short, or the name is no longer profiled) are taken
    to perform like p_eff, the configuration the policy would have given them. With no
    profiled configuration the concurrency rule answers.
    """
    if not load.configs:
        return Proposal(concurrency_target(load), "rpr:unprofiled"), None
    configs, met = eligible_configs(load.configs, load.slo_s)
    reason = "rpr" if met else "rpr:slo_unmet"
    eff = most_efficient(configs, params.tie_tolerance)
    by_name = {c.name: c for c in load.configs}
    cur = current(load)
    names = list(load.replica_configs[:cur]) + [eff.name] * max(0, cur - len(load.replica_configs))
    pods = [(name, by_name.get(name, eff)) for name in names]
    wanted = plan(load.arrival_rate, pods, configs, params.tie_tolerance)
    return Proposal(len(wanted), reason, tuple(name for name, _ in wanted), eff.name), None


# Applying the mix ----------------------------------------------------------------------------
def config_of(sm_share: float, quota: float, configs: Sequence[ReplicaConfig]) -> str:
    """The name of the configuration with this SM share and time quota ("" = none): a
    replica's shape read back from the share it was deployed with (or its host reported)."""
    for c in configs:
        if abs(c.sm_share - sm_share) <= _EPS and abs(c.quota - quota) <= _EPS:
            return c.name
    return ""


@dataclass(frozen=True)
class LiveReplica:
    """One current replica of a function, as :func:`choose_changes` ranks it."""

    replica_id: str
    config: str  # its configuration's name ("" = not one of the profile's)
    resource: float  # S·Q it holds (0 = unknown)
    rate_rps: float  # requests per second it completed lately (measured)
    warm: bool
    since_s: float  # when it warmed; when it was requested while starting


@dataclass(frozen=True)
class MixChange:
    """What turns the current replicas into the mix: configurations to start (most
    efficient first) and replica ids to retire (lowest RPR first)."""

    start: tuple[str, ...] = ()
    retire: tuple[str, ...] = ()


def replica_rpr(rep: LiveReplica, by_name: dict[str, ReplicaConfig]) -> tuple[float, float]:
    """A replica's RPR as scale-down ranks it: its configuration's profiled T / (S·Q) (the
    paper's RPR), then its measured rate per S·Q, which tells apart replicas of one
    configuration (a starting replica has served nothing: it ranks lowest). A replica of no
    known configuration ranks by its measured rate alone."""
    measured = rep.rate_rps / rep.resource if rep.resource > 0 else rep.rate_rps
    cfg = by_name.get(rep.config)
    return (cfg.rpr if cfg is not None else measured, measured)


def choose_changes(replicas: Sequence[LiveReplica], mix: Sequence[tuple[str, int]],
                   desired: int, configs: Sequence[ReplicaConfig]) -> MixChange:
    """The starts or retirements that bring ``replicas`` to ``desired`` following ``mix``
    (replicas per configuration name, the autoscaler's ScaleDecision.mix).

    Only one direction per decision, as the count says: scaling up starts the mix's
    missing configurations (fewer than ``desired`` minus current when the mix names none:
    the caller starts the rest in its default shape); scaling down retires replicas of the
    configurations the mix holds fewer of, lowest RPR first (:func:`replica_rpr`; ties:
    starting before warm, the most recently warmed first), then, if the mix does not
    account for enough, the lowest-RPR replicas of the rest.
    """
    by_name = {c.name: c for c in configs}
    want = dict(mix)
    have: dict[str, int] = {}
    for r in replicas:
        have[r.config] = have.get(r.config, 0) + 1
    cur = len(replicas)
    if desired > cur:
        missing = sorted(((by_name[n], k - have.get(n, 0)) for n, k in want.items()
                          if n in by_name and k > have.get(n, 0)),
                         key=lambda ck: (-ck[0].rpr, ck[0].p99_latency_s, ck[0].name))
        start = [c.name for c, k in missing for _ in range(k)]
        return MixChange(start=tuple(start[:desired - cur]))
    if desired < cur:
        order = sorted(replicas, key=lambda r: (*replica_rpr(r, by_name), r.warm, -r.since_s,
                                                r.replica_id))
        surplus = {n: k - want.get(n, 0) for n, k in have.items() if k > want.get(n, 0)}
        retire = []
        for r in order:
            if surplus.get(r.config, 0) > 0:
                surplus[r.config] -= 1
                retire.append(r)
        retire += [r for r in order if r not in retire]
        return MixChange(retire=tuple(r.replica_id for r in retire[:cur - desired]))
    return MixChange()
