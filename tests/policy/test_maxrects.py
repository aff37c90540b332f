"""MaxRects (flashpoint/policy/maxrects.py): splitting, pruning, and the exact-cover invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.policy import maxrects
from flashpoint.policy.maxrects import Rect, best_fit, free_after, free_space, prune, split_free

W, H = 10, 8  # a small bin keeps the exhaustive cell checks cheap


def test_to_units_rounds_up_and_rejects_out_of_range():
    assert maxrects.to_units(0.12, 100) == 12
    assert maxrects.to_units(0.3, 1000) == 300  # 0.3 * 1000 = 300.00000000000006 in binary
    assert maxrects.to_units(0.121, 100) == 13  # never under-provision
    assert maxrects.to_units(1e-6, 100) == 1
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(BadRequest):
            maxrects.to_units(bad, 100)


def test_split_gives_the_four_maximal_strips_that_overlap():
    free = Rect(0, 0, 10, 10)
    parts = split_free(free, Rect(3, 4, 2, 2))
    assert sorted(parts) == sorted([Rect(0, 0, 3, 10), Rect(5, 0, 5, 10),
                                    Rect(0, 0, 10, 4), Rect(0, 6, 10, 4)])
    assert split_free(free, Rect(10, 0, 2, 2)) == [free]  # touching is not intersecting


def test_placing_at_the_corner_leaves_the_papers_two_strips():
    """Alg. 2 line 5: R' (right strip) and R'' (top strip), overlapping, both kept."""
    free = free_after([Rect(0, 0, 1000, 100)], Rect(0, 0, 600, 50))
    assert free == (Rect(0, 50, 1000, 50), Rect(600, 0, 400, 100))


def test_prune_drops_contained_and_duplicates():
    assert prune([Rect(0, 0, 5, 5), Rect(1, 1, 2, 2), Rect(0, 0, 5, 5)]) == (Rect(0, 0, 5, 5),)


def test_best_fit_uses_area_waste_then_short_side():
    free = [Rect(0, 0, 10, 2), Rect(0, 0, 4, 5), Rect(0, 0, 3, 3)]
    assert best_fit(free, 3, 2).hole == Rect(0, 0, 3, 3)  # waste 3 beats 14 and 14
    assert best_fit(free, 5, 5) is None
    # equal waste (10): the smaller leftover short side wins (0 vs 1)
    assert best_fit([Rect(0, 0, 6, 3), Rect(0, 0, 4, 4)], 2, 4).hole == Rect(0, 0, 4, 4)
    # the inequality is w <= w_R and h <= h_R (Alg. 2 prints it reversed): no rotation
    assert best_fit([Rect(0, 0, 2, 5)], 5, 2) is None


def _cells(rects):
    return {(x, y) for r in rects for x in range(r.x, r.right) for y in range(r.y, r.top)}


rect_sizes = st.lists(st.tuples(st.integers(1, W), st.integers(1, H)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(rect_sizes)
def test_free_list_is_exactly_the_space_not_used(sizes):
    """The MaxRects invariant after any sequence of best-fit placements: used rectangles
    never overlap and stay in the bin, free rectangles cover exactly the unused cells, and
    no free rectangle is contained in another."""
    free: tuple[Rect, ...] = (Rect(0, 0, W, H),)
    used: list[Rect] = []
    for w, h in sizes:
        fit = best_fit(free, w, h)
        if fit is None:
            continue
        r = Rect(fit.hole.x, fit.hole.y, w, h)
        assert all(not r.intersects(u) for u in used)
        assert 0 <= r.x and r.right <= W and 0 <= r.y and r.top <= H
        used.append(r)
        free = free_after(free, r)
        occupied = _cells(used)
        assert _cells(free) == _cells([Rect(0, 0, W, H)]) - occupied
        assert not any(a != b and a.contains(b) for a in free for b in free)
    assert free == free_space(W, H, used)  # rebuilding from the pods gives the same list


@settings(max_examples=100, deadline=None)
@given(rect_sizes, st.tuples(st.integers(1, W), st.integers(1, H)))
def test_a_pod_fits_whenever_some_free_rectangle_holds_it(sizes, pod):
    """Completeness: if any axis-aligned hole of the pod's size is empty, best_fit finds one
    (maximal free rectangles contain every empty rectangle)."""
    free: tuple[Rect, ...] = (Rect(0, 0, W, H),)
    used: list[Rect] = []
    for w, h in sizes:
        fit = best_fit(free, w, h)
        if fit is not None:
            r = Rect(fit.hole.x, fit.hole.y, w, h)
            used.append(r)
            free = free_after(free, r)
    w, h = pod
    occupied = _cells(used)
    empty_somewhere = any(not (_cells([Rect(x, y, w, h)]) & occupied)
                          for x in range(W - w + 1) for y in range(H - h + 1))
    assert (best_fit(free, w, h) is not None) == empty_somewhere
