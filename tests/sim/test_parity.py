"""Parity (STYLE §11): one short trace's event sequence, fed to the live controller logic as
the Controller actor builds it, yields exactly the decisions the simulator acted on.

The simulator records every event it gave its ``ControllerState`` and the commands it got
back. A fresh ``ControllerState``, built the way ``controller/actor.py`` builds one (the
autoscaler from ``make_autoscaler(name, params)``, placement, sourcing and partitioning
inside), replays the events; every command list must be equal. This holds only if the
simulator reaches the policies through ``handle`` alone, with no private shortcut.
"""

from __future__ import annotations

import math

import pytest

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import DeployReplica
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.sim.cluster import SimCluster
from flashpoint.sim.cluster_config import ClusterConfig, Technique
from flashpoint.sim.models import thesis_model
from flashpoint.sim.network import Topology
from flashpoint.sim.traces import requests_from_rates, twitter_like

TOPO = Topology(n_hosts=6, gpus_per_host=2, hosts_per_leaf=3)


def _live_state(name: str, params: dict[str, float], cfg: ClusterConfig) -> ControllerState:
    # The actor's constructor call (controller/actor.py), with the simulator's settings.
    return ControllerState(heartbeat_timeout_s=math.inf, cold_start_timeout_s=math.inf,
                              replica_overhead_bytes=64 << 20, stop_unknown_replicas=True,
                              process_bytes=0, autoscaler=make_autoscaler(name, params),
                              max_chain_length=cfg.max_chain_length)


def _record(autoscaler: str, tech: Technique, params=()) -> tuple[SimCluster, ClusterConfig]:
    cfg = ClusterConfig(topology=TOPO, technique=tech, autoscaler=autoscaler,
                        autoscaler_params=params, decision_s=0.0, drain_s=120.0)
    log = requests_from_rates(twitter_like(4, duration_s=90), seed=2)
    sim = SimCluster(cfg, thesis_model("gpt2"), record=True)
    sim.run(log)
    return sim, cfg


@pytest.mark.parametrize("autoscaler", ["atl", "tsk", "owk", "smstar"])
@pytest.mark.parametrize("tech", [Technique.BL, Technique.LC_MC, Technique.LC_MC_MP])
def test_replaying_the_simulators_events_gives_its_decisions(autoscaler, tech):
    sim, cfg = _record(autoscaler, tech)
    assert sim.records is not None
    scale_ups = sum(isinstance(c, DeployReplica) for r in sim.records for c in r.commands)
    assert scale_ups >= 2, "the trace must make the autoscaler act"
    live = _live_state(autoscaler, dict(cfg.autoscaler_params), cfg)
    for i, rec in enumerate(sim.records):
        got = live.handle(rec.event)  # type: ignore[arg-type]
        assert tuple(got) == rec.commands, f"decision {i} differs on {type(rec.event).__name__}"
    assert live.counts(SimCluster.FUNCTION) == sim.state.counts(SimCluster.FUNCTION)


def test_parity_check_catches_a_different_policy():
    # The check is not vacuous: the same events under another autoscaler decide otherwise.
    sim, cfg = _record("atl", Technique.LC_MC)
    live = _live_state("tsk", {}, cfg)
    assert sim.records is not None
    assert any(tuple(live.handle(r.event)) != r.commands for r in sim.records)  # type: ignore[arg-type]
