"""Autoscaler plug-ins, the wrapper and make_autoscaler: hand-computed examples and properties."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashpoint.policy
from flashpoint.errors import BadRequest
from flashpoint.policy import autoscalers as p
from flashpoint.policy.autoscale import (
    POLICIES,
    AutoscalerMemory,
    LimitMemory,
    LimitParams,
    decide,
    limit,
    make_autoscaler,
)
from flashpoint.policy.autoscalers import Proposal
from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.rpr import RprParams, plan, rpr
from flashpoint.policy.snapshot import FunctionLoadSnapshot


def ld(**kw) -> FunctionLoadSnapshot:
    base = dict(name="f", now_s=100.0, queued=0, inflight=0, replicas_warm=0, replicas_starting=0,
                last_request_s=None, min_replicas=0, max_replicas=100, replica_concurrency=1,
                keep_alive_s=30.0)
    base.update(kw)
    return FunctionLoadSnapshot(**base)


def run(policy, params, loads, memory=None):
    """Feed snapshots through a plug-in; return every proposal and the final memory."""
    out = []
    for load in loads:
        proposal, memory = policy(load, params, memory)
        out.append(proposal)
    return out, memory


# ATL --------------------------------------------------------------------------------------
def test_atl_is_p99_arrival_rate_times_exec_time():
    loads = [ld(now_s=t, arrival_rate=lam, exec_time_s=0.5) for t, lam in ((0, 10), (1, 30), (2, 20))]
    props, mem = run(p.atl, p.AtlParams(), loads, p.Samples())
    # p99 of {10, 30} then {10, 30, 20} is 30; 30 req/s × 0.5 s = 15 replicas.
    assert [x.desired for x in props] == [5, 15, 15]
    assert props[-1].reason == "atl"
    # Window 60 s: at t=70 only the new sample is left: 5 × 0.5 = 2.5 -> 3.
    prop, _ = p.atl(ld(now_s=70, arrival_rate=5, exec_time_s=0.5), p.AtlParams(), mem)
    assert prop.desired == 3


def test_atl_is_independent_of_current_state_and_divides_by_concurrency():
    mem = p.Samples(((0.0, 30.0),))
    for warm, starting in ((0, 0), (3, 1), (40, 0)):
        prop, _ = p.atl(ld(now_s=0.5, arrival_rate=10, exec_time_s=0.5, replicas_warm=warm,
                           replicas_starting=starting), p.AtlParams(), mem)
        assert prop.desired == 15
    prop, _ = p.atl(ld(now_s=0.5, arrival_rate=10, exec_time_s=0.5, replica_concurrency=4),
                    p.AtlParams(), mem)
    assert prop.desired == 4  # 15 / 4 -> 4
    prop, _ = p.atl(ld(now_s=0.5, arrival_rate=10, replica_rate=7.0), p.AtlParams(), mem)
    assert prop.desired == 5  # 30 / 7 -> 5: a profiled replica rate wins over exec time


def test_atl_samples_at_most_every_sample_s_and_counts_the_current_rate():
    mem = p.Samples()
    for t in (0.0, 0.3, 0.6, 1.0):
        _, mem = p.atl(ld(now_s=t, arrival_rate=1, exec_time_s=1), p.AtlParams(), mem)
    assert [t for t, _ in mem.points] == [0.0, 1.0]
    prop, mem2 = p.atl(ld(now_s=1.5, arrival_rate=9, exec_time_s=1), p.AtlParams(), mem)
    assert prop.desired == 9 and mem2 == mem  # a burst counts before it is sampled


def test_atl_without_profile_falls_back_to_concurrency():
    prop, _ = p.atl(ld(queued=3, arrival_rate=50), p.AtlParams(), p.Samples())
    assert prop == Proposal(3, "atl:unprofiled")


def test_percentile_nearest_rank():
    values = list(range(100, 0, -1))
    assert p.percentile(values, 99) == 99
    assert p.percentile(values, 100) == 100
    assert p.percentile([4.0], 99) == 4.0
    assert p.percentile([], 99) == 0.0
    assert p.ceil_count(280 / 70) == 4 and p.ceil_count(4.2) == 5 and p.ceil_count(-1) == 0


# TSK --------------------------------------------------------------------------------------
def test_tsk_scales_by_latency_ratio_in_one_batch():
    prop, mem = p.tsk(ld(now_s=0, replicas_warm=2, queued=50, queue_latency_s=21), p.TskParams(),
                      p.Held())
    assert prop == Proposal(6, "tsk:up")  # 2 × 21 / 7
    # Inside the 15 s sync period the answer stands, however the queue grows.
    prop, mem2 = p.tsk(ld(now_s=10, replicas_warm=2, queue_latency_s=70), p.TskParams(), mem)
    assert prop.desired == 6 and mem2 == mem
    prop, _ = p.tsk(ld(now_s=15, replicas_warm=6, queue_latency_s=70), p.TskParams(), mem)
    assert prop.desired == 12  # 6 × 70 / 7 = 60, held to the HPA's ×2 per 15 s
    uncapped = p.TskParams(max_scale_up_ratio=1000)
    prop, _ = p.tsk(ld(now_s=15, replicas_warm=6, queue_latency_s=70), uncapped, mem)
    assert prop.desired == 60


def test_tsk_hpa_scale_up_policies_double_or_add_four():
    """Kubernetes' default scaleUp: Percent 100 and Pods 4 per 15 s, selectPolicy Max."""
    cases = [(1, 5), (2, 6), (4, 8), (5, 10), (30, 60)]  # (current, cap): max(2n, n + 4)
    for cur, cap in cases:
        prop, _ = p.tsk(ld(replicas_warm=cur, queued=1, queue_latency_s=7000), p.TskParams(),
                        p.Held())
        assert prop == Proposal(cap, "tsk:up"), cur
    # Two evaluations a period apart: ×2 each, never the ratio's ×1000 at once.
    prop, mem = p.tsk(ld(now_s=0, replicas_warm=10, queue_latency_s=7000), p.TskParams(),
                      p.Held())
    prop, _ = p.tsk(ld(now_s=15, replicas_warm=prop.desired, queue_latency_s=7000),
                    p.TskParams(), mem)
    assert prop.desired == 40
    with pytest.raises(BadRequest, match="max_scale_up_pods"):
        p.TskParams(max_scale_up_pods=0)


def test_tsk_tolerance_and_scale_down_floor():
    prop, _ = p.tsk(ld(replicas_warm=4, queue_latency_s=7.5), p.TskParams(), p.Held())
    assert prop == Proposal(4, "tsk:steady")  # within 10% of the target
    # Empty queue: an HPA would go to 0; we keep the 3 replicas busy with in-flight requests.
    prop, _ = p.tsk(ld(replicas_warm=5, inflight=3, queue_latency_s=0), p.TskParams(), p.Held())
    assert prop == Proposal(3, "tsk:down")
    prop, _ = p.tsk(ld(replicas_warm=5, queue_latency_s=0), p.TskParams(), p.Held())
    assert prop.desired == 0
    assert make_autoscaler("tsk").limits.scale_down_delay_s == 300.0


# OWK --------------------------------------------------------------------------------------
def test_owk_hpa_ratio():
    prop, _ = p.owk(ld(replicas_warm=4, utilisation=0.9), p.OwkParams(), p.Held())
    assert prop == Proposal(6, "owk:up")  # ceil(4 × 0.9 / 0.6)
    prop, _ = p.owk(ld(replicas_warm=4, utilisation=0.63), p.OwkParams(), p.Held())
    assert prop == Proposal(4, "owk:steady")
    prop, _ = p.owk(ld(replicas_warm=4, utilisation=0.15), p.OwkParams(), p.Held())
    assert prop == Proposal(1, "owk:down")
    # Utilisation not measured: credits in use, 3 of 2 × 2.
    prop, _ = p.owk(ld(replicas_warm=2, inflight=3, replica_concurrency=2), p.OwkParams(), p.Held())
    assert prop.desired == 3  # ceil(2 × 0.75 / 0.6)


def test_owk_at_most_doubles_or_adds_four_per_step():
    prop, _ = p.owk(ld(replicas_warm=1, utilisation=1.0), p.OwkParams(), p.Held())
    assert prop.desired == 2
    low = p.OwkParams(target_utilisation=0.2)
    prop, mem = p.owk(ld(now_s=0, replicas_warm=2, utilisation=1.0), low, p.Held())
    assert prop.desired == 6  # ceil(2 × 1 / 0.2) = 10, capped at max(2 × 2, 2 + 4)
    prop, _ = p.owk(ld(now_s=15, replicas_warm=4, utilisation=1.0), low, mem)
    assert prop.desired == 8  # 20 wanted, max(2 × 4, 4 + 4)
    prop, _ = p.owk(ld(now_s=15, replicas_warm=2, utilisation=1.0),
                    p.OwkParams(target_utilisation=0.2, max_scale_up_pods=1), mem)
    assert prop.desired == 4  # with Pods 1 the ×2 policy is the larger


def test_owk_starting_replicas_idle_going_up_busy_going_down():
    # Up: 2 warm at 90% want 3, but 4 are already coming: no second scale-up.
    prop, _ = p.owk(ld(replicas_warm=2, replicas_starting=2, utilisation=0.9), p.OwkParams(), p.Held())
    assert prop.desired == 4
    # Down: 4 warm at 15% and 2 starting counted busy: ceil((0.6 + 2) / 0.6) = 5 of 6.
    prop, _ = p.owk(ld(replicas_warm=4, replicas_starting=2, utilisation=0.15), p.OwkParams(), p.Held())
    assert prop.desired == 5
    prop, _ = p.owk(ld(replicas_starting=2, queued=9), p.OwkParams(), p.Held())
    assert prop == Proposal(2, "owk:no_metric")


# SM* --------------------------------------------------------------------------------------
def test_smstar_invocations_per_replica_over_the_window():
    loads = [ld(now_s=t, invocations_total=n) for t, n in ((0, 0), (30, 100), (60, 280), (90, 300))]
    props, mem = run(p.smstar, p.SmStarParams(), loads, p.Samples())
    # t=60: 280 in the minute / 70 = 4; t=90: 300 - 100 = 200 in [30, 90] -> 3.
    assert [x.desired for x in props] == [0, 2, 4, 3]
    prop, _ = p.smstar(ld(now_s=91, invocations_total=5), p.SmStarParams(), mem)
    assert prop.desired == 0  # counter went back: a restart, the window starts over


# Eq 4.12 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lam,desired,reason", [
    (40.0, 4, "eq412:up"),     # μ 30 <= λ − ρ_L·μ₁ = 35: up to ceil(40 / 10)
    (33.0, 3, "eq412:keep"),   # 28 < 30 < 53
    (20.0, 3, "eq412:keep"),   # surplus of one replica is inside ρ_H = 2
    (10.0, 1, "eq412:down"),   # 30 >= 10 + 20: down to ceil(10 / 10)
    (9.0, 1, "eq412:down"),
])
def test_eq412_three_cases(lam, desired, reason):
    params = p.Eq412Params(rho_l=0.5, rho_h=2.0)
    prop, _ = p.eq412(ld(replicas_warm=3, arrival_rate=lam, exec_time_s=0.1), params, None)
    assert prop == Proposal(desired, reason)


def test_eq412_counts_starting_replicas_and_needs_a_profile():
    prop, _ = p.eq412(ld(replicas_warm=1, replicas_starting=3, arrival_rate=35, exec_time_s=0.1),
                      p.Eq412Params(), None)
    assert prop.reason == "eq412:keep"  # 40 req/s on the way covers 35
    prop, _ = p.eq412(ld(queued=2, arrival_rate=35), p.Eq412Params(), None)
    assert prop == Proposal(2, "eq412:unprofiled")


# Dilu -------------------------------------------------------------------------------------
def dilu_run(rps_per_s, warm, seconds, params=None, memory=None, start=0):
    """One call per second; ``rps_per_s(t)`` requests arrive in second t."""
    params = params or p.DiluParams()
    memory = memory or p.DiluMemory()
    total, out = 0 if memory.last_s is None else memory.last_total, []
    for t in range(start, start + seconds + 1):
        if t > start:
            total += rps_per_s(t)
        prop, memory = p.dilu(ld(now_s=float(t), replicas_warm=warm, exec_time_s=0.1,
                                 invocations_total=total), params, memory)
        out.append(prop)
    return out, memory


def test_dilu_scales_out_only_after_20_of_40_samples_over_capacity():
    props, mem = dilu_run(lambda t: 25, warm=2, seconds=20)  # capacity 2 × 10 req/s
    assert [x.desired for x in props[:20]] == [2] * 20
    assert props[20] == Proposal(3, "dilu:out")
    assert mem.rps == ()  # window cleared after acting
    # The choice stands while the new replica starts and the window refills.
    props, _ = dilu_run(lambda t: 25, warm=2, seconds=5, memory=mem, start=20)
    assert {x.desired for x in props} == {3}


def test_dilu_ignores_a_short_burst():
    props, _ = dilu_run(lambda t: 25 if t <= 10 else 15, warm=2, seconds=40)
    assert {x.desired for x in props} == {2}


def test_dilu_scales_in_lazily_and_goes_idle():
    props, _ = dilu_run(lambda t: 15, warm=3, seconds=30)  # below (3 − 1) × 10
    assert [x.desired for x in props[:30]] == [3] * 30 and props[30] == Proposal(2, "dilu:in")
    props, mem = dilu_run(lambda t: 0, warm=1, seconds=30)
    assert props[29].desired == 1 and props[30] == Proposal(0, "dilu:idle")
    assert mem.target == 0


def test_dilu_samples_once_per_second():
    mem = p.DiluMemory()
    for i in range(11):
        _, mem = p.dilu(ld(now_s=i / 10, replicas_warm=1, exec_time_s=0.1, invocations_total=i),
                        p.DiluParams(), mem)
    assert mem.rps == (10.0,)


# RPR --------------------------------------------------------------------------------------
A = ReplicaConfig("a", 0.5, 1.0, 8, 50.0, 0.05)    # RPR 100
B = ReplicaConfig("b", 0.1, 1.0, 4, 20.0, 0.20)    # RPR 200
C = ReplicaConfig("c", 0.1, 0.5, 4, 12.0, 0.40)    # RPR 240, slow
D = ReplicaConfig("d", 0.05, 1.0, 1, 6.0, 0.25)    # RPR 120
CONFIGS = (A, B, C, D)


def rpr_decide(**kw):
    return make_autoscaler("rpr").decide(ld(configs=CONFIGS, **kw))[0]


def test_rpr_picks_the_cheapest_configuration_meeting_the_slo():
    # SLO 0.3 s rules out c: b has the best RPR. 45 req/s = 2 × b (40) + the least config
    # covering the last 5 req/s, d (6).
    d = rpr_decide(arrival_rate=45, slo_s=0.3)
    assert (d.desired, d.mix, d.reason) == (3, (("b", 2), ("d", 1)), "rpr")
    # A looser SLO lets c in: 3 × c (36), then c again for the last 9.
    assert rpr_decide(arrival_rate=45, slo_s=0.5).mix == (("c", 4),)
    # No configuration meets 10 ms: the fastest one serves, and the reason says so.
    d = rpr_decide(arrival_rate=45, slo_s=0.01)
    assert (d.desired, d.mix, d.reason) == (1, (("a", 1),), "rpr:slo_unmet")


def test_rpr_zero_delta_changes_nothing():
    d = rpr_decide(arrival_rate=40, slo_s=0.3, replicas_warm=2, replica_configs=("b", "b"))
    assert (d.desired, d.mix) == (2, (("b", 2),))
    assert plan(40.0, [("b", B), ("b", B)], (A, B, D), 0.02) == [("b", B), ("b", B)]


def test_rpr_scale_down_ends_when_the_lowest_rpr_replica_must_stay():
    # 70 req/s of capacity for 40: a (RPR 100) is first in line but cannot go (20 short);
    # the paper's loop spins here. b can go and does.
    assert plan(40.0, [("a", A), ("b", B)], (A, B, D), 0.02) == [("a", A)]
    d = rpr_decide(arrival_rate=40, slo_s=0.3, replicas_warm=2, replica_configs=("b", "a"),
                   last_request_s=100.0)
    assert (d.desired, d.mix) == (1, (("a", 1),))
    # Nothing removable at all: the plan is the current replicas.
    assert plan(49.0, [("a", A)], (A, B), 0.02) == [("a", A)]


def test_rpr_ties_and_unknown_replicas():
    slow = ReplicaConfig("slow", 0.1, 1.0, 8, 10.0, 0.3)   # RPR 100
    fast = ReplicaConfig("fast", 0.1, 0.5, 8, 4.95, 0.1)   # RPR 99: a tie within 2%
    prop, _ = rpr(ld(configs=(slow, fast), arrival_rate=9.9), RprParams(), None)
    assert prop.pad == "fast" and prop.pods == ("fast", "fast")
    prop, _ = rpr(ld(configs=(slow, fast), arrival_rate=9.9), RprParams(tie_tolerance=0), None)
    assert prop.pad == "slow"
    # Two replicas, one of unknown configuration: taken as p_eff (b); 40 req/s is enough.
    prop, _ = rpr(ld(configs=CONFIGS, slo_s=0.3, arrival_rate=40, replicas_warm=2,
                     replica_configs=("b",)), RprParams(), None)
    assert prop.pods == ("b", "b")
    prop, _ = rpr(ld(queued=5), RprParams(), None)
    assert prop == Proposal(5, "rpr:unprofiled")


# The wrapper ------------------------------------------------------------------------------
def lim(load, desired, memory=None, reason="x", **params):
    return limit(load, Proposal(desired, reason), LimitParams(**params), memory or LimitMemory())


def test_scale_from_zero_is_immediate_even_with_an_up_delay():
    d, mem = lim(ld(queued=1, last_request_s=100.0), 3, scale_up_delay_s=60)
    assert d.desired == 3 and mem == LimitMemory()
    d, _ = lim(ld(queued=1, last_request_s=100.0), 0, scale_up_delay_s=60)
    assert (d.desired, d.reason) == (1, "x+demand")


def test_scale_up_delay():
    d, mem = lim(ld(now_s=0, replicas_warm=1), 3, scale_up_delay_s=10)
    assert (d.desired, d.reason, mem.up_since_s) == (1, "scale_up_delay", 0)
    d, mem = lim(ld(now_s=5, replicas_warm=1), 4, mem, scale_up_delay_s=10)
    assert d.desired == 1
    d, mem = lim(ld(now_s=10, replicas_warm=1), 3, mem, scale_up_delay_s=10)
    assert (d.desired, d.reason, mem) == (3, "x", LimitMemory())
    # A break in the wish restarts the clock.
    _, mem = lim(ld(now_s=0, replicas_warm=1), 3, scale_up_delay_s=10)
    _, mem = lim(ld(now_s=5, replicas_warm=1), 1, mem, scale_up_delay_s=10)
    d, _ = lim(ld(now_s=10, replicas_warm=1), 3, mem, scale_up_delay_s=10)
    assert d.desired == 1


def test_scale_down_delay():
    kw = dict(replicas_warm=4, inflight=2)
    d, mem = lim(ld(now_s=0, **kw), 2, scale_down_delay_s=30)
    assert (d.desired, d.reason, mem.down_since_s) == (4, "scale_down_delay", 0)
    d, mem = lim(ld(now_s=29, **kw), 2, mem, scale_down_delay_s=30)
    assert d.desired == 4
    d, mem = lim(ld(now_s=30, **kw), 2, mem, scale_down_delay_s=30)
    assert d.desired == 2 and mem.down_since_s is None


def test_keep_alive_guards_scale_to_zero_only_unless_partial():
    recent = dict(replicas_warm=3, last_request_s=90.0)  # idle 10 s of 30
    d, _ = lim(ld(**recent), 0)
    assert (d.desired, d.reason) == (1, "keep_alive")
    d, _ = lim(ld(**recent), 2)
    assert (d.desired, d.reason) == (2, "x")
    d, _ = lim(ld(**recent), 2, keep_alive_partial=True)
    assert (d.desired, d.reason) == (3, "keep_alive")
    d, _ = lim(ld(replicas_warm=3, last_request_s=70.0), 0)
    assert (d.desired, d.reason) == (0, "idle")


def test_bounds_in_the_wrapper():
    d, _ = lim(ld(replicas_warm=1, max_replicas=5), 100)
    assert (d.desired, d.reason) == (5, "x+bounds")
    d, _ = lim(ld(replicas_warm=4, min_replicas=2), 0)
    assert (d.desired, d.reason) == (2, "idle+bounds")
    # Keep-alive holds 6 but the bound was lowered to 4.
    d, _ = lim(ld(replicas_warm=6, max_replicas=4, last_request_s=99.0), 3, keep_alive_partial=True)
    assert (d.desired, d.reason) == (4, "keep_alive+bounds")


def test_mix_follows_the_wrapper():
    prop = Proposal(3, "rpr", ("d", "b", "b"), "b")
    d, _ = limit(ld(max_replicas=2), prop, LimitParams(), LimitMemory())
    assert d.mix == (("b", 2),)  # d (lowest RPR) is first to go
    d, _ = limit(ld(min_replicas=5), prop, LimitParams(), LimitMemory())
    assert d.mix == (("b", 4), ("d", 1))
    held = ld(replicas_warm=3, replica_configs=("a", "a"), last_request_s=99.0)
    d, _ = limit(held, Proposal(1, "rpr", ("b",), "b"), LimitParams(keep_alive_partial=True),
                 LimitMemory())
    assert d.desired == 3 and d.mix == (("a", 2), ("b", 1))
    d, _ = lim(ld(), 2)
    assert d.mix == ()


# make_autoscaler --------------------------------------------------------------------------
def test_every_registered_policy_builds_with_defaults():
    assert set(POLICIES) == {"concurrency", "atl", "tsk", "owk", "smstar", "eq412", "dilu", "rpr",
                             "tokens"}
    for name in POLICIES:
        a = make_autoscaler(name)
        # tokens is the concurrency rule for functions that do not generate: same wrapper
        assert a.name == name and a.limits.keep_alive_partial == (name in ("concurrency",
                                                                            "tokens"))


def test_params_reach_the_policy_and_the_wrapper():
    a = make_autoscaler("owk", {"target_utilisation": 0.5, "scale_down_delay_s": 0, "period_s": 5})
    assert a.params == p.OwkParams(target_utilisation=0.5, period_s=5.0)
    assert a.limits == LimitParams()
    a = make_autoscaler("dilu", {"out_samples": 10.0, "keep_alive_partial": 1})
    assert a.params.out_samples == 10 and isinstance(a.params.out_samples, int)
    assert a.limits.keep_alive_partial is True


@pytest.mark.parametrize("name,params,words", [
    ("nope", {}, "unknown autoscaler 'nope'"),
    ("atl", {"windw_s": 3}, "unknown parameters for autoscaler 'atl': ['windw_s']"),
    ("concurrency", {"window_s": 3}, "unknown parameters"),
    ("atl", {"window_s": "60"}, "window_s must be a finite number"),
    ("atl", {"window_s": True}, "window_s must be a finite number"),
    ("atl", {"window_s": math.nan}, "window_s must be a finite number"),
    ("atl", {"window_s": 0}, "window_s must be > 0"),
    ("atl", {"percentile": 101}, "percentile"),
    ("owk", {"target_utilisation": 0}, "target_utilisation"),
    ("owk", {"max_scale_up_ratio": 1}, "max_scale_up_ratio"),
    ("dilu", {"out_samples": 2.5}, "whole number"),
    ("dilu", {"out_samples": 41}, "1..40"),
    ("tsk", {"keep_alive_partial": 2}, "true or false"),
    ("eq412", {"scale_up_delay_s": -1}, "scale_up_delay_s"),
    ("eq412", {"rho_l": -0.5}, "rho_l"),
])
def test_bad_config_is_a_bad_request(name, params, words):
    with pytest.raises(BadRequest) as info:
        make_autoscaler(name, params)
    assert words in str(info.value)


def test_memory_from_another_policy_is_dropped():
    atl = make_autoscaler("atl")
    _, mem = make_autoscaler("dilu").decide(ld(invocations_total=5))
    d, mem2 = atl.decide(ld(arrival_rate=4, exec_time_s=1), mem)
    assert d.desired == 4 and mem2.autoscaler == "atl" and isinstance(mem2.policy, p.Samples)


# The default keeps the first-cut behaviour -------------------------------------------------
def first_cut(load: FunctionLoadSnapshot) -> tuple[int, str]:
    """autoscale.decide as it was before the plug-ins (the oracle)."""
    current = load.replicas_warm + load.replicas_starting
    demand = load.queued + load.inflight
    want = math.ceil(demand / load.replica_concurrency) if demand else 0
    idle_for = math.inf if load.last_request_s is None else load.now_s - load.last_request_s
    if want >= current:
        desired, reason = want, "demand"
    elif idle_for < load.keep_alive_s:
        desired, reason = current, "keep_alive"
    else:
        desired, reason = want, "idle" if want == 0 else "demand"
    bounded = max(load.min_replicas, min(load.max_replicas, desired))
    return bounded, reason + ("+bounds" if bounded != desired else "")


@settings(max_examples=150, deadline=None)
@given(queued=st.integers(0, 200), inflight=st.integers(0, 200), warm=st.integers(0, 30),
       starting=st.integers(0, 30), mn=st.integers(0, 10), extra=st.integers(0, 20),
       conc=st.integers(1, 16), last=st.one_of(st.none(), st.floats(0, 200)),
       keep=st.floats(0, 100))
def test_property_decide_matches_the_first_cut(queued, inflight, warm, starting, mn, extra, conc,
                                               last, keep):
    load = ld(queued=queued, inflight=inflight, replicas_warm=warm, replicas_starting=starting,
              min_replicas=mn, max_replicas=max(1, mn + extra), replica_concurrency=conc,
              last_request_s=last, keep_alive_s=keep)
    d = decide(load)
    assert d.desired == first_cut(load)[0]
    if not d.reason.endswith("+bounds"):  # at a bound the wording may differ, not the count
        assert d.reason == first_cut(load)[1]


# Purity and properties over every policy ---------------------------------------------------
ALLOWED_IMPORTS = {"__future__", "math", "collections", "collections.abc", "dataclasses", "types",
                   "typing", "flashpoint.errors", "flashpoint.policy"}


@pytest.mark.parametrize("module", ["autoscale.py", "autoscalers.py", "rpr.py", "replica_config.py"])
def test_modules_import_no_clock_randomness_or_io(module):
    tree = ast.parse((Path(flashpoint.policy.__file__).parent / module).read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert all(m in ALLOWED_IMPORTS or m.startswith("flashpoint.policy.") for m in mods), mods


@st.composite
def load_sequences(draw):
    """A run of snapshots for one function: time and the invocation counter only go up."""
    mn = draw(st.integers(0, 3))
    mx = draw(st.integers(max(1, mn), 12))
    configs = draw(st.sampled_from([(), CONFIGS, (B,), (A, D)]))
    now, total, loads = 0.0, 0, []
    for _ in range(draw(st.integers(1, 12))):
        now += draw(st.sampled_from([0.1, 0.5, 1.0, 7.0, 20.0]))
        total += draw(st.integers(0, 200))
        warm = draw(st.integers(0, 15))
        loads.append(ld(
            now_s=now, queued=draw(st.integers(0, 60)), inflight=draw(st.integers(0, 60)),
            replicas_warm=warm, replicas_starting=draw(st.integers(0, 4)),
            last_request_s=draw(st.one_of(st.none(), st.floats(max(0.0, now - 60), now))),
            min_replicas=mn, max_replicas=mx, replica_concurrency=draw(st.integers(1, 8)),
            keep_alive_s=draw(st.sampled_from([0.0, 5.0, 30.0])),
            arrival_rate=draw(st.floats(0, 500)), exec_time_s=draw(st.sampled_from([0.0, 0.01, 0.3])),
            queue_latency_s=draw(st.floats(0, 60)),
            utilisation=draw(st.one_of(st.none(), st.floats(0, 1))), invocations_total=total,
            slo_s=draw(st.sampled_from([0.0, 0.1, 0.3])), configs=configs,
            replica_configs=tuple(draw(st.lists(st.sampled_from("abcdz"), max_size=warm))),
        ))
    return loads


@settings(max_examples=60, deadline=None)
@given(loads=load_sequences(), name=st.sampled_from(sorted(POLICIES)),
       up=st.sampled_from([0.0, 3.0]), down=st.sampled_from([0.0, 10.0]))
def test_property_every_policy_within_bounds_and_never_idle_with_work(loads, name, up, down):
    scaler = make_autoscaler(name, {"scale_up_delay_s": up, "scale_down_delay_s": down})
    memory = None
    for load in loads:
        d, memory = scaler.decide(load, memory)
        assert load.min_replicas <= d.desired <= load.max_replicas
        if load.queued + load.inflight > 0:
            assert d.desired >= 1
        if load.replicas_warm + load.replicas_starting == 0 and load.queued > 0:
            assert d.desired >= 1  # from zero at once, whatever the delays
        if d.mix:
            assert sum(n for _, n in d.mix) == d.desired


@settings(max_examples=40, deadline=None)
@given(loads=load_sequences(), name=st.sampled_from(sorted(POLICIES)))
def test_property_deterministic_and_memory_immutable(loads, name):
    scaler = make_autoscaler(name)

    def replay() -> list[tuple[object, AutoscalerMemory]]:
        memory, out = None, []
        for load in loads:
            d, memory = scaler.decide(load, memory)
            out.append((d, memory))
        return out

    first = replay()
    assert first == replay()
    memory = first[-1][1]
    hash(memory)  # frozen all the way down: safe to keep and share
    with pytest.raises(dataclasses.FrozenInstanceError):
        memory.autoscaler = "x"  # type: ignore[misc]
