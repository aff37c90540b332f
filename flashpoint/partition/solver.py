"""Exact partition solver: the cuts minimising ``T̄(p, x, P)`` (seed 004, Eqs 4.3-4.8).

For a plan with ``p`` parts, ``T̄ = (C + I(1) + IN) + α·B`` with ``α = Σ_{y≤x}(ceil(y/g)-1)/x``
and ``g = floor(P/p)`` (see :mod:`flashpoint.partition.model`). ``T̄`` mixes two max terms
(``C`` and ``B = max(E, N)``) with a sum (``IN``), so a DP that keeps one best sub-plan per
state — the thesis's Eq 4.10, :func:`flashpoint.partition.thesis.thesis_dp` — is only a
heuristic: a sub-plan that loses on ``T̄`` now can win once a later part raises the shared
max. This solver is exact.

**Algorithm: a Pareto-front DP over prefixes.** State ``(k, j)``: layers ``0..j-1`` cut into
``k`` parts. A label is ``(c, b, s)``: the prefix's longest part cold start, its longest
stage (part execution or transfer) and its transfer sum. Appending part ``[i, j)`` maps a
label of ``(k-1, i)`` to ``(max(c, cold[i,j]), max(b, exec[i,j], t_i), s + t_i)``.

**Why it is exact.** ``T̄`` is nondecreasing in each of ``C``, ``B`` and ``IN`` (``α >= 0``),
and the extension map is nondecreasing in each coordinate, so a label that is ``<=`` another
in all three coordinates at the same state is at least as good under every completion and
for every ``x`` and ``P``; dropping only such dominated labels keeps an optimal plan in the
final front, for every ``(x, P)`` at once. For "at most ``p`` parts" queries (``best_plan``,
plan tables) a label with *fewer* parts that is ``<=`` in all three coordinates dominates
too, because ``α`` never decreases with ``p`` (fewer parts, more pipelines ``floor(P/p)``);
those queries prune with it ("nested" fronts), :func:`best_plan_with_parts` does not.

Float arithmetic follows :func:`flashpoint.partition.model.combine` step for step, so the
solver's optimum equals :func:`~flashpoint.partition.model.evaluate` of its cuts exactly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from flashpoint.partition.model import (
    CostModel,
    LayerProfile,
    Plan,
    combine,
    evaluate,
    exec_sum_s,
    queue_factor,
)

# A label: (c, b, s, i, q) — cold max, stage max, transfer sum, start layer of the last part,
# index of the parent label in front (k-1, i). Tuples sort by (c, b, s) first.
_Label = tuple[float, float, float, int, int]


@dataclass(frozen=True)
class FrontPlan:
    """One non-dominated final plan: ``T̄ = (cold_s + (I(1) + transfer_sum_s)) + α·bottleneck_s``."""

    p: int
    cuts: tuple[int, ...]
    cold_s: float
    bottleneck_s: float
    transfer_sum_s: float


@dataclass(frozen=True)
class Fronts:
    """Per part count ``p`` (1-based index ``p``), the final non-dominated plans.

    ``nested``: fronts were pruned across part counts, so ``by_parts[p]`` is only complete
    for "at most ``p`` parts" questions (see the module docstring).
    """

    by_parts: tuple[tuple[FrontPlan, ...], ...]
    exec_sum_s: float
    nested: bool

    @property
    def k_max(self) -> int:
        return len(self.by_parts) - 1


def _tables(profiles: Sequence[LayerProfile], cost: CostModel):
    """Per-part cold start and execution for every ``[i, j)``, transfers per boundary.

    Sums run left to right from 0 exactly as :func:`model.part_costs` does.
    """
    n = len(profiles)
    cold = [[0.0] * (n + 1) for _ in range(n + 1)]
    ex = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        size = 0
        e = 0.0
        for j in range(i + 1, n + 1):
            size += profiles[j - 1].bytes
            e += profiles[j - 1].exec_s
            cold[i][j] = cost.cold_s(size)
            ex[i][j] = e
    # t[i]: the transfer at the boundary before layer i (a cut there moves layer i-1's output)
    t = [0.0] + [cost.transfer_s(profiles[i - 1].output_bytes) for i in range(1, n)]
    return n, cold, ex, t


def solve_fronts(profiles: Sequence[LayerProfile], cost: CostModel, k_max: int, *,
                 nested: bool = True) -> Fronts:
    """Non-dominated final plans for every part count ``1..min(k_max, n)``.

    ``nested=False`` computes only ``p = k_max`` completely (exactly-``p`` questions): its
    other entries are empty.
    """
    if not profiles:
        raise ValueError("a model needs at least one layer")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1 (k_max={k_max})")
    n, cold, ex, t = _tables(profiles, cost)
    k_max = min(k_max, n)

    def needed(k: int, j: int) -> bool:
        if j == n:
            return nested or k == k_max
        return k < k_max and (nested or n - j >= k_max - k)

    fronts: list[list[list[_Label]]] = [[[] for _ in range(n + 1)] for _ in range(k_max + 1)]
    # per front: (max c, max b, min s, index of the min-s label) for the collapse shortcut
    summ: list[list[tuple[float, float, float, int] | None]] = [
        [None] * (n + 1) for _ in range(k_max + 1)]
    for j in range(1, n + 1):
        if needed(1, j):
            lab = (cold[0][j], ex[0][j], 0.0, 0, 0)
            fronts[1][j] = [lab]
            summ[1][j] = (lab[0], lab[1], 0.0, 0)
    for k in range(2, k_max + 1):
        prev = fronts[k - 1]
        psum = summ[k - 1]
        for j in range(k, n + 1):
            if not needed(k, j):
                continue
            cand: list[_Label] = []
            for i in range(k - 1, j):
                fr = prev[i]
                if not fr:
                    continue
                c2 = cold[i][j]
                e2 = ex[i][j]
                ti = t[i]
                b2 = e2 if e2 > ti else ti
                mc, mb, ms, qs = psum[i]  # type: ignore[misc]
                if mc <= c2 and mb <= b2:
                    # every parent collapses to (c2, b2, s + ti): only the min-s one survives
                    cand.append((c2, b2, ms + ti, i, qs))
                else:
                    cand += [(c if c > c2 else c2, b if b > b2 else b2, s + ti, i, q)
                             for q, (c, b, s, _, _) in enumerate(fr)]
            if nested and prev[j]:
                # fewer parts, same prefix: dominators only (i = -1 sorts before equal labels)
                cand += [(c, b, s, -1, 0) for (c, b, s, _, _) in prev[j]]
            out = _pareto(cand)
            fronts[k][j] = out
            if out:
                qmin = min(range(len(out)), key=lambda q: out[q][2])
                summ[k][j] = (out[-1][0], max(lab[1] for lab in out), out[qmin][2], qmin)

    by_parts: list[tuple[FrontPlan, ...]] = [()]
    for p in range(1, k_max + 1):
        plans = []
        for lab in fronts[p][n]:
            plans.append(FrontPlan(p, _cuts(fronts, p, lab), lab[0], lab[1], lab[2]))
        by_parts.append(tuple(plans))
    return Fronts(tuple(by_parts), exec_sum_s(profiles), nested)


def _pareto(cand: list[_Label]) -> list[_Label]:
    """Labels not weakly dominated in (c, b, s), sorted by c; i = -1 entries only dominate.

    Sweep in (c, b, s) order over a staircase of kept (b, s) points (b ascending, s
    descending): a label is dominated iff the kept point with the largest b' <= b has
    s' <= s.
    """
    cand.sort()
    out: list[_Label] = []
    sb: list[float] = []
    ss: list[float] = []
    for lab in cand:
        b = lab[1]
        s = lab[2]
        pos = bisect.bisect_right(sb, b)
        if pos and ss[pos - 1] <= s:
            continue
        if lab[3] >= 0:
            out.append(lab)
        if pos and sb[pos - 1] == b:
            pos -= 1  # same b, larger s: replaced
        end = pos
        while end < len(sb) and ss[end] >= s:
            end += 1
        sb[pos:end] = [b]
        ss[pos:end] = [s]
    return out


def _cuts(fronts: list[list[list[_Label]]], k: int, lab: _Label) -> tuple[int, ...]:
    cuts = []
    while k > 1:
        i, q = lab[3], lab[4]
        cuts.append(i)
        k -= 1
        lab = fronts[k][i][q]
    return tuple(reversed(cuts))


def _check(x: int, P: int) -> None:
    if x < 1:
        raise ValueError(f"T̄ needs x >= 1 requests (x={x})")
    if P < 1:
        raise ValueError(f"P must be >= 1 GPU (P={P})")


def best_plan(profiles: Sequence[LayerProfile], cost: CostModel, p_max: int, x: int,
              P: int) -> Plan:
    """The plan with at most ``min(p_max, P, n)`` parts minimising ``T̄(p, x, P)``; exact.

    Part counts above ``P`` are skipped (a ``p``-part pipeline needs ``p`` GPUs), those above
    the layer count cannot exist. Ties go to the fewest parts.
    """
    _check(x, P)
    if p_max < 1:
        raise ValueError(f"p_max must be >= 1 (p_max={p_max})")
    fr = solve_fronts(profiles, cost, min(p_max, P), nested=True)
    best = None
    for p in range(1, fr.k_max + 1):
        alpha = queue_factor(x, p, P)
        for fp in fr.by_parts[p]:
            v = combine(fp.cold_s, fr.exec_sum_s, fp.transfer_sum_s, fp.bottleneck_s, alpha)
            if best is None or v < best[0]:
                best = (v, fp.cuts)
    assert best is not None
    return evaluate(profiles, cost, best[1], x, P)


def best_plan_with_parts(p: int, profiles: Sequence[LayerProfile], cost: CostModel, x: int,
                         P: int) -> Plan:
    """The plan with exactly ``p`` parts minimising ``T̄(p, x, P)``; exact.

    Raises ``ValueError`` when ``p`` exceeds the layer count or ``P`` (no such plan).
    """
    _check(x, P)
    n = len(profiles)
    if not 1 <= p <= n:
        raise ValueError(f"{p} parts need 1 <= p <= {n} layers")
    alpha = queue_factor(x, p, P)  # raises for p > P
    fr = solve_fronts(profiles, cost, p, nested=False)
    best = None
    for fp in fr.by_parts[p]:
        v = combine(fp.cold_s, fr.exec_sum_s, fp.transfer_sum_s, fp.bottleneck_s, alpha)
        if best is None or v < best[0]:
            best = (v, fp.cuts)
    assert best is not None
    return evaluate(profiles, cost, best[1], x, P)
