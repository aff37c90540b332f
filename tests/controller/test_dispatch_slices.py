"""Dispatcher over MIG slices: PROTEAN's job distribution (Alg. 1) routes a function whose
replicas all sit on MIG slices. Expected routes are worked out by hand from Alg. 1
(digest §2.4): η = RDF · max(Σ FBR, 1) with RDF = 7 / compute slices, BE first fit into
the smallest slices, one credit per request."""

from __future__ import annotations

import pytest

from flashpoint.controller.dispatch import Dispatcher
from flashpoint.errors import BadRequest


def _a100(d: Dispatcher, function: str = "f", credits: int = 2, fbr: float = 0.0) -> None:
    """A replica of ``function`` on each slice of an A100 at (4g,2g,1g)."""
    for prof in ("4g.20gb", "2g.10gb", "1g.5gb"):
        short = prof.split(".")[0]
        d.add_replica(f"{function}-{short}", function, credits,
                      slice_id=f"h/cuda:0/{short}", mig_profile=prof, fbr=fbr)


def _queue(d: Dispatcher, strict: int, best_effort: int, function: str = "f") -> None:
    for i in range(best_effort):  # BE arrives first: strict still goes first
        d.enqueue(function, f"b{i}", best_effort=True)
    for i in range(strict):
        d.enqueue(function, f"s{i}")


def test_strict_to_the_4g_best_effort_packed_into_the_1g_then_the_2g():
    d = Dispatcher()
    _a100(d)
    _queue(d, strict=2, best_effort=5)
    out = d.assign("f")
    assert out == [("s0", "f-4g"), ("s1", "f-4g"), ("b0", "f-1g"), ("b1", "f-1g"),
                   ("b2", "f-2g"), ("b3", "f-2g")]
    assert d.queued("f") == 1 and d.mig_profile_of("f-1g") == "1g.5gb"
    d.release("f-4g")
    assert d.assign("f") == [("b4", "f-4g")]  # only the 4g has room: BE spills there


def test_interference_on_the_4g_from_another_function_sends_strict_to_the_3g():
    d = Dispatcher()
    d.add_replica("g-4g", "g", 8, slice_id="h/4g", mig_profile="4g.20gb", fbr=0.5)
    for i in range(4):
        d.enqueue("g", i)
    assert len(d.assign("g")) == 4  # Σ FBR on the 4g: 4 × 0.5 = 2.0
    d.add_replica("f-4g", "f", 4, slice_id="h/4g", mig_profile="4g.20gb", fbr=0.5)
    d.add_replica("f-3g", "f", 4, slice_id="h/3g", mig_profile="3g.20gb", fbr=0.5)
    d.enqueue("f", "s")
    # 4g: 1.75 · (0.5 + 2.0) = 4.375; 3g: 7/3 · max(0.5, 1) = 2.33
    assert d.assign("f") == [("s", "f-3g")]
    for _ in range(4):
        d.release("g-4g")  # the 4g is quiet again: 1.75 < 2.33
    d.enqueue("f", "s2")
    assert d.assign("f") == [("s2", "f-4g")]


def test_a_replica_off_mig_or_least_loaded_policy_routes_as_before():
    for d, off_mig in ((Dispatcher(), True), (Dispatcher(slice_policy="least_loaded"), False)):
        _a100(d)
        if off_mig:
            d.add_replica("f-cpu", "f", 2)  # not on a MIG slice: the whole function is not
        _queue(d, strict=3, best_effort=0)
        rids = [rid for _, rid in d.assign("f")]
        assert len(set(rids)) == 3  # least loaded spreads; Alg. 1 would fill the 4g first
    d = Dispatcher()
    d.add_replica("x", "f", 2, slice_id="h/x", mig_profile="5g.25gb")  # no RDF: not MIG
    assert d.mig_profile_of("x") == ""
    with pytest.raises(BadRequest):
        Dispatcher(slice_policy="nope")
    with pytest.raises(BadRequest):
        Dispatcher(t_low=0.9, t_high=0.1)


def test_a_canary_split_takes_precedence_and_a_removed_replica_is_not_routed_to():
    d = Dispatcher()
    d.add_replica("f-4g", "f", 2, "v1", slice_id="h/4g", mig_profile="4g.20gb")
    d.add_replica("f-1g", "f", 2, "v2", slice_id="h/1g", mig_profile="1g.5gb")
    d.set_canary("f", "v2", 50.0)
    _queue(d, strict=2, best_effort=0)
    assert d.assign("f") == [("s0", "f-4g"), ("s1", "f-1g")]  # every other one to v2
    d.set_canary("f", "", 0.0)
    d.remove_replica("f-4g")
    _queue(d, strict=1, best_effort=0)
    assert d.assign("f") == [("s0", "f-1g")]
