"""The profiler's run (controller/profiler.py) with its trial I/O faked: which trials it
asks for, that each point is measured once, that a one-replica trial reuses the deployed
shadow when its share can change live, that every shadow it deployed is removed — also when
a trial fails or the run times out — and what it stores. The live half (deploying, driving
requests) runs in tests/cluster/test_profile.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from flashpoint.controller.profiler import Profiler, _Shadow, sample_inputs
from flashpoint.errors import BadRequest, Conflict, DeadlineExceeded, FunctionNotFound, Unavailable
from flashpoint.policy import profile_trials as pt
from flashpoint.policy.fastgshare import FunctionProfile, ProfilePoint, share_from_profile
from flashpoint.policy.share_placement import resolve_share
from flashpoint.spec import FunctionSpec, TensorSpec

SPEC = FunctionSpec(name="fn", model="m", inputs=(TensorSpec("x", "FP32", (-1, 3)),))


@dataclass
class _Host:
    host_id: str
    gpu_sharing: str = "tokens"
    alive: bool = True
    draining: bool = False


@dataclass
class _Rec:
    spec: FunctionSpec
    share_reason: str = ""


@dataclass
class _State:
    share_policy: str = "fastgshare"
    hosts: dict[str, Any] = field(default_factory=lambda: {"h0": _Host("h0")})
    functions: dict[str, Any] = field(default_factory=lambda: {"fn": _Rec(SPEC)})


class _Catalog:
    """The FunctionCatalog calls the profiler makes outside its trials."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.stored: dict[str, Any] = {}

    def registered_spec(self, name: str) -> FunctionSpec:
        if name not in self.state.functions:
            raise FunctionNotFound(name)
        return self.state.functions[name].spec

    async def store_profiles(self, name: str, **profiles: Any) -> FunctionSpec:
        import dataclasses

        self.stored = profiles
        spec = dataclasses.replace(self.registered_spec(name), **profiles)
        resolved, why = resolve_share(spec, self.state.share_policy)
        self.state.functions[name] = _Rec(resolved, why)
        return spec


class FakeProfiler(Profiler):
    """Trials answered from a synthetic surface: throughput = 100 * S * Q per replica,
    latency 1 / that; ``live`` says whether a share can change on a deployed replica."""

    def __init__(self, state: _State, live: bool = True, fail_at: pt.TrialPoint | None = None,
                 hang: bool = False) -> None:
        super().__init__(_Catalog(state), state, None, {}, lambda ev: None,  # type: ignore[arg-type]
                         lambda: None)
        self.live, self.fail_at, self.hang = live, fail_at, hang
        self.deployed: list[pt.TrialPoint] = []
        self.removed: list[str] = []
        self.driven: list[pt.TrialPoint] = []

    async def deploy(self, spec: FunctionSpec, point: pt.TrialPoint) -> _Shadow:
        self.deployed.append(point)
        return _Shadow(spec, point, [f"r{len(self.deployed)}"])

    async def remove(self, name: str) -> None:
        self.removed.append(name)

    async def reshare(self, sh: _Shadow, point: pt.TrialPoint) -> bool:
        if not self.live or sh.point.replicas != 1 or point.replicas != 1 \
                or sh.point.batch != point.batch:
            return False
        sh.point = point
        return True

    async def drive(self, sh: _Shadow, arrays: dict[str, np.ndarray],
                    requests: int) -> pt.TrialResult:
        p = sh.point
        self.driven.append(p)
        if p == self.fail_at:
            raise Unavailable("trial replicas went away")
        if self.hang:
            await asyncio.Event().wait()
        rps = 100.0 * p.sm_share * p.time_quota * p.replicas / (1 + 0.5 * (p.replicas - 1))
        lat = p.batch / (100.0 * p.sm_share * p.time_quota)
        return pt.summarise(p, [lat] * requests, 0, requests / rps, "h0/cuda:0")


async def test_a_full_run_measures_each_point_once_and_stores_three_profiles():
    state = _State()
    prof = FakeProfiler(state)
    req = pt.ProfileRequest(protean=True, dilu=True, slo_ms=3000.0, dilu_max_ibs=1,
                            requests=4)
    answer = await prof.profile("fn", req)
    grid = list(req.fast_grid())
    # FaST's grid, then Solo (= the grid's (1, 1): not run again), HGSS's (IBS 1, 10%:
    # 1 s within the 1.5 s budget), then the co-located pair
    assert prof.driven == [*grid, pt.dilu_point(1, 10), req.colocated_point()]
    # one deploy for every one-replica trial (shares changed live), one for the pair
    assert prof.deployed == [grid[0], req.colocated_point()]
    assert len(prof.removed) == 2 and answer["deploys"] == 2
    assert answer["stored"] == ["batch_fbr", "dilu_profile", "fast_profile", "protean_profile"]
    # the stored FaST profile is the trials' numbers; the share resolves from it
    ref = share_from_profile(FunctionProfile("fn", tuple(
        ProfilePoint(p.sm_share, p.time_quota, 100.0 * p.sm_share * p.time_quota,
                     1 / (100.0 * p.sm_share * p.time_quota)) for p in grid), 1))
    assert (answer["share"]["sm_share"], answer["share"]["time_quota"]) == (
        ref.sm_share, ref.time_quota)
    # PROTEAN: Solo serves 100 rps; the pair (S 0.5 each) 100 * 0.5 * 2 / 1.5 together, a
    # third of Solo each: slowdown 3 = 2 * FBR (Eq. 2 with two batches)
    assert prof.functions.stored["protean_profile"].slices[0].fbr == pytest.approx(1.5)
    # the dispatcher's batch_fbr: a batch of max_batch_size (8) = 8 trial batches of 1
    assert prof.functions.stored["batch_fbr"] == pytest.approx(1.5 * 8)
    assert prof.functions.stored["dilu_profile"].sm_request == 0.1
    assert "fn" not in prof._running


async def test_without_live_shares_every_point_deploys_and_every_shadow_is_removed():
    prof = FakeProfiler(_State(), live=False)
    await prof.profile("fn", pt.ProfileRequest(requests=2))
    assert len(prof.deployed) == 4 and len(prof.removed) == 4


async def test_a_failed_trial_removes_its_shadow_and_stores_nothing():
    req = pt.ProfileRequest(requests=2)
    prof = FakeProfiler(_State(), fail_at=req.fast_grid()[1])
    with pytest.raises(Unavailable):
        await prof.profile("fn", req)
    assert len(prof.removed) == len(prof.deployed) == 1
    assert prof.functions.stored == {} and "fn" not in prof._running


async def test_a_run_past_its_limit_is_deadline_exceeded_and_cleans_up():
    prof = FakeProfiler(_State(), hang=True)
    with pytest.raises(DeadlineExceeded, match="timeout_s=0.2"):
        await prof.profile("fn", pt.ProfileRequest(requests=2, timeout_s=0.2))
    assert len(prof.removed) == len(prof.deployed) == 1


async def test_hgss_without_an_slo_and_a_spread_pair_are_notes_not_failures():
    prof = FakeProfiler(_State())

    async def spread_drive(sh, arrays, requests):
        r = await FakeProfiler.drive(prof, sh, arrays, requests)
        if sh.point.replicas > 1:
            from dataclasses import replace

            r = replace(r, device="h0/cuda:0,h0/cuda:1")
        return r

    prof.drive = spread_drive  # type: ignore[method-assign]
    answer = await prof.profile("fn", pt.ProfileRequest(fast=False, protean=True, dilu=True,
                                                        requests=2))
    assert answer["stored"] == [] and answer["protean_profile"] is None
    assert any(n.startswith("dilu: no SLO") for n in answer["notes"])
    assert any("one device" in n for n in answer["notes"])


async def test_refusals():
    with pytest.raises(FunctionNotFound):
        await FakeProfiler(_State()).profile("nope", pt.ProfileRequest())
    unshared = _State(hosts={"h0": _Host("h0", gpu_sharing="none")})
    with pytest.raises(Conflict, match="gpu_sharing"):
        await FakeProfiler(unshared).profile("fn", pt.ProfileRequest())
    prof = FakeProfiler(_State())
    prof._running.add("fn")
    with pytest.raises(Conflict, match="being profiled"):
        await prof.profile("fn", pt.ProfileRequest())
    with pytest.raises(BadRequest, match="declares no inputs"):
        sample_inputs(FunctionSpec(name="g", model="m"))
    x = sample_inputs(SPEC)["x"]
    assert x.shape == (1, 3) and x.dtype == np.float32 and not x.any()
