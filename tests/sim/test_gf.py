"""GF, the thesis's "GPU-enabled FaaS" locality baseline (§8.2.2, [117]), against LC and BL
on tiny scenarios: own-host RAM hits and holder preference like LC, but no peer source and
no download shared by the GPUs of one host (one registry copy per replica, like BL)."""

from __future__ import annotations

import pytest

from flashpoint.controller.state.events import DeployReplica, StartChain
from flashpoint.policy.sourcing import REGISTRY, plan_sourcing
from flashpoint.sim.cluster import SimCluster
from flashpoint.sim.cluster_config import ClusterConfig, Technique
from flashpoint.sim.models import thesis_model
from flashpoint.sim.network import Topology
from flashpoint.sim.traces import RequestLog

MODEL = thesis_model("bart")  # 1,626 MB: 6.5 s from the registry at 2 Gbit/s
ONE_COPY_S = MODEL.size_bytes * 8 / 2e9


def _cfg(tech: Technique, topology: Topology, **kw) -> ClusterConfig:
    base = dict(topology=topology, technique=tech, autoscaler="concurrency", decision_s=0.0,
                drain_s=300.0)
    base.update(kw)
    return ClusterConfig(**base)


def _deploys(sim: SimCluster) -> list[DeployReplica]:
    assert sim.records is not None
    return [c for r in sim.records for c in r.commands if isinstance(c, DeployReplica)]


def test_technique_flags():
    gf = Technique.GF
    assert gf.keeps_models and not gf.locality and not gf.host_sharing
    assert not gf.multicast and not gf.partition
    assert not Technique.BL.keeps_models
    assert all(t.keeps_models for t in Technique if t.locality)


def test_two_gpus_of_one_host_cold_starting_at_once_gf_downloads_twice_lc_once():
    one_host = Topology(n_hosts=1, gpus_per_host=2, hosts_per_leaf=1, cloud_bps=2e9)
    gf_sim = SimCluster(_cfg(Technique.GF, one_host), MODEL, record=True)
    gf = gf_sim.run(RequestLog("burst", (0.0, 0.0)))
    lc_sim = SimCluster(_cfg(Technique.LC, one_host), MODEL, record=True)
    lc = lc_sim.run(RequestLog("burst", (0.0, 0.0)))
    # Both place the two replicas on the one host's two GPUs ...
    for sim in (gf_sim, lc_sim):
        assert [d.host_id for d in _deploys(sim)] == ["h0", "h0"]
    # ... GF pulls two copies over the registry link at once, LC one shared by both GPUs.
    assert gf.peak_registry_flows == 2 and lc.peak_registry_flows == 1
    assert gf.bytes_moved == pytest.approx(2 * MODEL.size_bytes)
    assert lc.bytes_moved == pytest.approx(MODEL.size_bytes)
    assert gf.sources == {"registry": 2} and lc.sources == {"registry": 2}
    assert max(gf.cold_starts_s) == pytest.approx(
        2 * ONE_COPY_S + MODEL.load_s + MODEL.to_device_s)
    assert max(lc.cold_starts_s) == pytest.approx(ONE_COPY_S + MODEL.load_s + MODEL.to_device_s)


def test_a_model_only_in_a_peers_ram_lc_pulls_from_the_peer_gf_from_the_registry():
    # Two hosts of one GPU; a first request warms h-something, keep-alive 0 lets it go but
    # its host keeps the model (both techniques). A burst of two later needs both hosts:
    # one is a holder (own RAM), the other must fetch.
    two = Topology(n_hosts=2, gpus_per_host=1, hosts_per_leaf=2, cloud_bps=2e9)
    log = RequestLog("two bursts", (0.0, 200.0, 200.0))
    out = {}
    for tech in (Technique.LC, Technique.GF, Technique.BL):
        sim = SimCluster(_cfg(tech, two, keep_alive_s=0.0), MODEL, record=True)
        out[tech] = (sim, sim.run(log))
    lc, gf, bl = (out[t][1] for t in (Technique.LC, Technique.GF, Technique.BL))
    assert lc.cold_start_sources[0] == gf.cold_start_sources[0] == "registry"
    first_host = _deploys(out[Technique.GF][0])[0].host_id
    assert sorted(lc.cold_start_sources[1:]) == sorted(["local", f"chain:{first_host}"])
    assert sorted(gf.cold_start_sources[1:]) == ["local", "registry"]
    assert bl.cold_start_sources == ["registry"] * 3  # BL keeps nothing
    # GF's decisions never name a peer: no StartChain, no peer in any fallback.
    gf_cmds = [c for r in out[Technique.GF][0].records for c in r.commands]
    assert not any(isinstance(c, StartChain) for c in gf_cmds)
    for d in _deploys(out[Technique.GF][0]):
        if d.source is not None:
            assert set(d.source.fallback) <= {REGISTRY}
    assert any(isinstance(c, StartChain) for r in out[Technique.LC][0].records
               for c in r.commands)
    # The peer copy crosses the cluster network (50 Gbit/s), the registry copy 2 Gbit/s.
    assert max(gf.cold_starts_s[1:]) > max(lc.cold_starts_s[1:]) + 0.5 * ONE_COPY_S


def test_gf_keeps_the_model_after_its_replica_stops_and_places_the_next_one_there():
    # Four hosts of one GPU, one request, keep-alive 0, a second request much later: GF's
    # second replica goes to the host that kept the model and only copies RAM to GPU.
    four = Topology(n_hosts=4, gpus_per_host=1, hosts_per_leaf=2, cloud_bps=2e9)
    log = RequestLog("two singles", (0.0, 200.0))
    gf_sim = SimCluster(_cfg(Technique.GF, four, keep_alive_s=0.0), MODEL, record=True)
    gf = gf_sim.run(log)
    bl = SimCluster(_cfg(Technique.BL, four, keep_alive_s=0.0), MODEL).run(log)
    hosts = [d.host_id for d in _deploys(gf_sim)]
    assert len(hosts) == 2 and hosts[0] == hosts[1]
    assert gf.cold_start_sources == ["registry", "local"]
    assert gf.cold_starts_s[1] == pytest.approx(MODEL.to_device_s)
    assert bl.cold_start_sources == ["registry", "registry"]
    assert bl.cold_starts_s[1] == pytest.approx(ONE_COPY_S + MODEL.load_s + MODEL.to_device_s)


def test_plan_sourcing_without_peer_sends_uses_own_ram_and_the_registry_only():
    plan = plan_sourcing("m@1", ["a", "b", "c"], ["a", "z"], peer_sends=False)
    assert plan.local == ("a",)
    assert [(c.sender, c.receivers) for c in plan.chains] == [(REGISTRY, ("b", "c"))]
    assert plan.fallback == (REGISTRY,)
    with_peers = plan_sourcing("m@1", ["a", "b", "c"], ["a", "z"])
    assert {c.sender for c in with_peers.chains} >= {"a", "z"}
