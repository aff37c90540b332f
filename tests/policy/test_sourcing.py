"""policy.sourcing.plan_sourcing: own RAM, then peers, then the registry; chains spread evenly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.policy.sourcing import REGISTRY, ChainPlan, plan_sourcing


def test_receiver_holding_the_model_uses_its_own_ram():
    plan = plan_sourcing("m@1", ["h1"], ["h1", "h2"])
    assert plan.local == ("h1",) and plan.chains == ()


def test_single_receiver_prefers_a_peer_over_the_registry():
    plan = plan_sourcing("m@1", ["h3"], ["h2"])
    assert plan.chains == (ChainPlan("h2", ("h3",)),)
    assert plan.fallback == ("h2", REGISTRY)


def test_no_holder_means_one_registry_chain_over_every_receiver():
    plan = plan_sourcing("m@1", ["a", "b", "c", "d"], [])
    assert plan.chains == (ChainPlan(REGISTRY, ("a", "b", "c", "d")),)
    assert plan.fallback == (REGISTRY,)


def test_receivers_spread_evenly_over_peers_and_registry():
    plan = plan_sourcing("m@1", ["r1", "r2", "r3", "r4", "r5"], ["p2", "p1"])
    assert plan.chains == (ChainPlan("p1", ("r1", "r4")), ChainPlan("p2", ("r2", "r5")),
                           ChainPlan(REGISTRY, ("r3",)))
    assert plan.chain_of("r4") == ChainPlan("p1", ("r1", "r4"))
    assert plan.chain_of("nobody") is None


def test_registry_can_be_kept_out_while_peers_hold_the_model():
    plan = plan_sourcing("m@1", ["r1", "r2", "r3"], ["p1"], registry_sends=False)
    assert plan.chains == (ChainPlan("p1", ("r1", "r2", "r3")),)
    assert plan_sourcing("m@1", ["r1"], [], registry_sends=False).chains == (
        ChainPlan(REGISTRY, ("r1",)),)


def test_duplicate_receivers_get_one_transfer():
    plan = plan_sourcing("m@1", ["a", "a", "b"], [])
    assert plan.chains == (ChainPlan(REGISTRY, ("a", "b")),)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([f"h{i}" for i in range(12)]), max_size=20),
       st.lists(st.sampled_from([f"h{i}" for i in range(12)]), max_size=6), st.booleans())
def test_every_receiver_is_served_exactly_once_and_chains_are_balanced(receivers, holders, reg):
    plan = plan_sourcing("m@1", receivers, holders, registry_sends=reg)
    on_chains = [h for c in plan.chains for h in c.receivers]
    assert sorted(on_chains + list(plan.local)) == sorted(set(receivers))
    assert not set(on_chains) & set(holders)
    senders = [c.sender for c in plan.chains]
    assert len(senders) == len(set(senders))
    assert all(s == REGISTRY or s in holders for s in senders)
    if plan.chains:
        lengths = [len(c.receivers) for c in plan.chains]
        assert max(lengths) - min(lengths) <= 1
    assert plan.fallback[-1] == REGISTRY and set(plan.fallback[:-1]) == set(holders)


def test_chain_length_cap_adds_chains_registry_first_then_holders():
    receivers = [f"r{i}" for i in range(10)]
    plan = plan_sourcing("m@1", receivers, ["h1"], max_chain_length=3)
    assert all(len(c.receivers) <= 3 for c in plan.chains)
    assert sorted(r for c in plan.chains for r in c.receivers) == sorted(receivers)
    assert [c.sender for c in plan.chains] == ["h1", REGISTRY, REGISTRY, "h1"]
    # No cap: one chain per sender.
    assert len(plan_sourcing("m@1", receivers, ["h1"]).chains) == 2
    # Without the registry as a sender, the holder heads every extra chain.
    only_peer = plan_sourcing("m@1", receivers, ["h1"], registry_sends=False, max_chain_length=4)
    assert [c.sender for c in only_peer.chains] == ["h1"] * 3
    assert max(len(c.receivers) for c in only_peer.chains) <= 4
