"""Traces: the synthetic generators keep the thesis's statistics, per seed, deterministically;
the Azure LLM CSV loads into a sorted log."""

from __future__ import annotations

import numpy as np
import pytest

from flashpoint.sim.experiments import AZURE_LLM_CSV as AZURE_CSV  # shipped in the package
from flashpoint.sim.traces import (
    RateTrace,
    RequestLog,
    azure_functions_like,
    load_azure_llm_csv,
    requests_from_rates,
    twitter_like,
)


@pytest.mark.parametrize("make,median,ratio", [(twitter_like, 57.0, 4.68),
                                               (azure_functions_like, 18.0, 2.54)])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_synthetic_rate_trace_has_the_stated_statistics(make, median, ratio, seed):
    trace = make(seed)
    assert trace.duration_s == 3600
    assert trace.median == pytest.approx(median, rel=1e-9)
    assert trace.peak_to_median == pytest.approx(ratio, rel=1e-9)
    assert min(trace.rates) > 0


@pytest.mark.parametrize("make,median,ratio", [(twitter_like, 57.0, 4.68),
                                               (azure_functions_like, 18.0, 2.54)])
def test_request_log_matches_the_statistics_within_sampling_noise(make, median, ratio):
    log = requests_from_rates(make(3), seed=11)
    counts = np.asarray(log.per_second(3600).rates)
    # Poisson noise: per-second counts are integers and their maximum overshoots the peak
    # rate by a few standard deviations, so compare 10 s means (noise ~1/sqrt(10) smaller).
    # A burst's first seconds are its peak, so the rate trace is smoothed the same way.
    box = np.ones(10) / 10
    smooth = np.convolve(counts, box, mode="valid")
    expected = np.convolve(np.asarray(make(3).rates), box, mode="valid")
    assert np.median(smooth) == pytest.approx(median, rel=0.05)
    assert smooth.max() / np.median(smooth) == pytest.approx(
        expected.max() / np.median(expected), rel=0.08)
    assert expected.max() / np.median(expected) > 0.7 * ratio  # smoothing keeps the burst
    assert len(log) == pytest.approx(sum(make(3).rates), rel=0.02)


def test_generators_are_deterministic_per_seed_and_differ_across_seeds():
    assert twitter_like(5) == twitter_like(5)
    assert twitter_like(5) != twitter_like(6)
    a = requests_from_rates(twitter_like(5, duration_s=60), seed=1)
    assert a == requests_from_rates(twitter_like(5, duration_s=60), seed=1)
    assert a != requests_from_rates(twitter_like(5, duration_s=60), seed=2)


def test_scaling_multiplies_rates_and_thins_logs():
    t = twitter_like(2, duration_s=600)
    half = t.scaled(0.15)
    assert half.median == pytest.approx(0.15 * t.median)
    assert half.peak_to_median == pytest.approx(t.peak_to_median)
    log = requests_from_rates(t, seed=0)
    assert len(log.scaled(0.5, seed=1)) == pytest.approx(len(log) / 2, rel=0.05)
    assert len(log.scaled(2.5, seed=1)) == pytest.approx(len(log) * 2.5, rel=0.05)
    with pytest.raises(ValueError):
        t.scaled(-1)


def test_poisson_arrivals_are_sorted_and_inside_their_second():
    trace = RateTrace("flat", (0.0, 100.0, 0.0))
    log = requests_from_rates(trace, seed=4)
    arr = np.asarray(log.arrivals_s)
    assert np.all(np.diff(arr) >= 0)
    assert np.all((arr >= 1.0) & (arr < 2.0))
    with pytest.raises(ValueError):
        RequestLog("bad", (2.0, 1.0))


def test_azure_llm_csv_loads_relative_sorted_timestamps():
    log = load_azure_llm_csv(AZURE_CSV)
    assert len(log) > 19_000  # the README says 19,365; the file holds 19,366 rows
    assert log.arrivals_s[0] == 0.0
    assert 3400 < log.duration_s < 3700  # one hour
    assert len(log.work) == len(log)
    assert np.mean(log.work) == pytest.approx(1.0)
    assert load_azure_llm_csv(AZURE_CSV, limit=100).arrivals_s == log.arrivals_s[:100]


def test_csv_with_wrong_columns_is_rejected(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_azure_llm_csv(bad)
