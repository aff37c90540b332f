"""The bursty scenario (issue 22 item 5): median 0 req/s, bursts of ~60 req/s, T5, TSK.
Before: TSK's HPA rule with no scale-up cap multiplies the count while the first cold
starts wait on the registry, and BL serves nothing. After: Kubernetes' scale-up policies and
the wrapper's governor order only what drains the queue. A shortened run (20 hosts, 10 min)
of the same generator; the full hour is in bench/RESULTS.md."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from flashpoint.sim.cluster_config import Technique
from flashpoint.sim.experiments import FULL, bursty_trace, run_bursty

SHORT = replace(FULL, n_hosts=20, hosts_per_leaf=10, duration_s=600, drain_s=600.0)


def test_the_trace_is_bursty_and_seeded():
    trace = bursty_trace(1)
    assert len(trace.rates) == 3600 and statistics.median(trace.rates) == 0.0
    bursts = [r for r in trace.rates if r > 0]
    assert 12 * 20 <= len(bursts) <= 12 * 40  # one burst of 20..40 s per 5 minutes
    assert all(54.0 <= r <= 66.0 for r in bursts)
    assert bursty_trace(1) == trace and bursty_trace(2) != trace


@pytest.fixture(scope="module")
def runs():
    techs = (Technique.BL, Technique.LC_MC)
    return ({r.technique: r.metrics for r in run_bursty(1, False, techniques=techs, cfg=SHORT)},
            {r.technique: r.metrics for r in run_bursty(1, True, techniques=techs, cfg=SHORT)})


def test_before_tsk_floods_the_registry_and_bl_serves_nothing(runs):
    before, _ = runs
    assert before[Technique.BL].unserved == before[Technique.BL].requests > 0
    assert before[Technique.BL].peak_starting >= 100


def test_after_the_governor_every_technique_serves_the_trace_with_few_starts(runs):
    before, after = runs
    for tech, m in after.items():
        assert m.unserved == 0, tech
        assert m.peak_starting <= 20, tech
        assert m.replica_s < before[tech].replica_s / 5, tech
