"""Data-centre simulator (issue 7).

* ``engine`` — discrete-event heap; ``network`` — max-min fair flows on a spine-leaf
  topology (chains as one flow over every hop);
* ``traces`` — rate traces, request logs, the Azure LLM CSV, synthetic Twitter/Azure traces;
* ``models`` — the thesis's six model profiles and a loader for profiled manifests;
* ``cluster`` — hosts, GPUs, caches and a request queue around the live
  ``ControllerState`` (autoscalers, placement, sourcing, partitioning);
* ``experiments`` — the thesis's grid; ``report`` — its markdown report beside the thesis's
  numbers; ``reproduce`` — the ``flashpoint sim reproduce`` command; ``plots`` — its PNG
  figures (matplotlib optional, the ``sim`` extra).

Pure and dependency-light: no asyncio, torch, NVML, aiohttp or RPC; from the
controller only its pure ``controller.state`` package (STYLE.md, the import rule;
``tests/core/test_import_rule.py``). ``cluster`` and ``experiments`` are not imported here,
so the engine and network stay importable on their own.
"""

from flashpoint.sim.engine import DEFAULT_MAX_EVENTS, Engine, EventHandle, EventLimitExceeded
from flashpoint.sim.network import (
    CLOUD,
    Flow,
    FlowId,
    FlowNetwork,
    LinkId,
    LinkKind,
    Node,
    Topology,
    chain_path,
    max_min_rates,
)

__all__ = [
    "DEFAULT_MAX_EVENTS", "Engine", "EventHandle", "EventLimitExceeded",
    "CLOUD", "Flow", "FlowId", "FlowNetwork", "LinkId", "LinkKind", "Node", "Topology",
    "chain_path", "max_min_rates",
]
