"""Applying RPR's configuration mix (policy/rpr.py): a replica's shape read back from its
share, and the starts or retirements that bring the replicas to the mix, lowest RPR first."""

from __future__ import annotations

from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.rpr import LiveReplica, MixChange, choose_changes, config_of

# RPR = T / (S*Q), by hand:
#   small  S .5 Q .5  (0.25)  T 1.0  -> 4
#   eff    S .5 Q 1   (0.5)   T 4.0  -> 8
#   mid    S 1  Q .5  (0.5)   T 2.5  -> 5
SMALL = ReplicaConfig("small", 0.5, 0.5, 1, 1.0, 0.05)
EFF = ReplicaConfig("eff", 0.5, 1.0, 1, 4.0, 0.03)
MID = ReplicaConfig("mid", 1.0, 0.5, 1, 2.5, 0.04)
CONFIGS = (SMALL, EFF, MID)


def rep(rid: str, config: ReplicaConfig | None, rate: float = 0.0, warm: bool = True,
        since: float = 0.0) -> LiveReplica:
    return LiveReplica(rid, config.name if config else "",
                       config.resource if config else 0.0, rate, warm, since)


def test_config_of_matches_a_grid_point_or_nothing():
    assert config_of(0.5, 1.0, CONFIGS) == "eff"
    assert config_of(0.5 + 1e-12, 0.5, CONFIGS) == "small"  # float noise is the same point
    assert config_of(0.3, 0.5, CONFIGS) == ""
    assert config_of(0.5, 1.0, ()) == ""


def test_scale_up_starts_the_missing_shapes_most_efficient_first():
    current = [rep("r1", EFF)]
    change = choose_changes(current, (("eff", 2), ("mid", 1), ("small", 1)), 4, CONFIGS)
    assert change == MixChange(start=("eff", "mid", "small"))
    # the count bounds the starts; what the mix names first is what starts first
    assert choose_changes(current, (("eff", 2), ("small", 1)), 2, CONFIGS).start == ("eff",)
    # a mix naming no missing shape leaves the rest to the caller's default shape
    assert choose_changes(current, (("eff", 1),), 3, CONFIGS) == MixChange()


def test_scale_down_retires_the_lowest_rpr_even_when_it_is_the_oldest():
    current = [rep("old-small", SMALL, rate=1.0, since=1.0), rep("a", EFF, rate=3.0, since=2.0),
               rep("newest", EFF, rate=3.0, since=9.0)]
    change = choose_changes(current, (("eff", 2),), 2, CONFIGS)
    assert change == MixChange(retire=("old-small",))


def test_replicas_of_one_shape_go_by_measured_rate_then_starting_then_newest():
    current = [rep("busy", EFF, rate=3.5, since=5.0), rep("idle", EFF, rate=0.5, since=1.0),
               rep("new", EFF, rate=0.5, since=8.0), rep("cold", EFF, warm=False, since=9.5)]
    order = choose_changes(current, (("eff", 0),), 0, CONFIGS).retire
    assert order == ("cold", "new", "idle", "busy")


def test_a_mix_that_accounts_for_too_few_retires_the_lowest_rpr_of_the_rest():
    # "unknown" holds no profiled shape: ranked by its measured rate per request alone
    current = [rep("m", MID, rate=2.0), rep("e", EFF, rate=2.0), rep("unknown", None, rate=9.0)]
    assert choose_changes(current, (("eff", 1), ("mid", 1), ("", 1)), 1, CONFIGS).retire == (
        "m", "e")
    # the count already matches: nothing to do
    assert choose_changes(current, (("eff", 3),), 3, CONFIGS) == MixChange()
