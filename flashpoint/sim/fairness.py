"""The thesis's fairness rule (§8.4): tune a technique until its replica-seconds are within
±5% of the baseline's, by a bounded, deterministic two-knob search.

Why two knobs. The autoscaler's own threshold (ATL's percentile, TSK's latency target, OWK's
utilisation target, SM*'s invocations per replica) is the knob the thesis names, but on
its own it often cannot reach the band: it saturates (ATL cannot go past p100, so a
technique whose cold starts take a second still reserves less than a baseline whose
replicas wait minutes on the registry), and its effect is stepwise and need not be monotone
(an integer replica count, HPA tolerances, a different cold-start pattern changing what
later scale-ups see). The second knob is the wrapper's ``scale_down_delay_s`` (every
plug-in has it, :func:`flashpoint.policy.autoscale.limit`): a longer delay holds replicas
longer, so replica-seconds rise with it; a shorter one (TSK and OWK default to the HPA's
300 s) lowers them.

The search (:func:`search`), at most ``max_runs`` evaluations, repeated values never re-run:

1. the defaults; in the band: done;
2. the primary knob's range end in the needed direction; if even the end stays on the same
   side of the band, the primary is saturated: go to 5 from the end;
3. a scan of ``scan`` points between the default and the end (linear or geometric), so a
   non-monotone response shows up as more than one crossing;
4. bisection of the crossings (adjacent scanned values whose ratios lie on both sides of
   1), the crossing whose ends are nearest 1 first; a crossing narrower than
   ``min_step`` of the value is a *jump* (no value in between gives anything else) and is
   not split further;
5. the hold knob from the closest run below 1 upwards (to its range end, then bisection),
   or from the closest run above 1 downwards, nearest to 1 first, while runs are left.

The run closest to the band is kept. When none is in it, :attr:`Outcome.note` says why,
with the numbers: the knob ends reached and the ratios there, a jump over the band, or the
budget spent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Knob", "Attempt", "Outcome", "search", "HOLD_PARAM"]

R = TypeVar("R")

#: The second knob: the wrapper's scale-down stabilisation delay.
HOLD_PARAM = "scale_down_delay_s"


@dataclass(frozen=True)
class Knob:
    """A parameter and the range the search may move it in.

    ``up`` says which way gives more replicas (+1: a larger value, -1: a smaller one);
    ``geometric`` spaces and bisects on the log scale (targets spanning orders of magnitude).
    """

    param: str
    lo: float
    hi: float
    up: int
    geometric: bool = False

    def __post_init__(self) -> None:
        if not self.lo < self.hi or self.up not in (-1, 1):
            raise ValueError(f"knob {self.param}: need lo < hi and up in (-1, +1)")
        if self.geometric and self.lo <= 0:
            raise ValueError(f"knob {self.param}: a geometric range must be positive")

    def end(self, more: bool) -> float:
        """The range end that gives more (``more``) or fewer replicas."""
        return self.hi if more == (self.up > 0) else self.lo

    def mid(self, a: float, b: float) -> float:
        return math.sqrt(a * b) if self.geometric else (a + b) / 2

    def between(self, a: float, b: float, n: int) -> list[float]:
        """``n`` evenly spaced values strictly between ``a`` and ``b``, from ``a``'s side."""
        if self.geometric:
            return [a * (b / a) ** (i / (n + 1)) for i in range(1, n + 1)]
        return [a + (b - a) * i / (n + 1) for i in range(1, n + 1)]


@dataclass(frozen=True)
class Attempt:
    """One evaluation: the primary knob's value, the hold knob's, and replica-s / BL's."""

    primary: float
    hold: float
    ratio: float


@dataclass(frozen=True)
class Outcome(Generic[R]):
    best: Attempt
    result: R
    tried: tuple[Attempt, ...]
    note: str  # empty when the best run is within the band

    @property
    def within(self) -> bool:
        return self.note == ""


def search(evaluate: Callable[[float, float], tuple[R, float]], primary: Knob, default: float,
           hold: Knob, hold_default: float, *, tol: float = 0.05, max_runs: int = 16,
           scan: int = 3, min_step: float = 1e-3) -> Outcome[R]:
    """The evaluation whose ratio is within ``1 ± tol`` (see the module docstring).

    ``evaluate(primary_value, hold_value)`` runs the technique and returns its result and
    its replica-seconds over the baseline's. Deterministic for a deterministic ``evaluate``.
    """
    if max_runs < 1 or scan < 0:
        raise ValueError("max_runs must be >= 1 and scan >= 0")
    default = min(max(default, primary.lo), primary.hi)
    hold_default = min(max(hold_default, hold.lo), hold.hi)
    tried: list[Attempt] = []
    results: dict[tuple[float, float], R] = {}
    why: list[str] = []

    def ok(a: Attempt) -> bool:
        return abs(a.ratio - 1) <= tol

    def run(p: float, h: float) -> Attempt | None:
        """Evaluate once per distinct (p, h), within the budget; None when it is spent."""
        for a in tried:
            if a.primary == p and a.hold == h:
                return a
        if len(tried) >= max_runs:
            return None
        result, ratio = evaluate(p, h)
        results[(p, h)] = result
        a = Attempt(p, h, ratio)
        tried.append(a)
        return a

    def found() -> bool:
        return any(ok(a) for a in tried)

    def side(a: Attempt) -> int:
        return 0 if ok(a) else (1 if a.ratio > 1 else -1)

    # 1-2: the defaults, then the primary's end in the needed direction.
    first = run(default, hold_default)
    assert first is not None
    if not found():
        end = primary.end(more=first.ratio < 1)
        last = run(end, hold_default)
        if last is not None and side(last) == side(first):
            why.append(f"{primary.param} at its range end {end:g} gives {last.ratio:.3f}×")
        elif last is not None and not found():
            # 3: scan between the default and the end (non-monotone responses show up).
            for p in primary.between(default, end, scan):
                a = run(p, hold_default)
                if a is None or ok(a):
                    break
            # 4: bisect the crossings, keeping runs for the hold knob.
            reserve = min(6, max_runs // 3)
            jumps: set[tuple[float, float]] = set()
            while not found() and len(tried) < max_runs - reserve:
                pts = sorted((a for a in tried if a.hold == hold_default), key=lambda a: a.primary)
                cross = [(x, y) for x, y in zip(pts, pts[1:], strict=False)
                         if side(x) * side(y) < 0 and (x.primary, y.primary) not in jumps]
                if not cross:
                    break
                x, y = min(cross, key=lambda c: min(abs(c[0].ratio - 1), abs(c[1].ratio - 1)))
                if abs(y.primary - x.primary) <= min_step * max(abs(x.primary), abs(y.primary)):
                    jumps.add((x.primary, y.primary))
                    why.append(f"{primary.param} jumps over the band between {x.primary:.4g} "
                               f"→ {x.ratio:.3f}× and {y.primary:.4g} → {y.ratio:.3f}×")
                    continue
                run(primary.mid(x.primary, y.primary), hold_default)
            if not found() and not jumps:
                pts = sorted((a for a in tried if a.hold == hold_default), key=lambda a: a.primary)
                cross = [(x, y) for x, y in zip(pts, pts[1:], strict=False)
                         if side(x) * side(y) < 0]
                if cross:  # runs kept for the hold knob: say where the band was jumped
                    x, y = min(cross, key=lambda c: abs(c[1].primary - c[0].primary))
                    why.append(f"{primary.param} jumps over the band between {x.primary:.4g} "
                               f"→ {x.ratio:.3f}× and {y.primary:.4g} → {y.ratio:.3f}× "
                               "(narrowest bracket tried)")
    # 5: the hold knob, from the closest run on each side of the band.
    if not found():
        below = [a for a in tried if a.ratio < 1 and a.hold < hold.hi]
        above = [a for a in tried if a.ratio > 1 and a.hold > hold.lo]
        starts = [min(g, key=lambda a: abs(a.ratio - 1)) for g in (below, above) if g]
        for start in sorted(starts, key=lambda a: abs(a.ratio - 1)):
            more = start.ratio < 1
            end_h = hold.end(more)
            last = run(start.primary, end_h)
            if last is None:
                break
            if side(last) == side(start):
                why.append(f"{primary.param} {start.primary:.4g} with {hold.param} {end_h:g} "
                           f"gives {last.ratio:.3f}×")
                continue
            lo_h, hi_h = start.hold, end_h  # lo_h: start's side of the band; hi_h: past it
            while not ok(last) and len(tried) < max_runs:
                if abs(hi_h - lo_h) <= min_step * max(abs(lo_h), abs(hi_h), 1.0):
                    why.append(f"{hold.param} jumps over the band at {primary.param} "
                               f"{start.primary:.4g}")
                    break
                m = hold.mid(lo_h, hi_h)
                a = run(start.primary, m)
                if a is None:
                    break
                last = a
                if side(a) == side(start):
                    lo_h = m
                else:
                    hi_h = m
            if found():
                break
    best = min(tried, key=lambda a: abs(a.ratio - 1))
    note = ""
    if not ok(best):
        if len(tried) >= max_runs:
            why.append(f"{max_runs} runs spent")
        note = "; ".join(why) + f" (closest {best.ratio:.3f}×)"
    return Outcome(best, results[(best.primary, best.hold)], tuple(tried), note)
