"""Partitioned pipelines (MP; thesis Ch. 4) in the simulated cluster.

The function gets ``max_stages > 1`` and a plan table solved by
``partition.table.plan_table`` with the worst-case (registry) cost model
(:func:`partition_cost`); ``ControllerState`` picks plans (Eq 4.14) and places stages. A stage
fetches its own byte range (from a holder's RAM under LC, else the registry), loads it
pro rata and reports ``StageReady``; ``LinkGroup`` is acknowledged at once
(``GroupLinked``) and ``ServeGroup`` makes the group one dispatch target whose requests
take I(p) = I(1) + IN(p) (Eq 4.2: the partition cost model's transfers at every cut)
with the credits the state grants. Each stage then fetches the rest of the model and
completes into a whole replica (§4.2.5); the state dissolves the group. (Live hosts
hold that fetch until the group's first answer, ``host/stage_hold.py``, because it
shares their CPU and links with the first pass; the simulator's first pass takes I(p)
regardless, so it starts the fetch at once and never feeds ``GroupAnswered``.) A pipeline's
cold start is counted once, from its deploy to serving. Simplification: a completed
stage serves alone *and* still counts inside its pipeline until the group dissolves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from flashpoint.controller.state import events as ev
from flashpoint.partition.model import CostModel
from flashpoint.policy.sourcing import REGISTRY
from flashpoint.sim.cluster_config import ClusterConfig
from flashpoint.sim.engine import Engine
from flashpoint.sim.metrics import RunMetrics
from flashpoint.sim.models import ModelProfile
from flashpoint.sim.network import CLOUD, Flow, FlowNetwork, Node
from flashpoint.sim.replicas import SimReplica, host_index

__all__ = ["PipelineStages", "partition_cost"]


class PipelineStages:
    """The MP half of :class:`flashpoint.sim.cluster.SimCluster`: stage deploys and pipeline
    groups. A mixin over the cluster's own fields; the cluster feeds the state and runs the
    commands (``_feed``, ``_execute``), schedules (``_after``) and warms replicas (``_warm``).
    """

    config: ClusterConfig
    model: ModelProfile
    engine: Engine
    net: FlowNetwork
    metrics: RunMetrics
    cost: CostModel | None
    _replicas: dict[str, SimReplica]
    _free: deque[str]
    _cache: list[set[str]]

    if TYPE_CHECKING:  # provided by SimCluster
        def _feed(self, event: object) -> list[object]: ...
        def _execute(self, cmds: list[object]) -> None: ...
        def _after(self, delay_s: float, fn: Callable[[], None]) -> None: ...
        def _warm(self, rid: str) -> None: ...

    def _deploy_stage(self, rep: SimReplica, c: ev.DeployReplica) -> None:
        """A stage fetches its own byte range first (execute-while-load), reports
        ``StageReady``, then fetches the rest and completes into a whole replica (§4.2.5)."""
        assert c.stage is not None
        rep.stage = c.stage
        first, last = c.stage
        own = self.model.stage_bytes(first, last)
        sender = self._stage_sender(c, rep.host)
        rep.source = "registry" if sender == CLOUD else f"peer:h{sender}"
        key = self.model.key

        def ready() -> None:
            if rep.rid not in self._replicas:
                return
            for cmd in [x for x in self._feed(ev.StageReady(rep.rid, self.engine.now_s))]:
                self._execute([cmd])
            rest = self.model.size_bytes - own
            if key in self._cache[rep.host] or rest <= 0:
                self._after(self.model.startup_s(rest), lambda: self._warm(rep.rid))
            else:
                rep.flow = self.net.start_flow(sender, rep.host, rest, lambda f: loaded_rest())

        def loaded_rest() -> None:
            rep.flow = None
            rep.pending = self.engine.schedule_in(
                self.model.startup_s(self.model.size_bytes - own), lambda: self._warm(rep.rid))

        def arrived(_: Flow) -> None:
            rep.flow = None
            rep.pending = self.engine.schedule_in(self.model.startup_s(own), ready)

        if key in self._cache[rep.host]:
            rep.pending = self.engine.schedule_in(self.model.startup_s(own), ready)
        else:
            rep.flow = self.net.start_flow(sender, rep.host, own, arrived)

    def _stage_sender(self, c: ev.DeployReplica, h: int) -> Node:
        """The first fallback the plan names that can send: a holder's RAM (LC), else the
        registry (the state lists holders first, the registry last)."""
        src = c.source
        for name in (src.fallback if src is not None else ()):
            if name == REGISTRY:
                return CLOUD
            peer = host_index(name)
            if peer != h and self.config.technique.locality and self.model.key in self._cache[peer]:
                return peer
        return CLOUD

    def _serve_group(self, cmd: ev.ServeGroup, stages: tuple[str, ...]) -> None:
        """The group is one dispatch target; a request crosses every stage and every cut
        (I(p) = I(1) + IN(p), thesis Eq 4.2, from the partition cost model)."""
        now = self.engine.now_s
        reps = [self._replicas[r] for r in stages if r in self._replicas]
        transfers = 0.0
        assert self.cost is not None
        for r in reps[:-1]:
            assert r.stage is not None
            transfers += self.cost.transfer_s(self.model.layers[r.stage[1]].output_bytes)
        deploy_s = min((r.deploy_s for r in reps), default=now)
        group = SimReplica(cmd.group_id, -1, now, warm_s=now, stages=stages,
                         service_s=self.model.service_s + transfers)
        self._replicas[cmd.group_id] = group
        # A pipeline's cold start: requested to serving (its longest stage, §4.1.2).
        self.metrics.cold_starts_s.append(now - deploy_s)
        self.metrics.cold_start_sources.append("pipeline")
        self.metrics.sources["pipeline"] = self.metrics.sources.get("pipeline", 0) + 1
        self.metrics.pipelines += 1
        for _ in range(cmd.credits):
            self._free.append(cmd.group_id)


def partition_cost(model: ModelProfile, config: ClusterConfig) -> CostModel:
    """The cost model the plan table is solved with: worst case, non-local (thesis §4.2.2).

    A part's cold start is its bytes over the registry link, then loaded and copied to the
    GPU at the model's rates: all pro rata to bytes, so one effective rate. Intermediate
    tensors cross a host link."""
    per_byte_s = (8.0 / config.topology.cloud_bps + model.load_s / model.size_bytes
                  + model.to_device_s / model.size_bytes)
    return CostModel(bandwidth_bps=8.0 / per_byte_s, link_bps=config.topology.host_link_bps,
                     overhead_s=0.0, link_latency_s=config.link_latency_s)
