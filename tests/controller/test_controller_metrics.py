"""controller/metrics.py: what the actor's hooks count, read back from the process registry
(prometheus_client's own sample lookup), and the gauges its StateCollector renders."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashpoint.controller.metrics import ControllerMetrics, state_registry
from flashpoint.controller.state import events as cs
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.records import (
    FunctionRecord,
    HostRecord,
    ReplicaPhase,
    ReplicaRecord,
)
from flashpoint.spec import FunctionSpec


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _hosts(**alive: tuple[bool, bool]) -> Any:
    """A stand-in for the state: hosts by id -> (alive, draining)."""
    return SimpleNamespace(hosts={h: SimpleNamespace(host_id=h, alive=a, draining=d)
                                  for h, (a, d) in alive.items()})


def test_a_start_that_never_served_is_a_failed_cold_start_with_its_code() -> None:
    fn = f"f-{uuid.uuid4().hex[:8]}"  # labels of its own in the process registry
    m = ControllerMetrics()
    state = _hosts(h1=(True, False))
    spec = FunctionSpec(name=fn, model="noop")
    m.commands([cs.DeployReplica("r1", "h1", "cpu0", spec),
                cs.DeployReplica("r2", "h1", "cpu0", spec),
                cs.DeployReplica("r3", "h1", "cpu0", spec)], state)
    # r1 fails, reported with its code; r2 warms; r3 is dropped unannounced (host lost)
    m.event(cs.ReplicaFailed("r1", "boom", during_start=True, code="registry_error"))
    m.commands([cs.ForgetReplica("r1")], state)
    m.replica_ready("r2", fn, "registry", {"load": 0.25, "obtain": 0.5}, starting=True)
    m.commands([cs.ForgetReplica("r2")], state)  # a warm replica that goes is no failed start
    m.commands([cs.ForgetReplica("r3")], state)
    assert _value("flashpoint_cold_starts_failed_total", function=fn, code="registry_error") == 1
    assert _value("flashpoint_cold_starts_failed_total", function=fn, code="not_started") == 1
    assert _value("flashpoint_replicas_started_total", function=fn, tier="registry") == 1
    assert _value("flashpoint_cold_start_seconds_sum", function=fn, phase="load",
                  tier="registry") == 0.25
    assert _value("flashpoint_cold_start_seconds_count", function=fn, phase="obtain",
                  tier="registry") == 1
    # a replica announcing again after a controller restart is no new start
    m.replica_ready("r9", fn, "local", {"load": 1.0}, starting=False)
    assert _value("flashpoint_replicas_started_total", function=fn, tier="ram") == 0


def test_a_cold_request_is_observed_once_per_replica() -> None:
    fn = f"f-{uuid.uuid4().hex[:8]}"
    m = ControllerMetrics()
    timings = {"decision": 0.01, "placement": 0.002, "load": 0.3, "request": 0.004, "total": 2.0}
    m.cold_request("r1", fn, "chain:host0", timings)
    m.cold_request("r1", fn, "chain:host0", {**timings, "total": 9.0})  # a second waiter
    assert _value("flashpoint_cold_start_wall_seconds_count", function=fn, tier="peer") == 1
    assert _value("flashpoint_cold_start_wall_seconds_sum", function=fn, tier="peer") == 2.0
    assert _value("flashpoint_cold_start_seconds_sum", function=fn, phase="decision",
                  tier="peer") == 0.01
    # the worker's phases came with replica_ready: not counted twice here
    assert _value("flashpoint_cold_start_seconds_count", function=fn, phase="load",
                  tier="peer") == 0
    # a pipeline group reports no replica_ready phases: its request's breakdown has them all
    m.cold_request("g1", fn, "pipeline:2", timings)
    assert _value("flashpoint_cold_start_seconds_sum", function=fn, phase="load",
                  tier="pipeline") == 0.3


def test_hosts_lost_and_spot_notices_are_counted() -> None:
    m = ControllerMetrics()
    lost0, notices0 = _value("flashpoint_hosts_lost_total"), _value("flashpoint_spot_notices_total")
    m.commands([], _hosts(a=(True, False), b=(True, False), c=(True, False)))
    m.event(cs.HostDraining("c", 100.0, 1.0))
    m.commands([], _hosts(a=(True, False), b=(True, False), c=(True, True)))
    # b misses its heartbeats; c leaves on its notice (not lost)
    m.commands([], _hosts(a=(True, False), b=(False, False), c=(False, True)))
    m.commands([], _hosts(a=(True, False), b=(False, False), c=(False, True)))  # no recount
    assert _value("flashpoint_hosts_lost_total") - lost0 == 1
    assert _value("flashpoint_spot_notices_total") - notices0 == 1


def test_state_gauges_are_read_at_scrape_time() -> None:
    state = ControllerState()
    spec = FunctionSpec(name="g", model="noop")
    state.functions["g"] = FunctionRecord(spec, model_bytes=1, desired=3, start_failures=2)
    for rid, phase in (("r1", ReplicaPhase.WARM), ("r2", ReplicaPhase.WARM),
                       ("r3", ReplicaPhase.STARTING)):
        state.replicas[rid] = ReplicaRecord(rid, "g", "h1", "cpu0", 1, phase, 0.0)
    state.hosts["h1"] = HostRecord("h1", {}, 0, set(), 0.0)
    state.hosts["h2"] = HostRecord("h2", {}, 0, set(), 0.0, alive=False)
    queued = {"g": 5}
    reg = state_registry(state, lambda f: queued.get(f, 0), lambda f: 7)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode())
               for s in fam.samples}
    g = (("function", "g"),)
    assert samples[("flashpoint_function_replicas", (("function", "g"), ("phase", "warm")))] == 2
    assert samples[("flashpoint_function_replicas",
                    (("function", "g"), ("phase", "starting")))] == 1
    assert samples[("flashpoint_function_replicas",
                    (("function", "g"), ("phase", "stopping")))] == 0
    assert samples[("flashpoint_function_replicas_desired", g)] == 3
    assert samples[("flashpoint_function_queued_requests", g)] == 5
    assert samples[("flashpoint_function_inflight_requests", g)] == 7
    assert samples[("flashpoint_function_start_failures", g)] == 2
    assert samples[("flashpoint_hosts", (("state", "alive"),))] == 1
    assert samples[("flashpoint_hosts", (("state", "lost"),))] == 1
    queued["g"] = 0  # read again at the next scrape, not cached
    again = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(reg).decode())
             for s in fam.samples if s.name == "flashpoint_function_queued_requests"}
    assert again["flashpoint_function_queued_requests"] == 0
