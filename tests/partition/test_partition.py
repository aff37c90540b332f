"""The partition solver (flashpoint.partition): the analytical model, exactness against brute
force, the thesis's heuristic DP, plan tables and the plan cache."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpoint.partition import (
    CostModel,
    LayerProfile,
    PlanCache,
    PlanTerms,
    best_plan,
    best_plan_with_parts,
    evaluate,
    latency_s,
    plan_table,
    queue_rounds_sum,
    tbar_s,
)
from flashpoint.partition.exhaustive import exhaustive_best
from flashpoint.partition.model import queue_factor, wait_s
from flashpoint.partition.thesis import thesis_dp

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
MB = 1_000_000


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))


# strategies -------------------------------------------------------------------------------
# Coarse grids make ties (equal parts, equal maxima) common; fine values cover the rest.
sizes = st.one_of(st.integers(0, 10).map(lambda k: k * 100 * MB), st.integers(0, 2_000 * MB))
times = st.one_of(st.integers(0, 10).map(lambda k: k / 100), st.floats(0, 0.2))
outs = st.one_of(st.integers(0, 10).map(lambda k: k * 10 * MB), st.integers(0, 200 * MB))


@st.composite
def models(draw, max_layers: int = 9):
    n = draw(st.integers(1, max_layers))
    return [LayerProfile(f"l{i}", draw(sizes), draw(times), draw(outs)) for i in range(n)]


costs = st.builds(
    CostModel,
    bandwidth_bps=st.sampled_from([8e8, 2.2e9, 1e10]) | st.floats(1e8, 1e11),
    link_bps=st.sampled_from([8e8, 1e10]) | st.floats(1e8, 1e11),
    overhead_s=st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 2),
    link_latency_s=st.sampled_from([0.0, 1e-3]) | st.floats(0, 0.01),
)
loads = st.integers(1, 60) | st.integers(1, 3000)
gpus = st.integers(1, 12)


# the analytical model ----------------------------------------------------------------------
@SETTINGS
@given(x=st.integers(0, 500), g=st.integers(1, 70))
def test_queue_rounds_sum_closed_form(x, g):
    assert queue_rounds_sum(x, g) == sum(-(-y // g) - 1 for y in range(1, x + 1))


@SETTINGS
@given(c=st.floats(0, 100), e=st.floats(0, 5), n=st.floats(0, 5), t_in=st.floats(0, 10),
       i1=st.floats(0, 20), P=st.integers(1, 64), data=st.data())
def test_tbar_closed_form_equals_the_sum_of_eq_4_8(c, e, n, t_in, i1, P, data):
    p = data.draw(st.integers(1, P))
    x = data.draw(st.integers(1, 400))
    terms = PlanTerms(c, e, n, t_in, i1)
    explicit = sum(latency_s(terms, p, y, P) for y in range(1, x + 1)) / x
    assert tbar_s(terms, p, x, P) == pytest.approx(explicit, rel=1e-12, abs=1e-12)


@SETTINGS
@given(x=st.integers(1, 500), P=st.integers(1, 64), data=st.data())
def test_queue_factor_grows_with_load_and_with_parts(x, P, data):
    """The two monotonicities the solver and tables rely on."""
    p = data.draw(st.integers(1, P))
    assert queue_factor(x + 1, p, P) >= queue_factor(x, p, P)
    if p < P:
        assert queue_factor(x, p + 1, P) >= queue_factor(x, p, P)


def test_the_thesis_worked_example_figs_4_2_to_4_4():
    """4 s requests, 8 of them, 2 GPUs, full cold start 24 s, half 12 s, 1 s transfer (§4.1.2)."""
    half = LayerProfile("half", 12_000 * MB, 2.0, 1_000 * MB)
    cost = CostModel(bandwidth_bps=8e9, link_bps=8e9)
    model = [half, dataclasses.replace(half, name="half2")]
    assert evaluate(model, cost, (), x=8, P=2).tbar_s == pytest.approx(34.0)   # full
    assert evaluate(model, cost, (1,), x=8, P=2).tbar_s == pytest.approx(24.0)  # pipelined
    assert best_plan(model, cost, p_max=2, x=8, P=2).cuts == (1,)


def test_plan_parts_and_terms():
    model = [LayerProfile("a", 100 * MB, 0.01, 4 * MB), LayerProfile("b", 300 * MB, 0.03, 8 * MB),
             LayerProfile("c", 0, 0.0, 2 * MB)]
    cost = CostModel(bandwidth_bps=8e9, link_bps=8e9, overhead_s=0.5, link_latency_s=0.001)
    plan = evaluate(model, cost, (1,), x=10, P=4)
    a, b = plan.parts
    assert (a.first_layer, a.last_layer, b.first_layer, b.last_layer) == (0, 0, 1, 2)
    assert a.bytes == 100 * MB and a.cold_s == pytest.approx(0.6)
    assert b.bytes == 300 * MB and b.cold_s == pytest.approx(0.8)
    assert a.out_transfer_s == pytest.approx(0.005) and b.out_transfer_s == 0.0
    t = plan.terms
    assert (t.cold_s, t.exec_max_s, t.transfer_max_s) == (b.cold_s, b.exec_s, a.out_transfer_s)
    assert t.inference_s == pytest.approx(0.045)
    # P=4, p=2: 2 pipelines; x=10 -> waits 0,0,1,1,2,2,3,3,4,4 periods of B = 0.03 s
    assert plan.tbar_s == pytest.approx(0.8 + 0.045 + 0.03 * 20 / 10)
    assert wait_s(t, 2, 10, 4) == pytest.approx(4 * 0.03)


def test_invalid_inputs():
    model = [LayerProfile("a", 1, 0.1, 1), LayerProfile("b", 1, 0.1, 1)]
    cost = CostModel(bandwidth_bps=1e9, link_bps=1e9)
    with pytest.raises(ValueError):
        LayerProfile("neg", -1, 0.0, 0)
    with pytest.raises(ValueError):
        CostModel(bandwidth_bps=0, link_bps=1e9)
    with pytest.raises(ValueError):
        evaluate(model, cost, (2,), x=1, P=2)      # a cut must be inside 1..n-1
    with pytest.raises(ValueError):
        evaluate(model, cost, (1,), x=1, P=1)      # 2 parts need 2 GPUs
    with pytest.raises(ValueError):
        best_plan(model, cost, p_max=2, x=0, P=2)  # T̄ needs x >= 1
    with pytest.raises(ValueError):
        best_plan([], cost, p_max=2, x=1, P=2)


def test_cost_fingerprint_is_stable_and_exact():
    a = CostModel(bandwidth_bps=1e9, link_bps=1e10, overhead_s=0.5)
    assert a.fingerprint() == CostModel(bandwidth_bps=1e9, link_bps=1e10, overhead_s=0.5).fingerprint()
    assert a.fingerprint() != dataclasses.replace(a, overhead_s=0.5 + 1e-12).fingerprint()


# exactness ------------------------------------------------------------------------------------
@SETTINGS
@given(model=models(), cost=costs, x=loads, P=gpus, p_max=st.integers(1, 12))
def test_best_plan_equals_exhaustive_minimum(model, cost, x, P, p_max):
    got = best_plan(model, cost, p_max, x, P)
    want = exhaustive_best(model, cost, x, P, p_max=p_max)
    assert close(got.tbar_s, want.tbar_s), (got, want)
    assert got.p <= min(p_max, P, len(model))
    assert got == evaluate(model, cost, got.cuts, x, P)


@SETTINGS
@given(model=models(), cost=costs, x=loads, P=gpus, data=st.data())
def test_best_plan_with_parts_equals_exhaustive_minimum(model, cost, x, P, data):
    p = data.draw(st.integers(1, min(len(model), P)))
    got = best_plan_with_parts(p, model, cost, x, P)
    want = exhaustive_best(model, cost, x, P, parts=p)
    assert got.p == p
    assert close(got.tbar_s, want.tbar_s), (got, want)


@SETTINGS
@given(model=models(max_layers=7), cost=costs, x=loads, P=gpus)
def test_thesis_dp_is_never_better_than_exact(model, cost, x, P):
    heuristic = thesis_dp(model, cost, x, P)
    exact = best_plan(model, cost, len(model), x, P)
    assert exact.tbar_s <= heuristic.tbar_s * (1 + 1e-12)


def test_thesis_dp_counterexample():
    """Eq 4.10 keeps one sub-plan per state, chosen by its own T̄; here that loses.

    100 MB/s sources, 0.5 s load overhead; cold starts 2.5/3.5/2.5 s, transfers 1.0/0.8 s.
    For the right half (layers 1..2) one part (T̄ 5.676: cold 5.5, 3 pipelines) beats two
    (6.04: cold 3.5 but 1 pipeline, 0.8 s transfer), and likewise for the left half, so
    the DP never assembles the three-part plan: it returns the whole model (T̄ 7.696) while
    cutting at 1 and 2 gives 3.5 + 0.14 + 1.8 + 2·1.0 = 7.44 (B = N = 1.0 s, α = 10/5).
    """
    model = [LayerProfile("l0", 200 * MB, 0.05, 100 * MB), LayerProfile("l1", 300 * MB, 0.09, 80 * MB),
             LayerProfile("l2", 200 * MB, 0.0, 40 * MB)]
    cost = CostModel(bandwidth_bps=8e8, link_bps=8e8, overhead_s=0.5)
    heuristic = thesis_dp(model, cost, x=5, P=3)
    exact = best_plan(model, cost, p_max=3, x=5, P=3)
    assert heuristic.cuts == () and heuristic.tbar_s == pytest.approx(7.696)
    assert exact.cuts == (1, 2) and exact.tbar_s == pytest.approx(7.44)
    assert exhaustive_best(model, cost, 5, 3).tbar_s == exact.tbar_s


# edge cases -------------------------------------------------------------------------------------
def test_edges_single_layer_p1_and_too_many_parts():
    cost = CostModel(bandwidth_bps=8e9, link_bps=8e9, overhead_s=1.0)
    one = [LayerProfile("only", 1000 * MB, 0.1, 1 * MB)]
    plan = best_plan(one, cost, p_max=64, x=100, P=64)       # p_max > layers: clamped
    assert plan.p == 1 and plan.cuts == ()
    assert plan.tbar_s == pytest.approx(2.0 + 0.1 + 0.1 * queue_rounds_sum(100, 64) / 100)
    three = [LayerProfile(f"l{i}", 1000 * MB, 0.1, 1 * MB) for i in range(3)]
    assert best_plan(three, cost, p_max=1, x=5, P=8).cuts == ()  # p_max=1: the whole model
    assert best_plan_with_parts(1, three, cost, 5, 8).cuts == ()
    assert best_plan_with_parts(3, three, cost, 5, 8).cuts == (1, 2)
    with pytest.raises(ValueError):
        best_plan_with_parts(4, three, cost, 5, 8)            # more parts than layers
    with pytest.raises(ValueError):
        best_plan_with_parts(3, three, cost, 5, 2)            # more parts than GPUs
    # best_plan skips part counts above P: with 2 GPUs it never returns 3 parts
    assert best_plan(three, cost, p_max=3, x=1, P=2).p <= 2
    assert best_plan(three, cost, p_max=3, x=1, P=3).p == 3   # x=1: parallel load wins


def test_zero_size_layers():
    cost = CostModel(bandwidth_bps=8e9, link_bps=8e9, overhead_s=0.25)
    zeros = [LayerProfile(f"z{i}", 0, 0.0, 0) for i in range(5)]
    plan = best_plan(zeros, cost, p_max=5, x=10, P=5)
    assert plan.p == 1 and plan.tbar_s == pytest.approx(0.25)  # ties go to the fewest parts
    mixed = [LayerProfile("emb", 0, 0.0, 2 * MB), LayerProfile("big", 800 * MB, 0.01, 2 * MB),
             LayerProfile("drop", 0, 0.0, 2 * MB), LayerProfile("big2", 800 * MB, 0.01, 0)]
    for x in (1, 7, 300):
        assert close(best_plan(mixed, cost, 4, x, 4).tbar_s,
                     exhaustive_best(mixed, cost, x, 4, p_max=4).tbar_s)


# plan tables ------------------------------------------------------------------------------------
@SETTINGS
@given(model=models(max_layers=8), cost=costs, p_max=st.integers(1, 10),
       x_max=st.integers(1, 400), fixed_P=st.none() | st.integers(1, 10), data=st.data())
def test_plan_table_lookup_matches_best_plan(model, cost, p_max, x_max, fixed_P, data):
    table = plan_table(model, cost, p_max=p_max, x_max=x_max, P=fixed_P)
    for scale in range(1, p_max + 1):  # segments tile 1..x_max
        segs = table.segments(scale)
        assert segs[0].x_first == 1 and segs[-1].x_last == x_max
        assert all(a.x_last + 1 == b.x_first for a, b in zip(segs, segs[1:], strict=False))
    for _ in range(6):  # inside and outside the table (x > x_max, scale > p_max)
        x = data.draw(st.integers(1, x_max + 50))
        scale = data.draw(st.integers(1, p_max + 3))
        P = scale if fixed_P is None else fixed_P
        got = table.lookup(x, scale)
        want = best_plan(model, cost, min(scale, p_max), x, P)
        assert (got.x, got.P) == (x, P)
        assert got.p <= min(scale, p_max)
        assert close(got.tbar_s, want.tbar_s), (x, scale, got, want)


def test_plan_table_lookup_rounds_fractional_loads_up():
    model = [LayerProfile(f"l{i}", 500 * MB, 0.02, 4 * MB) for i in range(4)]
    table = plan_table(model, CostModel(bandwidth_bps=8e9, link_bps=8e9), p_max=4, x_max=50)
    assert table.lookup(7.2, 4) == table.lookup(8, 4)
    assert table.lookup(-3.0, 4) == table.lookup(1, 4)
    with pytest.raises(ValueError):
        table.lookup(5, 0)


# Best p as a function of x for this 4-layer model on P = scale = 4 GPUs: 3 parts for
# x = 1..9, 2 for 10..16, 3 again for 17..30, then 2. Not monotone, so §4.2.2's
# exponential search (probe x0+1, x0+2, x0+4, ... then bisect) misses the 10..16 island.
ISLAND_MODEL = [LayerProfile("l0", 200 * MB, 0.09, 0), LayerProfile("l1", 700 * MB, 0.04, 80 * MB),
                LayerProfile("l2", 400 * MB, 0.04, 20 * MB), LayerProfile("l3", 200 * MB, 0.08, 10 * MB)]
ISLAND_COST = CostModel(bandwidth_bps=8e8, link_bps=8e8, overhead_s=1.0)


def _thesis_exponential_search(best_p, x_max: int) -> dict[int, int]:
    out: dict[int, int] = {}
    x0 = 1
    while x0 <= x_max:
        p0, lo, step = best_p(x0), x0, 1
        while x0 + step <= x_max and best_p(x0 + step) == p0:
            lo, step = x0 + step, step * 2
        hi = x0 + step
        if hi > x_max:
            if best_p(x_max) == p0:
                hi = x_max + 1
                lo = x_max
            else:
                hi = x_max
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if best_p(mid) == p0 else (lo, mid)
        out.update({x: p0 for x in range(x0, hi)})
        x0 = hi
    return out


def test_best_p_is_not_monotone_in_x_and_the_table_is_still_exact():
    def exact_p(x: int) -> int:
        return exhaustive_best(ISLAND_MODEL, ISLAND_COST, x, 4).p

    truth = {x: exact_p(x) for x in range(1, 41)}
    assert [truth[x] for x in (1, 9, 10, 16, 17, 30, 31, 40)] == [3, 3, 2, 2, 3, 3, 2, 2]
    table = plan_table(ISLAND_MODEL, ISLAND_COST, p_max=4, x_max=40)
    assert {x: table.lookup(x, 4).p for x in truth} == truth
    assert [(s.x_first, s.p) for s in table.segments(4)] == [(1, 3), (10, 2), (17, 3), (31, 2)]
    searched = _thesis_exponential_search(exact_p, 40)
    assert [x for x in truth if searched[x] != truth[x]] == list(range(10, 17))


def test_plan_table_55_layers_matches_best_plan_at_sampled_points():
    """A T5-3B-shaped model (bench/partition_solver.py): the table agrees with best_plan."""
    layers = [LayerProfile("shared", 131 * MB, 0.4e-3, 2 * 2**20)]
    layers += [LayerProfile(f"enc{i}", (195 + i % 7) * MB, 8e-3 + i * 1e-5, 2 * 2**20)
               for i in range(26)]
    layers += [LayerProfile(f"dec{i}", (262 + i % 5) * MB, 11e-3 + i * 1e-5, 4 * 2**20)
               for i in range(27)]
    layers += [LayerProfile("lm_head", 131 * MB, 6e-3, 64 * 2**20)]
    assert len(layers) == 55
    cost = CostModel(bandwidth_bps=2.2e9, link_bps=1e10, overhead_s=1.0, link_latency_s=5e-4)
    table = plan_table(layers, cost, p_max=64, x_max=3000)
    for x, scale in [(1, 64), (40, 64), (700, 64), (3000, 64), (5, 8), (2500, 3), (120, 17)]:
        got = table.lookup(x, scale)
        assert close(got.tbar_s, best_plan(layers, cost, scale, x, scale).tbar_s), (x, scale)
    assert table.lookup(1, 1).cuts == ()


# plan cache -------------------------------------------------------------------------------------
def test_plan_cache_hits_evicts_and_rebuilds_on_new_profiles():
    model = [LayerProfile(f"l{i}", 100 * MB, 0.01, MB) for i in range(4)]
    cost = CostModel(bandwidth_bps=8e9, link_bps=8e9)
    cache = PlanCache(max_entries=2)
    t1 = cache.get("m", "v1", model, cost, p_max=4, x_max=20)
    assert cache.get("m", "v1", model, cost, p_max=4, x_max=20) is t1
    assert (cache.hits, cache.misses) == (1, 1)
    other_cost = dataclasses.replace(cost, overhead_s=1.0)
    t2 = cache.get("m", "v1", model, other_cost, p_max=4, x_max=20)  # cost is part of the key
    assert t2 is not t1
    cache.get("m", "v2", model, cost, p_max=4, x_max=20)               # evicts (m, v1, cost)
    assert len(cache) == 2
    assert cache.get("m", "v1", model, cost, p_max=4, x_max=20) is not t1
    changed = [dataclasses.replace(model[0], exec_s=0.5)] + model[1:]
    t3 = cache.get("m", "v1", changed, cost, p_max=4, x_max=20)        # same version, new profiles
    assert t3.profiles == tuple(changed)
    assert cache.drop("m") == 2 and len(cache) == 0
