"""ControllerState: a function whose replicas keep failing to start backs off (pure)."""

from __future__ import annotations

import pytest

from flashpoint.config import ControllerConfig
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FailFunction,
    FunctionLoad,
    FunctionUpserted,
    HostHeartbeat,
    HostRegistered,
    ReplicaFailed,
    ReplicaWarmed,
    StartFailure,
    Tick,
)
from flashpoint.controller.state.records import start_backoff_s
from flashpoint.errors import BadRequest
from flashpoint.spec import FunctionSpec

GIB = 1 << 30
MIB = 1 << 20
LOAD_ERROR = "module tensor 'extra' has no weights in the blob"


def new_state(**kw) -> ControllerState:
    st = ControllerState(heartbeat_timeout_s=1e9, replica_overhead_bytes=0, **kw)
    st.handle(HostRegistered("h1", (DeviceRecord("cpu:0", "cpu", 4 * GIB),), 16 * GIB,
                             frozenset(), (), 0.0))
    st.handle(FunctionUpserted(FunctionSpec(name="fn", model="m", keep_alive_s=10.0,
                                            replica_concurrency=4), MIB))
    return st


def tick(st: ControllerState, t: float, queued: int = 1) -> list:
    st.handle(HostHeartbeat("h1", frozenset(), t))
    return st.handle(Tick(t, {"fn": FunctionLoad(queued, 0, t)}))


def deploys(cmds: list) -> list[DeployReplica]:
    return [c for c in cmds if isinstance(c, DeployReplica)]


def fail(st: ControllerState, rid: str, t: float) -> list:
    return st.handle(ReplicaFailed(rid, LOAD_ERROR, during_start=True, code="registry_error",
                                   now_s=t))


def fail_starts(st: ControllerState, times: list[float]) -> list[FailFunction]:
    out: list[FailFunction] = []
    for t in times:
        (dep,) = deploys(tick(st, t))
        out += [c for c in fail(st, dep.replica_id, t + 0.5) if isinstance(c, FailFunction)]
    return out


def test_backoff_doubles_and_is_capped():
    assert [start_backoff_s(n, 10.0, 300.0) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert start_backoff_s(10_000, 10.0, 300.0) == 300.0  # no float overflow


def test_one_failed_start_makes_it_not_ready_with_the_reason_but_it_keeps_trying():
    st = new_state()
    assert st.not_ready("fn") is None  # scales from zero, nothing failed yet
    assert fail_starts(st, [0.0]) == []
    failure = st.not_ready("fn")
    assert failure == StartFailure("registry_error", LOAD_ERROR, 1, 0.5, 0.5, None)
    assert st.backing_off("fn", 1.0) is None
    assert len(deploys(tick(st, 1.0))) == 1  # retried at once


def test_third_failure_backs_off_fails_the_queue_then_retries_with_a_doubled_backoff():
    st = new_state(start_backoff_s=10.0, start_backoff_max_s=300.0)
    (ff,) = fail_starts(st, [0.0, 1.0, 2.0])
    assert ff.name == "fn" and ff.code == "model_load_failed" and LOAD_ERROR in ff.reason
    assert ff.failure == StartFailure("registry_error", LOAD_ERROR, 3, 0.5, 2.5, 12.5)
    assert st.backing_off("fn", 3.0) == ff.failure and st.not_ready("fn") == ff.failure
    for t in (3.0, 8.0, 12.0):
        assert deploys(tick(st, t, queued=5)) == []  # no start while backing off
    # The back-off ends: one more try; it fails too -> at once a back-off twice as long.
    (ff2,) = fail_starts(st, [12.6])
    assert ff2.failure is not None and ff2.failure.failed_starts == 4
    assert ff2.failure.retry_at_s == pytest.approx(13.1 + 20.0)
    assert ff2.failure.since_s == 0.5  # the streak began with the first failure
    assert deploys(tick(st, 30.0)) == []
    (dep,) = deploys(tick(st, 33.2))
    # A replica that warms ends the streak: ready, no reason, counters reset.
    st.handle(ReplicaWarmed(dep.replica_id, {}, 34.0))
    assert st.not_ready("fn") is None and st.backing_off("fn", 34.0) is None
    fn = st.functions["fn"]
    assert (fn.start_failures, fn.start_failure, fn.backoff_rounds) == (0, None, 0)


def test_max_start_failures_is_configurable():
    st = new_state(max_start_failures=1, start_backoff_s=5.0)
    (ff,) = fail_starts(st, [0.0])
    assert ff.failure is not None and ff.failure.retry_at_s == 5.5


def test_a_warm_replica_keeps_serving_while_new_starts_back_off():
    st = new_state()
    (dep,) = deploys(tick(st, 0.0))
    st.handle(ReplicaWarmed(dep.replica_id, {}, 0.5))
    # Load for two replicas: every extra start fails; the queue is not failed (the warm
    # replica serves it) and the function stays ready.
    fails = []
    for t in (1.0, 2.0, 3.0):
        (extra,) = deploys(tick(st, t, queued=8))
        fails += [c for c in fail(st, extra.replica_id, t + 0.1) if isinstance(c, FailFunction)]
    assert fails == [] and st.not_ready("fn") is None
    assert st.backing_off("fn", 4.0) is not None
    assert deploys(tick(st, 4.0, queued=8)) == []


def test_failure_without_a_time_uses_the_last_event_time():
    st = new_state()
    (dep,) = deploys(tick(st, 7.0))
    st.handle(ReplicaFailed(dep.replica_id, "boom", during_start=True))
    failure = st.not_ready("fn")
    assert failure is not None and failure.last_s == 7.0 and failure.code == "start_failed"


def test_config_checks_the_backoff():
    with pytest.raises(BadRequest):
        ControllerConfig(max_start_failures=0)
    with pytest.raises(BadRequest):
        ControllerConfig(start_backoff_s=30.0, start_backoff_max_s=10.0)
