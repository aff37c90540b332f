"""HEURISTIC, for comparison only: the thesis's DP for the cuts (seed 004, §4.2.3, Eq 4.10).

``M[i, j, c]`` is the best ``T̄`` for layers ``i..j`` with up to ``c`` cuts, built from the
best left part ``(i, k, c_l)`` and the best right part ``(k+1, j, c-1-c_l)`` and companion
tables ``DC, DE, DN, DIN`` (max cold start, max execution, max transfer, transfer sum).
Each state keeps **one** sub-plan, the one with the lowest ``T̄`` of its own — but ``T̄``
mixes maxima with a sum, so a sub-plan that loses locally can win once the other side
raises a shared maximum; the DP is therefore not exact (``tests/partition/test_partition.py``
pins a counterexample). Use :func:`flashpoint.partition.solver.best_plan`.

Choices where the thesis is silent or inconsistent, made to match Eq 4.10's intent:

* the cut position runs over ``k = i..j-1`` (Eq 4.10 prints ``i..j``; a cut after ``j``
  is no cut), and the "no cut" branch is ``M[i, j, c-1]`` (printed as ``T(D, x, P, i, j,
  c-1)``);
* a sub-plan's ``T̄`` uses its own part count for ``floor(P/p)`` and the whole model's
  ``I(1)``; sub-plans with more parts than ``P`` GPUs cost infinity;
* the base case (not specified) is the range as one part, with no transfers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from flashpoint.partition.model import (
    CostModel,
    LayerProfile,
    Plan,
    combine,
    evaluate,
    exec_sum_s,
    queue_factor,
)


def thesis_dp(profiles: Sequence[LayerProfile], cost: CostModel, x: int, P: int,
              p_max: int | None = None) -> Plan:
    """The plan Eq 4.10's DP picks with at most ``min(p_max, P, n)`` parts (not optimal)."""
    n = len(profiles)
    if n < 1 or x < 1 or P < 1:
        raise ValueError("need >= 1 layer, x >= 1 and P >= 1")
    i1 = exec_sum_s(profiles)
    out_s = [cost.transfer_s(layer.output_bytes) for layer in profiles]

    def tbar(c: float, e: float, nmax: float, tin: float, p: int) -> float:
        if p > P:
            return math.inf
        return combine(c, i1, tin, max(e, nmax), queue_factor(x, p, P))

    # a sub-plan: (tbar, DC, DE, DN, DIN, p, cuts)
    @functools.cache
    def best(i: int, j: int, c: int) -> tuple:
        if c == 0:
            size = sum(layer.bytes for layer in profiles[i:j + 1])
            e = sum(layer.exec_s for layer in profiles[i:j + 1])
            dc = cost.cold_s(size)
            return (tbar(dc, e, 0.0, 0.0, 1), dc, e, 0.0, 0.0, 1, ())
        res = best(i, j, c - 1)
        for k in range(i, j):
            d = out_s[k]
            for cl in range(c):
                left, right = best(i, k, cl), best(k + 1, j, c - 1 - cl)
                dc = max(left[1], right[1])
                de = max(left[2], right[2])
                dn = max(left[3], right[3], d)
                din = left[4] + right[4] + d
                p = left[5] + right[5]
                v = tbar(dc, de, dn, din, p)
                if v < res[0]:
                    res = (v, dc, de, dn, din, p, left[6] + (k + 1,) + right[6])
        return res

    top = min(n, P, n if p_max is None else p_max)
    return evaluate(profiles, cost, best(0, n - 1, top - 1)[6], x, P)
