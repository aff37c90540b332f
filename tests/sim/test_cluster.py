"""The simulated cluster: cold starts from the model profile over the flow network, the
techniques' sourcing (BL, LC, MC), chains at their bottleneck rate, and the live
ControllerState making every decision."""

from __future__ import annotations

import pytest

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import DeployReplica, DissolveStages, ServeGroup
from flashpoint.sim.cluster import SimCluster
from flashpoint.sim.cluster_config import ClusterConfig, Technique
from flashpoint.sim.engine import Engine
from flashpoint.sim.models import thesis_model
from flashpoint.sim.network import CLOUD, FlowNetwork, LinkId, LinkKind, Topology, chain_path
from flashpoint.sim.traces import RequestLog, requests_from_rates, twitter_like

SMALL = Topology(n_hosts=8, gpus_per_host=1, hosts_per_leaf=4, cloud_bps=2e9)
MODEL = thesis_model("bart")  # 1,626 MB: 6.5 s from the registry at 2 Gbit/s


def _burst(n: int, at_s: float = 0.0) -> RequestLog:
    return RequestLog("burst", (at_s,) * n)  # simultaneous: one scale-up sees them all


def _cfg(tech: Technique, **kw) -> ClusterConfig:
    base = dict(topology=SMALL, technique=tech, autoscaler="concurrency", decision_s=0.0,
                drain_s=300.0)
    base.update(kw)
    return ClusterConfig(**base)


def test_chain_flow_moves_at_its_bottleneck_hop_and_loads_every_hop():
    topo = Topology(n_hosts=4, gpus_per_host=1, hosts_per_leaf=2, host_link_bps=10e9,
                    leaf_spine_bps=100e9, cloud_bps=2e9)
    eng = Engine()
    net = FlowNetwork(eng, topo)
    done = []
    path = chain_path(topo, (CLOUD, 0, 1, 2))
    flow = net.start_flow(CLOUD, 2, 1e9, lambda f: done.append(eng.now_s), path=path)
    assert flow.rate_bps == pytest.approx(2e9)  # the cloud link is the bottleneck
    loads = net.link_loads_bps()
    assert loads[LinkId(LinkKind.HOST_UP, 0)] == pytest.approx(2e9)  # a relay's uplink
    assert loads[LinkId(LinkKind.HOST_DOWN, 2)] == pytest.approx(2e9)
    eng.run()
    assert done == [pytest.approx(4.0)]  # 1 GB at 2 Gbit/s, once, for three receivers


def test_a_lone_cold_start_costs_download_load_and_copy():
    sim = SimCluster(_cfg(Technique.LC_MC), MODEL)
    m = sim.run(_burst(1))
    expected = MODEL.size_bytes * 8 / 2e9 + MODEL.load_s + MODEL.to_device_s
    assert m.cold_starts_s == [pytest.approx(expected)]
    assert m.unserved == 0 and len(m.latencies_s) == 1
    assert m.latencies_s[0] == pytest.approx(expected + MODEL.service_s)
    assert m.sources == {"registry": 1}


def test_multicast_turns_k_registry_downloads_into_one():
    # Four replicas at once on four hosts: BL downloads four copies over the 2 Gbit/s
    # registry link (each at a quarter of it); MC chains them (one copy).
    bl = SimCluster(_cfg(Technique.BL), MODEL).run(_burst(4))
    mc = SimCluster(_cfg(Technique.MC), MODEL).run(_burst(4))
    one = MODEL.size_bytes * 8 / 2e9
    assert len(bl.cold_starts_s) == len(mc.cold_starts_s) == 4
    assert max(bl.cold_starts_s) == pytest.approx(4 * one + MODEL.load_s + MODEL.to_device_s)
    assert max(mc.cold_starts_s) == pytest.approx(
        one + MODEL.load_s + MODEL.to_device_s + 3 * 0.001, rel=1e-6)
    assert mc.avg_latency_s < bl.avg_latency_s


def test_locality_serves_a_second_burst_from_host_ram_and_peers():
    log = RequestLog("two bursts", (*_burst(2).arrivals_s, *_burst(4, at_s=200).arrivals_s))
    lc = SimCluster(_cfg(Technique.LC, keep_alive_s=0.0), MODEL).run(log)
    bl = SimCluster(_cfg(Technique.BL, keep_alive_s=0.0), MODEL).run(log)
    # Second burst: the two hosts that kept the model start from RAM (copy to GPU only),
    # the others fetch from those peers, not the registry.
    assert lc.sources.get("local", 0) >= 2
    assert any(k.startswith("chain:h") for k in lc.sources)
    assert min(lc.cold_starts_s) == pytest.approx(MODEL.to_device_s)
    assert lc.avg_cold_start_s < bl.avg_cold_start_s
    assert bl.sources == {"registry": len(bl.cold_starts_s)}


def test_every_decision_is_the_live_controller_state():
    sim = SimCluster(_cfg(Technique.LC_MC), MODEL, record=True)
    sim.run(_burst(3))
    assert isinstance(sim.state, ControllerState)
    deploys = [c for r in sim.records for c in r.commands if isinstance(c, DeployReplica)]
    assert len(deploys) == 3
    assert {d.source.kind for d in deploys} == {"chain_head", "chain"}  # policy.sourcing
    # one GPU per host (placement's stage 2), every host distinct
    assert len({d.host_id for d in deploys}) == 3


@pytest.mark.parametrize("tech", list(Technique))
def test_small_trace_is_served_and_deterministic(tech):
    log = requests_from_rates(twitter_like(2, duration_s=120, scale=0.2), seed=3)
    cfg = ClusterConfig(topology=Topology(n_hosts=4, gpus_per_host=4, hosts_per_leaf=2),
                        technique=tech, autoscaler="atl", decision_s=0.0, prewarm=1)
    a = SimCluster(cfg, thesis_model("codebert")).run(log)
    b = SimCluster(cfg, thesis_model("codebert")).run(log)
    assert a.unserved == 0 and len(a.latencies_s) == len(log)
    assert (a.latencies_s, a.cold_starts_s, a.replica_s) == (b.latencies_s, b.cold_starts_s,
                                                            b.replica_s)
    assert a.replica_s > 0 and a.events > len(log)


def test_decision_time_is_charged_in_simulated_time():
    slow = SimCluster(_cfg(Technique.LC_MC, decision_s=2.0), MODEL).run(_burst(1))
    fast = SimCluster(_cfg(Technique.LC_MC), MODEL).run(_burst(1))
    assert slow.latencies_s[0] == pytest.approx(fast.latencies_s[0] + 2.0)


def test_partitioned_pipeline_starts_faster_then_completes_into_whole_replicas():
    t5 = thesis_model("t5")
    topo = Topology(n_hosts=4, gpus_per_host=1, hosts_per_leaf=4, cloud_bps=2e9)
    # Four requests at once from zero: four GPUs, none holding T5.
    mp = SimCluster(_cfg(Technique.MP, topology=topo, drain_s=900.0, keep_alive_s=1000.0), t5,
                    record=True)
    # (a late request keeps the control loop running until the groups have dissolved)
    m = mp.run(RequestLog("burst", (*_burst(4).arrivals_s, 400.0)))
    groups = [c for r in mp.records for c in r.commands if isinstance(c, ServeGroup)]
    stages = [c for r in mp.records for c in r.commands
              if isinstance(c, DeployReplica) and c.stage is not None]
    assert m.pipelines == len(groups) >= 1 and len(stages) >= 2
    # With the registry as the only source the stages share its link, but one copy crosses
    # it instead of four (thesis §8.4.1): the pipeline serves after about one whole
    # download, while BL's four replicas each wait for four.
    one = t5.size_bytes * 8 / 2e9
    assert min(m.cold_starts_s) < one + t5.load_s + t5.to_device_s
    bl = SimCluster(_cfg(Technique.BL, topology=topo, drain_s=900.0), t5).run(_burst(4))
    assert min(bl.cold_starts_s) > 3 * one
    assert m.avg_latency_s < bl.avg_latency_s / 2
    # Every stage completes into a whole replica, and the groups dissolve.
    assert m.completions == len(stages)
    assert any(isinstance(c, DissolveStages) for r in mp.records for c in r.commands)
    assert m.unserved == 0


def test_pipeline_requests_pay_the_transfer_penalty():
    t5 = thesis_model("t5")
    topo = Topology(n_hosts=4, gpus_per_host=1, hosts_per_leaf=4)
    sim = SimCluster(_cfg(Technique.MP, topology=topo, drain_s=900.0), t5)
    sim.run(_burst(4))
    cost = sim.cost
    assert cost is not None and cost.link_bps == topo.host_link_bps
    # The first requests are served by the pipeline: end-to-end is at least its cold start
    # plus I(1) and one cut's transfer.
    cut = cost.transfer_s(t5.layers[0].output_bytes)
    assert sorted(sim.metrics.latencies_s)[0] >= min(sim.metrics.cold_starts_s) + t5.service_s + cut


@pytest.mark.parametrize("tech", [Technique.MC, Technique.LC])
def test_a_head_host_with_several_replicas_starts_its_registry_chain_once(tech):
    # Eight replicas in one tick on two 4-GPU hosts: one registry chain (h0 -> h1). Every
    # replica on the head host carries the same chain_head assignment; the live host joins
    # its one fill, so the sim must start the chain once, not once per replica (which
    # shared the registry link four ways and made the cold start 4x longer).
    topo = Topology(n_hosts=2, gpus_per_host=4, hosts_per_leaf=2, cloud_bps=2e9)
    sim = SimCluster(_cfg(tech, topology=topo), MODEL)
    m = sim.run(_burst(8))
    assert len(m.cold_starts_s) == 8 and m.unserved == 0
    assert m.peak_starting == 8
    assert m.peak_registry_flows == (1 if tech is Technique.MC else 2)
    once = MODEL.size_bytes * 8 / 2e9 + MODEL.load_s + MODEL.to_device_s
    if tech is Technique.MC:  # one cut-through flow for both hosts: one copy's time and bytes
        assert m.bytes_moved == pytest.approx(MODEL.size_bytes)
        assert max(m.cold_starts_s) == pytest.approx(once, rel=0.01)
    else:  # LC: one unicast per host from the registry, sharing its link two ways
        assert m.bytes_moved == pytest.approx(2 * MODEL.size_bytes)
        assert max(m.cold_starts_s) == pytest.approx(
            2 * MODEL.size_bytes * 8 / 2e9 + MODEL.load_s + MODEL.to_device_s, rel=0.01)
