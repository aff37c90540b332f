"""Fitting PROTEAN's FBR (fractional bandwidth requirement) from co-location runs.

PROTEAN's slowdown model (Eq. 2, ``policy/protean.py``): a batch of model *k* co-located on
one MIG slice with batches *i* runs ``η/RDF = max(FBR_k + Σ FBR_i, 1)`` times slower than
alone on that slice. So one co-location run — a mix of models, ``n_j`` batches of model *j*,
on one slice type — measures, for every job in it, the slowdown
``s = solo throughput / co-located throughput`` and the model says

    s = max(Σ_j n_j · FBR_j, 1)                                     (per run, same for all)

A run with ``s > 1`` (bandwidth-bound) gives one linear equation ``Σ n_j FBR_j = s``;
a run with ``s ≈ 1`` says only ``Σ n_j FBR_j ≤ 1``. :func:`fit_fbr` solves the equations by
least squares with FBR ≥ 0 (an active-set loop: solve, drop the most negative, repeat), per
slice type since bandwidth is partitioned per slice (digest §2.3). A model that appears in
no saturated run is not identified: it gets the largest value its unsaturated runs allow
(an upper bound, listed in ``bounded``), which is the conservative choice for η.

The run's slowdown is the mean over its jobs' measured slowdowns (the model predicts one
value; measured ones differ by noise). Pure: numpy only, no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flashpoint.errors import BadRequest

SATURATED = 1.02  # a run slower than this (2% noise margin) is bandwidth-bound


@dataclass(frozen=True)
class CoLocationRun:
    """One measured run on one slice type: ``counts[model]`` batches of each model ran
    together; ``solo_tput[model]`` and ``coloc_tput[model]`` are per-batch throughputs
    of that model alone on this slice and in this mix."""

    slice: str
    counts: Mapping[str, int]
    solo_tput: Mapping[str, float]
    coloc_tput: Mapping[str, float]

    def slowdown(self) -> float:
        vals = []
        for m, n in self.counts.items():
            if n <= 0:
                raise BadRequest(f"run on {self.slice}: count of {m!r} must be > 0")
            solo, co = self.solo_tput.get(m), self.coloc_tput.get(m)
            if not solo or not co or solo <= 0 or co <= 0:
                raise BadRequest(f"run on {self.slice}: throughputs of {m!r} must be > 0")
            vals.append(solo / co)
        if not vals:
            raise BadRequest("a co-location run needs at least one model")
        return float(np.mean(vals))


@dataclass(frozen=True)
class FbrFit:
    """FBR per (model, slice); ``bounded`` lists the pairs only bounded above (no saturated
    run); ``rms`` is the root-mean-square residual of the saturated runs' slowdowns."""

    fbr: dict[tuple[str, str], float]
    bounded: tuple[tuple[str, str], ...]
    rms: float
    runs_used: int


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a·x − b|| with x ≥ 0, by dropping the most negative variable until none is."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    for _ in range(a.shape[1] + 1):  # bounded: each pass drops one variable
        x[:] = 0.0
        if not active:
            break
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= -1e-12).all():
            x[active] = np.maximum(sol, 0.0)
            break
        active.pop(int(np.argmin(sol)))
    return x


def fit_fbr(runs: Sequence[CoLocationRun]) -> FbrFit:
    """FBR of every (model, slice) seen in ``runs`` (module docstring)."""
    by_slice: dict[str, list[CoLocationRun]] = {}
    for r in runs:
        by_slice.setdefault(r.slice, []).append(r)
    fbr: dict[tuple[str, str], float] = {}
    bounded: list[tuple[str, str]] = []
    residuals: list[float] = []
    used = 0
    for slice_, rs in sorted(by_slice.items()):
        models = sorted({m for r in rs for m in r.counts})
        col = {m: i for i, m in enumerate(models)}
        sat = [(r, s) for r in rs if (s := r.slowdown()) > SATURATED]
        x = np.zeros(len(models))
        if sat:
            a = np.zeros((len(sat), len(models)))
            for row, (r, _s) in enumerate(sat):
                for m, n in r.counts.items():
                    a[row, col[m]] = n
            b = np.array([s for _r, s in sat])
            x = _nnls(a, b)
            residuals += list(a @ x - b)
            used += len(sat)
        seen = {m for r, _s in sat for m in r.counts}
        for m in models:
            if m in seen:
                continue
            # Not identified: the most each unsaturated run containing it allows, given the
            # others' fitted (or still unknown, taken as 0) FBRs.
            caps = [(1.0 - sum(n * x[col[o]] for o, n in r.counts.items() if o != m))
                    / r.counts[m] for r in rs if m in r.counts and r.slowdown() <= SATURATED]
            x[col[m]] = max(0.0, min(caps)) if caps else 0.0
            bounded.append((m, slice_))
        for m in models:
            fbr[(m, slice_)] = float(x[col[m]])
    rms = float(np.sqrt(np.mean(np.square(residuals)))) if residuals else 0.0
    return FbrFit(fbr, tuple(bounded), rms, used)
