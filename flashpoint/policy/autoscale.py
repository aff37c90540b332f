"""Autoscaling: the plug-in registry and the one wrapper every plug-in's answer goes through.

A plug-in (``autoscalers.py``, ``rpr.py``) computes the replica count it wants from the
snapshot and its own memory. :func:`limit` then applies, in this order:

1. never zero while requests are queued or in flight;
2. the function's ``min_replicas``..``max_replicas``;
3. scale from zero at once (no delay);
4. keep-alive: no scale to zero (and, with ``keep_alive_partial``, no scale-down at all)
   until the function has had no request for ``keep_alive_s``;
5. stabilisation delays: a scale-up (down) happens only once it has been wanted on every
   decision for ``scale_up_delay_s`` (``scale_down_delay_s``), as Ray Serve does;
6. the scale-up governor (:func:`govern`, issue 22 item 5): starting replicas are capacity
   arriving at their expected ready time, and no replica is ordered that would only become
   ready once the queue has drained.

Choose a plug-in by name with :func:`make_autoscaler`; :func:`decide` is the default
(``concurrency``) and keeps the first-cut behaviour. Everything here is pure: "now" is
``load.now_s`` and memory is passed in and returned.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from flashpoint.errors import BadRequest
from flashpoint.policy import autoscalers as plugins
from flashpoint.policy.autoscalers import Proposal, concurrency_target
from flashpoint.policy.rpr import RprParams, rpr
from flashpoint.policy.snapshot import FunctionLoadSnapshot
from flashpoint.policy.token_load import TokensParams, tokens

__all__ = [
    "POLICIES", "Autoscaler", "AutoscalerMemory", "LimitMemory", "LimitParams", "PolicySpec",
    "ScaleDecision", "concurrency_target", "decide", "drain_time_s", "govern", "limit",
    "make_autoscaler",
]


@dataclass(frozen=True)
class ScaleDecision:
    """The replica count a function should have, and why.

    ``mix`` is set by configuration-choosing policies (RPR): replicas per configuration
    name, sorted by name, summing to ``desired``.
    """

    function: str
    desired: int
    reason: str
    mix: tuple[tuple[str, int], ...] = ()


# The wrapper -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LimitParams:
    """The wrapper's settings, shared by every plug-in (keys of ``autoscaler_params``)."""

    scale_up_delay_s: float = 0.0
    scale_down_delay_s: float = 0.0
    # Hold every scale-down (not only the one to zero) until keep_alive_s without a request.
    # The first-cut rule did this; rate-driven policies have their own scale-down rules.
    keep_alive_partial: bool = False
    # The scale-up governor (govern), for every plug-in: opt in (``governor = true`` in
    # autoscaler_params). Off by default because it trades the latency of short bursts
    # (fewer replicas when cold starts are short) for fewer wasted starts under long ones;
    # it acts only when the snapshot says when new replicas would be ready and how fast
    # one serves.
    governor: bool = False
    # How long after a replica ordered now is ready the queue may still take to drain, in
    # cold starts of that replica: a replica ordered at a later decision would be ready
    # about that much later, so capacity beyond what drains the queue by then is not
    # ordered now.
    governor_horizon: float = 1.0

    def __post_init__(self) -> None:
        if not (self.scale_up_delay_s >= 0 and self.scale_down_delay_s >= 0):
            raise BadRequest("scale_up_delay_s and scale_down_delay_s must be >= 0")
        if not self.governor_horizon >= 0:
            raise BadRequest("governor_horizon must be >= 0")


@dataclass(frozen=True)
class LimitMemory:
    """Since when a scale-up (down) has been wanted without a break; None = not wanted."""

    up_since_s: float | None = None
    down_since_s: float | None = None


def limit(load: FunctionLoadSnapshot, proposal: Proposal, params: LimitParams,
          memory: LimitMemory) -> tuple[ScaleDecision, LimitMemory]:
    """Apply the common rules to a plug-in's proposal (the module docstring lists them)."""
    now, cur = load.now_s, load.replicas_warm + load.replicas_starting
    reason, suffix = proposal.reason, ""
    raw = max(0, proposal.desired)
    if raw == 0 and load.queued + load.inflight > 0:
        raw, suffix = 1, "+demand"
    target = min(max(raw, load.min_replicas), load.max_replicas)
    bounded = target != raw
    idle_for = math.inf if load.last_request_s is None else now - load.last_request_s
    up_since = down_since = None
    if target > cur and cur > 0 and params.scale_up_delay_s > 0:
        up_since = now if memory.up_since_s is None else memory.up_since_s
        if now - up_since < params.scale_up_delay_s:
            target, reason = cur, "scale_up_delay"
        else:
            up_since = None
    elif target < cur:
        floor = cur if params.keep_alive_partial else 1
        if idle_for < load.keep_alive_s and target < floor:
            target, reason = floor, "keep_alive"
        elif raw == 0:
            reason = "idle"
        if target < cur and params.scale_down_delay_s > 0:
            down_since = now if memory.down_since_s is None else memory.down_since_s
            if now - down_since < params.scale_down_delay_s:
                target, reason = cur, "scale_down_delay"
            else:
                down_since = None
    if params.governor and target > cur:
        governed = govern(load, target, params.governor_horizon)
        if governed < target:
            target, reason = governed, reason + "+governor"
    desired = min(max(target, load.min_replicas), load.max_replicas)
    bounded = bounded or desired != target
    decision = ScaleDecision(load.name, desired, reason + suffix + ("+bounds" if bounded else ""),
                             _mix(load, proposal, desired, cur))
    return decision, LimitMemory(up_since, down_since)


def drain_time_s(backlog: float, arrival_rate: float, replica_rate: float, warm: int,
                 ready_s: Sequence[float]) -> float:
    """Seconds from now until the queue is empty and stays empty at the capacity then.

    ``backlog`` requests wait or run now; requests arrive at ``arrival_rate``; ``warm``
    replicas serve ``replica_rate`` each from now, and one more from each offset in
    ``ready_s`` (seconds from now). math.inf when the final capacity does not exceed the
    arrivals while a backlog remains (or grows).
    """
    events = sorted(max(0.0, t) for t in ready_s)
    t, queue, serving = 0.0, float(backlog), warm
    for edge in (*events, math.inf):
        net = serving * replica_rate - arrival_rate  # how fast the queue shrinks
        if queue <= 0 and net >= 0:
            return t
        if net > 0 and t + queue / net <= edge:
            return t + queue / net
        if edge == math.inf:
            return math.inf
        queue = max(0.0, queue - net * (edge - t))
        t, serving = edge, serving + 1
    return math.inf  # not reached: the inf edge returns


def govern(load: FunctionLoadSnapshot, target: int, horizon: float = 1.0) -> int:
    """The count to order instead of ``target`` (> current), counting capacity on its way.

    Each starting replica serves from its expected ready time (``starting_ready_s``; an
    unknown one from ``new_ready_s``: it was ordered earlier, so it is ready no later). A
    replica ordered now serves from ``new_ready_s``. The answer is the fewest new replicas
    k such that the queue (queued + in flight, arrivals at λ) drains by ``new_ready_s`` +
    ``horizon`` cold starts; none if it drains before ``new_ready_s`` anyway (every
    replica ordered now would find no queue), ``target`` if even that many do not drain it
    within the horizon. Unchanged (``target``) when the snapshot lacks the ready time or one
    replica's rate, and when nothing is queued: with no queue there is nothing to drain, and
    a plug-in that scales ahead of demand (ATL's p99 rate) keeps its forecast. Pure: times
    are relative to ``load.now_s``.
    """
    cur = load.replicas_warm + load.replicas_starting
    rate = plugins.replica_rate(load)
    if load.new_ready_s is None or rate <= 0 or target <= cur or load.queued == 0:
        return target
    new_in = max(0.0, load.new_ready_s - load.now_s)
    known = [t - load.now_s for t in load.starting_ready_s[:load.replicas_starting]]
    starting = known + [new_in] * (load.replicas_starting - len(known))
    backlog = load.queued + load.inflight
    deadline = new_in * (1.0 + horizon)

    def drains(k: int) -> bool:
        return drain_time_s(backlog, load.arrival_rate, rate, load.replicas_warm,
                            starting + [new_in] * k) <= deadline

    if drain_time_s(backlog, load.arrival_rate, rate, load.replicas_warm, starting) <= new_in:
        return cur
    lo, hi = 1, target - cur  # drains(k) only gets truer as k grows: bisect the fewest
    if not drains(hi):
        return target
    while lo < hi:
        mid = (lo + hi) // 2
        if drains(mid):
            hi = mid
        else:
            lo = mid + 1
    return cur + lo


def _mix(load: FunctionLoadSnapshot, proposal: Proposal, desired: int,
         cur: int) -> tuple[tuple[str, int], ...]:
    """The plug-in's configuration mix fitted to the count the wrapper settled on."""
    if proposal.pad is None:
        return ()
    pods = proposal.pods
    if desired != len(pods) and desired == cur:  # held: the replicas stay as they are
        pods = (*load.replica_configs[:cur], *(proposal.pad,) * (cur - len(load.replica_configs)))
    elif desired < len(pods):  # the first are the first to remove
        pods = pods[len(pods) - desired:]
    else:
        pods = (*pods, *(proposal.pad,) * (desired - len(pods)))
    return tuple(sorted(Counter(pods).items()))


# The registry ------------------------------------------------------------------------------
Policy = Callable[[FunctionLoadSnapshot, Any, Any], tuple[Proposal, Any]]


@dataclass(frozen=True)
class PolicySpec:
    """A plug-in: its function, parameter class, first memory, and wrapper defaults."""

    policy: Policy
    params_type: type
    initial_memory: Any = None
    limit_defaults: Mapping[str, float] = field(default_factory=dict)


# HPA's default scale-down stabilisation window, for the two Kubernetes-based baselines.
_HPA_DOWN = MappingProxyType({"scale_down_delay_s": 300.0})

POLICIES: Mapping[str, PolicySpec] = MappingProxyType({
    "concurrency": PolicySpec(plugins.concurrency, plugins.NoParams, None,
                              MappingProxyType({"keep_alive_partial": True})),
    "atl": PolicySpec(plugins.atl, plugins.AtlParams, plugins.Samples()),
    "tsk": PolicySpec(plugins.tsk, plugins.TskParams, plugins.Held(), _HPA_DOWN),
    "owk": PolicySpec(plugins.owk, plugins.OwkParams, plugins.Held(), _HPA_DOWN),
    "smstar": PolicySpec(plugins.smstar, plugins.SmStarParams, plugins.Samples()),
    "eq412": PolicySpec(plugins.eq412, plugins.Eq412Params, None),
    "dilu": PolicySpec(plugins.dilu, plugins.DiluParams, plugins.DiluMemory()),
    "rpr": PolicySpec(rpr, RprParams, None),
    # text generation on tokens (policy/token_load.py); other functions: the concurrency rule
    "tokens": PolicySpec(tokens, TokensParams, None,
                         MappingProxyType({"keep_alive_partial": True})),
})


@dataclass(frozen=True)
class AutoscalerMemory:
    """One function's memory: the plug-in's and the wrapper's, tagged with the policy name."""

    autoscaler: str
    policy: Any
    limit: LimitMemory = LimitMemory()


@dataclass(frozen=True)
class Autoscaler:
    """A plug-in bound to its parameters, behind the wrapper. Build with make_autoscaler."""

    name: str
    spec: PolicySpec
    params: Any
    limits: LimitParams

    def initial_memory(self) -> AutoscalerMemory:
        return AutoscalerMemory(self.name, self.spec.initial_memory)

    def decide(self, load: FunctionLoadSnapshot,
               memory: AutoscalerMemory | None = None) -> tuple[ScaleDecision, AutoscalerMemory]:
        """The decision for one function and the memory to pass next time for it.

        Memory from another policy (the configuration changed) is dropped, not misread.
        """
        if memory is None or memory.autoscaler != self.name:
            memory = self.initial_memory()
        proposal, policy_memory = self.spec.policy(load, self.params, memory.policy)
        decision, limit_memory = limit(load, proposal, self.limits, memory.limit)
        return decision, AutoscalerMemory(self.name, policy_memory, limit_memory)


def make_autoscaler(name: str, params: Mapping[str, float] = MappingProxyType({})) -> Autoscaler:
    """The autoscaler registered as ``name``, with ``params`` for it and for the wrapper.

    Raises BadRequest for an unknown name, an unknown key, a value of the wrong type or
    out of range. Keys the plug-in and the wrapper do not set keep their defaults.
    """
    spec = POLICIES.get(name)
    if spec is None:
        raise BadRequest(f"unknown autoscaler {name!r}; known: {sorted(POLICIES)}")
    own = {f.name for f in dataclasses.fields(spec.params_type)}
    shared = {f.name for f in dataclasses.fields(LimitParams)}
    unknown = set(params) - own - shared
    if unknown:
        raise BadRequest(f"unknown parameters for autoscaler {name!r}: {sorted(unknown)}; "
                         f"known: {sorted(own | shared)}")
    limit_values = {**spec.limit_defaults, **{k: v for k, v in params.items() if k in shared}}
    return Autoscaler(
        name,
        spec,
        _build(spec.params_type, {k: v for k, v in params.items() if k in own}, name),
        _build(LimitParams, limit_values, name),
    )


def _build(cls: type, values: Mapping[str, Any], name: str) -> Any:
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    for key, value in values.items():
        kind, where = types[key], f"autoscaler {name!r}: {key}"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if kind == "bool":
            if not (isinstance(value, bool) or (number and value in (0, 1))):
                raise BadRequest(f"{where} must be true or false, not {value!r}")
            kw[key] = bool(value)
        elif not number or not math.isfinite(value):
            raise BadRequest(f"{where} must be a finite number, not {value!r}")
        elif kind == "int":
            if value != int(value):
                raise BadRequest(f"{where} must be a whole number, not {value!r}")
            kw[key] = int(value)
        else:
            kw[key] = float(value)
    return cls(**kw)


_DEFAULT = make_autoscaler("concurrency")


def decide(load: FunctionLoadSnapshot) -> ScaleDecision:
    """The default autoscaler (``concurrency`` with keep-alive on every scale-down).

    - Any demand with no replica at all scales from zero at once (first request).
    - Scaling up follows demand; scaling down waits for ``keep_alive_s`` of idleness so a
      short lull does not throw warm replicas away.
    - Bounds ``min_replicas``..``max_replicas`` are applied last.
    """
    return _DEFAULT.decide(load)[0]
