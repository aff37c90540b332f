"""RPR's configuration mix applied by ControllerState (controller/state/scaling.py): a
function registered with a FaST profile and the ``rpr`` autoscaler gets replicas of
different (SM share, quota) shapes as the load asks, and loses the lowest-RPR ones first."""

from __future__ import annotations

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FunctionLoad,
    FunctionUpserted,
    HostRegistered,
    ReplicaWarmed,
    StopAccepting,
    Tick,
)
from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.spec import FastProfileSpec, FunctionSpec

from .test_controller_state import of

GIB = 1 << 30
# (sm_share, quota, throughput_rps, p99_latency_s); RPR = T / (S*Q), by hand:
#   s50-q50   T 1.0 / 0.25 = 4   <- the lowest RPR, and the least throughput
#   s50-q100  T 4.0 / 0.5  = 8   <- p_eff
#   s100-q50  T 2.5 / 0.5  = 5
#   s100-q100 T 5.0 / 1.0  = 5
GRID = ((0.5, 0.5, 1.0, 0.05), (0.5, 1.0, 4.0, 0.03), (1.0, 0.5, 2.5, 0.04),
        (1.0, 1.0, 5.0, 0.02))
SMALL, EFF = (0.5, 0.5), (0.5, 1.0)  # (sm_share, time quota)


def new_state(share_policy: str = "fastgshare") -> ControllerState:
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0,
                         autoscaler=make_autoscaler("rpr"), share_policy=share_policy)
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0", "cuda", 40 * GIB),
                                    DeviceRecord("cuda:1", "cuda", 40 * GIB)), 64 * GIB,
                             frozenset(), (), 0.0, gpu_sharing="tokens"))
    st.handle(FunctionUpserted(FunctionSpec(
        name="rpr-fn", model="m", min_replicas=1, max_replicas=8, slo_ms=100,
        fast_profile=FastProfileSpec(1, GRID), gpu_memory_bytes=GIB), 100 << 20))
    return st


def tick(st: ControllerState, now: float, rate: float, **rates: float) -> list:
    cmds = st.handle(Tick(now, {"rpr-fn": FunctionLoad(0, 0, now, arrival_rate=rate,
                                                        replica_rates=rates)}))
    for d in of(cmds, DeployReplica):  # each starts at once
        st.handle(ReplicaWarmed(d.replica_id, {}, now))
    return cmds


def shape(d: DeployReplica) -> tuple[float, float]:
    assert d.share is not None and d.share.time_request == d.share.time_limit
    return (d.share.sm_share, d.share.time_request)


def test_replicas_get_the_shapes_of_rprs_mix_and_the_lowest_rpr_goes_first():
    st = new_state()
    # min_replicas before any load: one replica of p_eff
    (first,) = of(tick(st, 0.1, 0.0), DeployReplica)
    assert shape(first) == EFF
    # λ 4.5 over 4 rps: the 0.5 left is covered most tightly by s50-q50 (1 rps)
    (small,) = of(tick(st, 1.0, 4.5), DeployReplica)
    assert shape(small) == SMALL
    # λ 8 over 5 rps: 3 left; s50-q100 (4) covers it tighter than s100-q100 (5)
    (second,) = of(tick(st, 2.0, 8.0), DeployReplica)
    assert shape(second) == EFF
    assert st.functions["rpr-fn"].desired == 3
    assert {st.replica_config(st.replicas[d.replica_id]) for d in (first, small, second)} == {
        "s50-q50", "s50-q100"}
    # λ 7.5 under 9 rps: dropping the s50-q50 replica (RPR 4) leaves 8 >= 7.5. It is not
    # the most recently warmed one (the rule without a profile would drop that one).
    cmds = tick(st, 3.0, 7.5)
    assert of(cmds, StopAccepting) == [StopAccepting(small.replica_id)]
    assert st.replicas[small.replica_id].phase == ReplicaPhase.STOPPING
    assert of(cmds, DeployReplica) == []


def test_replicas_of_one_shape_go_by_their_measured_rate():
    st = new_state()
    (a,) = of(tick(st, 0.1, 0.0), DeployReplica)
    (b,) = of(tick(st, 1.0, 7.9), DeployReplica)  # 3.9 left: another s50-q100
    assert shape(b) == EFF
    # λ 3: one s50-q100 is enough. The one that served less goes, whichever is newer.
    cmds = tick(st, 2.0, 3.0, **{a.replica_id: 0.5, b.replica_id: 2.5})
    assert of(cmds, StopAccepting) == [StopAccepting(a.replica_id)]


def test_explicit_share_and_other_autoscalers_keep_one_shape():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0,
                         autoscaler=make_autoscaler("rpr"))
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0", "cuda", 40 * GIB),), 64 * GIB,
                             frozenset(), (), 0.0, gpu_sharing="tokens"))
    # an explicit sm_share is the user's shape for every replica: no configurations
    st.handle(FunctionUpserted(FunctionSpec(
        name="rpr-fn", model="m", min_replicas=1, sm_share=0.25, time_quota=0.5,
        fast_profile=FastProfileSpec(1, GRID), gpu_memory_bytes=GIB), 100 << 20))
    assert st.functions["rpr-fn"].configs == ()
    cmds = st.handle(Tick(0.1, {"rpr-fn": FunctionLoad(0, 0, None, arrival_rate=9.0)}))
    assert {shape(d) for d in of(cmds, DeployReplica)} == {(0.25, 0.5)}
    assert st.functions["rpr-fn"].reason.startswith("rpr:unprofiled")


def test_dilu_placement_keeps_the_registered_share():
    # Dilu reserves no quota, so a shape could not be read back: RPR still counts replicas
    # (each taken as p_eff), every one with the registered share
    st = new_state("dilu")
    (first,) = of(tick(st, 0.1, 0.0), DeployReplica)
    (second,) = of(tick(st, 1.0, 4.5), DeployReplica)
    assert first.share == second.share and first.share.time_request == EFF[0]
