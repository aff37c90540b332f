"""The fairness search (thesis §8.4's ±5% rule) on synthetic responses whose answer is known."""

from __future__ import annotations

import pytest

from flashpoint.sim.fairness import Knob, search

PCT = Knob("percentile", 1.0, 100.0, +1)  # ATL-like: larger = more replicas
UTIL = Knob("target_utilisation", 0.1, 0.9, -1)  # OWK-like: larger = fewer replicas
HOLD = Knob("scale_down_delay_s", 0.0, 1000.0, +1)


def _counting(f):
    calls = []

    def evaluate(p: float, h: float):
        calls.append((p, h))
        return (p, h), f(p, h)

    return evaluate, calls


def test_a_monotone_threshold_is_bisected_into_the_band():
    evaluate, calls = _counting(lambda p, h: p / 50.0)  # the band is p in [47.5, 52.5]
    out = search(evaluate, PCT, 99.0, HOLD, 0.0, max_runs=16)
    assert out.within and out.note == ""
    assert 47.5 <= out.best.primary <= 52.5 and abs(out.best.ratio - 1) <= 0.05
    assert out.best.hold == 0.0  # the hold knob was not needed
    assert out.result == (out.best.primary, out.best.hold)
    assert calls[0] == (99.0, 0.0) and len(calls) == len(out.tried) <= 16
    assert len(set(calls)) == len(calls)  # no value evaluated twice


def test_a_saturated_threshold_hands_over_to_the_hold_knob():
    # ATL at p100 still gives 0.6x; holding replicas raises it by 0.001 per second of delay:
    # the band is hold in [350, 450] at any percentile.
    evaluate, calls = _counting(lambda p, h: 0.5 + p / 1000.0 + h / 1000.0)
    out = search(evaluate, PCT, 99.0, HOLD, 0.0, max_runs=16)
    assert out.within
    assert out.best.primary == 100.0  # the range end first, then the delay from there
    assert 350.0 <= out.best.hold <= 450.0
    assert calls[:2] == [(99.0, 0.0), (100.0, 0.0)]
    # Then the scan between them (all 0.6x), then the delay's end from the closest run.
    assert calls[2:5] == [(99.25, 0.0), (99.5, 0.0), (99.75, 0.0)]
    assert calls[5] == (100.0, 1000.0)


def test_the_hold_knob_also_goes_down_from_a_default_above_the_band():
    # OWK-like: every threshold gives 1.3x at the HPA's 300 s delay; less delay, fewer replicas.
    evaluate, _ = _counting(lambda p, h: 1.0 + 0.3 * h / 300.0 - 0.01 * (p - 0.1))
    out = search(evaluate, UTIL, 0.6, HOLD, 300.0, max_runs=16)
    assert out.within and out.best.hold < 300.0


def test_a_non_monotone_response_is_scanned_and_its_narrow_band_found():
    # Lower utilisation target = more replicas, but the response is not monotone: the band
    # (ratio 1.0) exists only for p in [0.70, 0.80).
    def f(p: float, h: float) -> float:
        if p < 0.3:
            return 1.8
        if p < 0.5:
            return 0.45
        if p < 0.7:
            return 1.3
        if p < 0.8:
            return 1.0
        return 0.45

    evaluate, calls = _counting(f)
    out = search(evaluate, UTIL, 0.2, HOLD, 300.0, max_runs=16)
    assert out.within and 0.7 <= out.best.primary < 0.8
    assert len(calls) <= 16


def test_a_jump_over_the_band_and_saturated_knobs_are_explained_with_numbers():
    # 0.8x below p = 50, 1.2x from 50 on, whatever the delay: the band cannot be reached.
    evaluate, calls = _counting(lambda p, h: 0.8 if p < 50.0 else 1.2)
    out = search(evaluate, PCT, 10.0, Knob("scale_down_delay_s", 0.0, 1000.0, +1), 300.0,
                 max_runs=16)
    assert not out.within
    assert "percentile jumps over the band between" in out.note
    assert "scale_down_delay_s (at percentile 10) over 0..1000 gives 0.800–0.800×, all below" \
        in out.note
    assert "(closest 0.800×)" in out.note or "(closest 1.200×)" in out.note
    assert len(calls) <= 16


def test_out_of_reach_at_both_ends_is_said_with_the_ratios_reached():
    evaluate, calls = _counting(lambda p, h: 0.3 + p / 1000.0 + h / 10000.0)
    out = search(evaluate, PCT, 99.0, HOLD, 0.0, max_runs=16, scan=3)
    # default, p100, 3 scanned percentiles; the delay's end and 3 scanned delays: 9 runs.
    assert not out.within and len(calls) == 9
    assert "percentile over 99..100 gives 0.399–0.400×, all below the band" in out.note
    assert ("scale_down_delay_s (at percentile 100) over 0..1000 gives 0.400–0.500×, all "
            "below the band") in out.note
    assert out.best.ratio == pytest.approx(0.5) and out.best.hold == 1000.0


@pytest.mark.parametrize("max_runs", [1, 2, 5])
def test_the_run_budget_is_never_exceeded(max_runs):
    evaluate, calls = _counting(lambda p, h: 1.2 if p < 50.0 else 0.8)
    out = search(evaluate, PCT, 10.0, HOLD, 0.0, max_runs=max_runs)
    assert len(calls) <= max_runs and len(out.tried) == len(calls)


def test_the_search_is_deterministic():
    f = lambda p, h: 0.5 + p / 300.0 + h / 5000.0  # noqa: E731
    a = search(_counting(f)[0], PCT, 20.0, HOLD, 0.0)
    b = search(_counting(f)[0], PCT, 20.0, HOLD, 0.0)
    assert a.tried == b.tried and a.best == b.best


def test_knob_rejects_bad_ranges():
    with pytest.raises(ValueError):
        Knob("x", 1.0, 1.0, +1)
    with pytest.raises(ValueError):
        Knob("x", 0.0, 1.0, -1, geometric=True)
