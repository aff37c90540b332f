"""The wrapper's scale-up governor (issue 22 item 5): starting replicas are capacity arriving
at their expected ready time; no replica is ordered that would be ready after the queue has
drained. References are computed here independently (a time-stepped queue), never from the
governor's own earlier output."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.policy.autoscale import (
    LimitMemory,
    LimitParams,
    drain_time_s,
    govern,
    limit,
    make_autoscaler,
)
from flashpoint.policy.autoscalers import Proposal
from flashpoint.policy.snapshot import FunctionLoadSnapshot


def ld(**kw) -> FunctionLoadSnapshot:
    base = dict(name="f", now_s=100.0, queued=0, inflight=0, replicas_warm=0, replicas_starting=0,
                last_request_s=99.0, min_replicas=0, max_replicas=10_000, replica_concurrency=1,
                keep_alive_s=30.0, exec_time_s=1.0)
    base.update(kw)
    return FunctionLoadSnapshot(**base)


def stepped_drain(backlog: float, lam: float, mu: float, warm: int, ready: list[float],
                  dt: float = 1e-3, horizon_s: float = 200.0) -> float:
    """First time the queue is empty with capacity >= arrivals, by small time steps."""
    q, t = float(backlog), 0.0
    for _ in range(int(horizon_s / dt)):
        serving = warm + sum(r <= t for r in ready)
        if q <= 1e-9 and serving * mu >= lam:
            return t
        q = max(0.0, q + (lam - serving * mu) * dt)
        t += dt
    return math.inf


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(backlog=st.integers(0, 40), lam=st.floats(0, 6), warm=st.integers(0, 4),
       ready=st.lists(st.floats(0, 30), max_size=6))
def test_drain_time_matches_a_time_stepped_queue(backlog, lam, warm, ready):
    got = drain_time_s(backlog, lam, 1.0, warm, ready)
    ref = stepped_drain(backlog, lam, 1.0, warm, ready, dt=2e-3, horizon_s=100.0)
    if math.isinf(ref):
        assert got > 99.0  # the stepped queue ran out of horizon
    else:  # the steps' rounding: a step per ready time and per unit of queue
        assert got == pytest.approx(ref, rel=0.01, abs=0.1)


def test_drain_time_never_when_capacity_stays_short():
    assert drain_time_s(10, 5.0, 1.0, 2, [1.0, 2.0]) == math.inf
    assert drain_time_s(0, 0.0, 1.0, 0, []) == 0.0


def test_no_replica_that_would_be_ready_after_the_queue_drained():
    # 6 queued, 2 warm at 1 req/s, no arrivals: drained at 3 s. A new replica needs 30 s.
    load = ld(queued=6, replicas_warm=2, new_ready_s=130.0)
    assert govern(load, 50) == 2
    decision, _ = limit(load, Proposal(50, "demand"), LimitParams(governor=True), LimitMemory())
    assert decision.desired == 2 and decision.reason == "demand+governor"
    decision, _ = limit(load, Proposal(50, "demand"), LimitParams(), LimitMemory())
    assert decision.desired == 50  # off by default


def test_starting_replicas_count_as_capacity_at_their_ready_time():
    # 100 queued, no warm replica; 10 starting, ready in 5 s; no arrivals: they drain the
    # queue 15 s from now, before a new replica (ready in 30 s) could serve: order none.
    load = ld(queued=100, replicas_starting=10, starting_ready_s=(105.0,) * 10,
              new_ready_s=130.0)
    assert govern(load, 100) == 10
    # The same 10 replicas expected only in 60 s: new ones (ready in 30 s) do help. The
    # fewest that drain the queue by 30 s + one more cold start (60 s from now): k replicas
    # serve from 30 s to 60 s, 30·k >= 100 -> k = 4 (the starting ten add nothing by 60 s).
    late = ld(queued=100, replicas_starting=10, starting_ready_s=(160.0,) * 10,
              new_ready_s=130.0)
    assert govern(late, 100) == 14
    assert stepped_drain(100, 0.0, 1.0, 0, [30.0] * 4 + [60.0] * 10) <= 60.0 + 1e-6
    assert stepped_drain(100, 0.0, 1.0, 0, [30.0] * 3 + [60.0] * 10) > 60.0


def test_a_burst_orders_what_its_rate_needs_not_the_plugins_thousand():
    # 60 req/s arriving, 600 queued, 2 warm replicas of 2 req/s, a cold start of 40 s.
    load = ld(queued=600, replicas_warm=2, arrival_rate=60.0, exec_time_s=0.5,
              new_ready_s=140.0)
    got = govern(load, 1000)
    k = got - 2
    ready = [40.0] * k
    # The independent check: with k the queue drains by 80 s, with k - 1 it does not.
    assert stepped_drain(600, 60.0, 2.0, 2, ready, dt=0.01) <= 80.0 + 0.05
    assert stepped_drain(600, 60.0, 2.0, 2, ready[1:], dt=0.01) > 80.0 - 0.05
    assert 30 <= got < 100


def test_governor_leaves_the_count_when_it_cannot_know():
    assert govern(ld(queued=50, replicas_warm=1), 40) == 40  # no ready time
    assert govern(ld(queued=50, replicas_warm=1, exec_time_s=0.0, new_ready_s=130.0), 40) == 40
    # Nothing queued: nothing to drain; a plug-in scaling ahead of demand keeps its count.
    assert govern(ld(inflight=1, replicas_warm=1, arrival_rate=5.0, new_ready_s=130.0), 8) == 8
    # A queue that never drains (arrivals beyond any count allowed): the plug-in's count.
    assert govern(ld(queued=50, arrival_rate=500.0, new_ready_s=130.0), 20) == 20


def test_scale_from_zero_keeps_one_replica():
    load = ld(queued=3, new_ready_s=101.0)
    decision, _ = limit(load, Proposal(0, "demand"), LimitParams(governor=True), LimitMemory())
    assert decision.desired == 1


def test_every_plugin_goes_through_the_governor_when_asked():
    load = ld(queued=6, replicas_warm=2, queue_latency_s=700.0, new_ready_s=130.0)
    for name in ("concurrency", "tsk", "owk", "atl", "eq412"):
        decision, _ = make_autoscaler(name, {"governor": True}).decide(
            ld(queued=6, replicas_warm=2, queue_latency_s=700.0, new_ready_s=130.0,
               utilisation=1.0, arrival_rate=1.0))
        assert decision.desired <= 2, name
    on, _ = make_autoscaler("concurrency", {"governor": True}).decide(load)
    assert on.desired == 2 and "governor" in on.reason
    off, _ = make_autoscaler("concurrency").decide(load)
    assert off.desired == 6
    with pytest.raises(BadRequest, match="governor_horizon"):
        LimitParams(governor_horizon=-1)
