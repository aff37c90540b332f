"""Autoscaling plug-ins: pure functions that say how many replicas a function should have.

Every plug-in has the shape ``policy(load, params, memory) -> (Proposal, memory)``:

- ``load`` is the frozen :class:`FunctionLoadSnapshot`; "now" is ``load.now_s``.
- ``params`` is the plug-in's own frozen parameter dataclass (built by
  ``autoscale.make_autoscaler`` from the ``[controller] autoscaler_params`` table).
- ``memory`` is an immutable value the plug-in returned last time for this function (windows,
  last evaluation); the caller stores it and passes it back, so a restart loses nothing that
  the caller does not choose to lose.

A plug-in only computes the count it wants. Scale from zero, keep-alive, min/max bounds,
stabilisation delays and the "never zero while requests wait" rule live in one wrapper,
``autoscale.limit``. A plug-in whose input is not measured yet (no execution-time profile)
falls back to the concurrency rule and says so in its reason, rather than guessing.

The research policies come from the seeds: ATL, TSK, OWK, SM* and Eq 4.12 from the Flashpoint
thesis (seed 004 §4.6, §5.3), Dilu's lazy horizontal scaling (seed 002 §4.2); RPR
(FaST-GShare, seed 001 §4.1) is in ``rpr.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flashpoint.errors import BadRequest
from flashpoint.policy.snapshot import FunctionLoadSnapshot

_EPS = 1e-9


@dataclass(frozen=True)
class Proposal:
    """What a plug-in wants before the wrapper applies its rules.

    ``pods`` and ``pad`` are for configuration-choosing policies (RPR): the configuration
    name of every wanted replica, the first to remove first, and the configuration to add
    should the wrapper raise the count. Other policies leave them empty.
    """

    desired: int
    reason: str
    pods: tuple[str, ...] = ()
    pad: str | None = None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def ceil_count(x: float) -> int:
    """ceil(x) for replica counts, ignoring float noise: 4.000000001 replicas is 4, not 5."""
    return max(0, math.ceil(x - _EPS))


def current(load: FunctionLoadSnapshot) -> int:
    """Replicas the function has or has asked for: starting ones are capacity on the way."""
    return load.replicas_warm + load.replicas_starting


def concurrency_target(load: FunctionLoadSnapshot) -> int:
    """Replicas needed so each holds at most ``replica_concurrency`` requests."""
    demand = load.queued + load.inflight
    return math.ceil(demand / load.replica_concurrency) if demand else 0


def replica_rate(load: FunctionLoadSnapshot) -> float:
    """Requests per second one replica serves (μ of one replica, Eq 3.1's c(f)); 0 = unknown.

    The profiled ``replica_rate`` if given, else ``replica_concurrency / exec_time_s`` (a
    replica holds that many requests at once, each taking ``exec_time_s``).
    """
    if load.replica_rate > 0:
        return load.replica_rate
    if load.exec_time_s > 0:
        return load.replica_concurrency / load.exec_time_s
    return 0.0


def utilisation(load: FunctionLoadSnapshot) -> float:
    """Busy fraction of the warm replicas, 0..1: measured if given, else from credits in use."""
    if load.utilisation is not None:
        return min(1.0, max(0.0, load.utilisation))
    if load.replicas_warm == 0:
        return 0.0
    return min(1.0, load.inflight / (load.replicas_warm * load.replica_concurrency))


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation: the value was actually observed)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered) - _EPS))
    return ordered[min(rank, len(ordered)) - 1]


def _unprofiled(load: FunctionLoadSnapshot, name: str) -> Proposal:
    return Proposal(concurrency_target(load), f"{name}:unprofiled")


# Memory shapes shared by several plug-ins -------------------------------------------------
@dataclass(frozen=True)
class Samples:
    """(time, value) samples over the last ``window_s``, one at most every ``sample_s``."""

    points: tuple[tuple[float, float], ...] = ()

    def add(self, now_s: float, value: float, window_s: float, sample_s: float) -> Samples:
        """A new window with ``value`` sampled at ``now_s`` if a sample is due."""
        points = self.points
        if points and now_s < points[-1][0]:  # the clock went back (new run): start over
            points = ()
        if not points or now_s - points[-1][0] >= sample_s:
            points = (*points, (now_s, value))
        cutoff = now_s - window_s
        return Samples(tuple(p for p in points if p[0] >= cutoff))


@dataclass(frozen=True)
class Held:
    """A periodic policy's last evaluation: when, and what it proposed until the next one."""

    at_s: float | None = None
    desired: int = 0
    reason: str = ""

    def due(self, now_s: float, period_s: float) -> bool:
        return self.at_s is None or now_s < self.at_s or now_s - self.at_s >= period_s


# concurrency (the default) ----------------------------------------------------------------
@dataclass(frozen=True)
class NoParams:
    """A plug-in without parameters."""


def concurrency(load: FunctionLoadSnapshot, params: NoParams, memory: None) -> tuple[Proposal, None]:
    """ceil((queued + inflight) / replica_concurrency): the first-cut rule, state-free."""
    return Proposal(concurrency_target(load), "demand"), None


# ATL: Atoll, p99 arrival rate × mean execution time ---------------------------------------
@dataclass(frozen=True)
class AtlParams:
    window_s: float = 60.0  # history the percentile is taken over
    percentile: float = 99.0
    sample_s: float = 1.0  # one arrival-rate sample per this many seconds

    def __post_init__(self) -> None:
        _check(self.window_s > 0, "atl: window_s must be > 0")
        _check(0 < self.percentile <= 100, "atl: percentile must be in (0, 100]")
        _check(self.sample_s >= 0, "atl: sample_s must be >= 0")


def atl(load: FunctionLoadSnapshot, params: AtlParams, memory: Samples) -> tuple[Proposal, Samples]:
    """Desired = ceil(λ_p99 × d_e / replica_concurrency), independent of the current count.

    Seed 004 §5.3 and thesis §8.3: the physical deployment's Atoll policy sizes for the 99th
    percentile arrival rate scaled by the mean execution time (Little's law: requests in
    service at once). We divide by the replica's concurrency (the thesis runs one request per
    GPU), i.e. ceil(λ_p99 / μ₁). The percentile is over the window's samples plus the current
    rate, so a burst counts at once rather than at the next sample.
    """
    window = memory.add(load.now_s, load.arrival_rate, params.window_s, params.sample_s)
    rate = replica_rate(load)
    if rate <= 0:
        return _unprofiled(load, "atl"), window
    values = [v for _, v in window.points]
    if window.points[-1][0] != load.now_s:
        values.append(load.arrival_rate)
    return Proposal(ceil_count(percentile(values, params.percentile) / rate), "atl"), window


# The HPA's default scale-up behaviour ------------------------------------------------------
def hpa_up_cap(cur: int, ratio: float, pods: int) -> int:
    """The most replicas an HPA scale-up may reach from ``cur`` in one policy period.

    Kubernetes' default ``behavior.scaleUp`` (autoscaling/v2; the HPA concepts page): no
    stabilisation window, two policies per 15 s, ``Percent: 100`` (double) and ``Pods: 4``
    (add four), ``selectPolicy: Max`` (whichever allows more). Our plug-ins evaluate once per
    sync period (15 s, the policies' period), so the limit applies per evaluation, from the
    count at its start. (The API reference's field comment says "per 60 seconds"; the
    controller's defaults, and the concepts page, use 15 s.)
    """
    return max(math.floor(ratio * cur + _EPS), cur + pods)


# TSK: TorchServe on Kubernetes, queue-latency target through the HPA ----------------------
@dataclass(frozen=True)
class TskParams:
    target_s: float = 7.0  # TorchServe-on-K8s default queue-latency target (thesis §3.1)
    tolerance: float = 0.1  # HPA's default: no change within ±10% of the target
    period_s: float = 15.0  # HPA's default sync period
    # HPA scale-up policies (hpa_up_cap): ×2 (Percent 100) or +4 pods, whichever is more.
    max_scale_up_ratio: float = 2.0
    max_scale_up_pods: int = 4

    def __post_init__(self) -> None:
        _check(self.target_s > 0, "tsk: target_s must be > 0")
        _check(0 <= self.tolerance < 1, "tsk: tolerance must be in [0, 1)")
        _check(self.period_s >= 0, "tsk: period_s must be >= 0")
        _check(self.max_scale_up_ratio >= 1, "tsk: max_scale_up_ratio must be >= 1")
        _check(self.max_scale_up_pods >= 1, "tsk: max_scale_up_pods must be >= 1")


def tsk(load: FunctionLoadSnapshot, params: TskParams, memory: Held) -> tuple[Proposal, Held]:
    """HPA on queue latency: every ``period_s``, desired = ceil(current × latency / target).

    The metric is the age of the oldest queued request. It only rises once a queue has
    built, and the HPA ratio then multiplies the replica count (21 s against 7 s: ×3), so
    scale-ups come late and in large batches, as the thesis observed (§8.4.2) — at most
    what the HPA's default scale-up policies allow per period (:func:`hpa_up_cap`: ×2 or
    +4 pods, whichever is more). Between
    evaluations the last answer stands, as an HPA's does between syncs; the HPA's 300 s
    scale-down stabilisation is the wrapper's ``scale_down_delay_s`` (defaulted for tsk).

    Correction: a plain HPA on this metric would drop to ``min_replicas`` whenever the queue
    is empty (latency 0 says nothing about how busy replicas are), then rebuild a queue. We
    never scale below the replicas the queued and in-flight requests occupy
    (``concurrency_target``); only idle replicas go.
    """
    if not memory.due(load.now_s, params.period_s):
        return Proposal(memory.desired, memory.reason), memory
    cur = current(load)
    ratio = load.queue_latency_s / params.target_s
    if ratio > 1 + params.tolerance:
        cap = hpa_up_cap(cur, params.max_scale_up_ratio, params.max_scale_up_pods)
        want, reason = min(max(cur, ceil_count(cur * ratio)), cap), "tsk:up"
    elif ratio < 1 - params.tolerance:
        want, reason = min(cur, max(ceil_count(cur * ratio), concurrency_target(load))), "tsk:down"
    else:
        want, reason = cur, "tsk:steady"
    return Proposal(want, reason), Held(load.now_s, want, reason)


# OWK: OpenWhisk on Kubernetes, HPA on (GPU) utilisation -----------------------------------
@dataclass(frozen=True)
class OwkParams:
    target_utilisation: float = 0.6  # HPA default as used by OWK (thesis §3.1)
    # HPA scale-up policies (hpa_up_cap): ×2 (Percent 100, thesis §8.4.2) or +4 pods,
    # whichever is more.
    max_scale_up_ratio: float = 2.0
    max_scale_up_pods: int = 4
    tolerance: float = 0.1
    period_s: float = 15.0

    def __post_init__(self) -> None:
        _check(0 < self.target_utilisation <= 1, "owk: target_utilisation must be in (0, 1]")
        _check(self.max_scale_up_ratio > 1, "owk: max_scale_up_ratio must be > 1")
        _check(self.max_scale_up_pods >= 1, "owk: max_scale_up_pods must be >= 1")
        _check(0 <= self.tolerance < 1, "owk: tolerance must be in [0, 1)")
        _check(self.period_s >= 0, "owk: period_s must be >= 0")


def owk(load: FunctionLoadSnapshot, params: OwkParams, memory: Held) -> tuple[Proposal, Held]:
    """HPA on utilisation: desired = ceil(warm × util / target), at most ×2 per step.

    As Kubernetes does, replicas still starting have no metric: they count as idle when
    deciding to scale up and as fully busy when deciding to scale down, so a pending cold
    start neither triggers a second scale-up nor lets the count fall. Within ``tolerance`` of
    the target nothing changes. With no warm replica there is no metric and the count holds
    (scale from zero is the wrapper's). A step adds at most what the HPA's default scale-up
    policies allow (:func:`hpa_up_cap`: ×2 or +4 pods, whichever is more).
    """
    if not memory.due(load.now_s, params.period_s):
        return Proposal(memory.desired, memory.reason), memory
    warm, cur = load.replicas_warm, current(load)
    util = utilisation(load)
    ratio = util / params.target_utilisation
    if warm == 0:
        want, reason = cur, "owk:no_metric"
    elif abs(ratio - 1) <= params.tolerance:
        want, reason = cur, "owk:steady"
    elif ratio > 1:
        cap = hpa_up_cap(cur, params.max_scale_up_ratio, params.max_scale_up_pods)
        want, reason = min(max(cur, ceil_count(warm * ratio)), cap), "owk:up"
    else:
        busy = warm * util + load.replicas_starting
        want, reason = min(cur, ceil_count(busy / params.target_utilisation)), "owk:down"
    return Proposal(want, reason), Held(load.now_s, want, reason)


# SM*: SageMaker target tracking on invocations per instance -------------------------------
@dataclass(frozen=True)
class SmStarParams:
    # Invocations per replica per window. The thesis gives no value; 70 per minute is the
    # example in AWS's "define a scaling policy" page, the thesis's reference [29].
    target_invocations: float = 70.0
    window_s: float = 60.0  # CloudWatch's one-minute period
    sample_s: float = 1.0

    def __post_init__(self) -> None:
        _check(self.target_invocations > 0, "smstar: target_invocations must be > 0")
        _check(self.window_s > 0, "smstar: window_s must be > 0")
        _check(self.sample_s >= 0, "smstar: sample_s must be >= 0")


def smstar(load: FunctionLoadSnapshot, params: SmStarParams, memory: Samples) -> tuple[Proposal, Samples]:
    """Desired = ceil(invocations in the last ``window_s`` / ``target_invocations``).

    Target tracking holds the per-replica average at the target, so the desired count is
    the window's total over the target, whatever the current count. Invocations are accepted
    requests (SageMaker's metric counts requests sent, not completed: completions are capped
    by capacity and would hide an overload). A counter that went down means the controller
    restarted: the window starts over.
    """
    total = float(load.invocations_total)
    if memory.points and total < memory.points[-1][1]:
        memory = Samples()
    window = memory.add(load.now_s, total, params.window_s, params.sample_s)
    count = total - window.points[0][1]
    return Proposal(ceil_count(count / params.target_invocations), "smstar"), window


# Eq 4.12: Flashpoint's rate band with ρ_L / ρ_H -------------------------------------------
@dataclass(frozen=True)
class Eq412Params:
    # The thesis calls ρ_L, ρ_H "thresholds for number of replicas": we take them in
    # replicas' worth of service rate, so they mean the same for a fast and a slow model.
    rho_l: float = 0.0  # deficit tolerated before scaling up
    rho_h: float = 2.0  # surplus tolerated before scaling down

    def __post_init__(self) -> None:
        _check(self.rho_l >= 0 and self.rho_h >= 0, "eq412: rho_l and rho_h must be >= 0")


def eq412(load: FunctionLoadSnapshot, params: Eq412Params, memory: None) -> tuple[Proposal, None]:
    """Eq 4.12 (thesis §4.2.6): keep while λ − ρ_L < μ < λ + ρ_H, else resize to ceil(λ / μ₁).

    μ = current replicas × μ₁ (Eq 4.13 with every replica counted as a full one; a
    partitioned pipeline serves one replica's worth). ρ_L, ρ_H are in replicas (× μ₁).

    Correction: as printed, (1) "scale up if λ + ρ_H > μ" and (3) "scale down if
    λ − ρ_L > μ" overlap each other and row (2) (any μ < λ − ρ_L satisfies all three rows'
    inequalities but (2)'s lower edge). Row (2), the band, is the only row consistent with
    its label, so we keep it and make (1) and (3) its two sides:

        scale up    if μ ≤ λ − ρ_L     (capacity short by at least ρ_L)
        keep        if λ − ρ_L < μ < λ + ρ_H
        scale down  if μ ≥ λ + ρ_H     (capacity spare by at least ρ_H)

    The resize target is the just-sufficient count ceil(λ / μ₁) both ways; it lies inside the
    band whenever ρ_H ≥ 1, so the band adds hysteresis without flapping.
    """
    rate = replica_rate(load)
    if rate <= 0:
        return _unprofiled(load, "eq412"), None
    cur, lam = current(load), load.arrival_rate
    mu = cur * rate
    need = ceil_count(lam / rate)
    if mu <= lam - params.rho_l * rate:
        return Proposal(max(cur, need), "eq412:up"), None
    if mu >= lam + params.rho_h * rate:
        return Proposal(min(cur, need), "eq412:down"), None
    return Proposal(cur, "eq412:keep"), None


# Dilu: lazy horizontal scaling over a 40 s window -----------------------------------------
@dataclass(frozen=True)
class DiluParams:
    window_s: float = 40.0
    sample_s: float = 1.0  # the global scaler polls RPS every second
    out_samples: int = 20  # φ_out: samples over capacity before scaling out
    in_samples: int = 30  # φ_in: samples under (n − 1) replicas' capacity before scaling in

    def __post_init__(self) -> None:
        _check(self.sample_s > 0 and self.window_s >= self.sample_s,
               "dilu: need 0 < sample_s <= window_s")
        size = round(self.window_s / self.sample_s)
        _check(1 <= self.out_samples <= size and 1 <= self.in_samples <= size,
               f"dilu: out_samples and in_samples must be in 1..{size} (samples per window)")


@dataclass(frozen=True)
class DiluMemory:
    rps: tuple[float, ...] = ()  # newest last, one per sample_s, at most a window's worth
    last_s: float | None = None
    last_total: int = 0
    target: int | None = None  # the count Dilu last chose; None = adopt the current one
    reason: str = "dilu:steady"


def dilu(load: FunctionLoadSnapshot, params: DiluParams, memory: DiluMemory) -> tuple[Proposal, DiluMemory]:
    """Dilu's lazy scale-out/in (seed 002 §4.2): one replica at a time, on sustained load.

    Each ``sample_s`` the RPS since the last sample (from ``invocations_total``) enters a
    window of ``window_s / sample_s`` samples. With n = Dilu's replica count and T = one
    replica's rate: scale out to n + 1 when at least φ_out samples exceed n·T; scale in to
    n − 1 when at least φ_in samples are below (n − 1)·T. The window is cleared after every
    action (Dilu's reference code), which gives a cooldown of at least φ_out samples.
    Bursts shorter than that are left to vertical scaling and the queue.

    n is remembered, not re-read from the cluster: an action is a new desired count that
    stands until the next action, so the wrapper can hold it back (keep-alive, delays)
    without it being forgotten a tick later, and a failed replica is replaced. n is kept
    within min..max so it cannot wind up past what the wrapper allows.

    Serverless difference: Dilu keeps at least one instance. We propose 0 once at least
    φ_in samples have been recorded and every one of them is zero, and leave the timing of
    the scale to zero to the wrapper's keep-alive.
    """
    total = load.invocations_total
    n = current(load) if memory.target is None else memory.target
    n = min(max(n, load.min_replicas), load.max_replicas)
    if memory.last_s is None or load.now_s < memory.last_s or total < memory.last_total:
        return Proposal(n, "dilu:steady"), DiluMemory((), load.now_s, total, n)
    elapsed = load.now_s - memory.last_s
    if elapsed < params.sample_s:
        return Proposal(n, memory.reason), memory
    size = round(params.window_s / params.sample_s)
    samples = (*memory.rps, (total - memory.last_total) / elapsed)[-size:]
    rate = replica_rate(load)
    if rate <= 0:
        return _unprofiled(load, "dilu"), DiluMemory(samples, load.now_s, total)
    if sum(s > n * rate for s in samples) >= params.out_samples:
        want, reason = n + 1, "dilu:out"
    elif n >= 2 and sum(s < (n - 1) * rate for s in samples) >= params.in_samples:
        want, reason = n - 1, "dilu:in"
    elif n >= 1 and len(samples) >= params.in_samples and not any(s > 0 for s in samples):
        want, reason = 0, "dilu:idle"
    else:
        return Proposal(n, memory.reason), DiluMemory(samples, load.now_s, total, n, memory.reason)
    return Proposal(want, reason), DiluMemory((), load.now_s, total, want, reason)
