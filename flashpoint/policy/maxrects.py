"""MaxRects 2-D bin packing for one GPU: FaST-GShare's Maximal Rectangles Algorithm.

Seed 001 §3.4.2 (Algorithm 2, Fig. 6), digest 001-fastgshare.md §4.2. A GPU is a W×H
rectangle: width = its time window (time quota), height = its SMs (SM%). A pod is a w×h
rectangle (its time quota × its SM share). Each GPU keeps the list of *maximal* free
rectangles, which may overlap (Jylänki, "A thousand ways to pack the bin", MaxRects):

- a pod fits a free rectangle when ``w ≤ w_R and h ≤ h_R`` (Algorithm 2 line 1 prints the
  inequality reversed, a typo the digest flags: a pod must be *smaller* than the hole);
- it goes to the hole's bottom-left corner;
- *every* free rectangle that intersects the pod is replaced by its ≤ 4 maximal remainders
  (left, right, below, above the pod); the split of the chosen hole into the paper's two
  overlapping strips R', R'' (line 5) is the special case of this for the hole itself;
- free rectangles contained in another are pruned (line 15).

Rotation is never allowed: the two axes mean different resources.

Coordinates are integers (``TIME_UNITS`` per window, ``SM_UNITS`` per GPU) so that
containment and intersection are exact; a fraction is rounded *up* to units, so a pod never
gets less than it asked for. Positions are virtual: FaST's runtime only enforces each pod's
own quota and ΣS ≤ 100% among concurrent token holders (digest §4.2 "[I]"), so the packing
is a sufficient feasibility condition, and re-packing a GPU costs nothing at run time.

Pure: frozen values in, new values out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from flashpoint.errors import BadRequest

TIME_UNITS = 1000  # per-mille of the time window: quotas like 0.3 or 0.45 stay exact
SM_UNITS = 100  # percent of SMs: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is a percentage
_ROUND_EPS = 1e-9


def to_units(fraction: float, units: int) -> int:
    """``fraction`` of an axis in integer units, rounded up (never under-provision)."""
    if not (math.isfinite(fraction) and 0 < fraction <= 1 + _ROUND_EPS):
        raise BadRequest(f"a GPU share must be in (0, 1], got {fraction}")
    return min(units, max(1, math.ceil(fraction * units - _ROUND_EPS)))


@dataclass(frozen=True, order=True)
class Rect:
    """An axis-aligned rectangle: x along time, y along SMs, in integer units."""

    x: int
    y: int
    w: int
    h: int

    @property
    def area(self) -> int:
        """"secondCores" in the paper: quota × SMs, the common measure of size."""
        return self.w * self.h

    @property
    def right(self) -> int:
        return self.x + self.w

    @property
    def top(self) -> int:
        return self.y + self.h

    def fits(self, w: int, h: int) -> bool:
        """A w×h pod fits in this hole (the corrected inequality of Alg. 2 line 1)."""
        return w <= self.w and h <= self.h

    def intersects(self, other: Rect) -> bool:
        """Overlap of positive area (touching edges do not count)."""
        return (self.x < other.right and other.x < self.right
                and self.y < other.top and other.y < self.top)

    def contains(self, other: Rect) -> bool:
        return (self.x <= other.x and self.y <= other.y
                and other.right <= self.right and other.top <= self.top)


def split_free(free: Rect, used: Rect) -> list[Rect]:
    """The maximal sub-rectangles of ``free`` minus ``used`` (Alg. 2 lines 8–14).

    ``free`` itself if they do not intersect; otherwise up to four strips: left of, right
    of, below and above the used rectangle, each spanning the whole of ``free`` along the
    other axis (so they overlap: MaxRects keeps maximal rectangles, not a guillotine cut).
    """
    if not free.intersects(used):
        return [free]
    out = []
    if used.x > free.x:
        out.append(Rect(free.x, free.y, used.x - free.x, free.h))
    if used.right < free.right:
        out.append(Rect(used.right, free.y, free.right - used.right, free.h))
    if used.y > free.y:
        out.append(Rect(free.x, free.y, free.w, used.y - free.y))
    if used.top < free.top:
        out.append(Rect(free.x, used.top, free.w, free.top - used.top))
    return out


def prune(rects: Iterable[Rect]) -> tuple[Rect, ...]:
    """Drop duplicates and rectangles contained in another (Alg. 2 line 15), sorted."""
    uniq = sorted(set(rects), key=lambda r: (-r.area, r))
    kept: list[Rect] = []
    for r in uniq:  # larger first: a rectangle can only be contained in one at least as large
        if not any(k.contains(r) for k in kept):
            kept.append(r)
    return tuple(sorted(kept))


def free_after(free: Iterable[Rect], used: Rect) -> tuple[Rect, ...]:
    """The free list once ``used`` is taken: split every intersecting hole, then prune."""
    return prune(part for r in free for part in split_free(r, used))


def free_space(width: int, height: int, used: Iterable[Rect]) -> tuple[Rect, ...]:
    """The maximal free rectangles of an empty W×H bin once ``used`` are taken.

    Used on release instead of the paper's "keep-restructure" (append the freed rectangle
    to the list): that keeps the list sound but not maximal and, without the unspecified
    repacking threshold, lets it fill with duplicates (digest §8 item 12). Splitting the
    empty bin by the pods still there is exact and cheap (a GPU holds tens of pods at most).
    """
    free: tuple[Rect, ...] = (Rect(0, 0, width, height),)
    for u in used:
        free = free_after(free, u)
    return free


@dataclass(frozen=True)
class Fit:
    """Where a w×h pod would go in one bin, and how well it fits (lower is better).

    ``area_waste`` is the paper's score, Area(R) − Area(F) (best-area-fit, Alg. 2 line 1);
    ``short_side`` breaks its ties as Jylänki's BAF does: the smaller leftover side.
    """

    area_waste: int
    short_side: int
    hole: Rect

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.area_waste, self.short_side, self.hole.x, self.hole.y)


def best_fit(free: Iterable[Rect], w: int, h: int) -> Fit | None:
    """The best-area-fit hole for a w×h pod in one free list, or None if none fits."""
    best: Fit | None = None
    for r in free:
        if not r.fits(w, h):
            continue
        fit = Fit(r.area - w * h, min(r.w - w, r.h - h), r)
        if best is None or fit.key < best.key:
            best = fit
    return best
