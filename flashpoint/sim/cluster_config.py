"""How a simulated cluster (:class:`flashpoint.sim.cluster.SimCluster`) is built and
driven: its cold-start technique and parameters.

Techniques (thesis §8.4): BL — every replica downloads its own copy from the
registry and nothing stays in host RAM; LC — hosts keep models in RAM and report them, so
the controller sources from own RAM, then peers, then the registry, one download per host,
each receiver on its own unicast flow from its sender; MC — hosts share one download per
host and every chain the sourcing plan builds is a cut-through TCP chain, but nothing
stays in RAM afterwards (only the registry sends); LC+MC — both. GF, the thesis's
"GPU-enabled FaaS" locality baseline (§8.2.2, [117]): hosts keep models in RAM after their
replicas stop (lazy eviction) and report them, so placement prefers their GPUs (stage 1)
and a replica there copies host RAM to GPU; every other replica downloads its own copy
from the registry, as BL does — no peer source (the state runs with ``peer_sends=False``),
no chains, no download shared by the GPUs of one host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from flashpoint.sim.network import Topology

__all__ = ["ClusterConfig", "Technique"]

GIB = 1 << 30


class Technique(StrEnum):
    """Which cold-start techniques the cluster uses (thesis §8.4's abbreviations)."""

    BL = "BL"
    GF = "GF"  # GPU-enabled FaaS [117]: lazy eviction, host RAM -> GPU, holders preferred
    LC = "LC"
    MC = "MC"
    LC_MC = "LC+MC"
    MP = "MP"
    LC_MC_MP = "LC+MC+MP"

    @property
    def locality(self) -> bool:
        """Flashpoint's locality (LC): own RAM, then peers' RAM, then the registry."""
        return self in (Technique.LC, Technique.LC_MC, Technique.LC_MC_MP)

    @property
    def keeps_models(self) -> bool:
        """Hosts keep a model in RAM after its replicas stop and report it (lazy eviction):
        LC's techniques and GF."""
        return self.locality or self is Technique.GF

    @property
    def multicast(self) -> bool:
        return self in (Technique.MC, Technique.LC_MC, Technique.LC_MC_MP)

    @property
    def partition(self) -> bool:
        return self in (Technique.MP, Technique.LC_MC_MP)

    @property
    def host_sharing(self) -> bool:
        """One download per host shared by its GPUs (§2.4); BL and GF download per replica."""
        return self not in (Technique.BL, Technique.GF)


@dataclass(frozen=True)
class ClusterConfig:
    """One simulated cluster and how it is driven. Defaults are the thesis's (seed 004 §6,
    §8 testbed T3: A10 24 GB GPUs, 200 GiB host RAM)."""

    topology: Topology = field(default_factory=Topology)
    technique: Technique = Technique.LC_MC
    autoscaler: str = "atl"
    autoscaler_params: tuple[tuple[str, float], ...] = ()
    tick_s: float = 1.0  # the controller's loop interval
    # Wake the loop at once when a request finds a function with no replica at all (the
    # live controller's scale-from-zero path), at most this often.
    wake_min_s: float = 0.05
    # None = measure ControllerState.handle with perf_counter and charge it; a number =
    # charge exactly that (deterministic runs, tests).
    decision_s: float | None = None
    gpu_memory_bytes: int = 24 * GIB
    host_ram_bytes: int = 200 * GIB
    keep_alive_s: float = 30.0
    replica_concurrency: int = 1  # the thesis's prototype runs one request per GPU
    hop_delay_s: float = 0.001  # per-hop forwarding delay of a chain (RTT + one chunk)
    max_chain_length: int = 8
    drain_s: float = 600.0  # after the last arrival, run at most this long to finish work
    # Replicas warm at t = 0 (a cluster in steady state rather than cold; the thesis does
    # not say how its runs begin). Placed by the live placement, their hosts hold the model.
    prewarm: int = 0
    # MP: most stages per pipeline (the thesis sweeps 1..64; 0 = the model's layer count),
    # and the intermediate-tensor link (GPU to GPU across hosts).
    max_stages: int = 64
    link_latency_s: float = 0.0005

    def __post_init__(self) -> None:
        if self.tick_s <= 0 or self.wake_min_s < 0 or self.drain_s < 0:
            raise ValueError("tick_s must be > 0, wake_min_s and drain_s >= 0")
        if self.decision_s is not None and self.decision_s < 0:
            raise ValueError("decision_s must be >= 0")
