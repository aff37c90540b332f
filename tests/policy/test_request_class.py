"""Strict / best-effort classes (flashpoint/policy/request_class.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.policy.request_class import (
    ClassQueue,
    RequestClass,
    SloCompliance,
    protean_slo_s,
)

S, B = RequestClass.STRICT, RequestClass.BEST_EFFORT


def test_strict_first_then_fifo_within_class():
    q: ClassQueue[str] = ClassQueue()
    for item, cls in [("b1", B), ("s1", S), ("b2", B), ("s2", S)]:
        q.push(item, cls)
    assert q.peek() == ("s1", S)
    assert [q.pop() for _ in range(5)] == [("s1", S), ("s2", S), ("b1", B), ("b2", B), None]
    assert len(q) == 0


def test_be_waits_while_any_strict_is_queued_no_aging():
    """The paper bounds nothing: a BE item queued first still waits behind strict ones
    arriving later, for as long as they keep coming."""
    q: ClassQueue[int] = ClassQueue()
    q.push(0, B, arrived_s=0.0)
    for t in range(1, 50):
        q.push(t, S, arrived_s=float(t))
        assert q.pop() == (t, S)
    assert q.oldest_s(B) == 0.0 and q.oldest_s(S) is None
    assert q.pop() == (0, B)


def test_batch_fills_with_strict_then_tops_up_with_be():
    q: ClassQueue[str] = ClassQueue()
    for item, cls in [("b1", B), ("s1", S), ("b2", B)]:
        q.push(item, cls)
    assert q.pop_batch(2) == [("s1", S), ("b1", B)]
    assert q.pop_batch(5) == [("b2", B)]
    assert q.pop_batch(3) == [] and q.pop_batch(-1) == []


def test_remove_a_cancelled_request_and_reject_duplicates():
    q: ClassQueue[str] = ClassQueue()
    q.push("a", S)
    q.push("b", B)
    q.push("c", B)
    assert q.remove("b") and not q.remove("b") and "b" not in q
    assert (q.depth(S), q.depth(B), q.depth()) == (1, 1, 2)
    with pytest.raises(BadRequest):
        q.push("a", B)
    q.push("b", S)  # a removed id may come back
    assert q.pop_batch(3) == [("a", S), ("b", S), ("c", B)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push_s", "push_b", "pop", "remove"]),
                          st.integers(0, 15)), max_size=60))
def test_matches_a_reference_model(ops):
    """Against a trivially correct model: one list, pop takes the first strict item in
    arrival order, else the first BE one."""
    q: ClassQueue[int] = ClassQueue()
    model: list[tuple[int, RequestClass]] = []
    for op, item in ops:
        queued = {i for i, _ in model}
        if op in ("push_s", "push_b"):
            if item in queued:
                continue
            cls = S if op == "push_s" else B
            q.push(item, cls)
            model.append((item, cls))
        elif op == "pop":
            want = next((e for e in model if e[1] is S), next(iter(model), None))
            assert q.pop() == want
            if want is not None:
                model.remove(want)
        else:
            assert q.remove(item) == (item in queued)
            model = [e for e in model if e[0] != item]
        assert len(q) == len(model)


def test_slo_counts_strict_only():
    c = SloCompliance()
    assert c.compliance is None and c.total == 0
    slo = protean_slo_s(0.02)  # 3 × 20 ms batch on a whole GPU
    assert slo == pytest.approx(0.06)
    c = c.record(S, 0.05, slo).record(S, 0.06, slo).record(S, 0.07, slo)
    c = c.record(B, 9.0, slo).record(B, 0.01, 0.0)  # BE never counts, needs no SLO
    c = c.record(S, float("nan"), slo).record_failure(S).record_failure(B)
    assert (c.met, c.missed, c.total) == (2, 3, 5)
    assert c.compliance == pytest.approx(0.4)
    assert (c + SloCompliance(3, 0)).compliance == pytest.approx(5 / 8)


def test_slo_inputs_are_checked():
    with pytest.raises(BadRequest):
        SloCompliance().record(S, 0.1, 0.0)
    with pytest.raises(BadRequest):
        protean_slo_s(0.0)
    assert protean_slo_s(0.02, factor=2.0) == pytest.approx(0.04)  # "tight SLO" runs
