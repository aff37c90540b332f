"""ControllerState gives the autoscaler the governor's inputs (issue 22 item 5): each
starting replica's expected ready time, from the cold start measured lately for its source
of bytes, and a new replica's. Pure: events in, the snapshot the autoscaler saw out."""

from __future__ import annotations

import pytest

from flashpoint.controller.state.events import (
    DeployReplica,
    FunctionLoad,
    FunctionUpserted,
    ReplicaWarmed,
    Tick,
)
from flashpoint.policy.autoscale import make_autoscaler

from .test_controller_state import new_state, of, register, spec


class Recording:
    """The real autoscaler, recording every snapshot it was given."""

    def __init__(self) -> None:
        self.inner = make_autoscaler("concurrency")
        self.seen: list = []

    def decide(self, load, memory=None):
        self.seen.append(load)
        return self.inner.decide(load, memory)


def test_snapshot_carries_expected_ready_times_per_source():
    st = new_state()
    for h in ("h1", "h2", "h3"):
        register(st, h)
    rec = Recording()
    st.autoscaler = rec
    st.handle(FunctionUpserted(spec(replica_concurrency=1, max_replicas=10), 1 << 20, None, 0.0))
    # Nothing measured, no C(1): the governor's inputs are unknown.
    (first,) = of(st.handle(Tick(1.0, {"fn": FunctionLoad(1, 0, 1.0)})), DeployReplica)
    assert rec.seen[-1].new_ready_s is None and rec.seen[-1].starting_ready_s == ()
    assert first.source is not None and first.source.sender == "registry"
    # It warms 3 s later (hosts' heartbeats time out after 5 s: the test stays inside): a
    # registry start takes 3 s, and its host now holds the model.
    st.handle(ReplicaWarmed(first.replica_id, {}, 4.0))
    assert st.functions["fn"].cold_s == {"registry": pytest.approx(3.0)}
    cmds = st.handle(Tick(4.0, {"fn": FunctionLoad(3, 1, 4.0)}))
    seen = rec.seen[-1]
    # A new replica lands on the holder (local, not measured yet) or comes by a peer: the
    # only measured source stands in for them.
    assert seen.new_ready_s == pytest.approx(7.0)
    deploys = of(cmds, DeployReplica)
    assert len(deploys) == 3
    st.handle(Tick(4.5, {"fn": FunctionLoad(3, 1, 4.5)}))
    # Three starting replicas, each requested at 4 s: ready at 4 + their source's estimate.
    assert rec.seen[-1].starting_ready_s == pytest.approx((7.0, 7.0, 7.0))
    assert rec.seen[-1].replicas_starting == 3


def test_before_any_measurement_the_cost_models_whole_cold_start_is_the_prior():
    st = new_state()
    register(st, "h1")
    rec = Recording()
    st.autoscaler = rec
    st.handle(FunctionUpserted(spec(replica_concurrency=1, max_replicas=10), 1 << 20, None, 2.5))
    st.handle(Tick(1.0, {"fn": FunctionLoad(1, 0, 1.0)}))
    assert rec.seen[-1].new_ready_s == pytest.approx(3.5)
    st.handle(Tick(2.0, {"fn": FunctionLoad(1, 0, 2.0)}))
    assert rec.seen[-1].starting_ready_s == pytest.approx((3.5,))
