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
longer, so replica-seconds mostly rise with it; a shorter one (TSK and OWK default to the
HPA's 300 s) lowers them.

The search (:func:`search`), at most ``max_runs`` evaluations, repeated values never re-run:

1. the defaults; in the band: done;
2. the primary knob's range end in the needed direction;
3. a scan of ``scan`` points between the default and that end (linear or geometric), so a
   non-monotone response shows up as more than one crossing;
4. bisection of the crossings (neighbouring values whose ratios lie on both sides of the
   band), the crossing whose ends are nearest 1 first; a crossing narrower than
   ``min_step`` of the value is a *jump* (no value in between gives anything else) and is
   not split further. Steps 2-4 keep about half the runs for step 5;
5. the hold knob at the primary value of the run closest to the band: both of its range
   ends (the one in the needed direction first), a scan over its whole range (its response
   is not monotone either: full-scale T5 under TSK with a 10 ms target gave 0.454× BL at
   the HPA's 300 s and 0.131× at 4,200 s), then bisection of the crossings as in 4.

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

    def line(knob: Knob, fixed: float, on_primary: bool, start: float,
             ends: tuple[float, ...], stop_at: int) -> None:
        """Search one knob with the other fixed: its ``ends``, a scan from ``start`` to the
        first end (or over the whole range when both ends are given), then bisection of
        every crossing of the band, nearest-to-1 first, until found or ``stop_at`` runs."""
        def at(v: float) -> Attempt | None:
            return run(v, fixed) if on_primary else run(fixed, v)

        def key(a: Attempt) -> float:
            return a.primary if on_primary else a.hold

        def on_line(a: Attempt) -> bool:
            return (a.hold == fixed) if on_primary else (a.primary == fixed)

        label = (knob.param if on_primary else
                 f"{knob.param} (at {primary.param} {fixed:.4g})")
        scan_from, scan_to = (start, ends[0]) if len(ends) == 1 else (knob.lo, knob.hi)
        for v in (*ends, *knob.between(scan_from, scan_to, scan)):
            if found() or len(tried) >= stop_at:
                return
            at(v)
        jumped = False
        while not found() and len(tried) < stop_at:
            pts = sorted(filter(on_line, tried), key=key)
            cross = [(x, y) for x, y in zip(pts, pts[1:], strict=False)
                     if side(x) * side(y) < 0 and (key(x), key(y)) not in jumps]
            if not cross:
                break
            x, y = min(cross, key=lambda c: min(abs(c[0].ratio - 1), abs(c[1].ratio - 1)))
            if abs(key(y) - key(x)) <= min_step * max(abs(key(x)), abs(key(y)), 1e-9):
                jumps.add((key(x), key(y)))
                jumped = True
                why.append(f"{label} jumps over the band between {key(x):.4g} → "
                           f"{x.ratio:.3f}× and {key(y):.4g} → {y.ratio:.3f}×")
                continue
            at(knob.mid(key(x), key(y)))
        if found():
            return
        pts = sorted(filter(on_line, tried), key=key)
        cross = [(x, y) for x, y in zip(pts, pts[1:], strict=False) if side(x) * side(y) < 0]
        if cross and not jumped:  # runs ran out (or were kept): the narrowest bracket tried
            x, y = min(cross, key=lambda c: abs(key(c[1]) - key(c[0])))
            why.append(f"{label} jumps over the band between {key(x):.4g} → {x.ratio:.3f}× "
                       f"and {key(y):.4g} → {y.ratio:.3f}× (narrowest bracket tried)")
        elif not cross:
            lo_v, hi_v = key(pts[0]), key(pts[-1])
            ratios = [a.ratio for a in pts]
            where = "below" if max(ratios) < 1 else "above"
            why.append(f"{label} over {lo_v:.4g}..{hi_v:.4g} gives {min(ratios):.3f}–"
                       f"{max(ratios):.3f}×, all {where} the band")

    jumps: set[tuple[float, float]] = set()
    # 1-4: the defaults, the primary's end in the needed direction, a scan between them,
    # bisection of the crossings; runs are kept for the hold knob.
    first = run(default, hold_default)
    assert first is not None
    if not found():
        reserve = min(2 * scan + 4, max_runs // 2)
        line(primary, hold_default, True, default, (primary.end(more=first.ratio < 1),),
             max_runs - reserve)
    # 5: the hold knob over its whole range (its response need not be monotone either),
    # from the run closest to the band.
    if not found() and len(tried) < max_runs:
        start = min(tried, key=lambda a: abs(a.ratio - 1))
        more = start.ratio < 1
        ends = tuple(dict.fromkeys(v for v in (hold.end(more), hold.end(not more))
                                   if v != start.hold))
        line(hold, start.primary, False, start.hold, ends, max_runs)
    best = min(tried, key=lambda a: abs(a.ratio - 1))
    note = ""
    if not ok(best):
        if len(tried) >= max_runs:
            why.append(f"{max_runs} runs spent")
        note = "; ".join(why) + f" (closest {best.ratio:.3f}×)"
    return Outcome(best, results[(best.primary, best.hold)], tuple(tried), note)
