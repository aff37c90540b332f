"""FBR fitting from co-location runs, on synthetic runs with known FBRs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flashpoint.errors import BadRequest
from flashpoint.policy.protean import eta
from flashpoint.policy.protean_fit import CoLocationRun, fit_fbr

TRUE = {("resnet", "3g"): 0.35, ("bert", "3g"): 0.6, ("rnnt", "3g"): 0.2,
        ("resnet", "7g"): 0.15, ("bert", "7g"): 0.3}
SOLO = {"resnet": 120.0, "bert": 40.0, "rnnt": 75.0}


def _run(slice_: str, counts: dict[str, int], noise: np.random.Generator | None = None
         ) -> CoLocationRun:
    """What PROTEAN's model predicts for this mix (optionally with measurement noise)."""
    s = max(sum(n * TRUE[(m, slice_)] for m, n in counts.items()), 1.0)
    co = {}
    for m in counts:
        jitter = 1.0 + (noise.normal(0, 0.01) if noise is not None else 0.0)
        co[m] = SOLO[m] / s * jitter
    return CoLocationRun(slice_, counts, {m: SOLO[m] for m in counts}, co)


def _mixes(slice_: str) -> list[dict[str, int]]:
    models = sorted(m for m, s in TRUE if s == slice_)
    out = []
    for counts in itertools.product(range(0, 4), repeat=len(models)):
        if sum(counts) >= 1:
            out.append({m: n for m, n in zip(models, counts, strict=True) if n})
    return out


def test_exact_runs_recover_the_fbrs_per_slice():
    runs = [_run(s, c) for s in ("3g", "7g") for c in _mixes(s)]
    fit = fit_fbr(runs)
    assert fit.bounded == ()
    for key, want in TRUE.items():
        assert fit.fbr[key] == pytest.approx(want, abs=1e-9), key
    assert fit.rms < 1e-9
    # only saturated runs are equations: (1 resnet on 3g: 0.35 <= 1) is not one
    assert fit.runs_used == sum(max(sum(n * TRUE[(m, s)] for m, n in c.items()), 1.0) > 1.02
                                for s in ("3g", "7g") for c in _mixes(s))


def test_noisy_runs_recover_the_fbrs_closely_and_eta_follows():
    rng = np.random.default_rng(7)
    runs = [_run("3g", c, rng) for c in _mixes("3g") for _ in range(3)]
    fit = fit_fbr(runs)
    for m in ("resnet", "bert", "rnnt"):
        assert fit.fbr[(m, "3g")] == pytest.approx(TRUE[(m, "3g")], abs=0.02), m
    assert 0.0 < fit.rms < 0.05
    # the fitted FBRs predict a mix's slowdown as the true ones do
    got = eta(1.0, fit.fbr[("bert", "3g")], [fit.fbr[("resnet", "3g")]] * 2)
    assert got == pytest.approx(eta(1.0, 0.6, [0.35, 0.35]), rel=0.03)


def test_a_model_never_saturating_is_only_bounded():
    # rnnt alone (1 or 2 copies: 0.2, 0.4) and with one resnet (0.55) never saturates: its
    # FBR is known only to be <= (1 - 0.35) / 1 = 0.65 and <= 1/2 from the pair run.
    runs = [_run("3g", {"resnet": 3}), _run("3g", {"resnet": 4}),
            _run("3g", {"rnnt": 1}), _run("3g", {"rnnt": 2}),
            _run("3g", {"rnnt": 1, "resnet": 1})]
    fit = fit_fbr(runs)
    assert fit.fbr[("resnet", "3g")] == pytest.approx(0.35, abs=1e-9)
    assert fit.bounded == (("rnnt", "3g"),)
    assert fit.fbr[("rnnt", "3g")] == pytest.approx(0.5)


def test_bad_runs_are_refused():
    with pytest.raises(BadRequest):
        fit_fbr([CoLocationRun("3g", {"a": 1}, {"a": 10.0}, {"a": 0.0})])
    with pytest.raises(BadRequest):
        fit_fbr([CoLocationRun("3g", {"a": 0}, {"a": 10.0}, {"a": 5.0})])
    with pytest.raises(BadRequest):
        fit_fbr([CoLocationRun("3g", {}, {}, {})])
