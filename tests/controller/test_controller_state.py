"""ControllerState: events in, commands out (pure, no I/O)."""

from __future__ import annotations

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FailFunction,
    ForgetReplica,
    FunctionDeleted,
    FunctionLoad,
    FunctionUpserted,
    HostHeartbeat,
    HostRegistered,
    ReplicaFailed,
    ReplicaWarmed,
    StopAccepting,
    StopReplica,
    Tick,
)
from flashpoint.controller.state.records import MAX_CONSECUTIVE_START_FAILURES, ReplicaPhase
from flashpoint.spec import FunctionSpec

GIB = 1 << 30
MIB = 1 << 20


def spec(name: str = "fn", **kw) -> FunctionSpec:
    kw.setdefault("model", "m")
    kw.setdefault("keep_alive_s", 10.0)
    kw.setdefault("replica_concurrency", 4)
    return FunctionSpec(name=name, **kw)


def register(st: ControllerState, host_id: str, *, devices: int = 1, mem: int = 4 * GIB,
             now: float = 0.0, replicas=(), cached=frozenset(), ram: int = 16 * GIB):
    devs = tuple(DeviceRecord(f"cpu:{i}", "cpu", mem) for i in range(devices))
    return st.handle(HostRegistered(host_id, devs, ram, frozenset(cached), tuple(replicas), now))


def load(queued: int = 0, inflight: int = 0, last: float | None = None) -> FunctionLoad:
    return FunctionLoad(queued, inflight, last)


def of(cmds, cls):
    return [c for c in cmds if isinstance(c, cls)]


def new_state(**kw) -> ControllerState:
    return ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0, **kw)


def test_host_registration_records_host_and_devices():
    st = new_state()
    assert register(st, "h1", devices=2) == []
    assert set(st.hosts) == {"h1"}
    assert set(st.hosts["h1"].devices) == {"cpu:0", "cpu:1"}
    assert st.hosts["h1"].alive
    snap = st.snapshot(0.0)
    assert [d.memory_free_bytes for d in snap.hosts[0].devices] == [4 * GIB, 4 * GIB]


def test_unknown_heartbeat_is_ignored():
    st = new_state()
    assert st.handle(HostHeartbeat("nope", frozenset(), 1.0)) == []
    assert st.hosts == {}


def test_min_zero_and_no_load_deploys_nothing():
    st = new_state()
    register(st, "h1")
    assert st.handle(FunctionUpserted(spec(), 100 * MIB)) == []
    for t in (0.1, 1.0, 2.0):
        assert st.handle(Tick(t, {})) == []
        assert st.handle(Tick(t + 0.01, {"fn": load()})) == []
    assert st.replicas == {}


def test_min_replicas_deploys_without_load():
    st = new_state()
    register(st, "h1", devices=2)
    st.handle(FunctionUpserted(spec(min_replicas=2), 100 * MIB))
    cmds = st.handle(Tick(0.1, {}))
    assert len(of(cmds, DeployReplica)) == 2


def test_load_deploys_to_device_with_room_and_ids_are_unique():
    st = new_state()
    register(st, "small", mem=50 * MIB)  # too small for the model
    register(st, "big", devices=2)
    st.handle(FunctionUpserted(spec(), 100 * MIB))
    cmds = st.handle(Tick(0.5, {"fn": load(queued=1, last=0.5)}))
    deploys = of(cmds, DeployReplica)
    assert len(deploys) == 1
    assert deploys[0].host_id == "big"
    assert deploys[0].spec.name == "fn"
    assert st.replicas[deploys[0].replica_id].phase == ReplicaPhase.STARTING

    # more load: more replicas, all with fresh ids
    cmds = st.handle(Tick(0.6, {"fn": load(queued=20, last=0.6)}))
    more = of(cmds, DeployReplica)
    assert more
    ids = [d.replica_id for d in deploys + more]
    assert len(ids) == len(set(ids))
    assert all(d.host_id == "big" for d in more)


def test_replica_ids_unique_across_functions():
    st = new_state()
    register(st, "h1", devices=4)
    st.handle(FunctionUpserted(spec("a"), MIB))
    st.handle(FunctionUpserted(spec("a-r1"), MIB))
    ids = []
    for t in range(1, 6):
        loads = {"a": load(queued=4 * t, last=t), "a-r1": load(queued=4 * t, last=t)}
        cmds = st.handle(Tick(float(t), loads))
        ids += [d.replica_id for d in of(cmds, DeployReplica)]
    assert len(ids) == len(set(ids)) > 2


def test_replica_warmed_moves_to_warm_and_stale_warm_ignored():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(), MIB))
    (dep,) = of(st.handle(Tick(0.1, {"fn": load(queued=1, last=0.1)})), DeployReplica)
    assert st.handle(ReplicaWarmed(dep.replica_id, {"load": 0.2}, 0.3)) == []
    rep = st.replicas[dep.replica_id]
    assert rep.phase == ReplicaPhase.WARM
    assert rep.warm_s == 0.3
    assert rep.timings_s == {"load": 0.2}
    assert st.handle(ReplicaWarmed("unknown", {}, 0.4)) == []
    # demand is satisfied by the warm replica: no further deploys
    assert of(st.handle(Tick(0.5, {"fn": load(queued=1, last=0.5)})), DeployReplica) == []


def _warm_one(st: ControllerState, t: float = 0.0) -> str:
    (dep,) = of(st.handle(Tick(t, {"fn": load(queued=1, last=t)})), DeployReplica)
    st.handle(ReplicaWarmed(dep.replica_id, {}, t + 0.1))
    return dep.replica_id


def test_keep_alive_then_stop_accepting_then_stop_when_idle():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(keep_alive_s=10.0), MIB))
    rid = _warm_one(st, 1.0)
    # load drops to zero; last request was at t=2
    hb = lambda t: st.handle(HostHeartbeat("h1", frozenset(), t))  # noqa: E731
    for t in (2.0, 4.0, 8.0, 11.9):
        hb(t)
        cmds = st.handle(Tick(t, {"fn": load(last=2.0)}))
        assert cmds == [], t
        assert st.replicas[rid].phase == ReplicaPhase.WARM
    hb(12.5)
    cmds = st.handle(Tick(12.5, {"fn": load()}))
    assert cmds == [StopAccepting(rid)]
    assert st.replicas[rid].phase == ReplicaPhase.STOPPING
    # not yet idle: nothing more happens, and no replacement is deployed
    hb(13.0)
    assert st.handle(Tick(13.0, {"fn": load()})) == []
    hb(13.5)
    cmds = st.handle(Tick(13.5, {"fn": load()}, idle_replicas=frozenset({rid})))
    assert set(cmds) == {ForgetReplica(rid), StopReplica(rid, "h1")}
    assert rid not in st.replicas


def test_last_request_keeps_replica_alive_longer():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(keep_alive_s=10.0), MIB))
    rid = _warm_one(st, 0.0)
    st.handle(HostHeartbeat("h1", frozenset(), 4.0))
    st.handle(Tick(4.0, {"fn": load(last=4.0)}))
    st.handle(HostHeartbeat("h1", frozenset(), 12.0))
    assert st.handle(Tick(12.0, {"fn": load()})) == []  # 8 s idle only
    st.handle(HostHeartbeat("h1", frozenset(), 14.5))
    assert st.handle(Tick(14.5, {"fn": load()})) == [StopAccepting(rid)]


def test_silent_host_replicas_forgotten_and_redeployed_on_live_host():
    st = new_state()
    register(st, "a", now=0.0)
    st.handle(FunctionUpserted(spec(), MIB))
    rid = _warm_one(st, 0.0)
    assert st.replicas[rid].host_id == "a"
    register(st, "b", now=1.0)
    st.handle(HostHeartbeat("b", frozenset(), 5.5))
    cmds = st.handle(Tick(6.0, {"fn": load(queued=1, last=6.0)}))
    assert ForgetReplica(rid) in cmds
    assert of(cmds, StopReplica) == []  # the host is gone; nothing to tell it
    deploys = of(cmds, DeployReplica)
    assert len(deploys) == 1 and deploys[0].host_id == "b"
    assert not st.hosts["a"].alive
    assert rid not in st.replicas


def test_silent_host_without_load_forgets_only():
    st = new_state()
    register(st, "a", now=0.0)
    st.handle(FunctionUpserted(spec(), MIB))
    rid = _warm_one(st, 0.0)
    cmds = st.handle(Tick(5.5, {"fn": load()}))
    assert cmds == [ForgetReplica(rid)]


def test_dead_host_gets_no_placements():
    st = new_state()
    register(st, "a", now=0.0, devices=4)
    register(st, "b", now=0.0, mem=MIB)  # too small
    st.handle(FunctionUpserted(spec(), 2 * MIB))
    cmds = st.handle(Tick(6.0, {"fn": load(queued=1, last=6.0)}))
    assert of(cmds, DeployReplica) == []
    cmds = st.handle(Tick(7.0, {"fn": load(queued=100, last=7.0)}))
    assert of(cmds, DeployReplica) == []
    # heartbeats bring it back
    st.handle(HostHeartbeat("a", frozenset(), 7.5))
    cmds = st.handle(Tick(8.0, {"fn": load(queued=1, last=8.0)}))
    assert [d.host_id for d in of(cmds, DeployReplica)] == ["a"]


def test_restart_adopts_reported_replicas_without_duplicates():
    st = new_state()
    st.handle(FunctionUpserted(spec(), MIB))
    cmds = register(st, "h1", devices=2, replicas=[("fn-old1", "fn", "cpu:0", True),
                                                   ("fn-old2", "fn", "cpu:1", False)])
    assert cmds == []
    assert st.replicas["fn-old1"].phase == ReplicaPhase.WARM
    assert st.replicas["fn-old2"].phase == ReplicaPhase.STARTING
    # demand fits in the adopted replicas (concurrency 4 each): no new deploys
    cmds = st.handle(Tick(0.5, {"fn": load(queued=3, inflight=4, last=0.5)}))
    assert of(cmds, DeployReplica) == []
    assert len(st.replicas_of("fn")) == 2
    # adopted replicas count against device memory
    free = {d.device_id: d.memory_free_bytes for d in st.snapshot(0.5).hosts[0].devices}
    assert free == {"cpu:0": 4 * GIB - MIB, "cpu:1": 4 * GIB - MIB}
    # re-registering with the same replicas is idempotent
    cmds = register(st, "h1", devices=2, now=1.0, replicas=[("fn-old1", "fn", "cpu:0", True),
                                                           ("fn-old2", "fn", "cpu:1", False)])
    assert cmds == []
    assert len(st.replicas) == 2


def test_restart_stops_replicas_of_unknown_functions():
    st = new_state()
    st.handle(FunctionUpserted(spec(), MIB))
    cmds = register(st, "h1", replicas=[("ghost-1", "ghost", "cpu:0", True),
                                        ("fn-1", "fn", "cpu:0", True)])
    assert cmds == [StopReplica("ghost-1", "h1")]
    assert set(st.replicas) == {"fn-1"}


def test_reregistration_forgets_replicas_host_no_longer_has():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(), MIB))
    rid = _warm_one(st, 0.0)
    cmds = register(st, "h1", now=1.0, replicas=[])
    assert cmds == [ForgetReplica(rid)]
    assert st.replicas == {}


def test_repeated_start_failures_fail_function_and_stop_deploying():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(), MIB))
    fails = []
    for i in range(MAX_CONSECUTIVE_START_FAILURES):
        t = float(i)
        st.handle(HostHeartbeat("h1", frozenset(), t))
        (dep,) = of(st.handle(Tick(t, {"fn": load(queued=1, last=t)})), DeployReplica)
        cmds = st.handle(ReplicaFailed(dep.replica_id, "boom", during_start=True))
        assert ForgetReplica(dep.replica_id) in cmds
        fails += of(cmds, FailFunction)
    assert len(fails) == 1
    assert fails[0].name == "fn" and fails[0].code == "model_load_failed"
    assert fails[0].failure is not None and "boom" in fails[0].reason
    # Backing off (10 s from the third failure at t=2): no start before t=12.
    for t in (3.0, 4.0, 5.0):
        st.handle(HostHeartbeat("h1", frozenset(), t))
        assert of(st.handle(Tick(t, {"fn": load(queued=5, last=t)})), DeployReplica) == []


def test_warm_resets_start_failure_count():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(), MIB))
    for i in range(2 * MAX_CONSECUTIVE_START_FAILURES):
        t = float(i)
        st.handle(HostHeartbeat("h1", frozenset(), t))
        (dep,) = of(st.handle(Tick(t, {"fn": load(queued=1, last=t)})), DeployReplica)
        if i % 2:
            st.handle(ReplicaWarmed(dep.replica_id, {}, t))
            cmds = st.handle(ReplicaFailed(dep.replica_id, "crash", during_start=False))
        else:
            cmds = st.handle(ReplicaFailed(dep.replica_id, "boom", during_start=True))
        assert of(cmds, FailFunction) == []


def test_failed_unknown_replica_is_ignored():
    st = new_state()
    assert st.handle(ReplicaFailed("nope", "x", during_start=True)) == []


def test_function_deleted_fails_and_retires_replicas():
    st = new_state()
    register(st, "h1", devices=2)
    st.handle(FunctionUpserted(spec(), MIB))
    warm = _warm_one(st, 0.0)
    (starting,) = of(st.handle(Tick(0.2, {"fn": load(queued=8, last=0.2)})), DeployReplica)
    cmds = st.handle(FunctionDeleted("fn"))
    assert FailFunction("fn", "function_not_found", "function deleted") in cmds
    assert StopAccepting(warm) in cmds
    assert ForgetReplica(starting.replica_id) in cmds
    assert StopReplica(starting.replica_id, "h1") in cmds
    assert st.replicas[warm].phase == ReplicaPhase.STOPPING
    assert "fn" not in st.functions
    # the warm one stops once drained; no redeploy for a deleted function
    cmds = st.handle(Tick(0.5, {"fn": load(queued=8, last=0.5)}, idle_replicas=frozenset({warm})))
    assert set(cmds) == {ForgetReplica(warm), StopReplica(warm, "h1")}


def test_max_replicas_bound_respected():
    st = new_state()
    register(st, "h1", devices=8)
    st.handle(FunctionUpserted(spec(max_replicas=3), MIB))
    total = 0
    for t in range(5):
        cmds = st.handle(Tick(float(t), {"fn": load(queued=1000, last=float(t))}))
        total += len(of(cmds, DeployReplica))
    assert total == 3
    assert len(st.replicas_of("fn")) == 3


def test_placement_never_overcommits_device_memory():
    st = new_state()
    register(st, "h1", devices=2, mem=3 * GIB)
    st.handle(FunctionUpserted(spec("big", max_replicas=8), 5 * GIB))
    assert of(st.handle(Tick(0.1, {"big": load(queued=100, last=0.1)})), DeployReplica) == []

    st.handle(FunctionUpserted(spec("mid", max_replicas=8, replica_concurrency=1), 2 * GIB))
    cmds = st.handle(Tick(0.2, {"mid": load(queued=100, last=0.2)}))
    deploys = of(cmds, DeployReplica)
    assert len(deploys) == 2  # one per 3 GiB device
    assert {d.device_id for d in deploys} == {"cpu:0", "cpu:1"}
    # later ticks cannot squeeze more in
    st.handle(HostHeartbeat("h1", frozenset(), 1.0))
    assert of(st.handle(Tick(1.0, {"mid": load(queued=100, last=1.0)})), DeployReplica) == []
    for dev in st.snapshot(1.0).hosts[0].devices:
        assert dev.memory_free_bytes >= 0


def test_overhead_counts_against_device_memory():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=GIB)
    register(st, "h1", mem=4 * GIB)
    st.handle(FunctionUpserted(spec(max_replicas=8, replica_concurrency=1), GIB))
    cmds = st.handle(Tick(0.1, {"fn": load(queued=10, last=0.1)}))
    assert len(of(cmds, DeployReplica)) == 2  # 2 x (1 GiB + 1 GiB overhead)


def test_changed_model_rolls_old_replicas_over_instead_of_retiring_them():
    st = new_state()
    register(st, "h1", devices=2)
    st.handle(FunctionUpserted(spec(), MIB))
    rid = _warm_one(st, 0.0)
    assert st.handle(FunctionUpserted(spec(max_replicas=2), MIB)) == []
    # The old version keeps serving; the next tick starts the new one beside it
    # (tests/controller/test_rollout.py follows the whole roll).
    assert st.handle(FunctionUpserted(spec(model_version="2"), MIB)) == []
    cmds = st.handle(Tick(1.0, {"fn": load(inflight=1, last=1.0)}))
    (dep,) = of(cmds, DeployReplica)
    assert dep.spec.model_version == "2" and not of(cmds, StopAccepting)
    assert st.replicas[rid].phase == ReplicaPhase.WARM


def test_cold_start_past_timeout_is_a_failed_start_and_is_replaced():
    st = new_state(cold_start_timeout_s=30.0)
    register(st, "h1", devices=2)
    st.handle(FunctionUpserted(spec(), 100 * MIB))
    first = of(st.handle(Tick(1.0, {"fn": load(queued=1, last=1.0)})), DeployReplica)
    assert len(first) == 1
    rid = first[0].replica_id
    # Heartbeats keep the host alive; the replica simply never reports warm.
    st.handle(HostHeartbeat("h1", frozenset(), 20.0))
    assert of(st.handle(Tick(20.0, {"fn": load(queued=1, last=1.0)})), StopReplica) == []
    st.handle(HostHeartbeat("h1", frozenset(), 32.0))
    cmds = st.handle(Tick(32.0, {"fn": load(queued=1, last=1.0)}))
    assert [c.replica_id for c in of(cmds, StopReplica)] == [rid]
    assert [c.replica_id for c in of(cmds, ForgetReplica)] == [rid]
    replacement = of(cmds, DeployReplica)
    assert len(replacement) == 1 and replacement[0].replica_id != rid
    assert st.functions["fn"].start_failures == 1


# sourcing ---------------------------------------------------------------------------------
def test_scale_up_puts_receivers_on_chains_from_holders_and_the_registry():
    from flashpoint.controller.state.events import SourceAssignment, StartChain

    st = new_state()
    register(st, "holder", devices=1, mem=100 * MIB, cached={"m@1"})  # holds it, no room
    for h in ("r1", "r2", "r3"):
        register(st, h, mem=250 * MIB)  # room for one replica each
    st.handle(FunctionUpserted(spec(min_replicas=3), 200 * MIB))
    cmds = st.handle(Tick(1.0, {}))
    deploys = {d.host_id: d for d in of(cmds, DeployReplica)}
    assert set(deploys) == {"r1", "r2", "r3"}
    starts = of(cmds, StartChain)
    assert len(starts) == 1 and starts[0].sender == "holder"
    assert (starts[0].model, starts[0].version) == ("m", "1")
    peer_chain = set(starts[0].receivers)
    registry_chain = {"r1", "r2", "r3"} - peer_chain
    assert len(peer_chain) == 2 and len(registry_chain) == 1
    (head,) = registry_chain
    assert deploys[head].source == SourceAssignment(
        "chain_head", deploys[head].source.transfer_id, "registry", (), ("registry",),
        ("holder", "registry"))
    for h in peer_chain:
        src = deploys[h].source
        assert src.kind == "chain" and src.transfer_id == starts[0].transfer_id
        assert src.sender == "holder"
        assert src.fallback == ("holder", "registry")
    # The sender is told to stream only after the receivers were told to expect it.
    assert cmds.index(starts[0]) > max(cmds.index(d) for d in deploys.values())


def test_a_host_already_receiving_is_not_sent_the_model_twice():
    st = new_state()
    register(st, "h1", devices=2)
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    first = of(st.handle(Tick(1.0, {})), DeployReplica)
    assert first[0].source.kind == "chain_head"
    st.handle(FunctionUpserted(spec("fn2", min_replicas=1), 100 * MIB))
    second = of(st.handle(Tick(1.1, {})), DeployReplica)
    assert second[0].host_id == "h1" and second[0].source is None  # joins the running fetch
    # Once the host reports the model cached, a further deploy there uses its own RAM.
    st.handle(HostHeartbeat("h1", frozenset({"m@1"}), 1.2))
    assert st.receiving == {}


def test_local_source_when_the_receiver_holds_the_model():
    st = new_state()
    register(st, "h1", cached={"m@1"})
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    (d,) = of(st.handle(Tick(1.0, {})), DeployReplica)
    assert d.source.kind == "local"


def test_stale_receiving_entries_expire_with_the_cold_start_timeout():
    st = ControllerState(heartbeat_timeout_s=1e9, replica_overhead_bytes=0, cold_start_timeout_s=5.0)
    register(st, "h1")
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    st.handle(Tick(1.0, {}))
    assert ("h1", "m@1") in st.receiving
    st.handle(FunctionDeleted("fn"))
    st.handle(Tick(7.0, {}))
    assert ("h1", "m@1") not in st.receiving


def test_reconcile_forgets_a_replica_its_host_never_ran_after_the_grace():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    (dep,) = of(st.handle(Tick(0.0, {})), DeployReplica)
    # Not yet reported: the deploy may still be on its way (within the grace).
    assert st.handle(HostHeartbeat("h1", frozenset(), 1.0, frozenset())) == []
    assert st.counts("fn") == {"planned": 1, "requested": 1, "observed": 0, "reason": "demand+bounds"}
    # Reported once, then no longer (the host restarted and lost it): forgotten, replaced.
    st.handle(HostHeartbeat("h1", frozenset(), 2.0, frozenset({dep.replica_id})))
    assert st.counts("fn")["observed"] == 1
    cmds = st.handle(HostHeartbeat("h1", frozenset(), 11.0, frozenset()))
    assert cmds == [ForgetReplica(dep.replica_id)]
    assert len(of(st.handle(Tick(11.1, {})), DeployReplica)) == 1


def test_reconcile_stops_a_replica_the_controller_does_not_know():
    st = new_state()
    register(st, "h1")
    cmds = st.handle(HostHeartbeat("h1", frozenset(), 1.0, frozenset({"ghost-1"})))
    assert cmds == [StopReplica("ghost-1", "h1")]
    # A heartbeat without a replica list (an older host) changes nothing.
    assert st.handle(HostHeartbeat("h1", frozenset(), 2.0)) == []


def test_the_configured_autoscaler_decides_and_keeps_its_memory():
    from flashpoint.policy.autoscale import make_autoscaler

    st = ControllerState(heartbeat_timeout_s=60.0, replica_overhead_bytes=0,
                         autoscaler=make_autoscaler("atl", {"window_s": 10}))
    register(st, "h1", devices=8)
    st.handle(FunctionUpserted(spec(max_replicas=8, replica_concurrency=1), 10 * MIB))
    # ATL: ceil(p99 arrival rate x execution time) replicas, whatever is queued now.
    cmds = st.handle(Tick(1.0, {"fn": FunctionLoad(1, 0, 1.0, arrival_rate=20.0,
                                                   exec_time_s=0.2)}))
    assert len(of(cmds, DeployReplica)) == 4
    assert st.functions["fn"].scaler_memory is not None
    assert st.counts("fn")["planned"] == 4


def test_compute_shares_are_reserved_across_decisions():
    st = new_state()
    register(st, "h1", devices=1)
    st.handle(FunctionUpserted(spec("a", compute=0.6, max_replicas=2), 10 * MIB))
    st.handle(FunctionUpserted(spec("b", compute=0.5), 10 * MIB))
    cmds = st.handle(Tick(1.0, {"a": FunctionLoad(8, 0, 1.0), "b": FunctionLoad(1, 0, 1.0)}))
    # One device: a's first replica takes 0.6 of it; neither a second a nor b fits beside it.
    assert [d.spec.name for d in of(cmds, DeployReplica)] == ["a"]
    assert "compute" in st.functions["b"].unplaced


def _draining_setup():
    from flashpoint.controller.state.events import HostDraining, RequestHost, StartChain

    st = new_state()
    register(st, "h1", cached={"m@1"})
    register(st, "h2")
    register(st, "h3")
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    (dep,) = of(st.handle(Tick(0.0, {})), DeployReplica)
    assert dep.host_id == "h1"  # the holder
    st.handle(ReplicaWarmed(dep.replica_id, {}, 0.5))
    return st, dep, HostDraining, RequestHost, StartChain


def test_eviction_notice_replaces_first_then_drains_and_moves_the_model():
    st, dep, HostDraining, RequestHost, StartChain = _draining_setup()
    cmds = st.handle(HostDraining("h1", deadline_s=120.0, now_s=1.0))
    assert RequestHost("h1") in cmds
    (push,) = of(cmds, StartChain)  # only h1 holds m@1: it goes to a peer before h1 does
    assert push.sender == "h1" and push.receivers in (("h2",), ("h3",))
    # The warm replica keeps serving; a replacement starts elsewhere at once.
    cmds = st.handle(Tick(1.1, {"fn": FunctionLoad(0, 1, 1.1)}))
    (new,) = of(cmds, DeployReplica)
    assert new.host_id != "h1" and not of(cmds, StopAccepting)
    # h1 may still send: the replacement's bytes come from its RAM (or the pushed copy).
    assert new.source is not None
    # Once the replacement is warm, the draining replica stops taking work.
    st.handle(ReplicaWarmed(new.replica_id, {}, 3.0))
    cmds = st.handle(Tick(3.1, {"fn": FunctionLoad(0, 1, 3.1)}))
    assert StopAccepting(dep.replica_id) in cmds
    # Nothing new is ever placed on the draining host.
    for h in ("h2", "h3"):
        st.handle(HostHeartbeat(h, frozenset(), 3.2))
    cmds = st.handle(Tick(3.3, {"fn": FunctionLoad(50, 0, 3.3)}))
    assert all(d.host_id != "h1" for d in of(cmds, DeployReplica))


def test_a_draining_replica_stops_taking_work_before_the_deadline_even_alone():
    st, dep, HostDraining, _, _ = _draining_setup()
    st.handle(HostDraining("h1", deadline_s=20.0, now_s=1.0))
    for h in ("h1", "h2", "h3"):
        st.handle(HostHeartbeat(h, frozenset({"m@1"}) if h == "h1" else frozenset(), 9.0))
    assert StopAccepting(dep.replica_id) not in st.handle(Tick(9.5, {}))
    # drain margin 10 s: at 10 s before the deadline it goes, replacement or not.
    assert StopAccepting(dep.replica_id) in st.handle(Tick(10.0, {}))


def test_a_warm_replica_makes_its_host_a_holder_before_its_next_heartbeat():
    st = new_state()
    register(st, "h1")
    st.handle(FunctionUpserted(spec(min_replicas=1), 100 * MIB))
    (dep,) = of(st.handle(Tick(0.0, {})), DeployReplica)
    assert "m@1" not in st.hosts["h1"].cached_models
    st.handle(ReplicaWarmed(dep.replica_id, {}, 1.0))
    assert "m@1" in st.hosts["h1"].cached_models
    assert not [k for k in st.receiving if k[0] == "h1"]
