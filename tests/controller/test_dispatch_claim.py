"""Dispatcher.claim / free_credits: a migrated sequence sent past the queue to the replica
chosen for it takes one of its credits, never more than it has; release gives it back."""

from __future__ import annotations

from flashpoint.controller.dispatch import Dispatcher


def test_claim_takes_free_credits_only() -> None:
    d = Dispatcher()
    d.add_replica("r1", "f", credits=2)
    assert d.free_credits("r1") == 2
    assert d.claim("r1") and d.claim("r1")
    assert not d.claim("r1") and d.free_credits("r1") == 0
    assert d.inflight_of("r1") == 2
    d.release("r1")
    assert d.free_credits("r1") == 1
    # the queue sees the claimed credit as taken
    d.enqueue("f", "a")
    d.enqueue("f", "b")
    assert d.assign("f") == [("a", "r1")]


def test_no_claim_on_a_leaving_or_unknown_replica() -> None:
    d = Dispatcher()
    d.add_replica("r1", "f", credits=4)
    d.stop_accepting("r1")
    assert d.free_credits("r1") == 0 and not d.claim("r1")
    assert d.free_credits("nope") == 0 and not d.claim("nope")
