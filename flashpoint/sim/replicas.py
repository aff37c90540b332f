"""What the simulated cluster tracks per replica and per host fill, and how its hosts are
named to the controller state (``h0``, ``h1``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpoint.policy.sourcing import REGISTRY
from flashpoint.sim.engine import EventHandle
from flashpoint.sim.network import Flow

__all__ = ["HostFill", "SimReplica", "host_id", "host_index"]


@dataclass
class SimReplica:
    """A replica of the simulated function, a partition stage, or a pipeline group serving as
    one dispatch target (``stages`` set, ``host`` -1)."""

    rid: str
    host: int
    deploy_s: float
    warm_s: float | None = None
    stopping: bool = False
    busy: int = 0
    stopped_s: float | None = None
    pending: EventHandle | None = None  # its to-device step, while starting
    flow: Flow | None = None  # its private download (BL), while it runs
    stage: tuple[int, int] | None = None  # a partition stage's layers
    completed: bool = False  # a stage that completed into a whole replica
    service_s: float = 0.0  # per request; a pipeline group's is longer (transfers)
    stages: tuple[str, ...] = ()  # a group target's stage replicas
    source: str = ""  # where its bytes came from (local, chain:<sender>, registry)


@dataclass
class HostFill:
    """A host's copy of a model on its way: transfer, then load; waiters copy to GPU after."""

    waiters: list[str] = field(default_factory=list)
    source: str = ""


def host_id(h: int) -> str:
    """The host id the controller state knows host ``h`` by."""
    return f"h{h}"


def host_index(hid: str) -> int:
    """Host ``h`` of a host id (``"h3"`` -> 3); the registry is no host."""
    if hid == REGISTRY:
        raise ValueError("the registry is not a host")
    return int(hid[1:])
