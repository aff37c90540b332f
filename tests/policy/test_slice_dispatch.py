"""PROTEAN Alg. 1 over MIG slices for the live dispatcher (policy/slice_dispatch.py).

Every expected routing here is worked out by hand from Alg. 1 as the digest states it
(§2.4): BE requests first-fit into the smallest slices, strict ones to the least
η = RDF · max(Σ FBR, 1), RDF = 7 / compute slices, one credit per request.
"""

from __future__ import annotations

import pytest

from flashpoint.errors import BadRequest
from flashpoint.policy.slice_dispatch import (
    SliceReplica,
    SliceRoutingSnapshot,
    route_to_slices,
    short_profile,
)

# One A100 at (4g,2g,1g), a replica of the function on each slice, two credits free each.
A100 = (SliceReplica("r4", "h/g0/4g", "4g", 2), SliceReplica("r2", "h/g0/2g", "2g", 2),
        SliceReplica("r1", "h/g0/1g", "1g", 2))


def test_strict_on_the_large_slice_best_effort_packed_small():
    d = route_to_slices(SliceRoutingSnapshot(A100, strict=2, best_effort=3))
    assert d.strict == ("r4", "r4")  # RDF 1.75 < 3.5 < 7: the 4g
    assert d.best_effort == ("r1", "r1", "r2")  # first fit: the 1g, then the 2g
    assert d.tags == {"h/g0/1g": 1.0, "h/g0/2g": 0.5, "h/g0/4g": 0.0}


def test_strict_spills_to_the_next_largest_slice_when_the_4g_is_full():
    d = route_to_slices(SliceRoutingSnapshot(A100, strict=4, best_effort=0))
    assert d.strict == ("r4", "r4", "r2", "r2")


def test_strict_goes_first_best_effort_gets_the_credits_left():
    d = route_to_slices(SliceRoutingSnapshot(A100, strict=5, best_effort=4))
    assert len(d.strict) == 5 and d.best_effort == ("r1",)  # 6 credits: 5 strict, 1 BE
    d = route_to_slices(SliceRoutingSnapshot(A100, strict=7, best_effort=4))
    assert len(d.strict) == 6 and d.best_effort == ()  # the 7th strict waits, and all BE


def test_interference_sends_strict_to_a_smaller_slice():
    """The GPT case (§6.2): a crowded 4g loses to a quiet 3g once Σ FBR passes 1."""
    reps = (SliceReplica("r4", "g/4g", "4g", 4), SliceReplica("r3", "g/3g", "3g", 4))
    crowded = {"g/4g": 2.0}
    d = route_to_slices(SliceRoutingSnapshot(reps, 1, 0, request_fbr=0.5,
                                             resident_fbr=crowded))
    # 4g: 7/4 · max(0.5 + 2.0, 1) = 4.375; 3g: 7/3 · max(0.5, 1) = 2.33
    assert d.strict == ("r3",)
    quiet = {"g/4g": 0.4}  # 4g: 1.75 · max(0.9, 1) = 1.75 < 2.33
    assert route_to_slices(SliceRoutingSnapshot(reps, 1, 0, 0.5, quiet)).strict == ("r4",)
    # each strict request adds its own FBR: 4g 1.75·max(0.5,1), then 1.75·1.0, then
    # 1.75·1.5 = 2.625 > 3g's 2.33: the third goes to the 3g
    assert route_to_slices(SliceRoutingSnapshot(reps, 3, 0, 0.5)).strict == ("r4", "r4", "r3")


def test_t_high_keeps_strict_work_off_a_nearly_full_be_slice_without_starving_it():
    one = (SliceReplica("a", "g/4g", "4g", 20),)
    d = route_to_slices(SliceRoutingSnapshot(one, 1, 30, t_high=1.0))
    assert d.strict == ("a",) and len(d.best_effort) == 19  # tag 19/20 < 1
    # T_high 0.9: a tag of 0.95 would keep the strict request off the only slice, so this
    # round sends 18 BE requests (tag 18/20 = 0.9, not above T_high) and the strict one
    d = route_to_slices(SliceRoutingSnapshot(one, 1, 30, t_low=0.05, t_high=0.9))
    assert d.strict == ("a",) and len(d.best_effort) == 18


def test_replicas_on_one_slice_share_its_requests_by_free_credits():
    reps = (SliceReplica("a", "g/4g", "4g", 1), SliceReplica("b", "g/4g", "4g", 3),
            SliceReplica("c", "h/4g", "4g", 2))
    d = route_to_slices(SliceRoutingSnapshot(reps, 4, 0))
    # equal η: the slice with more room left for strict work first (g/4g 4, 3 vs h/4g 2;
    # at 2 against 2 the later slice id), inside it the replica with the most credits left
    # (b 3, 2; then a and b at 1 each: the smaller id)
    assert d.strict == ("b", "b", "c", "a")


def test_nothing_to_route_and_bad_thresholds():
    assert route_to_slices(SliceRoutingSnapshot(A100, 0, 0)).strict == ()
    full = tuple(SliceReplica(r.replica_id, r.slice_id, r.slice, 0) for r in A100)
    d = route_to_slices(SliceRoutingSnapshot(full, 3, 3))
    assert d.strict == () and d.best_effort == ()
    with pytest.raises(BadRequest):
        route_to_slices(SliceRoutingSnapshot(A100, 1, 0, t_low=0.5, t_high=0.5))
    assert short_profile("3g.20gb") == "3g" and short_profile("1g.10gb+me") == "1g"
    with pytest.raises(BadRequest):
        short_profile("5g.25gb")
