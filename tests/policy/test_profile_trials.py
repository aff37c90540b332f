"""The profiler's pure half (policy/profile_trials.py): the request it takes, how a trial is
summarised, and how trials become FaST, PROTEAN and Dilu profiles — each checked against an
independent reference (numpy's percentile, the FBR model's closed form, the placement
policies' own shares, HGSS over a synthetic surface)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashpoint.errors import BadRequest
from flashpoint.policy import profile_trials as pt
from flashpoint.policy.dilu_profile import hgss
from flashpoint.policy.fastgshare import share_from_profile
from flashpoint.policy.share_placement import (
    ReplicaShare,
    ShareDevice,
    ShareRequest,
    place_shared,
)

GIB = 1 << 30


def test_summarise_is_served_over_wall_and_nearest_rank_p99():
    rng = np.random.default_rng(7)
    lat = list(rng.exponential(0.01, size=250))
    r = pt.summarise(pt.TrialPoint(0.5, 1.0), lat, failed=3, wall_s=2.5, device="h/cuda:0")
    assert (r.ok, r.failed) == (250, 3)
    assert r.throughput_rps == pytest.approx(100.0)
    assert r.p99_latency_s == np.percentile(lat, 99, method="inverted_cdf")
    assert r.mean_latency_s == pytest.approx(float(np.mean(lat)))
    assert r.co_located
    empty = pt.summarise(pt.TrialPoint(0.5, 1.0), [], failed=4, wall_s=1.0)
    assert (empty.ok, empty.throughput_rps) == (0, 0.0)
    assert not pt.summarise(pt.TrialPoint(0.5, 1.0, replicas=2), [0.1], 0, 1.0,
                            device="h/cuda:0,h/cuda:1").co_located


def test_request_defaults_validation_and_grid():
    req = pt.ProfileRequest.from_dict({})
    assert req == pt.ProfileRequest()
    assert [(p.sm_share, p.time_quota) for p in req.fast_grid()] == [
        (0.5, 0.5), (0.5, 1.0), (1.0, 0.5), (1.0, 1.0)]
    req = pt.ProfileRequest.from_dict({"sm_shares": [1, 0.25], "quotas": [0.5], "batch": 4,
                                       "requests": 3, "protean": True, "colocate": 3,
                                       "inputs": {"ignored": "by the policy"}})
    assert req.sm_shares == (0.25, 1.0) and req.batch == 4
    assert req.colocated_point() == pt.TrialPoint(round(1 / 3, 6), 1.0, 4, 3)
    assert req.solo_point() == pt.TrialPoint(1.0, 1.0, 4)
    assert pt.ProfileRequest.from_dict(req.to_dict()) == req
    for bad in ({"sm_shares": [0]}, {"quotas": [1.5]}, {"quotas": []},
                {"sm_shares": [0.5, 0.5]}, {"requests": 0}, {"colocate": 1},
                {"batch": True}, {"fast": "yes"}, {"timeout_s": 0}, {"slo_ms": -1},
                {"grid": [1]}, {"fast": False}, []):
        with pytest.raises(BadRequest):
            pt.ProfileRequest.from_dict(bad)


def _result(point: pt.TrialPoint, rps: float, p99_s: float, device: str = "h/cuda:0",
            mean_s: float | None = None) -> pt.TrialResult:
    return pt.TrialResult(point, 10, 0, 10 / rps, rps, p99_s, mean_s or p99_s / 2, device)


def test_fast_profile_is_the_grid_and_share_from_profile_reads_it():
    req = pt.ProfileRequest(sm_shares=(0.5, 1.0), quotas=(0.5, 1.0), batch=2)
    rps = {(0.5, 0.5): 40.0, (0.5, 1.0): 90.0, (1.0, 0.5): 50.0, (1.0, 1.0): 100.0}
    results = [_result(p, rps[(p.sm_share, p.time_quota)], 0.02) for p in req.fast_grid()]
    prof = pt.fast_profile("fn", results, req.batch)
    assert prof.batch == 2 and prof.lookup(0.5, 1.0).throughput_rps == 90.0
    # RPR's p_eff: T / (S*Q) is 160, 180, 100, 100 -> s50-q100
    assert share_from_profile(prof).config == "s50-q100"
    with pytest.raises(BadRequest, match="full grid"):
        pt.fast_profile("fn", results[:-1], 2)


def test_protean_fit_is_the_slowdown_over_the_copies():
    solo = _result(pt.TrialPoint(1.0, 1.0), 100.0, 0.02, mean_s=0.012)
    # two copies serve 120 rps together: 60 each, slowdown 100/60; Eq. 2 with 2 batches:
    # 2 * FBR = 5/3
    co = _result(pt.TrialPoint(0.5, 1.0, 1, 2), 120.0, 0.05)
    got = pt.protean_fit("fn", solo, [co])
    assert got.fbr == pytest.approx((100 / 60) / 2)
    assert (got.slice, got.solo_s, got.fbr_bounded) == ("7g", 0.012, False)
    # no slowdown: FBR is only bounded above by 1/2 (2 * FBR <= 1)
    free = pt.protean_fit("fn", solo, [_result(pt.TrialPoint(0.5, 1.0, 1, 2), 200.0, 0.02)])
    assert free.fbr_bounded and free.fbr == pytest.approx(0.5)
    spread = _result(pt.TrialPoint(0.5, 1.0, 1, 2), 120.0, 0.05, device="h/cuda:0,h/cuda:1")
    with pytest.raises(BadRequest, match="one device"):
        pt.protean_fit("fn", solo, [spread])


def test_hgss_over_trials_of_a_synthetic_surface():
    """HGSS through dilu_point / dilu_trial: the trials it asks for are the points it
    names, and a trial that served nothing misses every budget."""
    asked: list[pt.TrialPoint] = []

    def measure(ibs: int, smr: int):
        point = pt.dilu_point(ibs, smr)
        asked.append(point)
        latency = ibs * 0.01 / (smr / 100)  # one batch: 10 ms of work per item at 100%
        return pt.dilu_trial(_result(point, ibs / latency, latency))

    got = hgss(measure, slo_s=0.2)  # budget t_exec = 100 ms
    # by hand: (1, 10%) takes 100 ms: met. (2, 10%) 200 ms: missed, (2, 20%) 100 ms: met,
    # TE 20/20 = 1.0 as at (1, 10%) (10/10): accepted. (4, 20%) 200 ms and (4, 30%) 133 ms
    # both miss: stop at (2, 20%), limit 2 x 20%.
    assert got is not None
    assert (got.sm_request, got.sm_limit, got.ibs) == (0.2, 0.4, 2)
    assert [(p.batch, round(p.sm_share * 100)) for p in asked] == [
        (1, 10), (2, 10), (2, 20), (4, 20), (4, 30)]
    assert all(p.sm_share == p.time_quota == p.sm_limit and p.replicas == 1 for p in asked)
    miss = pt.dilu_trial(pt.summarise(pt.TrialPoint(0.1, 0.1), [], 5, 1.0))
    assert math.isinf(miss.latency_s) and miss.throughput_rps == 0.0


@pytest.mark.parametrize("policy", ["fastgshare", "dilu"])
def test_a_live_share_is_what_placement_gives_that_point(policy):
    """trial_share mirrors share_placement: the share a new replica of the trial's spec
    would get on an empty GPU under the same policy."""
    point = pt.TrialPoint(0.3, 0.6, sm_limit=0.45 if policy == "dilu" else 0.0)
    placed = place_shared(policy, [ShareDevice("h", "cuda:0", 40 * GIB)], ShareRequest(
        "fn", ("r1",), point.sm_share, point.sm_limit, point.time_quota, GIB, False))
    assert placed.placements
    current = ReplicaShare(1.0, 1.0, 1.0, GIB, False)
    assert pt.trial_share(policy, point, current) == placed.placements[0].share
