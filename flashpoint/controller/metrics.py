"""The controller's Prometheus metrics: cold starts, replicas, queues, hosts.

Two kinds live here:

- **process-wide counters and histograms** (the default registry), updated by a few hooks in
  the actor (:class:`ControllerMetrics`): every cold-start phase (controller/cold_timings.py)
  by function and source tier (own RAM, peer chain, registry, pipeline; the thesis's Fig 8.5
  hierarchy, ``gateway/ui/view.py`` ``source_tier``), the wall of the request that waited for a
  start, replicas started and starts that failed, hosts lost and spot notices;
- **gauges read from the state at scrape time** (:class:`StateCollector`, in a registry of
  the controller's own so several controllers in one test process do not collide): replicas
  by function and phase, planned replicas, queued and in-flight requests, hosts by state.

The request counters (``flashpoint_requests_total``, ``flashpoint_request_seconds``,
``flashpoint_slo_requests_total``) stay with the request path. ``deploy/prometheus/`` alerts
on these names and ``deploy/grafana/`` charts them; tests/metrics checks both against a real
Prometheus.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from flashpoint import tracing
from flashpoint.controller.cold_timings import (
    COLD_PHASES,
    CONTROLLER_PHASES,
    HOST_PHASES,
    WORKER_PHASES,
)
from flashpoint.controller.state import events as cs  # the state's events and commands
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.gateway.ui.view import source_tier

COLD_BUCKETS_S = (.001, .01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120)

COLD_START = Histogram(
    "flashpoint_cold_start_seconds",
    "Cold-start phase durations (controller/cold_timings.py), by function and source tier",
    ["function", "phase", "tier"], buckets=COLD_BUCKETS_S)
COLD_START_WALL = Histogram(
    "flashpoint_cold_start_wall_seconds",
    "Arrival to answer of the request that waited for a replica's start (its phases' sum)",
    ["function", "tier"], buckets=COLD_BUCKETS_S)
REPLICAS_STARTED = Counter(
    "flashpoint_replicas_started_total", "Replicas whose start finished (worker announced)",
    ["function", "tier"])
COLD_STARTS_FAILED = Counter(
    "flashpoint_cold_starts_failed_total",
    "Replica starts that never served (failed, timed out, host lost while starting)",
    ["function", "code"])
HOSTS_LOST = Counter("flashpoint_hosts_lost_total",
                     "Hosts declared dead after missing their heartbeats")
SPOT_NOTICES = Counter("flashpoint_spot_notices_total",
                       "Eviction notices hosts reported (each host then drains)")

# The phases the host and worker time and report with replica_ready; the others the
# controller knows only for the request that waited (controller/cold_timings.py).
_REPLICA_PHASES = (*HOST_PHASES, *WORKER_PHASES)
_REQUEST_PHASES = tuple(p for p in COLD_PHASES if p not in _REPLICA_PHASES)
assert set(CONTROLLER_PHASES) <= set(_REQUEST_PHASES)
# Starts remembered at once (replica id -> function): bounded like any controller memory.
MAX_TRACKED = 10_000


class ControllerMetrics:
    """The actor's hooks into the process-wide cold-start, replica and host metrics.

    Pure bookkeeping over what the actor already knows (events it applies, commands the
    state returns, replica announcements, the breakdown of a cold request): reads no clock.
    """

    def __init__(self) -> None:
        self._starting: OrderedDict[str, str] = OrderedDict()  # replica id -> function
        self._fail_code: dict[str, str] = {}  # replica id -> its reported failure's code
        self._cold_seen: OrderedDict[str, None] = OrderedDict()  # walls observed, by replica
        self._alive: set[str] = set()  # hosts alive after the last step

    def event(self, event: cs.Event) -> None:
        """An event the actor is about to apply."""
        match event:
            case cs.ReplicaFailed() if event.during_start:
                self._fail_code[event.replica_id] = event.code
            case cs.HostDraining():
                SPOT_NOTICES.inc()

    def commands(self, cmds: Iterable[Any], state: ControllerState) -> None:
        """The commands one step returned, and the state after it."""
        for cmd in cmds:
            match cmd:
                case cs.DeployReplica():
                    self._starting[cmd.replica_id] = cmd.spec.name
                    while len(self._starting) > MAX_TRACKED:
                        self._starting.popitem(last=False)
                case cs.ForgetReplica():
                    function = self._starting.pop(cmd.replica_id, None)
                    code = self._fail_code.pop(cmd.replica_id, "")
                    if function is not None:
                        COLD_STARTS_FAILED.labels(function, code or "not_started").inc()
        alive = {h.host_id for h in state.hosts.values() if h.alive}
        for _ in self._alive - alive - {h for h, r in state.hosts.items() if r.draining}:
            HOSTS_LOST.inc()  # alive before this step, dead now, and not leaving on notice
        self._alive = alive

    def replica_ready(self, replica_id: str, function: str, source: str,
                      timings_s: Mapping[str, float], starting: bool) -> None:
        """A worker announced ``replica_id``; ``timings_s``: its host's and worker's phases.
        ``starting``: the state still had it starting (not a reconnect after a restart)."""
        self._starting.pop(replica_id, None)
        self._fail_code.pop(replica_id, None)
        if not starting:
            return
        tier = source_tier(source)
        REPLICAS_STARTED.labels(function, tier).inc()
        for phase in _REPLICA_PHASES:
            if phase in timings_s:
                COLD_START.labels(function, phase, tier).observe(float(timings_s[phase]))

    def cold_request(self, replica_id: str, function: str, source: str,
                     timings_s: Mapping[str, float]) -> None:
        """The breakdown of a request that waited for ``replica_id``'s start (the first one
        only: the replica's cold start); the host and worker phases came with
        :meth:`replica_ready`, except for a pipeline group, which reports none there. With
        tracing on, also its spans (:func:`flashpoint.tracing.cold_start`)."""
        if replica_id in self._cold_seen:
            return
        self._cold_seen[replica_id] = None
        while len(self._cold_seen) > MAX_TRACKED:
            self._cold_seen.popitem(last=False)
        tier = source_tier(source)
        # and, with OpenTelemetry on, as spans under the request's (flashpoint/tracing.py)
        tracing.cold_start(replica_id, function, source, tier, timings_s, COLD_PHASES)
        phases = COLD_PHASES if tier == "pipeline" else _REQUEST_PHASES
        for phase in phases:
            if phase in timings_s:
                COLD_START.labels(function, phase, tier).observe(float(timings_s[phase]))
        if "total" in timings_s:
            COLD_START_WALL.labels(function, tier).observe(float(timings_s["total"]))


class StateCollector:
    """Gauges read from the controller at scrape time (no update on any hot path).

    ``queued`` and ``inflight`` give a function's queued and in-flight request counts
    (the dispatcher's).
    """

    def __init__(self, state: ControllerState, queued: Callable[[str], int],
                 inflight: Callable[[str], int]) -> None:
        self._state = state
        self._queued = queued
        self._inflight = inflight

    def collect(self) -> Iterator[Metric]:
        state = self._state
        replicas = GaugeMetricFamily("flashpoint_function_replicas",
                                     "Replicas of a function by phase", labels=["function", "phase"])
        desired = GaugeMetricFamily("flashpoint_function_replicas_desired",
                                    "The autoscaler's planned replica count", labels=["function"])
        queued = GaugeMetricFamily("flashpoint_function_queued_requests",
                                   "Requests waiting in the controller for a replica",
                                   labels=["function"])
        inflight = GaugeMetricFamily("flashpoint_function_inflight_requests",
                                     "Requests sent to a replica and not answered yet",
                                     labels=["function"])
        backoff = GaugeMetricFamily("flashpoint_function_start_failures",
                                    "Consecutive failed starts of a function (0 once one warms)",
                                    labels=["function"])
        counts: dict[tuple[str, str], int] = {}
        for rep in state.replicas.values():
            key = (rep.function, str(rep.phase.value))
            counts[key] = counts.get(key, 0) + 1
        for name, fn in state.functions.items():
            for phase in ReplicaPhase:
                replicas.add_metric([name, str(phase.value)], counts.get((name, str(phase.value)), 0))
            desired.add_metric([name], fn.desired)
            queued.add_metric([name], self._queued(name))
            inflight.add_metric([name], self._inflight(name))
            backoff.add_metric([name], fn.start_failures)
        hosts = GaugeMetricFamily("flashpoint_hosts", "Hosts the controller knows, by state",
                                  labels=["state"])
        by_state = {"alive": 0, "draining": 0, "lost": 0}
        for h in state.hosts.values():
            by_state["lost" if not h.alive else "draining" if h.draining else "alive"] += 1
        for s, n in by_state.items():
            hosts.add_metric([s], n)
        yield from (replicas, desired, queued, inflight, backoff, hosts)


def state_registry(state: ControllerState, queued: Callable[[str], int],
                   inflight: Callable[[str], int]) -> CollectorRegistry:
    """A registry of the controller's own holding its :class:`StateCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state, queued, inflight))
    return registry
