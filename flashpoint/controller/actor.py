"""Controller: the cluster's one decision maker, plus the HTTP gateway it serves.

I/O only: RPC handlers and the control loop turn what they hear into events for
:class:`ControllerState` and execute the commands it returns. Requests travel through the
:class:`RequestPath` it owns (``requests.py``: per-function queues, credit-based dispatch to
warm replicas by :class:`Dispatcher`, retries, deadlines). It implements
:class:`flashpoint.gateway.backend.InvokeBackend` for the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import prometheus_client
from aiohttp import web
from prometheus_client import Counter

from flashpoint import heap, tracing
from flashpoint.actor import PROCESS_LOOP_LAG_INTERVAL_S, Actor
from flashpoint.audit import AuditLog
from flashpoint.config import ClusterConfig, check_http_auth, check_secret
from flashpoint.controller.cold_timings import ColdStartMarks
from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.functions import FunctionCatalog
from flashpoint.controller.gateway_service import GatewayService
from flashpoint.controller.handles import HostHandle, WorkerHandle
from flashpoint.controller.kaas_pool import KaasPool
from flashpoint.controller.metrics import ControllerMetrics, state_registry
from flashpoint.controller.mig_driver import MigDriver
from flashpoint.controller.migration import Migrator
from flashpoint.controller.persist import FunctionTable
from flashpoint.controller.pipeline_groups import PipelineGroups
from flashpoint.controller.profiler import Profiler
from flashpoint.controller.requests import RequestPath
from flashpoint.controller.state import events as cs  # the state's events and commands
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.records import GroupPhase, ReplicaPhase
from flashpoint.controller.status import cluster_status
from flashpoint.controller.token_metrics import TokenLedger
from flashpoint.controller.ui_journal import UiJournal
from flashpoint.errors import (
    BadRequest,
    DeadlineExceeded,
    FlashpointError,
    Forbidden,
    PeerLost,
)
from flashpoint.gateway.backend import FunctionInfo, InvokeResult, StreamChunk
from flashpoint.gateway.streams import StreamRegistry
from flashpoint.kaas import KAAS_FUNCTION
from flashpoint.log import get_logger
from flashpoint.messages import controller_host as ch
from flashpoint.messages import controller_worker as cw
from flashpoint.messages.base import handler, to_payload
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.policy.request_class import RequestClass
from flashpoint.policy.share_placement import ReplicaShare
from flashpoint.policy.sourcing import REGISTRY
from flashpoint.rpc import roles
from flashpoint.rpc.tls import server_context
from flashpoint.spec import FunctionSpec
from flashpoint.spot.cost import TABLE3_PRICES, CostMeter
from flashpoint.spot.provider import HostProvider, replace_host

log = get_logger("flashpoint.controller")

WORKERS_SILENT = Counter("flashpoint_workers_silent_total",
                         "Workers dropped for missing a ping on their connection")

class Controller(Actor):
    """The controller actor. Its background tasks (the control loop, deploys, chains, request
    sends, worker watches) are owned by the :class:`~flashpoint.actor.Actor` base."""

    # invoke() fails a request at its deadline (RequestPath's call_later expiry, never later
    # than the timeout_s it was given), so the gateway needs no backstop timer around it.
    enforces_deadline = True

    def __init__(self, config: ClusterConfig, store: Any) -> None:
        super().__init__("controller", loop_lag_interval_s=PROCESS_LOOP_LAG_INTERVAL_S)
        self.config = config
        self.cc = config.controller
        self.store = store
        self.state = ControllerState(heartbeat_timeout_s=self.cc.heartbeat_timeout_s,
                                     cold_start_timeout_s=self.cc.cold_start_timeout_s,
                                     replica_overhead_bytes=self.cc.replica_overhead_bytes,
                                     stop_unknown_replicas=self.cc.stop_unknown_replicas,
                                     process_bytes=config.host.worker_memory_bytes,
                                     autoscaler=make_autoscaler(self.cc.autoscaler,
                                                                self.cc.autoscaler_params),
                                     max_chain_length=self.cc.max_chain_length,
                                     drain_margin_s=self.cc.drain_margin_s,
                                     share_policy=self.cc.share_policy,
                                     kaas_replicas=self.cc.kaas_workers,
                                     kaas_cache_bytes=self.cc.kaas_cache_bytes,
                                     max_start_failures=self.cc.max_start_failures,
                                     start_backoff_s=self.cc.start_backoff_s,
                                     start_backoff_max_s=self.cc.start_backoff_max_s)
        self.state.epoch = f"{int(time.time()) % 100000:05d}-"
        self.dispatcher = Dispatcher(self.cc.slice_dispatch, self.cc.protean_t_low,
                                     self.cc.protean_t_high)
        self.streams = StreamRegistry()  # streamed generation requests (gateway/streams.py)
        self.tokens = TokenLedger()  # generation load and metrics in tokens (token_metrics.py)
        self.kaas = KaasPool(self.cc, lambda: self.state.kaas_broken)
        self.hosts: dict[str, HostHandle] = {}
        self.workers: dict[str, WorkerHandle] = {}
        self._conn_replica: dict[int, str] = {}
        self._runner: web.AppRunner | None = None
        self._rpc: Any = None
        self.url = ""
        self.rpc_url = ""
        self._started_s = time.monotonic()
        self._wake = asyncio.Event()
        self.ui = UiJournal()  # recent history for the dashboard (/ui)
        self.metrics = ControllerMetrics()  # cold starts, failed starts, hosts lost (Prometheus)
        # replica id -> when its start was decided, placed, acknowledged, announced
        # (controller/cold_timings.py); dropped when the replica is forgotten
        self._cold_marks: dict[str, ColdStartMarks] = {}
        self._step_s = 0.0  # when the control step (tick or event) now running began
        self.provider: HostProvider | None = None  # replacement hosts on eviction, if any
        prices = dict(TABLE3_PRICES.get(self.cc.cloud, TABLE3_PRICES["aws"]))
        if self.cc.spot_price_usd_per_hour > 0:
            prices["spot"] = self.cc.spot_price_usd_per_hour
        if self.cc.ondemand_price_usd_per_hour > 0:
            prices["ondemand"] = self.cc.ondemand_price_usd_per_hour
        self.cost = CostMeter(prices)
        self.replacements: list[dict[str, Any]] = []  # what the provider gave, per eviction
        # PROTEAN's MIG reconfigurator (controller/state/mig_reconfig.py), when opted in
        self.mig = MigDriver(self.cc, self.state, self.hosts, self._execute, self.spawn,
                             time.monotonic, AuditLog(config.gateway.audit_log_path),
                             ) if self.cc.mig_reconfigure else None
        # The function table, its manifests and plan tables (controller/functions.py).
        self.functions = FunctionCatalog(
            self.cc, store, self.state, self.dispatcher,
            FunctionTable(Path(self.cc.state_path).expanduser()), self._apply, self._wake.set,
            lambda name: self.requests.forget(name))
        self.requests = RequestPath(self.cc, self.state, self.dispatcher, self.workers,
                                    self.streams, self._cold_marks, self.mig, self.spawn,
                                    self._wake.set, self._started_s, self.ui,
                                    self.tokens, self.functions.manifests, self.metrics)
        # partitioned scale-up groups: link, completion, dissolve (controller/pipeline_groups.py)
        self.groups = PipelineGroups(self.config.secret, self.state, self.functions, self.hosts,
                                     self.workers, self._apply, self.streams.on_chunk)
        # trial-driven FaST / PROTEAN / Dilu profiles (controller/profiler.py)
        self.profiler = Profiler(self.functions, self.state, self.requests, self.hosts,
                                 self._apply, self._wake.set)
        # live migration of streamed generations off leaving replicas (controller/migration.py)
        self.requests.migration = self.migration = Migrator(
            self.state, self.dispatcher, self.streams, self.workers, self.spawn,
            self.requests.send, self.requests.pump, park_wait_s=self.cc.migration_park_wait_s,
            park_ttl_s=self.cc.migration_park_ttl_s, park_rounds=self.cc.migration_park_rounds,
            park_min_tokens=self.cc.migration_park_min_tokens)

    # lifecycle ---------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Restore the function table, listen (HTTP API and RPC), start the control loop."""
        from flashpoint.gateway.app import RUNNER_KWARGS, add_routes
        from flashpoint.rpc import RpcServer

        # With tracing on, each invoke runs in its own span (off: the plain method, no cost).
        # (RequestPath's: its streamed requests go through it too)
        tracing.trace_method(self.requests, "invoke", "flashpoint.controller.invoke",
                             lambda name, *_, **kw: {"flashpoint.function": name,
                                                     "flashpoint.request_id": kw.get("request_id", "")})
        check_secret(self.config.secret, self.cc.listen_host, "the controller")
        check_http_auth(self.config.gateway.api_keys, self.cc.listen_host, self.config.insecure,
                        "the controller's HTTP API")
        await self.functions.table.open()
        for spec in await self.functions.table.load():
            try:
                await self.functions.apply_function(spec, persist=False)
            except FlashpointError as exc:
                log.error("function_restore_failed", function=spec.name, error=exc.to_wire())
            except Exception as exc:  # one bad function must not stop the controller starting
                log.error("function_restore_failed", function=spec.name, error=repr(exc)[:300])
        tls = server_context(self.cc.tls_cert_path, self.cc.tls_key_path, setting="controller")
        gw = self.config.gateway
        app = web.Application(client_max_size=gw.max_body_bytes)
        add_routes(app, self, gw, kaas=self.kaas, profiler=self.profiler,
                   process_registry=prometheus_client.REGISTRY).metrics.also += (state_registry(
                       self.state, self.dispatcher.queued, self.dispatcher.inflight),)
        # Each peer proves its own key and may call only what its role needs (rpc/roles.py).
        self._rpc = RpcServer(
            roles.guard({"register_host": handler(ch.RegisterHost, self._register_host),
             "heartbeat": handler(ch.Heartbeat, self._heartbeat),
             "replica_ready": handler(cw.ReplicaReady, self._replica_ready, "replica_ready"),
             "replica_failed": handler(ch.ReplicaFailed, self._replica_failed),
             "stage_ready": handler(ch.StageReady, self._stage_ready),
             "host_draining": handler(ch.HostDraining, self._host_draining),
             "gen_chunk": self.tokens.relay(self.streams.on_chunk, time.monotonic),
             **GatewayService(self, self.kaas).handlers()}),
            secret=roles.controller_keyring(self.config.secret.encode()),
            on_disconnect=self._on_disconnect,
        )
        self._rpc.add_to_app(app, "/rpc")
        self._runner = web.AppRunner(app, access_log=None, **RUNNER_KWARGS)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cc.listen_host, self.cc.listen_port,
                           ssl_context=tls)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if tls else 'http'}://{self.cc.listen_host}:{port}"
        self.rpc_url = f"{'wss' if tls else 'ws'}://{self.cc.listen_host}:{port}/rpc"
        heap.settle()  # start-up objects out of the collector's scans (flashpoint/heap.py)
        self.spawn(self._control_loop(), "control-loop")
        log.info("controller_started", url=self.url, functions=len(self.state.functions))

    async def on_stop(self, timeout_s: float) -> None:
        """After the base cancelled every task: fail what is queued, close the listeners."""
        for name in list(self.state.functions):
            self.requests.fail_queue(name, FlashpointError("controller shutting down"))
        await self.kaas.close()
        if self._rpc is not None:
            await self._rpc.stop(timeout_s=2.0)
        if self._runner is not None:
            await self._runner.cleanup()

    # control loop ------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cc.loop_interval_s)
            self._wake.clear()
            try:
                self._tick()
            except Exception:  # a failed step must never end the loop
                log.exception("control_step_failed")

    def _tick(self) -> None:
        now = self._step_s = time.monotonic()
        loads = self.requests.loads(now)
        idle = frozenset(
            r.replica_id for r in self.state.replicas.values()
            if r.phase == ReplicaPhase.STOPPING and self.dispatcher.inflight_of(r.replica_id) == 0
        ) | frozenset(
            g.group_id for g in self.state.groups.values()
            if g.phase == GroupPhase.STOPPING and self.dispatcher.inflight_of(g.group_id) == 0
        )
        self._execute(self.state.handle(cs.Tick(now, loads, idle)))
        self.migration.step(now)
        if self.mig is not None:
            self.mig.step(now)
        for h in self.state.hosts.values():
            if not h.alive:
                self.cost.stop(h.host_id, now)
        self.requests.fail_unplaceable(now)

    def _apply(self, event: cs.Event) -> None:
        self._step_s = time.monotonic()
        self.metrics.event(event)
        self._execute(self.state.handle(event))

    def _execute(self, cmds: list[cs.Command]) -> None:
        self.ui.observe(cmds, self.state, time.monotonic())
        self.metrics.commands(cmds, self.state)
        if self.stopping:  # shutting down (connections closing): start nothing new
            return
        for cmd in cmds:
            match cmd:
                case cs.DeployReplica() | cs.DeployKaas():
                    self._cold_marks[cmd.replica_id] = ColdStartMarks(self._step_s,
                                                                      time.monotonic())
                    self.spawn(self._deploy(cmd), f"deploy:{cmd.replica_id}")
                case cs.StartChain():
                    self.spawn(self._start_chain(cmd), f"chain:{cmd.transfer_id}")
                case cs.StopAccepting():
                    self.dispatcher.stop_accepting(cmd.replica_id)
                    self.migration.soon()  # its streams move (controller/migration.py)
                case cs.StopReplica():
                    host = self.hosts.get(cmd.host_id)
                    if host is not None:
                        self.spawn(self._stop_on_host(host, cmd.replica_id), f"stop:{cmd.replica_id}")
                case cs.ForgetReplica():
                    self.dispatcher.remove_replica(cmd.replica_id)
                    self.requests.forget_replica(cmd.replica_id)
                    self.kaas.replica_gone(cmd.replica_id)
                    self.groups.forget(cmd.replica_id)
                    self._cold_marks.pop(cmd.replica_id, None)
                    handle = self.workers.pop(cmd.replica_id, None)
                    if handle is not None:
                        self._conn_replica.pop(id(handle.conn), None)
                        self.spawn(handle.conn.close(), f"close:{cmd.replica_id}")
                case cs.FailFunction():
                    self.requests.fail_function(cmd)
                case cs.LinkGroup():
                    self.spawn(self.groups.link(cmd), f"link:{cmd.group_id}")
                case cs.ServeGroup():
                    if cmd.group_id in self.workers:
                        self.dispatcher.add_replica(cmd.group_id, cmd.function, cmd.credits)
                        log.info("group_serving", group_id=cmd.group_id, function=cmd.function)
                case cs.DissolveStages():
                    self.spawn(self.groups.dissolve(cmd), f"dissolve:{cmd.group_id}")
                case cs.BeginCompletion():
                    self.spawn(self.groups.begin_completion(cmd), f"complete:{cmd.group_id}")
                case cs.RequestHost():
                    self.spawn(self._replace_host(cmd.replacing), f"replace:{cmd.replacing}")
                case cs.RouteCanary():
                    self.dispatcher.set_canary(cmd.function, cmd.model_key, cmd.pct)
                    log.info("canary_routed", function=cmd.function, model=cmd.model_key,
                             pct=cmd.pct)
        self._sync_dispatch()

    def _sync_dispatch(self) -> None:
        """Every warm replica with a live worker handle is dispatchable (a KaaS executor's
        joins the KaaS pool, whichever came first: its report or its host's); then pump."""
        for rep in self.state.replicas.values():
            if rep.phase == ReplicaPhase.WARM and rep.function == KAAS_FUNCTION \
                    and (w := self.workers.get(rep.replica_id)) is not None:
                self.kaas.ensure(rep.replica_id, w.conn)
            elif rep.phase == ReplicaPhase.WARM and rep.replica_id in self.workers \
                    and not self.dispatcher.has_replica(rep.replica_id):
                fn = self.state.functions.get(rep.function)
                if fn is not None:  # on a MIG slice, PROTEAN's Alg. 1 routes to it
                    self.dispatcher.add_replica(
                        rep.replica_id, rep.function, fn.spec.replica_concurrency,
                        rep.model_key, slice_id=f"{rep.host_id}/{rep.device_id}",
                        mig_profile=self.state.mig_profile(rep.host_id, rep.device_id),
                        fbr=fn.spec.batch_fbr / fn.spec.max_batch_size)
        for name in self.state.functions:
            self.requests.pump(name)

    async def _deploy(self, cmd: cs.DeployReplica | cs.DeployKaas) -> None:
        host = self.hosts.get(cmd.host_id)
        try:
            if host is None:
                raise FlashpointError(f"host {cmd.host_id} has no connection")
            if isinstance(cmd, cs.DeployKaas):
                await host.deploy_kaas(cmd)
                return
            manifest = await self.functions.manifest(cmd.spec.model, cmd.spec.model_version)
            await host.deploy(cmd, self._resolve_source(cmd.source), manifest)
            if (marks := self._cold_marks.get(cmd.replica_id)) is not None:
                marks.deployed_s = time.monotonic()
        except FlashpointError as exc:
            log.warning("deploy_failed", replica_id=cmd.replica_id, error=exc.to_wire())
            self._apply(cs.ReplicaFailed(cmd.replica_id, exc.message, during_start=True,
                                         code=exc.code, now_s=time.monotonic()))

    def _endpoints(self, host_ids: tuple[str, ...]) -> list[Any]:
        """Data-plane endpoints for host ids; ``registry`` stays a name; unknown hosts drop out."""
        out: list[Any] = []
        for h in host_ids:
            if h == REGISTRY:
                out.append(REGISTRY)
            elif (handle := self.hosts.get(h)) is not None and handle.data_endpoint is not None:
                out.append(handle.data_endpoint)
        return out

    def _resolve_source(self, src: cs.SourceAssignment | None) -> ch.SourcePlan | None:
        """The state's source assignment as the host's typed plan, hosts as endpoints."""
        if src is None:
            return None
        return ch.source_plan(src.kind, transfer_id=src.transfer_id, sender=src.sender,
                              chain=tuple(self._endpoints(src.chain)),
                              upstream=tuple(self._endpoints(src.upstream)),
                              fallback=tuple(self._endpoints(src.fallback)))

    async def _start_chain(self, cmd: cs.StartChain) -> None:
        # A sender that cannot start leaves its receivers to their fallback sources (they wait
        # only a bounded time for the chain to reach them).
        host = self.hosts.get(cmd.sender)
        try:
            if host is None:
                raise FlashpointError(f"host {cmd.sender} has no connection")
            # The registry's manifest is pinned: every receiver is told to expect this
            # transfer with this digest before the sender starts (a receiver refuses a chain
            # it was not told of), and the sender sends only a copy with this digest.
            digest = (await self.functions.manifest(cmd.model, cmd.version)).digest
            receivers = [h for h in cmd.receivers if h in self.hosts]
            announced = await asyncio.gather(
                *(self.hosts[h].expect_transfer(cmd.transfer_id, digest) for h in receivers),
                return_exceptions=True)
            for h, res in zip(receivers, announced, strict=True):
                if isinstance(res, BaseException):  # it will refuse the chain and pull instead
                    log.warning("expect_transfer_failed", transfer_id=cmd.transfer_id, host=h,
                                error=repr(res)[:200])
            await host.start_chain(cmd, self._endpoints(cmd.receivers),
                                   self._endpoints(cmd.fallback), digest)
            log.info("chain_started", transfer_id=cmd.transfer_id, sender=cmd.sender,
                     receivers=list(cmd.receivers))
        except FlashpointError as exc:
            log.warning("chain_start_failed", transfer_id=cmd.transfer_id, error=exc.to_wire())

    async def _replace_host(self, replacing: str) -> None:
        """PROTEAN's procurement: another spot host, else an on-demand one."""
        if self.provider is None:
            log.warning("no_host_provider", replacing=replacing)
            return
        try:
            host_id, kind = await asyncio.wait_for(replace_host(self.provider, replacing), 300)
        except (FlashpointError, TimeoutError) as exc:
            log.error("replacement_failed", replacing=replacing, error=repr(exc))
            self.replacements.append({"replacing": replacing, "error": repr(exc)})
            return
        self.replacements.append({"replacing": replacing, "host_id": host_id, "kind": kind})
        log.info("host_replaced", replacing=replacing, host_id=host_id, kind=kind)

    async def _stop_on_host(self, host: HostHandle, replica_id: str) -> None:
        try:
            await host.stop(replica_id)
        except FlashpointError as exc:
            log.warning("stop_failed", replica_id=replica_id, error=exc.code)

    # RPC handlers ------------------------------------------------------------------------
    async def _register_host(self, conn: Any, msg: ch.RegisterHost) -> ch.Ack:
        host_id = msg.host_id
        roles.check_host(conn, host_id)
        self.hosts[host_id] = HostHandle(conn, msg.data_endpoint)
        devices = tuple(cs.DeviceRecord(d.device_id, d.kind, d.memory_bytes, d.gpu_index,
                                        d.mig_profile) for d in msg.devices)
        gpus = tuple(cs.GpuRecord(int(g["gpu_index"]), str(g.get("model") or ""), bool(g.get("mig")))
                     for g in msg.gpus if "gpu_index" in g)
        replicas = tuple(r for r in msg.replicas
                         # a host reports only its own replicas, never another host's
                         if (k := self.state.replicas.get(r[0])) is None or k.host_id == host_id)
        for r in replicas:  # a worker of another host claimed one of these before we knew it
            if (w := self.workers.get(r[0])) is not None and getattr(w, "host_id", host_id) != host_id:
                self.workers.pop(r[0], None)
        self._apply(cs.HostRegistered(host_id, devices, msg.ram_bytes,
                                      frozenset(msg.cached_models), replicas, time.monotonic(),
                                      msg.leaf, msg.gpu_sharing or "none",
                                      _shares(msg.shares), gpus, dict(msg.models)))
        kind = msg.kind if msg.kind in ("spot", "ondemand") else "ondemand"
        self.cost.start(host_id, kind, time.monotonic())
        log.info("host_registered", host_id=host_id, devices=len(devices), replicas=len(replicas))
        return ch.Ack()

    async def _heartbeat(self, conn: Any, msg: ch.Heartbeat) -> None:
        host_id = msg.host_id
        roles.check_host(conn, host_id)
        if host_id not in self.state.hosts:
            return
        handle = self.hosts.get(host_id)
        if handle is None:
            handle = self.hosts[host_id] = HostHandle(conn, msg.data_endpoint)
        else:
            handle.conn = conn
        handle.transfers = dict(msg.transfers)
        if msg.draining_s is not None and not self.state.hosts[host_id].draining:
            # The host's own report was lost (or we restarted): its heartbeat says it too.
            await self._host_draining(conn, ch.HostDraining(host_id=host_id,
                                                            remaining_s=msg.draining_s))
        self._apply(cs.HostHeartbeat(host_id, frozenset(msg.cached_models), time.monotonic(),
                                     frozenset(msg.replicas) if msg.replicas is not None else None))

    async def _replica_ready(self, conn: Any, msg: cw.ReplicaReady) -> cw.Ok:
        rid = msg.replica_id
        host_id = self._check_replica_host(conn, rid, msg.host_id)
        timings = dict(msg.timings_s)
        if (marks := self._cold_marks.get(rid)) is not None and not marks.ready_s:
            marks.ready_s = time.monotonic()
        self.workers[rid] = WorkerHandle(conn, host_id, timings, msg.source)
        if id(conn) not in self._conn_replica:  # a new connection: watch it until it closes
            self.spawn(self._watch_worker(rid, conn), f"watch:{rid}")
        self._conn_replica[id(conn)] = rid
        known = self.state.replicas.get(rid)
        self.metrics.replica_ready(rid, known.function if known is not None else "",
                                   msg.source, timings,
                                   known is not None and known.phase == ReplicaPhase.STARTING)
        self._apply(cs.ReplicaWarmed(rid, timings, time.monotonic()))
        log.info("replica_warm", replica_id=rid, timings=timings)
        return cw.Ok()

    def _check_replica_host(self, conn: Any, rid: str, host_id: str) -> str:
        """A host or worker may speak only for replicas placed on its own host (one the
        controller does not know yet, after its restart, only in its host's name)."""
        me = roles.principal_of(conn)
        if me.role is roles.Role.ADMIN:
            return host_id
        rep = self.state.replicas.get(rid)
        if (rep.host_id if rep is not None else host_id or me.host_id) != me.host_id:
            raise Forbidden(f"{me} may not speak for replica {rid!r}")
        return me.host_id

    async def _stage_ready(self, conn: Any, msg: ch.StageReady) -> ch.Ack:
        rid = msg.replica_id
        self._check_replica_host(conn, rid, msg.host_id)
        self.groups.stage_ready(rid, list(msg.pipeline_endpoint), dict(msg.timings_s))
        log.info("stage_ready", replica_id=rid, source=msg.source, timings=msg.timings_s)
        self._apply(cs.StageReady(rid, time.monotonic()))
        return ch.Ack()

    async def _host_draining(self, conn: Any, msg: ch.HostDraining) -> ch.Ack:
        roles.check_host(conn, msg.host_id)
        log.warning("host_draining", host_id=msg.host_id, remaining_s=round(msg.remaining_s, 1),
                    action=msg.action or None)
        now = time.monotonic()
        self._apply(cs.HostDraining(msg.host_id, now + max(0.0, msg.remaining_s), now))
        return ch.Ack()

    async def _replica_failed(self, conn: Any, msg: ch.ReplicaFailed) -> ch.Ack:
        self._check_replica_host(conn, msg.replica_id, msg.host_id)
        self._apply(cs.ReplicaFailed(msg.replica_id, msg.reason, msg.during_start,
                                     code=msg.code or "start_failed", now_s=time.monotonic()))
        return ch.Ack()

    async def _watch_worker(self, rid: str, conn: Any) -> None:
        """Ping a worker on its own connection until the connection closes.

        A worker that misses one ping (stopped, wedged, cut off while its socket stays open)
        is silent: its connection is closed here, which fails its in-flight calls with
        PeerLost (``_send`` re-queues those requests for another replica, within their
        deadlines) and reports the replica lost (``_on_disconnect``). Detection takes at most
        ``worker_ping_interval_s + worker_ping_timeout_s`` instead of the websocket's 10 s.
        """
        interval_s, timeout_s = self.cc.worker_ping_interval_s, self.cc.worker_ping_timeout_s
        while not conn.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.wait_closed(), interval_s)
                return
            try:
                await conn.call("ping", to_payload(cw.Ping()), timeout_s=timeout_s)
            except DeadlineExceeded:
                log.warning("worker_silent", replica_id=rid, timeout_s=timeout_s)
                WORKERS_SILENT.inc()
                self._on_disconnect(conn)  # no new work for it from now on, not after close
                await conn.close()  # fails its in-flight calls first; the close is bounded
                return
            except PeerLost:
                return
            except FlashpointError as exc:  # e.g. a worker too old to answer pings
                log.warning("worker_ping_failed", replica_id=rid, error=exc.to_wire())
                return

    def _on_disconnect(self, conn: Any) -> None:
        rid = self._conn_replica.pop(id(conn), None)
        if rid is not None and self.workers.get(rid) is not None and self.workers[rid].conn is conn:
            self.workers.pop(rid, None)
            self.kaas.replica_gone(rid)
            self.dispatcher.remove_replica(rid)
            self._apply(cs.ReplicaFailed(rid, "worker connection lost", during_start=False,
                                         code="peer_lost", now_s=time.monotonic()))


    # requests (controller/requests.py) ----------------------------------------------------
    def invoke(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
               timeout_s: float | None = None, request_class: str = RequestClass.STRICT,
               stream: bool = False) -> Coroutine[Any, Any, InvokeResult]:
        """Run ``name`` on ``inputs`` (await it for the result): :meth:`RequestPath.invoke`.
        Its coroutine is returned as is, so the hot path pays no extra await."""
        return self.requests.invoke(name, inputs, request_id=request_id, timeout_s=timeout_s,
                                    request_class=request_class, stream=stream)

    def invoke_stream(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                      timeout_s: float | None = None,
                      request_class: str = RequestClass.STRICT
                      ) -> AsyncIterator[StreamChunk | InvokeResult]:
        """A text-generation request's token chunks as they come, then its result
        (:meth:`RequestPath.invoke_stream`)."""
        return self.requests.invoke_stream(name, inputs, request_id=request_id,
                                           timeout_s=timeout_s, request_class=request_class)

    # functions (controller/functions.py) -------------------------------------------------
    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        """Register (or update) ``spec``: :meth:`FunctionCatalog.register`."""
        return await self.functions.register(spec)

    async def delete_function(self, name: str) -> None:
        """Delete function ``name``: :meth:`FunctionCatalog.delete`."""
        await self.functions.delete(name)

    def list_functions(self) -> list[FunctionInfo]:
        """Every registered function's info."""
        return self.functions.infos()

    def function_spec(self, name: str) -> FunctionSpec:
        """Function ``name``'s spec (FunctionNotFound when it is not registered)."""
        return self.functions.spec(name)

    def get_function(self, name: str) -> FunctionInfo:
        """Function ``name``'s info (FunctionNotFound when it is not registered)."""
        return self.functions.get(name)

    def cluster_status(self) -> dict[str, Any]:
        """The cluster as ``/v1/cluster`` and the dashboard show it (controller/status.py)."""
        now = time.monotonic()
        return cluster_status(self, now_s=now, uptime_s=now - self._started_s)

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return any(h.alive for h in self.state.hosts.values())


def _shares(wire: dict[str, Any]) -> dict[str, ReplicaShare]:
    """A host's ``shares`` report (replica id -> share); a malformed entry is dropped (its
    replica is then treated as unshared, which only makes placement more careful)."""
    out: dict[str, ReplicaShare] = {}
    for rid, share in wire.items():
        with contextlib.suppress(BadRequest):
            out[rid] = ReplicaShare.from_wire(share)
    return out
