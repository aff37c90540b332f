"""A simulated cluster driven by the live controller logic (issue 7, seed 004 §6).

The decisions are not re-implemented here: a :class:`ControllerState` — the same class the
Controller actor feeds — receives the events a real cluster would produce (hosts
registering, ticks with per-function load, replicas warming, heartbeats with the models a
host caches) and returns commands (``DeployReplica`` with a sourcing plan, ``StartChain``,
``StopAccepting``, ``StopReplica`` ...). Its autoscaler is a plug-in from
``policy/autoscale.py`` (ATL, TSK, OWK, SM* ...), its placement ``policy.placement.
select_receivers``, its sourcing ``policy.sourcing.plan_sourcing``. This module plays the
hosts, the GPUs, the network and the request queue, on the :class:`Engine`'s clock:

* **Cold start** (thesis §1.5): model bytes reach host RAM (a flow from the registry or a
  peer over :class:`FlowNetwork`), are loaded once per host (``load_s``), then copied to
  each GPU (``to_device_s``). A host holding the model only pays the copy (§2.1, "local").
* **Techniques** (thesis §8.4): BL — every replica downloads its own copy from the
  registry and nothing stays in host RAM; LC — hosts keep models in RAM and report them, so
  the controller sources from own RAM, then peers, then the registry, one download per host,
  each receiver on its own unicast flow from its sender; MC — hosts share one download per
  host and every chain the sourcing plan builds is a cut-through TCP chain, but nothing
  stays in RAM afterwards (only the registry sends); LC+MC — both. GF, the thesis's
  "GPU-enabled FaaS" locality baseline (§8.2.2, [117]): hosts keep models in RAM after their
  replicas stop (lazy eviction) and report them, so placement prefers their GPUs (stage 1)
  and a replica there copies host RAM to GPU; every other replica downloads its own copy
  from the registry, as BL does — no peer source (the state runs with ``peer_sends=False``),
  no chains, no download shared by the GPUs of one host.
* **Chains** are one flow over the links of all hops (``network.chain_path``): cut-through
  relaying moves every hop at the chain's bottleneck rate and loads every hop's links with
  it; receiver ``i`` completes ``i × hop_delay_s`` after the head.
* **Requests** join one queue per function (the thesis's global pull queue, Sparrow-style);
  a warm replica takes the next request when it has a free credit; service time is the
  profile's (× the request's ``work``). No batching (the thesis's worker concurrency is 1).
* **Decision time** is charged in simulated time (seed 004 §9 note 2): commands returned
  by a tick take effect ``decision_s`` later, measured with ``perf_counter`` around
  ``ControllerState.handle`` (or fixed, for reproducible runs and tests).

* **Partitioned pipelines** (MP; thesis Ch. 4): the function gets ``max_stages > 1`` and
  a plan table solved by ``partition.table.plan_table`` with the worst-case (registry)
  cost model; ``ControllerState`` picks plans (Eq 4.14) and places stages. A stage
  fetches its own byte range (from a holder's RAM under LC, else the registry), loads it
  pro rata and reports ``StageReady``; ``LinkGroup`` is acknowledged at once
  (``GroupLinked``) and ``ServeGroup`` makes the group one dispatch target whose requests
  take I(p) = I(1) + IN(p) (Eq 4.2: the partition cost model's transfers at every cut)
  with the credits the state grants. Each stage then fetches the rest of the model and
  completes into a whole replica (§4.2.5); the state dissolves the group. (Live hosts
  hold that fetch until the group's first answer, ``host/stage_hold.py``, because it
  shares their CPU and links with the first pass; the simulator's first pass takes I(p)
  regardless, so it starts the fetch at once and never feeds ``GroupAnswered``.) A pipeline's
  cold start is counted once, from its deploy to serving. Simplification: a completed
  stage serves alone *and* still counts inside its pipeline until the group dissolves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from flashpoint.controller.state import events as ev
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.rates import RateMeter
from flashpoint.partition.model import CostModel
from flashpoint.partition.table import PlanTable, plan_table
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.policy.sourcing import REGISTRY
from flashpoint.sim.engine import Engine, EventHandle
from flashpoint.sim.models import ModelProfile
from flashpoint.sim.network import (
    CLOUD,
    Flow,
    FlowNetwork,
    LinkId,
    LinkKind,
    Node,
    Topology,
    chain_path,
)
from flashpoint.sim.traces import RequestLog
from flashpoint.spec import FunctionSpec

__all__ = ["Technique", "ClusterConfig", "SimCluster", "RunMetrics", "DecisionRecord"]

GIB = 1 << 30


class Technique(StrEnum):
    """Which cold-start techniques the cluster uses (thesis §8.4's abbreviations)."""

    BL = "BL"
    GF = "GF"  # GPU-enabled FaaS [117]: lazy eviction, host RAM -> GPU, holders preferred
    LC = "LC"
    MC = "MC"
    LC_MC = "LC+MC"
    MP = "MP"
    LC_MC_MP = "LC+MC+MP"

    @property
    def locality(self) -> bool:
        """Flashpoint's locality (LC): own RAM, then peers' RAM, then the registry."""
        return self in (Technique.LC, Technique.LC_MC, Technique.LC_MC_MP)

    @property
    def keeps_models(self) -> bool:
        """Hosts keep a model in RAM after its replicas stop and report it (lazy eviction):
        LC's techniques and GF."""
        return self.locality or self is Technique.GF

    @property
    def multicast(self) -> bool:
        return self in (Technique.MC, Technique.LC_MC, Technique.LC_MC_MP)

    @property
    def partition(self) -> bool:
        return self in (Technique.MP, Technique.LC_MC_MP)

    @property
    def host_sharing(self) -> bool:
        """One download per host shared by its GPUs (§2.4); BL and GF download per replica."""
        return self not in (Technique.BL, Technique.GF)


@dataclass(frozen=True)
class ClusterConfig:
    """One simulated cluster and how it is driven. Defaults are the thesis's (seed 004 §6,
    §8 testbed T3: A10 24 GB GPUs, 200 GiB host RAM)."""

    topology: Topology = field(default_factory=Topology)
    technique: Technique = Technique.LC_MC
    autoscaler: str = "atl"
    autoscaler_params: tuple[tuple[str, float], ...] = ()
    tick_s: float = 1.0  # the controller's loop interval
    # Wake the loop at once when a request finds a function with no replica at all (the
    # live controller's scale-from-zero path), at most this often.
    wake_min_s: float = 0.05
    # None = measure ControllerState.handle with perf_counter and charge it; a number =
    # charge exactly that (deterministic runs, tests).
    decision_s: float | None = None
    gpu_memory_bytes: int = 24 * GIB
    host_ram_bytes: int = 200 * GIB
    keep_alive_s: float = 30.0
    replica_concurrency: int = 1  # the thesis's prototype runs one request per GPU
    hop_delay_s: float = 0.001  # per-hop forwarding delay of a chain (RTT + one chunk)
    max_chain_length: int = 8
    drain_s: float = 600.0  # after the last arrival, run at most this long to finish work
    # Replicas warm at t = 0 (a cluster in steady state rather than cold; the thesis does
    # not say how its runs begin). Placed by the live placement, their hosts hold the model.
    prewarm: int = 0
    # MP: most stages per pipeline (the thesis sweeps 1..64; 0 = the model's layer count),
    # and the intermediate-tensor link (GPU to GPU across hosts).
    max_stages: int = 64
    link_latency_s: float = 0.0005

    def __post_init__(self) -> None:
        if self.tick_s <= 0 or self.wake_min_s < 0 or self.drain_s < 0:
            raise ValueError("tick_s must be > 0, wake_min_s and drain_s >= 0")
        if self.decision_s is not None and self.decision_s < 0:
            raise ValueError("decision_s must be >= 0")


@dataclass
class _Replica:
    rid: str
    host: int
    deploy_s: float
    warm_s: float | None = None
    stopping: bool = False
    busy: int = 0
    stopped_s: float | None = None
    pending: EventHandle | None = None  # its to-device step, while starting
    flow: Flow | None = None  # its private download (BL), while it runs
    stage: tuple[int, int] | None = None  # a partition stage's layers
    completed: bool = False  # a stage that completed into a whole replica
    service_s: float = 0.0  # per request; a pipeline group's is longer (transfers)
    stages: tuple[str, ...] = ()  # a group target's stage replicas
    source: str = ""  # where its bytes came from (local, chain:<sender>, registry)


@dataclass
class _Fill:
    """A host's copy of a model on its way: transfer, then load; waiters copy to GPU after."""

    waiters: list[str] = field(default_factory=list)
    source: str = ""


@dataclass(frozen=True)
class DecisionRecord:
    """One ``ControllerState.handle`` call: the event and the commands it returned (parity)."""

    event: object
    commands: tuple[object, ...]


@dataclass
class RunMetrics:
    """What a run measured; times in seconds."""

    cold_starts_s: list[float] = field(default_factory=list)
    cold_start_sources: list[str] = field(default_factory=list)  # where each one's bytes came from
    latencies_s: list[float] = field(default_factory=list)
    replica_s: float = 0.0
    requests: int = 0
    unserved: int = 0
    failed: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    decisions: int = 0
    pipelines: int = 0  # partitioned groups that served
    completions: int = 0  # stages that completed into whole replicas
    decision_wall_s: float = 0.0
    events: int = 0
    wall_s: float = 0.0
    sim_end_s: float = 0.0
    bytes_moved: float = 0.0
    peak_starting: int = 0  # most replicas cold-starting at once
    peak_registry_flows: int = 0  # most flows sharing the registry link at once

    @property
    def avg_cold_start_s(self) -> float:
        return sum(self.cold_starts_s) / len(self.cold_starts_s) if self.cold_starts_s else 0.0

    @property
    def avg_latency_s(self) -> float:
        return sum(self.latencies_s) / len(self.latencies_s) if self.latencies_s else 0.0

    @property
    def p99_latency_s(self) -> float:
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered), max(1, math.ceil(0.99 * len(ordered)))) - 1]

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0


class SimCluster:
    """Hosts, GPUs, network and a request queue around a live :class:`ControllerState`.

    One function (one model) per run, as the thesis's grid does (seed 004 §6). Build it,
    then :meth:`run` a request log; ``record=True`` keeps every decision for parity checks.
    """

    FUNCTION = "fn"

    def __init__(self, config: ClusterConfig, model: ModelProfile, record: bool = False) -> None:
        self.config = config
        self.model = model
        self.engine = Engine()
        self.net = FlowNetwork(self.engine, config.topology)
        self.state = ControllerState(
            heartbeat_timeout_s=math.inf,  # simulated hosts never fall silent
            cold_start_timeout_s=math.inf,  # a congested registry may take minutes; wait
            registry_sends=True,
            autoscaler=make_autoscaler(config.autoscaler, dict(config.autoscaler_params)),
            max_chain_length=config.max_chain_length,
            # GF: a host's RAM copy serves that host only (BL holds none, so it is moot).
            peer_sends=config.technique is not Technique.GF,
        )
        self.records: list[DecisionRecord] | None = [] if record else None
        self.metrics = RunMetrics()
        self.spec = FunctionSpec(
            self.FUNCTION, model.name, "1", max_batch_size=1, min_replicas=0,
            max_replicas=min(1024, config.topology.n_gpus), keep_alive_s=config.keep_alive_s,
            replica_concurrency=config.replica_concurrency, timeout_s=3600.0, compute=1.0,
        )
        self.plans: PlanTable | None = None
        self.cost: CostModel | None = None
        if config.technique.partition:
            n = len(model.layers)
            stages = min(n, 64, config.max_stages or n)
            self.spec = dataclasses.replace(self.spec, max_stages=max(1, stages))
            self.cost = partition_cost(model, config)
            self.plans = plan_table(model.layers, self.cost, p_max=stages, x_max=3000)
        self._replicas: dict[str, _Replica] = {}
        self._free: deque[str] = deque()  # warm replicas with a free credit (may be stale)
        # Indexes kept with _replicas so no per-tick or per-warm step scans every replica
        # (at 20,000 GPUs those scans dominated): replicas told to stop accepting, in order,
        # and per host the replicas still starting (not warm).
        self._stopping: dict[str, None] = {}
        self._starting: dict[int, int] = {}
        self._n_starting = 0  # Σ of _starting
        self._queue: deque[tuple[float, float]] = deque()  # (arrival_s, work)
        self._cache: list[set[str]] = [set() for _ in range(config.topology.n_hosts)]
        self._fills: dict[int, _Fill] = {}  # host -> fill of the one model
        self._heads_started: set[str] = set()  # registry chains started (transfer ids)
        self._arrivals = RateMeter()
        self._completions = RateMeter()
        self._invocations = 0
        self._last_request_s: float | None = None
        self._last_wake_s = -math.inf
        self._inflight = 0
        self._log: RequestLog | None = None
        self._next_req = 0
        self._tick_handle: EventHandle | None = None
        self._stop_at_s = math.inf
        self._done_s: float | None = None  # when the last request completed

    # --- setup and run -------------------------------------------------------------------
    def _feed(self, event: object) -> list[object]:
        t0 = time.perf_counter()
        cmds = self.state.handle(event)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        self.metrics.decisions += 1
        self.metrics.decision_wall_s += dt
        if self.records is not None:
            self.records.append(DecisionRecord(event, tuple(cmds)))
        return cmds

    def _register(self) -> None:
        topo = self.config.topology
        devices = tuple(ev.DeviceRecord(f"g{j}", "cuda", self.config.gpu_memory_bytes)
                        for j in range(topo.gpus_per_host))
        for h in range(topo.n_hosts):
            self._feed(ev.HostRegistered(_hid(h), devices, self.config.host_ram_bytes,
                                         frozenset(), (), 0.0, leaf=f"leaf{topo.leaf_of(h)}"))
        # C(1): the cost model's whole cold start; without a plan table, a lone registry
        # start (bytes over the registry link, load, copy) as the live controller's profile
        # would give it — the governor's prior before any start has been measured.
        whole = (self.cost.cold_s(self.model.size_bytes) if self.cost is not None else
                 self.model.size_bytes * 8 / min(topo.cloud_bps, topo.host_link_bps)
                 + self.model.load_s + self.model.to_device_s)
        self._feed(ev.FunctionUpserted(self.spec, self.model.size_bytes, self.plans, whole))
        if self.config.prewarm > 0:
            self._prewarm(self.config.prewarm)

    def _prewarm(self, n: int) -> None:
        """Start with ``n`` warm replicas: one decision of the demand-driven ``concurrency``
        plug-in for ``n`` queued requests (so placement is the live one), deploys made warm
        at once. The configured autoscaler is restored after; its memory starts empty (the
        state drops memory tagged with another plug-in's name)."""
        scaler = self.state.autoscaler
        self.state.autoscaler = make_autoscaler("concurrency")
        try:
            cmds = self._feed(ev.Tick(0.0, {self.FUNCTION: ev.FunctionLoad(
                n * self.config.replica_concurrency, 0, None)}))
        finally:
            self.state.autoscaler = scaler
        for c in cmds:
            if isinstance(c, ev.DeployReplica):
                h = _host(c.host_id)
                rep = self._replicas[c.replica_id] = _Replica(c.replica_id, h, 0.0, warm_s=0.0,
                                                              service_s=self.model.service_s)
                self._cache[h].add(self.model.key)
                self._feed(ev.ReplicaWarmed(rep.rid, {}, 0.0))
                self._free.extend([rep.rid] * self.config.replica_concurrency)
        # Steady state: the function was just invoked, so keep-alive holds these replicas
        # until the rate meters have seen the trace.
        self._last_request_s = 0.0
        for h in range(self.config.topology.n_hosts):
            if self._cache[h]:
                if not self.config.technique.keeps_models:
                    self._cache[h].clear()
                self._report(h)

    def run(self, log: RequestLog) -> RunMetrics:
        """Serve ``log`` and return the metrics (bounded: the engine's event limit, and at
        most ``drain_s`` after the last arrival)."""
        if self._log is not None:
            raise RuntimeError("a SimCluster runs once")
        self._log = log
        self.metrics.requests = len(log)
        wall0 = time.perf_counter()
        self._register()
        self._stop_at_s = (log.duration_s if len(log) else 0.0) + self.config.drain_s
        if len(log):
            self.engine.schedule(log.arrivals_s[0], self._arrive)
        self._tick_handle = self.engine.schedule(0.0, self._tick)
        self.engine.run(until_s=self._stop_at_s)
        # Resources are counted until the workload is served (or the run was cut off).
        end = self._done_s if self._done_s is not None else self.engine.now_s
        for r in self._replicas.values():
            self.metrics.replica_s += end - r.deploy_s
        self.metrics.unserved = len(self._queue) + self._inflight + (len(log) - self._next_req)
        self.metrics.events = self.engine.events_processed
        self.metrics.sim_end_s = end
        self.metrics.bytes_moved = self.net.bytes_delivered
        self.metrics.peak_registry_flows = self.net.peak_flows(LinkId(LinkKind.CLOUD_EGRESS, 0))
        self.metrics.wall_s = time.perf_counter() - wall0
        return self.metrics

    # --- requests ------------------------------------------------------------------------
    def _arrive(self) -> None:
        log = self._log
        assert log is not None
        now = self.engine.now_s
        arrivals, n = log.arrivals_s, len(log)
        # Every request due now in one event: a burst is seen whole by the wake below, and
        # the heap holds one arrival at a time however long the log is.
        i = self._next_req
        while i < n and arrivals[i] <= now:  # bounded by the log's length
            self._queue.append((arrivals[i], log.work[i] if log.work else 1.0))
            i += 1
        added = i - self._next_req
        self._next_req = i
        self._arrivals.add(self.FUNCTION, added)
        self._invocations += added
        self._last_request_s = now
        if i < n:
            self.engine.schedule(arrivals[i], self._arrive)
        self._dispatch()
        if self._queue and not self._replicas and now - self._last_wake_s >= self.config.wake_min_s:
            self._last_wake_s = now
            self.engine.schedule(now, self._wake)

    def _dispatch(self) -> None:
        free, queue, reps = self._free, self._queue, self._replicas
        while queue and free:  # bounded: each pass pops a free slot or a queued request
            rid = free.popleft()
            rep = reps.get(rid)
            if rep is None or rep.stopping or rep.busy >= self.config.replica_concurrency:
                continue
            arrival_s, work = queue.popleft()
            rep.busy += 1
            self._inflight += 1
            if rep.busy < self.config.replica_concurrency:
                free.append(rid)
            self.engine.schedule_in(rep.service_s * work,
                                    lambda rid=rid, a=arrival_s: self._complete(rid, a))

    def _complete(self, rid: str, arrival_s: float) -> None:
        now = self.engine.now_s
        self.metrics.latencies_s.append(now - arrival_s)
        self._completions.add(self.FUNCTION)
        self._inflight -= 1
        rep = self._replicas.get(rid)
        if rep is not None:
            rep.busy -= 1
            if not rep.stopping and rep.busy == self.config.replica_concurrency - 1:
                self._free.append(rid)
        self._dispatch()
        log = self._log
        if (log is not None and self._next_req >= len(log) and not self._queue
                and self._inflight == 0):
            self._done_s = now  # the workload is served: the control loop stops
            if self._tick_handle is not None:
                self.engine.cancel(self._tick_handle)

    # --- control loop --------------------------------------------------------------------
    def _load(self, now: float) -> ev.FunctionLoad:
        """The figures the live controller's ``_tick`` builds, from the simulated queue."""
        oldest = self._queue[0][0] if self._queue else None
        return ev.FunctionLoad(
            len(self._queue), self._inflight, self._last_request_s,
            self._arrivals.rate(self.FUNCTION), self._completions.rate(self.FUNCTION),
            self.model.service_s, now - oldest if oldest is not None else 0.0,
            self._invocations)

    def _control(self) -> None:
        now = self.engine.now_s
        self._arrivals.update(now)
        self._completions.update(now)
        reps = self._replicas
        idle = frozenset(rid for rid in self._stopping if reps[rid].busy == 0)
        t0 = time.perf_counter()
        cmds = self._feed(ev.Tick(now, {self.FUNCTION: self._load(now)}, idle))
        charged = time.perf_counter() - t0 if self.config.decision_s is None \
            else self.config.decision_s
        if cmds:
            self._after(charged, lambda: self._execute(cmds))

    def _tick(self) -> None:
        self._control()
        nxt = self.engine.now_s + self.config.tick_s
        if nxt <= self._stop_at_s and self._done_s is None:
            self._tick_handle = self.engine.schedule(nxt, self._tick)

    def _wake(self) -> None:
        if not self._replicas:
            self._control()


    def _after(self, delay_s: float, fn: Callable[[], None]) -> None:
        if delay_s <= 0:
            fn()
        else:
            self.engine.schedule_in(delay_s, fn)

    # --- commands ------------------------------------------------------------------------
    def _execute(self, cmds: list[object]) -> None:
        chains: list[tuple[Node, tuple[int, ...]]] = []
        for c in cmds:
            if isinstance(c, ev.DeployReplica):
                head = self._deploy(c)
                if head is not None:
                    chains.append(head)
            elif isinstance(c, ev.StartChain):
                chains.append((_host(c.sender), tuple(_host(h) for h in c.receivers)))
            elif isinstance(c, ev.StopAccepting):
                rep = self._replicas.get(c.replica_id)
                if rep is not None:
                    rep.stopping = True
                    self._stopping[c.replica_id] = None
            elif isinstance(c, ev.StopReplica):
                self._stop(c.replica_id)
            elif isinstance(c, ev.ForgetReplica):
                rep = self._replicas.get(c.replica_id)
                if rep is not None and rep.stages:  # a dissolved pipeline: no longer a target
                    del self._replicas[c.replica_id]
                    self._stopping.pop(c.replica_id, None)
                elif rep is not None and rep.warm_s is None:
                    self._stop(c.replica_id)
            elif isinstance(c, ev.LinkGroup):
                # Linking is local work on the hosts (no bytes): acknowledged at once.
                for cmd in self._feed(ev.GroupLinked(c.group_id, True, "", self.engine.now_s)):
                    if isinstance(cmd, ev.ServeGroup):
                        self._serve_group(cmd, tuple(r for r, _ in c.stages))
                    else:
                        self._execute([cmd])
            elif isinstance(c, ev.FailFunction):
                self.metrics.failed += len(self._queue)
                self._queue.clear()
        # Receivers learn their chain before the sender streams (the live order, too).
        for sender, receivers in chains:
            self._start_chain(sender, receivers)
        self._dispatch()

    def _deploy(self, c: ev.DeployReplica) -> tuple[Node, tuple[int, ...]] | None:
        """Start a replica's cold start; returns a registry chain this deploy heads."""
        now = self.engine.now_s
        h = _host(c.host_id)
        rep = _Replica(c.replica_id, h, now)
        self._replicas[c.replica_id] = rep
        self._starting[h] = self._starting.get(h, 0) + 1
        self._n_starting += 1
        if self._n_starting > self.metrics.peak_starting:
            self.metrics.peak_starting = self._n_starting
        rep.service_s = self.model.service_s
        key = self.model.key
        tech = self.config.technique
        if c.stage is not None:
            self._deploy_stage(rep, c)
            return None
        if not tech.host_sharing:  # BL, GF: a private download from the registry
            if tech.keeps_models and key in self._cache[h]:  # GF: host RAM -> GPU
                rep.source = "local"
                self._to_device(rep)
                return None
            rep.source = "registry"
            rep.flow = self.net.start_flow(CLOUD, h, self.model.size_bytes,
                                           lambda f, rid=rep.rid: self._private_done(rid))
            return None
        src = c.source
        chain: tuple[Node, tuple[int, ...]] | None = None
        if (src is not None and src.kind == "chain_head"
                and src.transfer_id not in self._heads_started):
            # It heads a registry chain: the chain starts whatever this host already has,
            # or the receivers behind it would wait forever. Once per transfer: every
            # replica the tick places on the head host carries the same assignment, and the
            # live host joins its one fill rather than pulling again (one transfer per host
            # and model); starting one chain per replica multiplied the registry load.
            self._heads_started.add(src.transfer_id)
            chain = CLOUD, (h, *(_host(x) for x in src.chain))
        if key in self._cache[h]:
            rep.source = "local"
            self._to_device(rep)
            return chain
        fill = self._fills.get(h)
        if fill is not None:  # one download per host: join it
            fill.waiters.append(rep.rid)
            rep.source = fill.source
            return chain
        fill = self._fills[h] = _Fill([rep.rid])
        if chain is not None:
            fill.source = rep.source = "registry"
            return chain
        if src is not None and src.kind == "chain":
            # The sender's StartChain (a holder) or the registry chain's head starts the flow.
            fill.source = rep.source = (f"chain:{src.sender}" if src.sender != REGISTRY
                                        else "registry")
            return None
        # No plan for this host (its earlier transfer finished and its copy was dropped,
        # or a "local" copy that is gone): pull from the registry.
        fill.source = rep.source = "registry"
        self.net.start_flow(CLOUD, h, self.model.size_bytes, lambda f, h=h: self._arrived(h))
        return None

    # --- partitioned pipelines (MP) --------------------------------------------------------
    def _deploy_stage(self, rep: _Replica, c: ev.DeployReplica) -> None:
        """A stage fetches its own byte range first (execute-while-load), reports
        ``StageReady``, then fetches the rest and completes into a whole replica (§4.2.5)."""
        assert c.stage is not None
        rep.stage = c.stage
        first, last = c.stage
        own = self.model.stage_bytes(first, last)
        sender = self._stage_sender(c, rep.host)
        rep.source = "registry" if sender == CLOUD else f"peer:h{sender}"
        key = self.model.key

        def ready() -> None:
            if rep.rid not in self._replicas:
                return
            for cmd in [x for x in self._feed(ev.StageReady(rep.rid, self.engine.now_s))]:
                self._execute([cmd])
            rest = self.model.size_bytes - own
            if key in self._cache[rep.host] or rest <= 0:
                self._after(self.model.startup_s(rest), lambda: self._warm(rep.rid))
            else:
                rep.flow = self.net.start_flow(sender, rep.host, rest, lambda f: loaded_rest())

        def loaded_rest() -> None:
            rep.flow = None
            rep.pending = self.engine.schedule_in(
                self.model.startup_s(self.model.size_bytes - own), lambda: self._warm(rep.rid))

        def arrived(_: Flow) -> None:
            rep.flow = None
            rep.pending = self.engine.schedule_in(self.model.startup_s(own), ready)

        if key in self._cache[rep.host]:
            rep.pending = self.engine.schedule_in(self.model.startup_s(own), ready)
        else:
            rep.flow = self.net.start_flow(sender, rep.host, own, arrived)

    def _stage_sender(self, c: ev.DeployReplica, h: int) -> Node:
        """The first fallback the plan names that can send: a holder's RAM (LC), else the
        registry (the state lists holders first, the registry last)."""
        src = c.source
        for name in (src.fallback if src is not None else ()):
            if name == REGISTRY:
                return CLOUD
            peer = _host(name)
            if peer != h and self.config.technique.locality and self.model.key in self._cache[peer]:
                return peer
        return CLOUD

    def _serve_group(self, cmd: ev.ServeGroup, stages: tuple[str, ...]) -> None:
        """The group is one dispatch target; a request crosses every stage and every cut
        (I(p) = I(1) + IN(p), thesis Eq 4.2, from the partition cost model)."""
        now = self.engine.now_s
        reps = [self._replicas[r] for r in stages if r in self._replicas]
        transfers = 0.0
        assert self.cost is not None
        for r in reps[:-1]:
            assert r.stage is not None
            transfers += self.cost.transfer_s(self.model.layers[r.stage[1]].output_bytes)
        deploy_s = min((r.deploy_s for r in reps), default=now)
        group = _Replica(cmd.group_id, -1, now, warm_s=now, stages=stages,
                         service_s=self.model.service_s + transfers)
        self._replicas[cmd.group_id] = group
        # A pipeline's cold start: requested to serving (its longest stage, §4.1.2).
        self.metrics.cold_starts_s.append(now - deploy_s)
        self.metrics.cold_start_sources.append("pipeline")
        self.metrics.sources["pipeline"] = self.metrics.sources.get("pipeline", 0) + 1
        self.metrics.pipelines += 1
        for _ in range(cmd.credits):
            self._free.append(cmd.group_id)

    def _start_chain(self, sender: Node, receivers: tuple[int, ...]) -> None:
        """A chain's bytes: one cut-through flow (MC) or one unicast per receiver (LC)."""
        size = self.model.size_bytes
        if not receivers:
            return
        if self.config.technique.multicast and len(receivers) > 1:
            path = chain_path(self.config.topology, (sender, *receivers))
            hop = self.config.hop_delay_s

            def done(_: Flow, receivers: tuple[int, ...] = receivers) -> None:
                for i, r in enumerate(receivers):
                    self._after(i * hop, lambda r=r: self._arrived(r))

            self.net.start_flow(sender, receivers[-1], size, done, path=path)
        else:
            for r in receivers:
                self.net.start_flow(sender, r, size, lambda f, r=r: self._arrived(r))

    def _arrived(self, h: int) -> None:
        """The model's bytes are in host ``h``'s RAM: load once, then copy to each GPU."""
        fill = self._fills.get(h)
        if fill is None:
            fill = self._fills[h] = _Fill(source="chain")
        self.engine.schedule_in(self.model.load_s, lambda: self._loaded(h))

    def _loaded(self, h: int) -> None:
        fill = self._fills.pop(h, None)
        self._cache[h].add(self.model.key)
        if fill is not None:
            for rid in fill.waiters:
                rep = self._replicas.get(rid)
                if rep is not None and rep.warm_s is None:
                    self._to_device(rep)
        self._report(h)

    def _private_done(self, rid: str) -> None:
        rep = self._replicas.get(rid)
        if rep is None:
            return
        rep.flow = None
        rep.pending = self.engine.schedule_in(self.model.load_s, lambda: self._private_loaded(rep))

    def _private_loaded(self, rep: _Replica) -> None:
        """A private copy is loaded in host RAM: GF keeps it there (lazy eviction) and says
        so, making the host a placement preference; BL's is the replica's alone."""
        if self.config.technique.keeps_models and self.model.key not in self._cache[rep.host]:
            self._cache[rep.host].add(self.model.key)
            self._report(rep.host)
        self._to_device(rep)

    def _to_device(self, rep: _Replica) -> None:
        rep.pending = self.engine.schedule_in(self.model.to_device_s, lambda: self._warm(rep.rid))

    def _warm(self, rid: str) -> None:
        rep = self._replicas.get(rid)
        if rep is None:
            return
        now = self.engine.now_s
        if rep.warm_s is None:
            self._started(rep.host)
        rep.warm_s, rep.pending = now, None
        if rep.stage is None:
            self.metrics.cold_starts_s.append(now - rep.deploy_s)
            self.metrics.cold_start_sources.append(rep.source)
            self.metrics.sources[rep.source] = self.metrics.sources.get(rep.source, 0) + 1
        else:  # a stage completed into a whole replica: its host holds the model now
            rep.completed = True
            self._cache[rep.host].add(self.model.key)
            self.metrics.completions += 1
        for cmd in self._feed(ev.ReplicaWarmed(rid, {"cold_start_s": now - rep.deploy_s}, now)):
            self._execute([cmd])
        if not self.config.technique.keeps_models:
            # No locality: the host keeps no copy once its GPUs have loaded it, and says so
            # (the controller learnt of the copy from ReplicaWarmed).
            if not self._starting.get(rep.host):
                self._cache[rep.host].discard(self.model.key)
            self._report(rep.host)
        if not rep.stopping:
            for _ in range(self.config.replica_concurrency):
                self._free.append(rid)
        self._dispatch()

    def _started(self, h: int) -> None:
        """A replica on host ``h`` left the starting phase (warm or stopped)."""
        self._n_starting -= 1
        left = self._starting[h] - 1
        if left:
            self._starting[h] = left
        else:
            del self._starting[h]

    def _report(self, h: int) -> None:
        """A heartbeat with the models host ``h`` holds (what makes it a sender under LC)."""
        cached = frozenset(self._cache[h]) if self.config.technique.keeps_models else frozenset()
        self._feed(ev.HostHeartbeat(_hid(h), cached, self.engine.now_s))

    def _stop(self, rid: str) -> None:
        rep = self._replicas.pop(rid, None)
        if rep is None:
            return
        self._stopping.pop(rid, None)
        if rep.warm_s is None:
            self._started(rep.host)
        if rep.pending is not None:
            self.engine.cancel(rep.pending)
        if rep.flow is not None:  # a private download nobody will use: stop it
            self.net.cancel_flow(rep.flow.flow_id)
        fill = self._fills.get(rep.host)
        if fill is not None and rid in fill.waiters:
            fill.waiters.remove(rid)
        self.metrics.replica_s += self.engine.now_s - rep.deploy_s
        self._inflight_check(rep)

    def _inflight_check(self, rep: _Replica) -> None:
        # A stopped replica holds nothing: the controller stops it only when idle.
        if rep.busy:
            raise AssertionError(f"replica {rep.rid} stopped with {rep.busy} in flight")


def _hid(h: int) -> str:
    return f"h{h}"


def _host(host_id: str) -> int:
    if host_id == REGISTRY:
        raise ValueError("the registry is not a host")
    return int(host_id[1:])


def partition_cost(model: ModelProfile, config: ClusterConfig) -> CostModel:
    """The cost model the plan table is solved with: worst case, non-local (thesis §4.2.2).

    A part's cold start is its bytes over the registry link, then loaded and copied to the
    GPU at the model's rates: all pro rata to bytes, so one effective rate. Intermediate
    tensors cross a host link."""
    per_byte_s = (8.0 / config.topology.cloud_bps + model.load_s / model.size_bytes
                  + model.to_device_s / model.size_bytes)
    return CostModel(bandwidth_bps=8.0 / per_byte_s, link_bps=config.topology.host_link_bps,
                     overhead_s=0.0, link_latency_s=config.link_latency_s)
