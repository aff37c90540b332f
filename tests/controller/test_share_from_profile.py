"""FaST profile -> share: a function registered with a FaST-GShare profile and no sm_share
gets the SM share and time quota of RPR's most efficient configuration meeting its SLO
(policy/fastgshare.share_from_profile), chosen by ControllerState when it registers and
carried by DeployReplica onto a sharing host's GPU."""

from __future__ import annotations

import pytest

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FunctionUpserted,
    HostRegistered,
    ReplicaShareChanged,
    Tick,
)
from flashpoint.errors import BadRequest
from flashpoint.policy.fastgshare import share_from_profile
from flashpoint.policy.share_placement import ReplicaShare, resolve_share
from flashpoint.spec import (
    DiluProfileSpec,
    FastProfileSpec,
    FunctionSpec,
    ProteanProfileSpec,
    ProteanSliceSpec,
)

from .test_controller_state import load, of

GIB = 1 << 30
# (sm_share, quota, throughput_rps, p99_latency_s). RPR = T / (S*Q):
#   s25-q50  40/0.125 = 320  p99 80 ms   <- the most efficient overall
#   s25-q100 76/0.25  = 304  p99 70 ms   (5% below: no tie within 2%)
#   s50-q50  60/0.25  = 240  p99 40 ms
#   s50-q100 120/0.5  = 240  p99 30 ms   <- the most efficient within a 50 ms SLO (tie: lower p99)
#   s100-q50 70/0.5   = 140  p99 35 ms
#   s100-q100 140/1.0 = 140  p99 20 ms   <- the fastest, when nothing meets 10 ms
GRID = ((0.25, 0.5, 40.0, 0.080), (0.25, 1.0, 76.0, 0.070), (0.5, 0.5, 60.0, 0.040),
        (0.5, 1.0, 120.0, 0.030), (1.0, 0.5, 70.0, 0.035), (1.0, 1.0, 140.0, 0.020))
PROFILE = FastProfileSpec(4, GRID)


@pytest.mark.parametrize("slo_s,expect", [
    (0.0, (0.25, 0.5, "s25-q50", True)),
    (0.050, (0.5, 1.0, "s50-q100", True)),
    (0.010, (1.0, 1.0, "s100-q100", False)),
])
def test_share_from_profile_is_rprs_most_efficient_config_within_the_slo(slo_s, expect):
    c = share_from_profile(PROFILE.to_profile("fn"), slo_s)
    assert (c.sm_share, c.time_quota, c.config, c.slo_met) == expect
    # the choice is a measured grid point, not an interpolation
    assert (c.sm_share, c.time_quota, c.throughput_rps, c.p99_latency_s) in GRID


def test_an_slo_between_points_excludes_the_slower_ones():
    # 75 ms: s25-q50 (80 ms) is out, s25-q100 (70 ms, RPR 304) is the best left
    c = share_from_profile(PROFILE.to_profile("fn"), 0.075)
    assert (c.sm_share, c.time_quota, c.config) == (0.25, 1.0, "s25-q100")


def test_resolve_share_explicit_share_wins_and_limit_is_raised():
    explicit = FunctionSpec(name="fn", model="m", sm_share=0.3, fast_profile=PROFILE)
    assert resolve_share(explicit) == (explicit, "")
    plain = FunctionSpec(name="fn", model="m")
    assert resolve_share(plain) == (plain, "")
    spec, why = resolve_share(FunctionSpec(name="fn", model="m", slo_ms=50,
                                           fast_profile=PROFILE, sm_limit=0.3))
    assert (spec.sm_share, spec.time_quota, spec.sm_limit) == (0.5, 1.0, 0.5)
    assert "s50-q100" in why
    spec, why = resolve_share(FunctionSpec(name="fn", model="m", slo_ms=10,
                                           fast_profile=PROFILE))
    assert spec.sm_share == 1.0 and "no configuration meets" in why


def test_profile_round_trips_and_bad_grids_are_refused():
    spec = FunctionSpec(name="fn", model="m", fast_profile=PROFILE, batch_memory_bytes=GIB)
    back = FunctionSpec.from_dict(spec.to_dict())
    assert back == spec and back.fast_profile.points == GRID
    with pytest.raises(BadRequest, match="full grid"):  # one point missing
        FunctionSpec(name="fn", model="m", fast_profile=FastProfileSpec(1, GRID[:-1]))
    with pytest.raises(BadRequest):  # an SM share outside (0, 1]
        FunctionSpec(name="fn", model="m", fast_profile=FastProfileSpec(
            1, ((1.5, 1.0, 10.0, 0.01),)))
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict({"name": "fn", "model": "m",
                                "fast_profile": {"batch": 1, "points": [{"sm_share": 1}]}})
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict({"name": "fn", "model": "m", "batch_memory_bytes": -1})


def test_controller_state_places_a_profiled_function_with_the_chosen_share():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0", "cuda", 40 * GIB),), 64 * GIB,
                             frozenset(), (), 0.0, gpu_sharing="mps"))
    st.handle(FunctionUpserted(FunctionSpec(
        name="fn", model="m", min_replicas=2, replica_concurrency=1, slo_ms=50,
        fast_profile=PROFILE, gpu_memory_bytes=2 * GIB), 100 << 20))
    rec = st.functions["fn"]
    assert (rec.spec.sm_share, rec.spec.time_quota) == (0.5, 1.0)
    assert "s50-q100" in rec.share_reason
    deploys = of(st.handle(Tick(0.1, {"fn": load()})), DeployReplica)
    # FaST: rectangles of 0.5 SM x 1.0 time; two fill the GPU exactly
    assert [d.share for d in deploys] == [ReplicaShare(0.5, 1.0, 1.0, 2 * GIB)] * 2
    assert {d.device_id for d in deploys} == {"cuda:0"}
    # a third does not fit the unit square any more: it stays unplaced, never overcommits
    st.handle(FunctionUpserted(FunctionSpec(
        name="fn", model="m", min_replicas=3, replica_concurrency=1, slo_ms=50,
        fast_profile=PROFILE, gpu_memory_bytes=2 * GIB), 100 << 20))
    assert of(st.handle(Tick(0.2, {"fn": load()})), DeployReplica) == []
    assert st.functions["fn"].unplaced


DILU = DiluProfileSpec(0.3, 0.6, 4, 80.0, 5)


def test_resolve_share_reads_a_dilu_profile_and_the_policy_picks_between_two():
    spec, why = resolve_share(FunctionSpec(name="fn", model="m", dilu_profile=DILU))
    assert (spec.sm_share, spec.sm_limit, spec.time_quota) == (0.3, 0.6, 0.0)
    assert why.startswith("dilu profile: request 0.3, limit 0.6 at IBS 4")
    both = FunctionSpec(name="fn", model="m", slo_ms=50, fast_profile=PROFILE, dilu_profile=DILU)
    assert resolve_share(both)[0].sm_share == 0.5  # FaST's, under fastgshare
    assert resolve_share(both, "dilu")[0].sm_share == 0.3  # Dilu's, under dilu
    only_fast = FunctionSpec(name="fn", model="m", slo_ms=50, fast_profile=PROFILE)
    assert resolve_share(only_fast, "dilu")[0].sm_share == 0.5  # the one it has
    explicit = FunctionSpec(name="fn", model="m", sm_share=0.2, dilu_profile=DILU)
    assert resolve_share(explicit, "dilu") == (explicit, "")


def test_protean_and_dilu_profiles_round_trip_and_bad_ones_are_refused():
    protean = ProteanProfileSpec(2, (ProteanSliceSpec("7g", 0.01, 0.4, False, 1 << 20),
                                     ProteanSliceSpec("3g", 0.02, 0.9, True)))
    spec = FunctionSpec(name="fn", model="m", protean_profile=protean, dilu_profile=DILU,
                        time_quota=0.5)  # a quota needs a share, or a profile to pick it
    assert FunctionSpec.from_dict(spec.to_dict()) == spec
    for bad in ({"protean_profile": {"batch": 1, "slices": []}},
                {"protean_profile": {"batch": 1, "slices": [{"slice": "7g", "solo_s": -1,
                                                             "fbr": 0.1}]}},
                {"protean_profile": {"batch": 1, "slices": [
                    {"slice": "7g", "solo_s": 1, "fbr": 0.1}] * 2}},
                {"dilu_profile": {"sm_request": 0.5, "sm_limit": 0.4, "ibs": 1,
                                  "throughput_rps": 1}},
                {"dilu_profile": {"sm_request": 0.5, "sm_limit": 0.5, "ibs": 0,
                                  "throughput_rps": 1}},
                {"dilu_profile": {"sm_request": 0.5}}):
        with pytest.raises(BadRequest):
            FunctionSpec.from_dict({"name": "fn", "model": "m", **bad})
    with pytest.raises(BadRequest):  # a quota with neither a share nor a profile
        FunctionSpec(name="fn", model="m", time_quota=0.5)


def test_a_live_share_change_is_what_placement_accounts_from_then_on():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0", "cuda", 40 * GIB),), 64 * GIB,
                             frozenset(), (), 0.0, gpu_sharing="tokens"))
    st.handle(FunctionUpserted(FunctionSpec(name="fn", model="m", min_replicas=1,
                                            sm_share=0.25, time_quota=0.5,
                                            gpu_memory_bytes=GIB), 100 << 20))
    (deploy,) = of(st.handle(Tick(0.1, {"fn": load()})), DeployReplica)
    bigger = ReplicaShare(1.0, 1.0, 1.0, GIB)
    assert st.handle(ReplicaShareChanged(deploy.replica_id, bigger)) == []
    assert st.replicas[deploy.replica_id].share == bigger
    assert st.handle(ReplicaShareChanged("gone", bigger)) == []  # unknown: nothing
    # the GPU is full now: a second function's replica finds no room on it
    st.handle(FunctionUpserted(FunctionSpec(name="g", model="m", min_replicas=1,
                                            sm_share=0.25, time_quota=0.5,
                                            gpu_memory_bytes=GIB), 100 << 20))
    assert of(st.handle(Tick(0.2, {"fn": load(), "g": load()})), DeployReplica) == []
