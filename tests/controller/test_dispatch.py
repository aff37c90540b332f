"""Dispatcher: credit-based, least-loaded assignment of queued requests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.controller.dispatch import Dispatcher


def test_credits_never_exceeded():
    d = Dispatcher()
    d.add_replica("r1", "f", 2)
    d.add_replica("r2", "f", 1)
    for i in range(10):
        d.enqueue("f", i)
    out = d.assign("f")
    assert [item for item, _ in out] == [0, 1, 2]
    assert sorted(rid for _, rid in out) == ["r1", "r1", "r2"]
    assert d.inflight_of("r1") == 2 and d.inflight_of("r2") == 1
    assert d.queued("f") == 7
    assert d.assign("f") == []
    d.release("r2")
    assert d.assign("f") == [(3, "r2")]
    assert d.inflight("f") == 3


def test_zero_credits_treated_as_one():
    d = Dispatcher()
    d.add_replica("r", "f", 0)
    d.enqueue("f", "a")
    d.enqueue("f", "b")
    assert d.assign("f") == [("a", "r")]


def test_least_loaded_first():
    d = Dispatcher()
    d.add_replica("old", "f", 4)
    for i in range(3):
        d.enqueue("f", i)
    d.assign("f")
    assert d.inflight_of("old") == 3
    d.add_replica("new", "f", 4)
    for i in range(3):
        d.enqueue("f", f"n{i}")
    out = d.assign("f")
    # the new replica fills to the old one's level before the old one gets more
    assert [rid for _, rid in out] == ["new", "new", "new"]


def test_least_loaded_by_ratio_and_id_tiebreak():
    d = Dispatcher()
    d.add_replica("b", "f", 2)
    d.add_replica("a", "f", 2)
    d.enqueue("f", 1)
    assert d.assign("f") == [(1, "a")]  # tie: lower id
    d.enqueue("f", 2)
    assert d.assign("f") == [(2, "b")]


def test_stop_accepting_excludes_replica():
    d = Dispatcher()
    d.add_replica("r1", "f", 5)
    d.add_replica("r2", "f", 5)
    d.stop_accepting("r1")
    d.stop_accepting("missing")  # no error
    for i in range(3):
        d.enqueue("f", i)
    assert {rid for _, rid in d.assign("f")} == {"r2"}
    d.stop_accepting("r2")
    d.enqueue("f", 9)
    assert d.assign("f") == []
    assert d.queued("f") == 1


def test_front_requeue_order():
    d = Dispatcher()
    for i in (1, 2, 3):
        d.enqueue("f", i)
    d.enqueue("f", 0, front=True)
    d.enqueue("f", -1, front=True)
    assert d.peek("f") == -1
    assert d.drain_queue("f") == [-1, 0, 1, 2, 3]
    assert d.queued("f") == 0


def test_remove_and_peek():
    d = Dispatcher()
    assert d.peek("f") is None
    assert d.remove("f", "x") is False
    d.enqueue("f", "a")
    d.enqueue("f", "b")
    assert d.peek("f") == "a"
    assert d.remove("f", "a") is True
    assert d.remove("f", "a") is False
    assert d.peek("f") == "b"
    assert d.queued("f") == 1
    assert d.peek("other") is None


def test_remove_replica():
    d = Dispatcher()
    d.add_replica("r1", "f", 1)
    assert d.has_replica("r1")
    d.enqueue("f", "a")
    assert d.assign("f") == [("a", "r1")]
    d.remove_replica("r1")
    d.remove_replica("r1")
    assert not d.has_replica("r1")
    d.release("r1")  # no error
    d.enqueue("f", "b")
    assert d.assign("f") == []
    assert d.inflight("f") == 0


def test_functions_are_isolated():
    d = Dispatcher()
    d.add_replica("r1", "f", 4)
    d.enqueue("g", "x")
    assert d.assign("g") == []
    assert d.assign("f") == []
    assert d.queued("g") == 1


@settings(max_examples=100, deadline=None)
@given(
    credits=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    ops=st.lists(st.one_of(
        st.tuples(st.just("enq"), st.integers(0, 3)),
        st.tuples(st.just("rel"), st.integers(0, 4)),
        st.tuples(st.just("stop"), st.integers(0, 4)),
        st.tuples(st.just("assign"), st.just(0)),
    ), max_size=60),
)
def test_property_credits_never_exceeded(credits, ops):
    d = Dispatcher()
    for i, c in enumerate(credits):
        d.add_replica(f"r{i}", "f", c)
    cap = {f"r{i}": max(1, c) for i, c in enumerate(credits)}
    stopped: set[str] = set()
    n = 0
    for op, arg in ops:
        if op == "enq":
            d.enqueue("f", n, front=bool(arg % 2))
            n += 1
        elif op == "rel" and arg < len(credits):
            d.release(f"r{arg}")
        elif op == "stop" and arg < len(credits):
            d.stop_accepting(f"r{arg}")
            stopped.add(f"r{arg}")
        else:
            for _, rid in d.assign("f"):
                assert rid not in stopped
        for rid, c in cap.items():
            assert 0 <= d.inflight_of(rid) <= c


def test_strict_requests_go_before_best_effort_ones_fifo_within_each():
    d = Dispatcher()
    for i in range(3):
        d.enqueue("f", f"be{i}", best_effort=True)
    d.enqueue("f", "s0")
    d.enqueue("f", "s1")
    d.enqueue("f", "retry", front=True)  # a retried strict request goes first of all
    assert d.queued("f") == 6 and d.peek("f") == "retry"
    assert d.fronts("f") == ["retry", "be0"]  # the oldest of each class (queue age)
    d.add_replica("r", "f", credits=4)
    assert [item for item, _ in d.assign("f")] == ["retry", "s0", "s1", "be0"]
    d.enqueue("f", "s2")
    for _ in range(4):
        d.release("r")
    assert [item for item, _ in d.assign("f")] == ["s2", "be1", "be2"]
    assert d.remove("f", "nope") is False and d.queued("f") == 0


def test_remove_finds_best_effort_items_and_drain_keeps_class_order():
    d = Dispatcher()
    d.enqueue("f", "be", best_effort=True)
    d.enqueue("f", "s")
    d.enqueue("f", "be2", best_effort=True)
    assert d.remove("f", "be") is True
    assert d.drain_queue("f") == ["s", "be2"] and d.queued("f") == 0
