"""Brute force over every contiguous cut set: the reference the solver is tested against.

``2**(n-1)`` cut sets, so small models only (``n <= MAX_LAYERS``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from flashpoint.partition.model import CostModel, LayerProfile, Plan, evaluate

MAX_LAYERS = 14


def exhaustive_best(profiles: Sequence[LayerProfile], cost: CostModel, x: int, P: int, *,
                    p_max: int | None = None, parts: int | None = None) -> Plan:
    """Minimum-``T̄`` plan over all cut sets with at most ``min(p_max, P)`` parts, or with
    exactly ``parts`` parts when given. Ties go to the first found (fewest parts first)."""
    n = len(profiles)
    if not 1 <= n <= MAX_LAYERS:
        raise ValueError(f"exhaustive search is for 1..{MAX_LAYERS} layers (got {n})")
    if parts is not None:
        sizes = [parts] if 1 <= parts <= min(n, P) else []
    else:
        top = min(n, P, n if p_max is None else p_max)
        sizes = list(range(1, top + 1))
    best: Plan | None = None
    for p in sizes:
        for cuts in itertools.combinations(range(1, n), p - 1):
            plan = evaluate(profiles, cost, cuts, x, P)
            if best is None or plan.tbar_s < best.tbar_s:
                best = plan
    if best is None:
        raise ValueError(f"no plan: parts={parts}, p_max={p_max}, P={P}, n={n}")
    return best
