"""Data-centre simulator (issue 7): a discrete-event engine and a flow-level network.

Pure and dependency-light: no asyncio, torch, NVML, aiohttp, RPC or actors (STYLE.md, the
import rule; ``tests/sim/test_import_rule.py``). Later layers drive the live state classes
and policies with this engine's simulated clock.
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
    max_min_rates,
)

__all__ = [
    "DEFAULT_MAX_EVENTS", "Engine", "EventHandle", "EventLimitExceeded",
    "CLOUD", "Flow", "FlowId", "FlowNetwork", "LinkId", "LinkKind", "Node", "Topology",
    "max_min_rates",
]
