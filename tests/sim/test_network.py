"""Flow-level network: topology paths, max-min fairness and completion times by hand."""

from __future__ import annotations

import pytest

from flashpoint.sim import CLOUD, Engine, Flow, FlowNetwork, LinkId, LinkKind, Topology, max_min_rates

GB = 1_000_000_000
# Small cluster: 2 leaves x 2 hosts; numbers chosen so answers are exact in binary floats.
SMALL = Topology(n_hosts=4, hosts_per_leaf=2, host_link_bps=8e9, leaf_spine_bps=16e9, cloud_bps=2e9)


def L(kind: str, i: int = 0) -> LinkId:
    return LinkId(LinkKind(kind), i)


def net(topo: Topology = SMALL) -> tuple[Engine, FlowNetwork, dict[int, float]]:
    e = Engine()
    finished: dict[int, float] = {}
    return e, FlowNetwork(e, topo), finished


def record(finished: dict[int, float]):
    def on_done(f: Flow) -> None:
        assert f.finished_s is not None
        finished[f.flow_id] = f.finished_s
    return on_done


# --- topology ------------------------------------------------------------------------------

def test_thesis_defaults():
    t = Topology()
    assert (t.n_hosts, t.n_gpus, t.n_leaves) == (200, 1600, 10)
    assert t.capacity_bps[L("host_up", 0)] == 50e9
    assert t.capacity_bps[L("leaf_down", 9)] == 100e9
    assert t.capacity_bps[L("cloud_egress")] == 2e9
    assert len(t.capacity_bps) == 2 * 200 + 2 * 10 + 2


def test_paths():
    t = SMALL
    assert t.path(0, 1) == (L("host_up", 0), L("host_down", 1))
    assert t.path(1, 2) == (L("host_up", 1), L("leaf_up", 0), L("leaf_down", 1), L("host_down", 2))
    assert t.path(CLOUD, 3) == (L("cloud_egress"), L("leaf_down", 1), L("host_down", 3))
    assert t.path(0, CLOUD) == (L("host_up", 0), L("leaf_up", 0), L("cloud_ingress"))


@pytest.mark.parametrize("src,dst", [(0, 0), (0, 4), (-1, 0), (True, 0), ("x", 0), (CLOUD, CLOUD)])
def test_bad_paths_rejected(src, dst):
    with pytest.raises(ValueError):
        SMALL.path(src, dst)


@pytest.mark.parametrize("kw", [{"n_hosts": 0}, {"hosts_per_leaf": 0}, {"host_link_bps": 0.0},
                                {"cloud_bps": float("inf")}, {"leaf_spine_bps": float("nan")}])
def test_bad_topology_rejected(kw):
    with pytest.raises(ValueError):
        Topology(**kw)


def test_partial_last_leaf():
    t = Topology(n_hosts=5, hosts_per_leaf=2)
    assert t.n_leaves == 3 and t.leaf_of(4) == 2


# --- max-min fairness (pure function) ------------------------------------------------------

def test_two_flows_sharing_a_host_downlink_get_half_each():
    t = SMALL
    r = max_min_rates({"a": t.path(0, 1), "b": t.path(2, 1)}, t.capacity_bps)
    assert r == {"a": 4e9, "b": 4e9}


def test_flow_bottlenecked_elsewhere_leaves_its_share_to_others():
    # Cloud flow is capped at 2 Gbit/s by the registry; the host flow takes the other 6.
    t = SMALL
    r = max_min_rates({"cloud": t.path(CLOUD, 1), "host": t.path(0, 1)}, t.capacity_bps)
    assert r == {"cloud": 2e9, "host": 6e9}


def test_cloud_egress_shared_by_n_flows():
    t = Topology()
    paths = {h: t.path(CLOUD, h) for h in range(0, 200, 5)}  # 40 hosts over all leaves
    r = max_min_rates(paths, t.capacity_bps)
    assert all(v == pytest.approx(2e9 / 40, rel=1e-12) for v in r.values())


def test_leaf_uplink_bottleneck_then_host_links():
    # Three flows leave leaf 0 (16 Gbit/s uplink) for leaf 1; host 0 sends two of them, so
    # host_up[0] (8) and leaf_up[0] (16) both bind: the classic two-level water-fill.
    t = Topology(n_hosts=6, hosts_per_leaf=3, host_link_bps=8e9, leaf_spine_bps=12e9)
    paths = {"a": t.path(0, 3), "b": t.path(0, 4), "c": t.path(1, 5), "d": t.path(2, 1)}
    r = max_min_rates(paths, t.capacity_bps)
    # Level 4: host_up[0] fills (a, b at 4); leaf_up[0] has 12 - 8 = 4 left for c alone.
    # d stays in leaf 0 and is limited only by host_down[1] / host_up[2]: 8.
    assert r == {"a": 4e9, "b": 4e9, "c": 4e9, "d": 8e9}


def test_empty_path_rejected():
    with pytest.raises(ValueError):
        max_min_rates({"a": ()}, SMALL.capacity_bps)


# --- completion times (engine-driven) ------------------------------------------------------

def test_one_gigabyte_at_eight_gigabit_takes_one_second():
    e, n, finished = net()
    f = n.start_flow(0, 1, GB, record(finished))
    assert f.rate_bps == 8e9
    e.run()
    assert finished == {0: 1.0}
    assert n.bytes_delivered == GB and n.active_flows == {} and n.flows_finished == 1


def test_second_flow_joining_halfway():
    # A: 1 GB at 8 Gbit/s from t=0. B joins at 0.5 s on the same downlink: both at 4.
    # A has 0.5 GB left -> done at 1.5 s; B then has 0.5 GB left at 8 -> done at 2.0 s.
    e, n, finished = net()
    n.start_flow(0, 1, GB, record(finished))
    e.schedule(0.5, lambda: n.start_flow(2, 1, GB, record(finished)))
    e.run()
    assert finished == {0: 1.5, 1: 2.0}
    assert n.bytes_delivered == 2 * GB and n.max_residual_bytes == 0.0


def test_equal_flows_finish_together_in_one_event():
    e, n, finished = net()
    for src in (0, 2, 3):
        n.start_flow(src, 1, GB, record(finished))
    e.run()
    assert finished == {0: 3.0, 1: 3.0, 2: 3.0}
    assert e.events_processed == 1


def test_cloud_flow_and_local_flow():
    # Cloud 0.5 GB at 2 Gbit/s = 2 s; local 3 GB at 6 Gbit/s for 2 s (1.5 GB), then 8 for
    # the last 1.5 GB = 1.5 s -> 3.5 s.
    e, n, finished = net()
    n.start_flow(CLOUD, 1, GB // 2, record(finished))
    n.start_flow(0, 1, 3 * GB, record(finished))
    e.run()
    assert finished == {0: 2.0, 1: 3.5}


def test_on_done_may_start_a_flow():
    e, n, finished = net()
    chain = record(finished)

    def then(f: Flow) -> None:
        chain(f)
        if f.flow_id == 0:
            n.start_flow(1, 3, GB, chain)  # a pipeline hop: forward once received

    n.start_flow(0, 1, GB, then)
    e.run()
    assert finished == {0: 1.0, 1: 2.0}


def test_zero_byte_flow_completes_now_in_an_event():
    e, n, finished = net()
    e.run(until_s=1.0)
    n.start_flow(0, 1, 0, record(finished))
    assert finished == {}
    e.run()
    assert finished == {0: 1.0}


def test_cancel_flow_frees_bandwidth():
    e, n, finished = net()
    a = n.start_flow(0, 1, GB, record(finished))
    b = n.start_flow(2, 1, GB, record(finished))
    e.schedule(0.5, lambda: n.cancel_flow(b.flow_id))
    e.run()
    # A: 0.25 GB by 0.5 s at 4, then 0.75 GB at 8 = 0.75 s -> 1.25 s.
    assert finished == {a.flow_id: 1.25}
    assert n.bytes_delivered == 1.25 * GB  # A's 1 GB plus B's 0.25 GB before the abort
    assert n.cancel_flow(b.flow_id) is False


def test_rates_listener_sees_every_recompute():
    e = Engine()
    seen: list[dict[LinkId, float]] = []
    n = FlowNetwork(e, SMALL, on_rates_changed=lambda net: seen.append(net.link_loads_bps()))
    n.start_flow(0, 1, GB, lambda f: None)
    n.start_flow(2, 1, 2 * GB, lambda f: None)
    e.run()
    assert e.now_s == 3.0
    assert [s.get(L("host_down", 1)) for s in seen] == [8e9, 8e9, 8e9, None]


def test_bad_size_rejected():
    _, n, finished = net()
    for size in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            n.start_flow(0, 1, size, record(finished))
    assert n.active_flows == {}
