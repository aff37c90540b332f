"""Dilu's multi-factor profiling (seed 002 §3.2): the ``<request, limit>`` SM rate (SMR).

Digest 002-ie.md §2. Both searches run over a *measurement callback*, so they are pure and
a test can drive them with a synthetic or recorded throughput surface; the caller's
callback runs the real trial (≈30 s each in the paper, under an MPS SM cap).

- **Inference: HGSS**, the Hybrid Growth Search Strategy (§3.2 "Inference Profiling").
  Throughput efficacy TE = throughput / SMR (the paper's TE = IBS / (t_exec · SMR)). The
  inference batch size (IBS) grows by doubling and SMR linearly by 10 points, climbing the
  convex ⟨IBS, SMR, TE⟩ surface; every accepted point meets the latency budget
  t_exec = SLO / 2 (footnote 2, after INFless: the other half is communication, batching
  wait and preprocessing). The best point is ``request`` (with its IBS);
  ``limit = 2 × request`` (the paper's rule of thumb for bursts), capped at one GPU.
  The paper gives only this outline; the control flow and its two stopping rules are the
  reference scripts' (digest §2.3): stop when one extra +10 SMR step at the doubled IBS
  still misses the budget, or when TE falls more than ``te_drop`` (absolute, TE in
  throughput per SMR *percent*) below the last accepted point.
- **Training: binary search** over SMR (§3.2 "Training Profiling"): ``request`` = the SMR
  reaching p = 80% of exclusive throughput, ``limit`` = the SMR reaching p = 100% (within
  the paper's 2% tolerance: the reference stops at ≥ 0.98 T1), on a 5% grid as the
  reference rounds; the smallest such SMR, not the first one found (see
  :func:`smr_for_fraction`).

Every loop is bounded: SMR ≤ 100, IBS ≤ ``max_ibs``, the binary search by log₂(100/5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flashpoint.errors import BadRequest


@dataclass(frozen=True)
class Trial:
    """What one profiling run measured at (IBS, SMR%): batch latency and throughput."""

    latency_s: float
    throughput_rps: float


# (ibs, smr_pct) -> Trial; smr_pct is an integer percentage of the GPU's SMs
InferenceMeasure = Callable[[int, int], Trial]
# smr_pct -> training throughput (samples/s, tokens/s: any unit, only ratios matter)
TrainingMeasure = Callable[[int], float]


@dataclass(frozen=True)
class HgssResult:
    """``request``/``limit`` as fractions of one GPU; ``trials`` = distinct measurements."""

    sm_request: float
    sm_limit: float
    ibs: int
    throughput_rps: float
    te: float
    trials: int


@dataclass(frozen=True)
class HgssParams:
    smr_start_pct: int = 10
    smr_step_pct: int = 10  # "SMR increases linearly by a fixed rate (i.e., 10 units)"
    max_ibs: int = 128
    te_drop: float = 0.2  # absolute, in throughput per SMR percent (the reference's unit)
    limit_factor: float = 2.0  # "limit quota at twice of request"

    def __post_init__(self) -> None:
        if not (0 < self.smr_start_pct <= 100 and 0 < self.smr_step_pct <= 100):
            raise BadRequest("hgss: SMR start and step must be in 1..100 percent")
        if self.max_ibs < 1 or self.te_drop < 0 or self.limit_factor < 1:
            raise BadRequest("hgss: need max_ibs >= 1, te_drop >= 0, limit_factor >= 1")


class _Memo:
    """Each (IBS, SMR) point is measured once: a trial costs tens of seconds."""

    def __init__(self, measure: InferenceMeasure) -> None:
        self.measure = measure
        self.seen: dict[tuple[int, int], Trial] = {}

    def __call__(self, ibs: int, smr: int) -> Trial:
        if (ibs, smr) not in self.seen:
            self.seen[(ibs, smr)] = self.measure(ibs, smr)
        return self.seen[(ibs, smr)]


def hgss(measure: InferenceMeasure, slo_s: float,
         params: HgssParams = HgssParams()) -> HgssResult | None:
    """HGSS over ``measure``; None if even 100% SMR at IBS 1 misses t_exec = SLO / 2."""
    if not (math.isfinite(slo_s) and slo_s > 0):
        raise BadRequest("hgss: slo_s must be > 0")
    budget_s = slo_s / 2
    trial = _Memo(measure)

    def te(ibs: int, smr: int) -> float:
        return trial(ibs, smr).throughput_rps / smr

    # Phase 1: the first SMR meeting the budget at IBS 1
    ibs, smr = 1, params.smr_start_pct
    while trial(ibs, smr).latency_s > budget_s:
        smr += params.smr_step_pct
        if smr > 100:
            return None
    best = last = (ibs, smr)
    ibs *= 2
    # Phase 2: hybrid growth; each pass doubles IBS, so at most log2(max_ibs) passes
    while ibs <= params.max_ibs:
        if trial(ibs, smr).latency_s <= budget_s:
            best = last = (ibs, smr)
        else:
            nxt = smr + params.smr_step_pct
            if nxt > 100 or trial(ibs, nxt).latency_s > budget_s:
                break  # one more SMR step at the doubled IBS still misses: stop
            if te(ibs, nxt) < te(*last) - params.te_drop:
                break  # efficacy fell: past the top of the convex surface
            smr = nxt
            best = last = (ibs, smr)
        ibs *= 2
    b_ibs, b_smr = best
    request = b_smr / 100
    return HgssResult(request, min(1.0, params.limit_factor * request), b_ibs,
                      trial(b_ibs, b_smr).throughput_rps, te(b_ibs, b_smr), len(trial.seen))


@dataclass(frozen=True)
class TrainingProfile:
    sm_request: float
    sm_limit: float
    trials: int


def smr_for_fraction(measure: TrainingMeasure, fraction: float, exclusive: float,
                     tolerance: float = 0.02, quantum_pct: int = 5) -> tuple[int, int]:
    """The smallest SMR% on the ``quantum_pct`` grid found to reach ``fraction`` of the
    exclusive throughput (within ``tolerance`` of it), by binary search; and the trials.

    Assumes throughput grows with SMR (the search's premise). At most ⌈log₂(100/q)⌉ + 1
    trials; 0% is never run (it gives zero throughput).

    The paper stops as soon as T is within p·T1 ± 2%. For the limit (p = 1) every SMR past
    the knee qualifies, so the first mid above it would become the limit (75% for a model
    saturating at 60%), which is the over-provisioning the limit exists to avoid. We keep
    halving to the smallest grid SMR reaching (p − tolerance)·T1: at most ~5 more trials.
    """
    if not (0 < fraction <= 1 and 0 <= tolerance < fraction and 0 < quantum_pct <= 50):
        raise BadRequest("binary search: need 0 < fraction <= 1, 0 <= tolerance < fraction, "
                         "0 < quantum_pct <= 50")
    target = (fraction - tolerance) * exclusive
    low, high, trials = 0, 100, 0
    for _ in range(8):  # 100/5 = 20 cells: 5 halvings; 8 bounds any quantum >= 1 below
        mid = (low + high) // 2 // quantum_pct * quantum_pct
        if mid <= low or high - low <= quantum_pct:
            break
        got = measure(mid)
        trials += 1
        if got >= target:
            high = mid  # no early stop inside the ±2% band: see the docstring
        else:
            low = mid
    return high, trials


def binary_search_profile(measure: TrainingMeasure, request_fraction: float = 0.8,
                          tolerance: float = 0.02, quantum_pct: int = 5) -> TrainingProfile:
    """``<request, limit>`` for a training function: p = 0.8 and p = 1.0 of exclusive."""
    exclusive = measure(100)
    if not (math.isfinite(exclusive) and exclusive > 0):
        raise BadRequest("binary search: exclusive throughput must be > 0")
    req, t1 = smr_for_fraction(measure, request_fraction, exclusive, tolerance, quantum_pct)
    lim, t2 = smr_for_fraction(measure, 1.0, exclusive, tolerance, quantum_pct)
    return TrainingProfile(req / 100, max(req, lim) / 100, 1 + t1 + t2)
