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
* **Chains** are one flow over the links of all hops (``network.chain_path``): cut-through
  relaying moves every hop at the chain's bottleneck rate and loads every hop's links with
  it; receiver ``i`` completes ``i × hop_delay_s`` after the head.
* **Requests** join one queue per function (the thesis's global pull queue, Sparrow-style);
  a warm replica takes the next request when it has a free credit; service time is the
  profile's (× the request's ``work``). No batching (the thesis's worker concurrency is 1).
* **Decision time** is charged in simulated time (seed 004 §9 note 2): commands returned
  by a tick take effect ``decision_s`` later, measured with ``perf_counter`` around
  ``ControllerState.handle`` (or fixed, for reproducible runs and tests).
* **Techniques** (BL, GF, LC, MC, LC+MC, MP, LC+MC+MP): :mod:`flashpoint.sim.cluster_config`
  says what each changes; **partitioned pipelines** (MP) are :mod:`flashpoint.sim.pipelines`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable

from flashpoint.controller.state import events as ev
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.rates import RateMeter
from flashpoint.partition.model import CostModel
from flashpoint.partition.table import PlanTable, plan_table
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.policy.sourcing import REGISTRY
from flashpoint.sim.cluster_config import ClusterConfig, Technique
from flashpoint.sim.engine import Engine, EventHandle
from flashpoint.sim.metrics import DecisionRecord, RunMetrics
from flashpoint.sim.models import ModelProfile
from flashpoint.sim.network import CLOUD, Flow, FlowNetwork, LinkId, LinkKind, Node, chain_path
from flashpoint.sim.pipelines import PipelineStages, partition_cost
from flashpoint.sim.replicas import HostFill, SimReplica, host_id, host_index
from flashpoint.sim.traces import RequestLog
from flashpoint.spec import FunctionSpec

__all__ = ["SimCluster"]


class SimCluster(PipelineStages):
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
        self._replicas: dict[str, SimReplica] = {}
        self._free: deque[str] = deque()  # warm replicas with a free credit (may be stale)
        # Indexes kept with _replicas so no per-tick or per-warm step scans every replica
        # (at 20,000 GPUs those scans dominated): replicas told to stop accepting, in order,
        # and per host the replicas still starting (not warm).
        self._stopping: dict[str, None] = {}
        self._starting: dict[int, int] = {}
        self._n_starting = 0  # Σ of _starting
        self._queue: deque[tuple[float, float]] = deque()  # (arrival_s, work)
        self._cache: list[set[str]] = [set() for _ in range(config.topology.n_hosts)]
        self._fills: dict[int, HostFill] = {}  # host -> fill of the one model
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
            self._feed(ev.HostRegistered(host_id(h), devices, self.config.host_ram_bytes,
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
                h = host_index(c.host_id)
                rep = self._replicas[c.replica_id] = SimReplica(c.replica_id, h, 0.0, warm_s=0.0,
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
                chains.append((host_index(c.sender), tuple(host_index(h) for h in c.receivers)))
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
        h = host_index(c.host_id)
        rep = SimReplica(c.replica_id, h, now)
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
            chain = CLOUD, (h, *(host_index(x) for x in src.chain))
        if key in self._cache[h]:
            rep.source = "local"
            self._to_device(rep)
            return chain
        fill = self._fills.get(h)
        if fill is not None:  # one download per host: join it
            fill.waiters.append(rep.rid)
            rep.source = fill.source
            return chain
        fill = self._fills[h] = HostFill([rep.rid])
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
            fill = self._fills[h] = HostFill(source="chain")
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

    def _private_loaded(self, rep: SimReplica) -> None:
        """A private copy is loaded in host RAM: GF keeps it there (lazy eviction) and says
        so, making the host a placement preference; BL's is the replica's alone."""
        if self.config.technique.keeps_models and self.model.key not in self._cache[rep.host]:
            self._cache[rep.host].add(self.model.key)
            self._report(rep.host)
        self._to_device(rep)

    def _to_device(self, rep: SimReplica) -> None:
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
        self._feed(ev.HostHeartbeat(host_id(h), cached, self.engine.now_s))

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

    def _inflight_check(self, rep: SimReplica) -> None:
        # A stopped replica holds nothing: the controller stops it only when idle.
        if rep.busy:
            raise AssertionError(f"replica {rep.rid} stopped with {rep.busy} in flight")
