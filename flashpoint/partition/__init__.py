"""Model partitioning: the thesis's analytical model and an exact, fast cut solver (seed 004, Ch. 4).

Pure code (see ``tests/core/test_import_rule.py``): no asyncio, aiohttp, torch, RPC, actors
or NVML.

* :mod:`.model` — profiles, cost model, ``T(p, x, P)`` and ``T̄(p, x, P)`` (Eqs 4.2-4.8).
* :mod:`.solver` — :func:`best_plan`, :func:`best_plan_with_parts`: exact Pareto-front DP.
* :mod:`.table` — :func:`plan_table`: best plan for every load and scale-up size.
* :mod:`.cache` — :class:`PlanCache`: LRU of plan tables per model version.
* :mod:`.exhaustive` — brute force (tests); :mod:`.thesis` — the thesis's heuristic DP.
"""

from flashpoint.partition.cache import PlanCache, PlanKey
from flashpoint.partition.model import (
    CostModel,
    LayerProfile,
    PartCost,
    Plan,
    PlanTerms,
    evaluate,
    latency_s,
    queue_rounds_sum,
    tbar_s,
)
from flashpoint.partition.solver import best_plan, best_plan_with_parts
from flashpoint.partition.table import PlanSegment, PlanTable, plan_table

__all__ = [
    "CostModel", "LayerProfile", "PartCost", "Plan", "PlanCache", "PlanKey", "PlanSegment",
    "PlanTable", "PlanTerms", "best_plan", "best_plan_with_parts", "evaluate", "latency_s",
    "plan_table", "queue_rounds_sum", "tbar_s",
]
