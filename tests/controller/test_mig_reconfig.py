"""The controller's MIG reconfiguration as a state machine (controller/state/mig_reconfig.py): events
(what the controller observes, the host's apply outcome) in, commands out; and the events
ControllerState takes from it (UnitsBlocked, UnitsUnblocked, ReplicasRetired), plus the
snapshot the actor builds from the controller's state (controller/mig_driver.observe)."""

from __future__ import annotations

import pytest

from flashpoint.config import load_config
from flashpoint.controller.mig_driver import observe
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FunctionUpserted,
    GpuRecord,
    HostHeartbeat,
    HostRegistered,
    ReplicasRetired,
    ReplicaWarmed,
    StopAccepting,
    Tick,
    UnitsBlocked,
    UnitsUnblocked,
)
from flashpoint.controller.state.mig_reconfig import (
    ApplyMig,
    BlockDevices,
    FunctionView,
    MigApplied,
    MigFailed,
    MigGpuView,
    MigObserved,
    MigReconfigState,
    ReplicaView,
    RetireReplicas,
    UnblockDevices,
)
from flashpoint.errors import BadRequest
from flashpoint.policy.protean import ReconfigParams
from flashpoint.spec import FunctionSpec

from .test_controller_state import load, of

GB = 10**9
SMALL = ("4g", "2g", "1g")


def gpu(i: int, geometry=SMALL, replicas=(), reported=frozenset(), alive=True,
        host="h0") -> MigGpuView:
    ids = tuple(f"cuda:{i}/gi{k}ci0" for k in range(len(geometry)))
    return MigGpuView(host, i, "A100-40GB", tuple(geometry), ids, tuple(replicas),
                      frozenset(reported), alive)


def fn(name: str, be: int = 0, mem: int = 2 * GB, warm: int = 1, starting: int = 0,
       desired: int = 1, unplaced: bool = False) -> FunctionView:
    return FunctionView(name, warm, starting, desired, unplaced, be, 1, mem)


def state(**kw) -> MigReconfigState:
    return MigReconfigState(ReconfigParams(wait_limit=3), interval_s=1.0, **kw)


def run(st: MigReconfigState, t0: float, n: int, gpus, fns, step: float = 1.0) -> list:
    out: list = []
    for k in range(n):
        out += st.handle(MigObserved(t0 + k * step, tuple(gpus), tuple(fns)))
    return out


def test_no_decision_before_any_best_effort_request_was_seen():
    st = state()
    # MIG GPUs with no instances at all, strict load only: no BE model to size slices by
    assert run(st, 0.0, 10, [gpu(0, ()), gpu(1, ())], [fn("strict")]) == []
    assert st.be_model is None and st.counters.decided == 0


def test_fig7_be_model_switch_drains_one_gpu_then_applies_4g_3g():
    """PROTEAN Fig. 7 on two A100-40GB at (4g,2g,1g): BE model A (2 GB batches) fits the
    [1g,2g] set (8 batches over 2 GPUs: 8 of 15 GB); the BE model switches to B (10 GB
    batches): 40 GB per GPU fits no small set, so Alg. 2 wants (4g,3g); after the wait limit
    one GPU (30% of 2, at least 1) is drained and reconfigured, the other is deferred."""
    st = state()
    rep = ReplicaView("a-1", "be-a", "warm")
    g0 = gpu(0, replicas=[rep], reported={"a-1"})
    g1 = gpu(1)
    assert run(st, 0.0, 6, [g0, g1], [fn("be-a", be=8), fn("be-b")]) == []
    assert st.be_model == "be-a" and set(st.targets.values()) == {SMALL}
    # the switch: B's BE requests now, A's none (a-1 is be-a's only warm replica)
    switched = [fn("be-a", warm=1), fn("be-b", be=8, mem=10 * GB)]
    assert run(st, 6.0, 3, [g0, g1], switched) == []  # mismatches 1..3: waiting
    assert st.be_model == "be-b" and set(st.targets.values()) == {("4g", "3g")}
    cmds = run(st, 9.0, 1, [g0, g1], switched)  # the 4th mismatch: reconfigure
    # a-1 waits for a replacement: it is not "elsewhere" although the view was taken
    # before its GPU was blocked
    assert cmds == [BlockDevices("h0", 0, g0.device_ids)]
    assert st.status()["inflight"] == [{"host_id": "h0", "gpu": 0, "phase": "draining",
                                        "target": ["4g", "3g"]}]
    # the next observations in the same interval only advance the drain
    assert st.handle(MigObserved(9.5, (g0, g1), tuple(switched))) == []
    # a replacement of be-a is warm elsewhere: a-1 is retired (once)
    ok = [fn("be-a", warm=2), fn("be-b", be=8, mem=10 * GB)]
    assert st.handle(MigObserved(9.6, (g0, g1), tuple(ok))) == [RetireReplicas(("a-1",))]
    stopping = gpu(0, replicas=[ReplicaView("a-1", "be-a", "stopping")], reported={"a-1"})
    assert st.handle(MigObserved(9.7, (stopping, g1), tuple(ok))) == []
    # the controller stopped it, but the host still reports it: no apply yet (gpu_busy)
    assert st.handle(MigObserved(9.8, (gpu(0, reported={"a-1"}), g1), tuple(ok))) == []
    # the host reports it gone: apply
    assert st.handle(MigObserved(9.9, (gpu(0), g1), tuple(ok))) == [
        ApplyMig("h0", 0, ("4g", "3g"))]
    assert st.handle(MigObserved(10.0, (gpu(0), g1), tuple(ok))) == []  # applying: waits
    done = st.handle(MigApplied("h0", 0, 10.2))
    assert done == [UnblockDevices("h0", 0, g0.device_ids)]
    assert st.counters.applied == 1 and not st.busy()
    # the deferred GPU goes next (its mismatch count kept), GPU 0 now matches
    cmds = st.handle(MigObserved(11.0, (gpu(0, ("4g", "3g")), g1), tuple(ok)))
    assert cmds == [BlockDevices("h0", 1, g1.device_ids), ApplyMig("h0", 1, ("4g", "3g"))]


def test_at_most_30_percent_of_gpus_reconfigure_at_once():
    st = state()
    gpus = [gpu(i, ("7g",)) for i in range(10)]  # all mismatch (7g vs the BE target)
    cmds = run(st, 0.0, 4, gpus, [fn("be", be=20, mem=2 * GB)])
    blocked = of(cmds, BlockDevices)
    assert len(blocked) == 3 and len(st.inflight) == 3  # floor(0.3 * 10)
    # while they are in flight, no more start, however long the others wait
    st.handle(MigObserved(4.0, tuple(gpus), (fn("be", be=20),)))
    assert len(st.inflight) == 3
    for b in blocked:
        st.handle(MigApplied(b.host_id, b.gpu_index, 5.0))
    more = of(st.handle(MigObserved(6.0, tuple(gpus), (fn("be", be=20),))), BlockDevices)
    assert len(more) == 3 and {b.gpu_index for b in more}.isdisjoint(
        {b.gpu_index for b in blocked})


@pytest.mark.parametrize("code", ["gpu_busy", "invalid_geometry", "mig_failed", "peer_lost"])
def test_a_failed_apply_returns_the_gpu_to_service_and_is_counted(code):
    st = state()
    cmds = run(st, 0.0, 4, [gpu(0, ("7g",))], [fn("be", be=4)])  # 8 of [1g,2g]'s 15 GB
    assert ApplyMig("h0", 0, SMALL) in cmds  # nothing on it: applied at once
    out = st.handle(MigFailed("h0", 0, code, "refused", 4.0))
    assert out == [UnblockDevices("h0", 0, gpu(0, ("7g",)).device_ids)]
    assert st.counters.failed == {code: 1} and not st.busy()
    # and Alg. 2 waits its wait limit again before the next try
    assert run(st, 5.0, 3, [gpu(0, ("7g",))], [fn("be", be=4)]) == []
    assert of(run(st, 8.0, 1, [gpu(0, ("7g",))], [fn("be", be=4)]), ApplyMig)


def test_host_lost_and_drain_timeout_return_the_gpu():
    st = state(drain_grace_s=5.0, drain_timeout_s=10.0)
    held = gpu(0, ("7g",), replicas=[ReplicaView("r", "f", "stopping")])
    run(st, 0.0, 4, [held, gpu(1, ("7g",), host="h1")], [fn("be", be=8), fn("f")])
    assert set(st.inflight) == {("h0", 0)}  # one of 2 at once
    # the replica never stops: the drain is abandoned after drain_timeout_s
    out = st.handle(MigObserved(14.0, (held,), (fn("be", be=8),)))
    assert of(out, UnblockDevices) == [UnblockDevices("h0", 0, held.device_ids)]
    assert st.counters.failed == {"drain_timeout": 1}
    # the next decision takes h1's GPU (waited longest); its host then goes silent
    st.handle(MigObserved(15.0, (held, gpu(1, ("7g",), host="h1",
                                           replicas=[ReplicaView("q", "f", "stopping")])),
                          (fn("be", be=8), fn("f"))))
    assert ("h1", 1) in st.inflight
    out = st.handle(MigObserved(15.5, (held, gpu(1, ("7g",), host="h1", alive=False)),
                                (fn("be", be=8),)))
    assert UnblockDevices("h1", 1, gpu(1, ("7g",)).device_ids) in out
    assert st.counters.failed == {"drain_timeout": 1, "host_lost": 1}


def test_which_replicas_are_retired_while_draining():
    st = state(drain_grace_s=5.0)
    reps = [ReplicaView("s", "f-start", "starting"),  # holds no work: at once
            ReplicaView("w", "f-wait", "warm"),  # no warm peer yet: waits
            ReplicaView("u", "f-full", "warm"),  # no capacity elsewhere, nothing starting
            ReplicaView("z", "f-zero", "warm"),  # nobody wants it any more
            ReplicaView("x", "gone", "warm")]  # its function was deleted
    # counts include the replicas on the GPU being drained
    fns = [fn("be", be=8), fn("f-start", warm=0, starting=1), fn("f-wait", warm=1,
           starting=1), fn("f-full", warm=1, unplaced=True), fn("f-zero", warm=1, desired=0)]
    cmds = run(st, 0.0, 4, [gpu(0, ("7g",), replicas=reps)], fns)
    assert of(cmds, RetireReplicas) == [RetireReplicas(("s", "u", "z", "x"))]
    # past the grace the last one goes too, even without a warm peer
    left = gpu(0, ("7g",), replicas=[reps[1]])
    assert st.handle(MigObserved(4.0, (left,), tuple(fns))) == []
    assert st.handle(MigObserved(8.1, (left,), tuple(fns))) == [RetireReplicas(("w",))]


def test_driver_feeds_the_mean_best_effort_queue_over_the_decision_interval():
    from flashpoint.controller.mig_driver import MigDriver

    now = [0.0]
    cc = load_config().controller
    driver = MigDriver(cc, ControllerState(), {}, lambda cmds: None, lambda coro, name: None,
                       lambda: now[0])
    driver.be_began("f")  # t=0: 1 outstanding
    now[0] = 1.0
    driver.be_began("f")  # t=1: 2
    now[0] = 2.0
    driver.be_ended("f")  # t=2: 1, until t=4
    assert driver.be_mean(4.0) == {"f": pytest.approx((1 + 2 + 2) / 4)}
    driver.step(4.0)  # the first step decides (no GPUs): the next interval starts empty
    now[0] = 5.0
    driver.be_ended("f")
    assert driver.be_outstanding == {}
    assert driver.be_mean(6.0) == {"f": pytest.approx(1 / 2)}


def test_mig_config_is_validated():
    cfg = load_config(overrides={"controller": {"mig_reconfigure": True, "mig_interval_s": 2}})
    assert cfg.controller.mig_reconfigure and cfg.controller.mig_interval_s == 2
    with pytest.raises(BadRequest, match="mig_"):
        load_config(overrides={"controller": {"mig_fleet_fraction": 0}})
    with pytest.raises(BadRequest, match="mig_"):
        load_config(overrides={"controller": {"mig_drain_grace_s": 200}})


# ControllerState hooks and the snapshot the driver builds ---------------------------------
def _cluster() -> ControllerState:
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    devs = tuple(DeviceRecord(f"cuda:{g}/gi{k}ci0", "cuda", mem * GB, g, f"{p}.{mem}gb")
                 for g in (0, 1) for k, (p, mem) in enumerate((("4g", 20), ("2g", 10),
                                                               ("1g", 5))))
    st.handle(HostRegistered("h0", devs, 64 * GB, frozenset(), (), 0.0, gpus=(
        GpuRecord(0, "A100-40GB", True), GpuRecord(1, "A100-40GB", True),
        GpuRecord(2, "A100-40GB", True))))  # GPU 2: MIG on, no instances yet
    return st


def test_blocked_units_get_no_placements_and_their_replicas_are_replaced_elsewhere():
    st = _cluster()
    st.handle(FunctionUpserted(FunctionSpec(name="f", model="m", min_replicas=1,
                                            batch_memory_bytes=3 * GB), 100 << 20))
    (d,) = of(st.handle(Tick(0.1, {"f": load()})), DeployReplica)
    st.handle(ReplicaWarmed(d.replica_id, {}, 0.2))
    st.handle(HostHeartbeat("h0", frozenset(), 0.3, frozenset({d.replica_id})))
    gpu_of = int(d.device_id.split(":")[1].split("/")[0])
    snap = observe(st, {"f": 3}, 1.0)
    views = {g.gpu_index: g for g in snap.gpus}
    assert views[gpu_of].geometry == SMALL and views[2].geometry == ()
    assert views[gpu_of].replicas == (ReplicaView(d.replica_id, "f", "warm"),)
    assert views[gpu_of].host_reported == {d.replica_id}
    assert snap.functions == (FunctionView("f", 1, 0, 1, False, 3, 8, 3 * GB),)
    # drain that GPU: nothing more lands there, the replica is not capacity any more
    assert st.handle(UnitsBlocked("h0", views[gpu_of].device_ids)) == []
    placeable = [dev.device_id for host in st.snapshot(1.0).hosts for dev in host.devices]
    assert len(placeable) == 3 and not set(placeable) & set(views[gpu_of].device_ids)
    (r,) = of(st.handle(Tick(1.1, {"f": load()})), DeployReplica)
    assert not r.device_id.startswith(f"cuda:{gpu_of}/")  # the replacement goes elsewhere
    assert (observe(st, {}, 1.2).functions[0].warm,
            observe(st, {}, 1.2).functions[0].starting) == (1, 1)
    st.handle(ReplicaWarmed(r.replica_id, {}, 1.3))
    assert observe(st, {}, 1.4).functions[0].warm == 2
    assert st.handle(ReplicasRetired((d.replica_id, "unknown"))) == [StopAccepting(d.replica_id)]
    assert st.handle(UnitsUnblocked("h0", views[gpu_of].device_ids)) == []
    assert not st.blocked
    assert len([x for h in st.snapshot(2.0).hosts for x in h.devices]) == 6


@pytest.mark.parametrize("error", ["busy", "invalid", "lost", "ok"])
async def test_driver_applies_over_rpc_and_a_refusal_returns_the_gpu(error):
    """The driver's I/O: Alg. 2 decides for a MIG GPU at 7g, its units are blocked, the host's
    apply_mig is called with the geometry; a typed refusal (or a lost connection) unblocks
    the units and is counted by its code, success unblocks them too."""
    from flashpoint.controller.handles import HostHandle
    from flashpoint.controller.mig_driver import MigDriver
    from flashpoint.errors import GpuBusy, InvalidGeometry, PeerLost

    calls: list = []

    class Conn:
        async def call(self, method, payload, timeout_s):
            calls.append((method, payload))
            if error == "busy":
                raise GpuBusy("runs replicas", gpu=0, replicas=["x"])
            if error == "invalid":
                raise InvalidGeometry("no", reason="no_placement")
            if error == "lost":
                raise PeerLost("gone")
            return {"gpu_index": 0, "slices": []}


    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0/gi0ci0", "cuda", 40 * GB, 0,
                                                 "7g.40gb"),), 64 * GB, frozenset(), (), 0.0,
                             gpus=(GpuRecord(0, "A100-40GB", True),)))
    st.handle(FunctionUpserted(FunctionSpec(name="be", model="m", max_batch_size=1,
                                            batch_memory_bytes=2 * GB), 100 << 20))
    spawned: list = []
    cc = load_config(overrides={"controller": {"mig_interval_s": 1.0}}).controller
    now = [0.0]
    driver = MigDriver(cc, st, {"h0": HostHandle(Conn())}, lambda cmds: None,
                       lambda coro, name: spawned.append(coro), lambda: now[0])
    for _ in range(4):  # 4 BE requests outstanding: 8 of [1g,2g]'s 15 GB -> (4g,2g,1g)
        driver.be_began("be")
    for k in range(4):  # the 4th mismatch with 7g: reconfigure
        now[0] = k + 1.0
        driver.step(now[0])
    assert st.blocked == {("h0", "cuda:0/gi0ci0")} and driver.busy()
    (coro,) = spawned
    await coro
    assert calls == [("apply_mig", {"gpu_index": 0, "geometry": ["4g", "2g", "1g"]})]
    assert not st.blocked and not driver.busy()
    status = driver.status()
    if error == "ok":
        assert status["applied"] == 1 and status["failed"] == {}
    else:
        code = {"busy": "gpu_busy", "invalid": "invalid_geometry", "lost": "peer_lost"}[error]
        assert status["applied"] == 0 and status["failed"] == {code: 1}
