"""Plan tables: the best plan for every load ``x <= x_max`` and scale-up size (seed 004, §4.2.2).

The autoscaler asks, on a scale-up by ``scale`` GPUs expecting ``x`` requests (Eq 4.14),
for the best plan with at most ``scale`` parts (§4.2.6). :func:`plan_table` answers every
such question ahead of time, per model version.

**How.** One Pareto-front solve (:func:`~flashpoint.partition.solver.solve_fronts`) gives,
per part count ``p``, the non-dominated plans; each is a line ``T̄ = a + α·b`` in the queue
factor ``α = Σ_{y≤x}(ceil(y/g)-1)/x`` (``g = floor(P/p)``), so the best ``p``-part value is
the lower envelope of those lines, kept exactly (rational arithmetic). The envelope is
evaluated for every ``x = 1..x_max`` at once with numpy (O(hull size · x_max) per ``(p, g)``)
and the argmin over ``p`` is run-length encoded into segments per ``scale``.

**Why not the thesis's exponential search over x.** §4.2.2 finds where the best ``p``
changes by exponential + binary search from each change point. That is only right if every
``p`` wins on one interval of ``x``; it does not hold: ``α`` depends on ``x`` through
``floor``/``ceil`` steps that differ per ``p``, so the winner can go ``p1 → p2 → p1``
(``tests/partition/test_partition.py`` pins a case), and a search that probes ``x+1, x+2, x+4…``
skips such islands. What *is* monotone is each envelope: ``α`` never decreases with ``x``
(``queue_rounds_sum`` is convex and 0 at 0), so the best ``p``-part plan moves along its
envelope one way. The dense sweep needs no assumption and costs a few milliseconds.

**P.** ``P=None`` (default): the GPUs of the scale-up are the pipelines' GPUs, ``P = scale``
in Eq 4.5 — the physical meaning. An int ``P`` fixes it for every lookup, as §4.2.2 solves
the table with one ``P`` and falls back to the best plan with ``<= scale`` parts; a table
built with ``P < p`` never offers ``p`` parts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from flashpoint.partition.model import CostModel, LayerProfile, Plan, evaluate, queue_factor
from flashpoint.partition.solver import FrontPlan, solve_fronts


@dataclass(frozen=True)
class PlanSegment:
    """Loads ``x_first..x_last`` (inclusive) share the best plan: ``p`` parts, ``cuts``."""

    x_first: int
    x_last: int
    p: int
    cuts: tuple[int, ...]


@dataclass(frozen=True)
class Envelope:
    """Lower envelope over ``α >= 0`` of one part count's plans: ``T̄ = a + α·b``.

    Lines are in order of decreasing ``b``; ``starts[k]`` is the ``α`` from which line ``k``
    is the minimum (exact rationals; ``starts[0] = 0``).
    """

    a: tuple[float, ...]
    b: tuple[float, ...]
    cuts: tuple[tuple[int, ...], ...]
    starts: tuple[Fraction, ...]

    def best(self, alpha: float) -> int:
        """Index of the line minimal at ``alpha``."""
        return bisect.bisect_right(self.starts, Fraction(alpha)) - 1


def envelope(plans: Sequence[FrontPlan], exec_sum_s: float) -> Envelope:
    """Exact lower envelope of the lines ``a = cold + (I(1) + IN)``, slope ``b = B``."""
    lines = sorted(((fp.cold_s + (exec_sum_s + fp.transfer_sum_s), fp.bottleneck_s, fp.cuts)
                    for fp in plans), key=lambda ln: (ln[0], ln[1]))
    # 2-D Pareto first (smaller a, then strictly smaller b), exact float comparisons
    stair = []
    for ln in lines:
        if not stair or ln[1] < stair[-1][1]:
            stair.append(ln)
    # now a ascending, b descending; convex hull in exact arithmetic
    hull: list[tuple[Fraction, Fraction, tuple]] = []
    starts: list[Fraction] = []
    for a_f, b_f, cuts in stair:
        a, b = Fraction(a_f), Fraction(b_f)
        while hull:
            ha, hb, _ = hull[-1]
            cross = (a - ha) / (hb - b)  # α where the new line gets below the last kept one
            if cross <= starts[-1]:
                hull.pop()
                starts.pop()
            else:
                break
        starts.append(Fraction(0) if not hull else (a - hull[-1][0]) / (hull[-1][1] - b))
        hull.append((a, b, cuts))
    return Envelope(a=tuple(float(h[0]) for h in hull), b=tuple(float(h[1]) for h in hull),
                    cuts=tuple(h[2] for h in hull), starts=tuple(starts))


def _alpha_row(x_max: int, g: int) -> np.ndarray:
    """``α(x) = queue_rounds_sum(x, g) / x`` for ``x = 1..x_max`` (same float as the scalar)."""
    x = np.arange(1, x_max + 1, dtype=np.int64)
    q, r = np.divmod(x, g)
    return (g * q * (q - 1) // 2 + r * q) / x


class PlanTable:
    """Best plans by load and scale-up size for one model version; read-only once built.

    ``lookup(x, scale)`` is exact for every ``x >= 1`` and ``scale >= 1``: inside the table
    (``x <= x_max``, ``scale <= p_max``) it reads a segment, outside it evaluates the
    envelopes directly. Plans never have more than ``p_max`` parts.
    """

    def __init__(self, profiles: Sequence[LayerProfile], cost: CostModel, p_max: int,
                 x_max: int, P: int | None, envelopes: tuple[Envelope, ...],
                 segments: tuple[tuple[PlanSegment, ...], ...]) -> None:
        self.profiles = tuple(profiles)
        self.cost = cost
        self.p_max = p_max
        self.x_max = x_max
        self.P = P
        self._env = envelopes            # index p (0 unused)
        self._segments = segments        # index scale (0 unused)
        self._firsts = tuple(tuple(s.x_first for s in segs) for segs in segments)

    @property
    def k_max(self) -> int:
        """The most parts any plan of this table has."""
        return len(self._env) - 1

    def gpus(self, scale: int) -> int:
        """``P`` of Eq 4.5 for a scale-up by ``scale`` GPUs."""
        return scale if self.P is None else self.P

    def segments(self, scale: int) -> tuple[PlanSegment, ...]:
        """The segments of ``x = 1..x_max`` for ``scale`` (``1 <= scale <= p_max``)."""
        if not 1 <= scale <= self.p_max:
            raise ValueError(f"scale must be in 1..{self.p_max} (scale={scale})")
        return self._segments[scale]

    def change_points(self, scale: int) -> tuple[int, ...]:
        """The loads ``x > 1`` at which the best plan changes, for ``scale``."""
        return tuple(s.x_first for s in self.segments(scale)[1:])

    def lookup(self, x: float, scale: int) -> Plan:
        """Best plan with at most ``scale`` parts for ``x`` requests (``T̄`` minimal).

        ``x`` may be fractional (Eq 4.14's ``E(x)``): it is rounded up, and at least 1.
        """
        if scale < 1:
            raise ValueError(f"scale must be >= 1 (scale={scale})")
        xi = max(1, math.ceil(x))
        P = self.gpus(scale)
        if xi <= self.x_max and scale <= self.p_max:
            segs = self._segments[scale]
            seg = segs[bisect.bisect_right(self._firsts[scale], xi) - 1]
            return evaluate(self.profiles, self.cost, seg.cuts, xi, P)
        return evaluate(self.profiles, self.cost, self._direct(xi, scale)[1], xi, P)

    def _direct(self, x: int, scale: int) -> tuple[int, tuple[int, ...]]:
        P = self.gpus(scale)
        best: tuple[float, int, tuple[int, ...]] | None = None
        for p in range(1, min(scale, P, self.k_max) + 1):
            env = self._env[p]
            if not env.a:
                continue
            alpha = queue_factor(x, p, P)
            k = env.best(alpha)
            v = env.a[k] + env.b[k] * alpha
            if best is None or v < best[0]:
                best = (v, p, env.cuts[k])
        assert best is not None
        return best[1], best[2]


def plan_table(profiles: Sequence[LayerProfile], cost: CostModel, p_max: int = 64,
               x_max: int = 3000, P: int | None = None) -> PlanTable:
    """Solve once, then tabulate the best plan for ``x = 1..x_max``, ``scale = 1..p_max``."""
    if p_max < 1 or x_max < 1 or (P is not None and P < 1):
        raise ValueError(f"need p_max >= 1, x_max >= 1, P >= 1 (p_max={p_max}, x_max={x_max}, "
                         f"P={P})")
    k_max = min(p_max, len(profiles), p_max if P is None else P)
    fr = solve_fronts(profiles, cost, k_max, nested=True)
    envs = (Envelope((), (), (), ()),) + tuple(
        envelope(fr.by_parts[p], fr.exec_sum_s) for p in range(1, fr.k_max + 1))
    arrays = [(np.asarray(e.a), np.asarray(e.b)) for e in envs]
    alphas: dict[int, np.ndarray] = {}
    rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def row(p: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Best ``p``-part value and envelope line index for every x, with ``g`` pipelines."""
        key = (p, g)
        if key not in rows:
            if g not in alphas:
                alphas[g] = _alpha_row(x_max, g)
            a, b = arrays[p]
            vals = a[:, None] + b[:, None] * alphas[g][None, :]
            idx = np.argmin(vals, axis=0)
            rows[key] = (vals[idx, np.arange(x_max)], idx)
        return rows[key]

    segments: list[tuple[PlanSegment, ...]] = [()]
    for scale in range(1, p_max + 1):
        gpus = scale if P is None else P
        ps = [p for p in range(1, min(scale, gpus, fr.k_max) + 1) if envs[p].a]
        got = [row(p, gpus // p) for p in ps]
        vals = np.stack([v for v, _ in got])
        which = np.argmin(vals, axis=0)              # first minimum: fewest parts on ties
        line = np.stack([i for _, i in got])[which, np.arange(x_max)]
        key = which.astype(np.int64) * 1_000_000 + line
        starts = np.concatenate(([0], np.flatnonzero(np.diff(key)) + 1))
        ends = np.concatenate((starts[1:], [x_max])) - 1
        segs = []
        for s0, s1 in zip(starts.tolist(), ends.tolist(), strict=True):
            p = ps[int(which[s0])]
            segs.append(PlanSegment(s0 + 1, s1 + 1, p, envs[p].cuts[int(line[s0])]))
        segments.append(tuple(segs))
    return PlanTable(profiles, cost, p_max, x_max, P, envs, tuple(segments))
