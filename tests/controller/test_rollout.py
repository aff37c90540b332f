"""Version roll-outs: the pure plan (policy/rollout.py), the state driving it through a roll,
a canary and a roll-back (ControllerState), and the dispatcher's canary split."""

from __future__ import annotations

import pytest

from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FailFunction,
    ForgetReplica,
    FunctionLoad,
    FunctionUpserted,
    HostHeartbeat,
    HostRegistered,
    ReplicaFailed,
    ReplicaWarmed,
    RouteCanary,
    StopAccepting,
    StopReplica,
    Tick,
)
from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.errors import BadRequest
from flashpoint.policy.rollout import RollPhase, RollReplica, RollSnapshot, plan_roll
from flashpoint.spec import FunctionSpec

GIB = 1 << 30
MIB = 1 << 20


# the pure plan ------------------------------------------------------------------------------
def _reps(*specs: tuple[str, str, bool]) -> tuple[RollReplica, ...]:
    return tuple(RollReplica(rid, key, warm, float(i)) for i, (rid, key, warm) in enumerate(specs))


def test_plan_surges_one_new_replica_while_the_old_ones_serve():
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 2,
                               _reps(("a", "m@1", True), ("b", "m@1", True))))
    assert d.start == (("m@2", 1),) and d.retire == () and d.phase == RollPhase.ROLLING


def test_plan_waits_while_the_new_replica_starts():
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 2, _reps(
        ("a", "m@1", True), ("b", "m@1", True), ("n", "m@2", False))))
    assert d.start == () and d.retire == ()


def test_plan_retires_one_old_replica_per_warm_new_one():
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 2, _reps(
        ("a", "m@1", True), ("b", "m@1", True), ("n", "m@2", True))))
    assert d.start == () and d.retire == ("b",)  # the most recently warmed goes first
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 2, _reps(("a", "m@1", True), ("n", "m@2", True))))
    assert d.start == (("m@2", 1),) and d.retire == ()
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 2, _reps(
        ("a", "m@1", True), ("n", "m@2", True), ("o", "m@2", True))))
    assert d.retire == ("a",) and d.phase == RollPhase.STABLE


def test_plan_stops_a_starting_old_replica_at_once():
    d = plan_roll(RollSnapshot("m@2", None, 100.0, 1, _reps(("a", "m@1", True), ("s", "m@1", False))))
    assert d.retire == ("s",) and d.start == (("m@2", 1),)


def test_plan_canary_splits_replicas_and_holds():
    reps = _reps(("a", "m@1", True), ("b", "m@1", True), ("n", "m@2", True))
    d = plan_roll(RollSnapshot("m@2", "m@1", 50.0, 2, reps))
    assert d.shares == (("m@2", 1), ("m@1", 1)) and d.retire == ("b",)
    d = plan_roll(RollSnapshot("m@2", "m@1", 50.0, 2, reps[:1] + reps[2:]))
    assert d.start == () and d.retire == () and d.phase == RollPhase.CANARY


@pytest.mark.parametrize("desired,pct,want", [
    (1, 10.0, (1, 1)), (2, 1.0, (1, 1)), (2, 99.0, (1, 1)), (4, 25.0, (1, 3)),
    (10, 30.0, (3, 7)), (0, 50.0, (0, 0)),
])
def test_plan_canary_shares(desired, pct, want):
    d = plan_roll(RollSnapshot("m@2", "m@1", pct, desired, ()))
    assert tuple(n for _, n in d.shares) == want[:len(d.shares)] and sum(
        n for _, n in d.shares) == sum(want)


def test_plan_never_leaves_fewer_warm_replicas_than_wanted():
    # Whatever the mix, the warm replicas left after the retirements cover the shares.
    for old in range(0, 4):
        for new_warm in range(0, 4):
            for new_starting in range(0, 2):
                reps = _reps(*[(f"o{i}", "m@1", True) for i in range(old)],
                             *[(f"n{i}", "m@2", True) for i in range(new_warm)],
                             *[(f"s{i}", "m@2", False) for i in range(new_starting)])
                d = plan_roll(RollSnapshot("m@2", None, 100.0, 3, reps))
                warm_left = sum(r.warm and r.replica_id not in d.retire for r in reps)
                assert warm_left >= min(3, old + new_warm), (old, new_warm, new_starting, d)
                # beyond what the autoscaler wants, at most one surge replica
                shortfall = max(0, 3 - (old + new_warm + new_starting))
                assert sum(n for _, n in d.start) <= shortfall + 1


# the state ------------------------------------------------------------------------------------
def _state(hosts: int = 2) -> ControllerState:
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    for h in range(hosts):
        st.handle(HostRegistered(f"h{h}", (DeviceRecord("cpu:0", "cpu", 4 * GIB),
                                           DeviceRecord("cpu:1", "cpu", 4 * GIB)),
                                 16 * GIB, frozenset(), (), 0.0))
    return st


def _spec(version: str = "1", **kw) -> FunctionSpec:
    return FunctionSpec(name="fn", model="m", model_version=version, min_replicas=2,
                        keep_alive_s=60.0, **kw)


class Roll:
    """Drives a state through ticks; warms every deploy it sees, reports drained replicas
    idle, and counts the warm replicas per version after every step."""

    def __init__(self, st: ControllerState) -> None:
        self.st, self.now, self.min_warm = st, 0.0, 10**9

    def tick(self) -> list:
        self.now += 1.0
        for host in list(self.st.hosts):
            self.st.handle(HostHeartbeat(host, frozenset(), self.now))
        idle = frozenset(r.replica_id for r in self.st.replicas.values()
                         if r.phase == ReplicaPhase.STOPPING)
        cmds = self.st.handle(Tick(self.now, {"fn": FunctionLoad(0, 1, self.now)}, idle))
        for c in cmds:
            if isinstance(c, DeployReplica):
                self.st.handle(ReplicaWarmed(c.replica_id, {}, self.now + 0.5))
        self.min_warm = min(self.min_warm, len(self.warm()))
        return cmds

    def warm(self, key: str | None = None) -> list[str]:
        return [r.replica_id for r in self.st.replicas.values() if r.phase == ReplicaPhase.WARM
                and (key is None or r.model_key == key)]

    def settle(self, max_ticks: int = 20) -> list:
        seen: list = []
        for _ in range(max_ticks):
            cmds = self.tick()
            seen += cmds
            if not cmds:
                return seen
        raise AssertionError(f"no steady state in {max_ticks} ticks: {self.st.rollout('fn')}")


def test_state_rolls_replicas_one_by_one_and_back():
    st = _state()
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll = Roll(st)
    roll.settle()
    assert len(roll.warm("m@1")) == 2 and st.rollout("fn")["phase"] == "stable"
    roll.min_warm = 10**9
    st.handle(FunctionUpserted(_spec("2"), MIB))
    assert st.rollout("fn")["phase"] == "rolling"  # at once, before the next tick
    cmds = roll.tick()
    (dep,) = [c for c in cmds if isinstance(c, DeployReplica)]  # one at a time
    assert dep.spec.model_version == "2"
    assert st.rollout("fn")["phase"] == "rolling"
    assert st.rollout("fn")["previous_version"] == "1"
    seen = cmds + roll.settle()
    assert len(roll.warm("m@2")) == 2 and not roll.warm("m@1")
    assert roll.min_warm >= 2  # never fewer warm replicas than wanted
    # every old replica was drained (no new work) before it was stopped
    stops = [c.replica_id for c in seen if isinstance(c, StopReplica)]
    assert len(stops) == 2
    for rid in stops:
        assert seen.index(StopAccepting(rid)) < next(
            i for i, c in enumerate(seen) if isinstance(c, StopReplica) and c.replica_id == rid)
    assert st.rollout("fn") == {"phase": "stable", "version": "2", "previous_version": None,
                                "canary_pct": None, "reason": "",
                                "replicas": {"m@2": {"starting": 0, "warm": 2, "stopping": 0}}}
    # roll back: just a roll to the old version
    roll.min_warm = 10**9
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll.settle()
    assert len(roll.warm("m@1")) == 2 and not roll.warm("m@2") and roll.min_warm >= 2


def test_state_canary_keeps_both_versions_until_a_full_deploy():
    st = _state()
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll = Roll(st)
    roll.settle()
    cmds = st.handle(FunctionUpserted(_spec("2", canary_pct=50.0), MIB))
    assert cmds == [RouteCanary("fn", "m@2", 50.0)]
    roll.settle()
    assert len(roll.warm("m@1")) == 1 and len(roll.warm("m@2")) == 1
    view = st.rollout("fn")
    assert view["phase"] == "canary" and view["canary_pct"] == 50.0
    # more ticks change nothing: the canary holds
    assert roll.tick() == []
    # a replica of the stable version lost during the canary is replaced by the old version
    (old,) = roll.warm("m@1")
    assert st.handle(ReplicaFailed(old, "worker exited", during_start=False)) == [
        ForgetReplica(old)]
    (dep,) = [c for c in roll.tick() if isinstance(c, DeployReplica)]
    assert dep.spec.model_version == "1"
    # the same version without a canary completes the roll and ends the split
    cmds = st.handle(FunctionUpserted(_spec("2"), MIB))
    assert cmds == [RouteCanary("fn", "", 100.0)]
    roll.settle()
    assert len(roll.warm("m@2")) == 2 and not roll.warm("m@1")
    assert st.rollout("fn")["phase"] == "stable"


def test_state_canary_rolled_back_without_a_canary():
    st = _state()
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll = Roll(st)
    roll.settle()
    st.handle(FunctionUpserted(_spec("2", canary_pct=50.0), MIB))
    roll.settle()
    assert st.handle(FunctionUpserted(_spec("1"), MIB)) == [RouteCanary("fn", "", 100.0)]
    roll.settle()
    assert len(roll.warm("m@1")) == 2 and not roll.warm("m@2")


def test_state_same_version_reregistered_changes_nothing():
    st = _state()
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll = Roll(st)
    roll.settle()
    assert st.handle(FunctionUpserted(_spec("1", max_replicas=8), MIB)) == []
    assert roll.tick() == []


@pytest.mark.parametrize("pct", [0, -1, 100.5, float("nan"), "50", True])
def test_spec_refuses_a_bad_canary_pct(pct):
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict({"name": "fn", "model": "m", "canary_pct": pct})


# the dispatcher's split -----------------------------------------------------------------------
def test_canary_split_sends_the_percentage_to_the_new_version():
    d = Dispatcher()
    d.add_replica("old", "f", 1000, "m@1")
    d.add_replica("new", "f", 1000, "m@2")
    d.set_canary("f", "m@2", 25.0)
    for i in range(100):
        d.enqueue("f", i)
    out = d.assign("f")
    assert len(out) == 100
    assert sum(rid == "new" for _, rid in out) == 25
    d.set_canary("f", "", 100.0)  # split ended: least loaded again
    d.enqueue("f", "x")
    assert d.assign("f") == [("x", "new")]


def test_canary_split_lends_a_full_sides_turn_and_skips_draining_replicas():
    d = Dispatcher()
    d.add_replica("old", "f", 2, "m@1")
    d.add_replica("new", "f", 1, "m@2")
    d.set_canary("f", "m@2", 50.0)
    for i in range(3):
        d.enqueue("f", i)
    assert sorted(rid for _, rid in d.assign("f")) == ["new", "old", "old"]
    d.stop_accepting("old")
    d.release("new")
    d.release("old")
    d.release("old")
    for i in range(3):
        d.enqueue("f", i)
    assert [rid for _, rid in d.assign("f")] == ["new"]  # never to the draining one


def test_state_a_version_that_does_not_start_fails_the_roll_not_the_function():
    st = _state()
    st.handle(FunctionUpserted(_spec("1"), MIB))
    roll = Roll(st)
    roll.settle()
    old = set(roll.warm("m@1"))
    st.handle(FunctionUpserted(_spec("2"), MIB))
    for attempt in range(3):
        roll.now += 1.0
        cmds = st.handle(Tick(roll.now, {"fn": FunctionLoad(0, 1, roll.now)}))
        (dep,) = [c for c in cmds if isinstance(c, DeployReplica)]
        assert dep.spec.model_version == "2", attempt
        cmds = st.handle(ReplicaFailed(dep.replica_id, "bad weights", during_start=True))
        assert not [c for c in cmds if isinstance(c, FailFunction)]
    assert st.not_ready("fn") is None  # the old version serves: the function is ready
    view = st.rollout("fn")
    assert view["phase"] == "failed" and view["reason"] == "bad weights"
    # the old version keeps serving and no more replicas of the new one are started
    assert not [c for c in roll.settle() if isinstance(c, DeployReplica)]
    assert set(roll.warm("m@1")) == old and st.rollout("fn")["phase"] == "failed"
    # the next deploy (here: a retry of version 2) rolls again
    st.handle(FunctionUpserted(_spec("2"), MIB))
    roll.settle()
    assert len(roll.warm("m@2")) == 2 and st.rollout("fn")["phase"] == "stable"


def test_restarted_controller_goes_on_with_a_roll_from_the_versions_hosts_report():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(FunctionUpserted(_spec("2"), MIB))  # reloaded from the function table
    devs = (DeviceRecord("cpu:0", "cpu", 4 * GIB), DeviceRecord("cpu:1", "cpu", 4 * GIB))
    st.handle(HostRegistered("h0", devs, 16 * GIB, frozenset(),
                             (("fn-a", "fn", "cpu:0", True), ("fn-b", "fn", "cpu:1", True)),
                             0.0, models={"fn-a": "m@1", "fn-b": "m@2"}))
    assert st.replicas["fn-a"].model_key == "m@1" and st.replicas["fn-b"].model_key == "m@2"
    st.handle(HostRegistered("h1", devs, 16 * GIB, frozenset(), (), 0.0))
    roll = Roll(st)
    roll.settle()
    assert "fn-a" not in st.replicas and len(roll.warm("m@2")) == 2
