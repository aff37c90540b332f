"""HostManager: owns one machine — devices, the model cache, and worker processes.

It never makes cluster-wide decisions: it registers with the controller (again after every
reconnect, reporting the replicas it runs so a restarted controller adopts them), heartbeats,
and carries out ``deploy_replica`` / ``stop_replica``. Deploys are idempotent by replica id
and acknowledged at once; the cold start runs in the background and ends with the worker
announcing itself to the controller, or with ``replica_failed``.

Partition stages (issue 4): a deploy with ``stage: [first, last]`` starts as soon as that
stage's bytes are in (execute-while-load). With ``pipeline: {"listen_host", "port" (0: any),
"next_hop" (an endpoint's wire form, or None for the last stage)}`` its worker serves a
StageServer instead of announcing to the controller's dispatch; the bound endpoint is kept
on the replica and reported (``stages`` in ``register_host`` and ``host_status``; the
4-tuples of ``replicas`` are unchanged). Model completion: when this host's copy of the
model is complete, every stage worker on it gets ``complete_replica``: it builds the whole
module over the bytes it already maps and announces itself to the controller as a whole
replica (``replica_ready``, same replica id), while its stage server keeps serving (no
pipeline request in flight fails because of completion) until ``dissolve_stage``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashpoint import heap
from flashpoint.actor import PROCESS_LOOP_LAG_INTERVAL_S, Actor
from flashpoint.config import ClusterConfig, check_secret
from flashpoint.errors import BadRequest, FlashpointError, NotFound, Unavailable
from flashpoint.exposition import MetricsEndpoint
from flashpoint.gpu.inventory import Device
from flashpoint.host import reports
from flashpoint.host import state as hs
from flashpoint.host.controller_link import ControllerLink
from flashpoint.host.gpu import HostGpu
from flashpoint.host.metrics import host_collectors
from flashpoint.host.stage_hold import StageHolds
from flashpoint.host.workers import WorkerPool, WorkerProcess
from flashpoint.log import bind_ids, get_logger
from flashpoint.messages import controller_host as ch
from flashpoint.messages import host_worker as hw
from flashpoint.messages.base import Message, from_payload, handler, to_payload
from flashpoint.registry.manifest import Manifest
from flashpoint.rpc import roles
from flashpoint.spec import FunctionSpec
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.cache import HostCache, default_cache_dir
from flashpoint.transfer.obtain import ModelObtainer, ObtainOptions, pinned_digest
from flashpoint.transfer.plan import Endpoint

log = get_logger("flashpoint.host")

@dataclass
class ReplicaTask:
    """The I/O side of one replica (its record is ``HostState.replicas[replica_id]``)."""

    replica_id: str
    device_id: str
    stage: Any = None  # (first, last) layer of a partition stage, or None for a whole model
    task: asyncio.Task | None = None
    worker: WorkerProcess | None = None
    started_s: float = field(default_factory=time.monotonic)
    pipeline: dict[str, Any] | None = None  # a stage's pipeline options for its worker
    pipeline_endpoint: Endpoint | None = None  # where its StageServer listens, once started
    env: dict[str, str] = field(default_factory=dict)  # its worker's GPU env (host/gpu.py)
    weight_slot: dict[str, Any] | None = None  # where its weights are shared (CUDA IPC)


class HostManager(Actor):
    """The per-host actor. Its background tasks (refill, heartbeat, cold starts, worker
    watches, transfers) are owned by the :class:`~flashpoint.actor.Actor` base."""

    def __init__(self, config: ClusterConfig, store: Any, *, host_id: str | None = None) -> None:
        self.config = config
        self.hc = config.host
        self.store = store
        self.host_id = host_id or self.hc.host_id or socket.gethostname()
        super().__init__(f"host:{self.host_id}", loop_lag_interval_s=PROCESS_LOOP_LAG_INTERVAL_S)
        # Its own credential for the controller (rpc/roles.py); with one from the environment
        # the configured secret is the data plane's key, else the cluster secret to derive from.
        self.credential, given = roles.credential_from_env(
            roles.host_principal(self.host_id), config.secret.encode())
        self.secret = config.secret.encode() if given else roles.data_key(config.secret.encode())
        cache_dir = (Path(self.hc.cache_dir) / self.host_id if self.hc.cache_dir
                     else default_cache_dir(f"{self.host_id}-{os.getpid()}"))
        self.cache = HostCache(cache_dir, self.hc.cache_bytes, self.host_id,
                               memory_bytes=self.hc.host_memory_bytes)
        self.dataplane: Any = None
        # Chains this host may receive: only those the controller announced, carrying the
        # manifest it pinned (transfer/admission.py).
        self.admission = TransferAdmission(ttl_s=2 * self.config.controller.deploy_timeout_s)
        self.data_endpoint: Endpoint | None = None
        self._registry_source: Any = None
        self.bytes: ModelObtainer | None = None  # model-bytes orchestration, once started
        self.devices: list[Device] = []
        self.gpu = HostGpu(self.hc, self.host_id)  # inventory, MPS/tokens, MIG (host/gpu.py)
        self.state = hs.HostState(self.host_id, self.hc.warm_pool_size)
        self.replicas: dict[str, ReplicaTask] = {}
        self._server: Any = None
        self.metrics: MetricsEndpoint | None = None  # [host] metrics_listen
        self._local_url = ""
        self._controller: ControllerLink | None = None
        # A stage's completion fill and pool refill wait for its group's first answer.
        self.stage_holds = StageHolds(self.hc.completion_hold_s)
        # The worker processes and the warm pool (host/workers.py); ``workers`` is its map.
        self.pool = WorkerPool(self.hc, self.host_id, self.state, credential=self.credential,
                               secret=self.secret, holds=self.stage_holds, spawn=self.spawn,
                               spawn_env=self.gpu.spawn_env, on_exit=self._worker_exited)
        self.workers = self.pool.workers
        self._stop_timeout_s = 10.0
        self._stop_task: asyncio.Future | None = None
        self.notice: Any = None  # the EvictionNotice once one arrived
        self.evicted = asyncio.Event()  # set when this host has left (its deadline passed)

    # lifecycle ---------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Inventory the devices, open the cache and data plane, listen for workers, fill
        the warm pool, register with the controller and start heartbeats."""
        from flashpoint.rpc import RpcServer

        bind_ids(host_id=self.host_id)
        check_secret(self.config.secret, self.hc.data_listen_host, f"host {self.host_id}'s data plane")
        if self.hc.tls_ca_path:
            from flashpoint.rpc.client import TLS_CA_ENV

            # This process's RPC clients and the workers it spawns trust the cluster's CA.
            os.environ[TLS_CA_ENV] = self.hc.tls_ca_path
        from flashpoint.transfer.sources import RegistrySource

        # Before the warm pool: a tokens host starts its workers with the hook preloaded.
        self._set_devices(await self.gpu.start())
        self.cache.start()
        self._registry_source = RegistrySource(self.store, span_bytes=self.hc.registry_span_bytes)
        self.bytes = ModelObtainer(
            self.cache, self.store, self._registry_source, secret=self.secret,
            host_id=self.host_id, admission=self.admission, holds=self.stage_holds,
            spawn=self.spawn, options=ObtainOptions(
                deploy_timeout_s=self.config.controller.deploy_timeout_s,
                chain_wait_s=self.hc.chain_wait_s,
                chain_stall_timeout_s=self.hc.chain_stall_timeout_s,
                orphan_grace_s=self.hc.orphan_grace_s))
        self.dataplane, self.data_endpoint = await self.bytes.start_data_plane(
            self.hc.data_listen_host, self.hc.data_port, self.hc.data_advertise_host)
        self._server = RpcServer({"worker_hello": handler(hw.WorkerHello, self.pool.hello,
                                                          "worker_hello"),
                                  "replica_served": handler(hw.ReplicaServed,
                                                            self.pool.served,
                                                            "replica_served")},
                                 secret=roles.host_keyring(self.host_id, self.credential.key))
        host, port = await self._server.start(self.hc.listen_host, 0)
        self._local_url = self.pool.local_url = f"ws://{host}:{port}/rpc"
        self.spawn(self.pool.refill(), "refill")
        self._controller = ControllerLink(
            self.hc.controller_url,
            {"deploy_replica": self._deploy,
             "stop_replica": handler(ch.StopReplica, self._stop_replica),
             "start_chain": handler(ch.StartChain, self._start_chain),
             "expect_transfer": handler(ch.ExpectTransfer, self._expect_transfer),
             "host_status": handler(ch.HostStatusRequest, self._status, "host_status"),
             "dissolve_stage": handler(ch.DissolveStage, self._dissolve_stage),
             "link_stage": handler(ch.LinkStage, self._link_stage),
             "begin_completion": handler(ch.BeginCompletion, self._begin_completion),
             "set_replica_share": handler(ch.SetReplicaShare, self._set_replica_share),
             "apply_mig": handler(ch.ApplyMig, self._apply_mig)},
            credential=self.credential, registration=self._registration,
            heartbeat=self._heartbeat, heartbeat_interval_s=self.hc.heartbeat_interval_s)
        await self._controller.start()
        self.spawn(self._controller.heartbeat_loop(), "heartbeat")
        from flashpoint.spot.notice import watch, watchers_from

        watchers = watchers_from(self.hc.spot_notice, self.hc.imds_endpoint)
        if watchers:
            self.spawn(watch(watchers, self.on_eviction_notice,
                                   interval_s=self.hc.spot_poll_interval_s), "spot-watch")
        if self.hc.metrics_listen:
            gw = self.config.gateway  # the cluster's API keys, when scrapes must carry one
            self.metrics = MetricsEndpoint(  # + its replicas' counters, asked at each scrape
                self.hc.metrics_listen,
                extra=lambda: host_collectors(self.workers.values(), self.host_id),
                keys=list(gw.api_keys) if gw.metrics_require_key else None)
            await self.metrics.start()
        log.info("host_started", devices=[d.device_id for d in self.devices], url=self._local_url,
                 data_endpoint=str(self.data_endpoint),
                 metrics=self.metrics.url if self.metrics else None)
        heap.settle()  # start-up objects out of the collector's scans (flashpoint/heap.py)

    @property
    def idle(self) -> list[WorkerProcess]:
        """The warm pool's workers, in the order the next cold starts take them."""
        return self.pool.idle

    async def wait_pool_ready(self, timeout_s: float) -> bool:
        """Wait until the warm pool is full (a cold start then pays only for model bytes)."""
        deadline = time.monotonic() + timeout_s
        while not self.state.pool_full() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.state.pool_full()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop workers, servers and the cache (idempotent: later calls wait for the first,
        unlike the base's, because an eviction and the test harness may both stop a host)."""
        if self._stop_task is None:
            self._stop_timeout_s = timeout_s
            self.state.handle(hs.Stopping())  # before the refill task sees its cancellation
            self._stop_task = asyncio.ensure_future(super().stop(timeout_s))
        await asyncio.shield(self._stop_task)

    async def on_stop(self, timeout_s: float) -> None:
        """After the base cancelled every task: stop the workers (each within half the stop
        timeout, as before the base), the listeners, the GPU side and the cache."""
        worker_timeout_s = self._stop_timeout_s / 2
        await asyncio.gather(*(self.pool.stop_worker(w, worker_timeout_s)
                               for w in list(self.workers.values())),
                             return_exceptions=True)
        if self._controller is not None:
            await self._controller.stop()
        if self._server is not None:
            await self._server.stop(timeout_s=2.0)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.dataplane is not None:
            await self.dataplane.stop()
        await self.gpu.stop()  # after the workers: MPS clients are gone before their daemon
        self.cache.close()

    # state -------------------------------------------------------------------------------
    def _set_devices(self, devices: list[Device]) -> None:
        self.devices = devices
        self.pool.size_threads(devices, gpus=len(self.gpu.gpus))
        self.state.handle(hs.DevicesReported(tuple((d.device_id, d.memory_bytes) for d in devices)))

    def _release(self, replica_id: str) -> None:
        """Give back a replica's reservations (idempotent: the state releases once)."""
        for cmd in self.state.handle(hs.ReplicaGone(replica_id)):
            assert isinstance(cmd, hs.ReleaseReplica)
            self.gpu.detach(cmd.replica_id)
            if cmd.process_bytes:
                self.cache.release_process(cmd.process_bytes)
            if cmd.orphaned_readers:
                log.warning("weights_exporter_stopped_before_readers",
                            replica_id=cmd.replica_id, readers=list(cmd.orphaned_readers))

    # controller side ----------------------------------------------------------------------
    def _registration(self) -> ch.RegisterHost:
        return reports.registration(self.state, self.hc, gpu=self.gpu, devices=self.devices,
                                    cache=self.cache, data_endpoint=self.data_endpoint)

    async def on_eviction_notice(self, notice: Any) -> None:
        """This host is going away at ``notice.deadline_s``: tell the controller (it stops
        placing here, starts replacements elsewhere, moves queued work, and has this host push
        its cached models to peers), and leave at the deadline whatever is still running."""
        if self.notice is not None:
            return
        self.notice = notice
        log.warning("host_draining", action=notice.action, source=notice.source,
                    remaining_s=round(notice.remaining_s(), 1))
        await self._report("host_draining", ch.HostDraining(
            host_id=self.host_id, remaining_s=notice.remaining_s(), action=notice.action))
        asyncio.get_running_loop().call_later(notice.remaining_s(), self._leave)

    def _leave(self) -> None:
        """The deadline: the VM is gone. Stop everything (outside our own task set)."""
        if self.stopping:
            return
        log.warning("host_evicted")
        task = asyncio.get_running_loop().create_task(self.stop())
        task.add_done_callback(lambda _t: self.evicted.set())

    async def _report(self, method: str, msg: Message) -> None:
        assert self._controller is not None, "reports start once the host has started"
        await self._controller.report(method, msg)

    def _heartbeat(self) -> ch.Heartbeat:
        return ch.Heartbeat(
            host_id=self.host_id, cached_models=tuple(self.cache.keys()),
            transfers=self.cache.progress(), replicas=tuple(self.replicas),
            draining_s=self.notice.remaining_s() if self.notice else None)

    def _device(self, device_id: str) -> Device:
        device = next((d for d in self.devices if d.device_id == device_id), None)
        if device is None:
            raise BadRequest(f"unknown device {device_id!r} on host {self.host_id}")
        return device

    async def _deploy(self, conn: Any, payload: Any) -> dict[str, Any]:
        """``deploy_replica``: idempotent by replica id, acknowledged at once; the cold start
        runs in the background (it ends with ``replica_ready`` or ``replica_failed``)."""
        msg = ch.decode_deploy(payload)
        if self.stopping:
            # A deploy that raced stop() (the controller link closes late in it) would start a
            # cold start and a worker after the sweep of tasks and workers: refuse it, the
            # controller places the replica elsewhere (the cluster harness's leak check).
            raise Unavailable(f"host {self.host_id} is stopping")
        if msg.replica_id in self.replicas:
            return to_payload(ch.Accepted(duplicate=True))
        if isinstance(msg, ch.DeployKaas):
            return to_payload(self._deploy_kaas(msg))
        spec: FunctionSpec = msg.spec
        device = self._device(msg.device_id)
        manifest = Manifest.from_json(msg.manifest_json) if msg.manifest_json is not None else None
        pinned = pinned_digest(msg.manifest_digest, manifest)
        if isinstance(msg.source, ch.ChainSource) and pinned:
            assert self.bytes is not None
            self.bytes.expect(msg.source.transfer_id, pinned)
        self.gpu.check_deployable(device)
        rt = ReplicaTask(msg.replica_id, device.device_id, stage=msg.stage)
        if msg.pipeline is not None:
            # Stages on other hosts dial it: it listens where the data plane does.
            nxt = msg.pipeline.next_hop
            rt.pipeline = {"listen_host": msg.pipeline.listen_host or self.hc.data_listen_host,
                           "port": msg.pipeline.port, "next_hop": list(nxt) if nxt else None}
        need = (manifest.blob_size if manifest else 0) + self.config.controller.replica_overhead_bytes
        self._admit(rt, device, hs.ReplicaRequested(
            msg.replica_id, spec.name, device.device_id, need, self.hc.worker_memory_bytes,
            model_key=spec.model_key, stage=msg.stage, pipeline=msg.pipeline is not None,
            share=msg.share))
        rt.task = self.spawn(self._cold_start(rt, spec, msg.source, manifest, pinned),
                                   f"coldstart:{msg.replica_id}")
        return to_payload(ch.Accepted())

    def _admit(self, rt: ReplicaTask, device: Device, ev: hs.ReplicaRequested) -> None:
        """Reserve the device (HostState: NoCapacity) and the worker's host RAM (the cache:
        NoCapacity) for ``rt`` from the moment its cold start begins, so concurrent starts
        can never overcommit either; then attach it to its GPU."""
        for cmd in self.state.handle(ev):
            assert isinstance(cmd, hs.ReserveHostMemory)
            try:
                self.cache.reserve_process(cmd.process_bytes)
            except BaseException:
                # Its device bytes go back; nothing else was taken yet (no RAM, no GPU
                # attachment), so the release the state returns has nothing to execute.
                self.state.handle(hs.HostMemoryRefused(ev.replica_id))
                raise
        try:
            rt.env = self.gpu.attach(ev.replica_id, device, ev.share)
        except BaseException:
            self._release(ev.replica_id)
            raise
        self.replicas[ev.replica_id] = rt

    def _deploy_kaas(self, msg: ch.DeployKaas) -> ch.Accepted:
        """A KaaS executor replica: no model to fetch, a worker whose executor's device cache
        is ``cache_bytes``; reserves ``device_bytes`` of its device like a model replica."""
        from flashpoint.kaas import KAAS_FUNCTION

        device = self._device(msg.device_id)
        self.gpu.check_deployable(device)
        rt = ReplicaTask(msg.replica_id, device.device_id)
        self._admit(rt, device, hs.ReplicaRequested(
            msg.replica_id, KAAS_FUNCTION, device.device_id, msg.device_bytes,
            self.hc.worker_memory_bytes))
        rt.task = self.spawn(self._start_kaas(rt, msg.cache_bytes), f"kaas:{msg.replica_id}")
        return ch.Accepted()

    async def _start_kaas(self, rt: ReplicaTask, cache_bytes: int) -> None:
        from flashpoint.kaas import KAAS_FUNCTION

        bind_ids(replica_id=rt.replica_id)
        try:
            try:
                worker = await self._assign_worker(rt, KAAS_FUNCTION, None)
                reply = from_payload(hw.LoadKaasReply, await worker.conn.call(
                    "load_kaas", to_payload(hw.LoadKaas(
                        replica_id=rt.replica_id, host_id=self.host_id,
                        device=self._worker_device(rt), env=rt.env, cache_bytes=cache_bytes,
                        controller_url=self.hc.controller_url)),
                    timeout_s=self.config.controller.deploy_timeout_s), method="load_kaas")
                self._loaded(rt, worker, "")
                log.info("kaas_executor_started", timings=reply.timings_s)
            finally:
                self._cold_start_ended(rt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._start_failed(rt, exc)

    async def _assign_worker(self, rt: ReplicaTask, function: str,
                             model_key: str | None) -> WorkerProcess:
        worker = await self._take_worker()
        worker.replica_id, worker.device_id = rt.replica_id, rt.device_id
        worker.function, worker.model_key = function, model_key
        self.gpu.bind_worker(rt.replica_id, worker.proc.pid)  # before its CUDA starts
        rt.worker = worker
        dev = self.gpu.device(rt.device_id)
        if model_key is not None and rt.stage is None and dev is not None:
            rt.weight_slot = self.gpu.weight_slot(dev, model_key)
        self.state.handle(hs.WorkerAssigned(rt.replica_id, rt.weight_slot))
        return worker

    def _loaded(self, rt: ReplicaTask, worker: WorkerProcess, weights_role: str) -> None:
        worker.warm = True
        self.state.handle(hs.ReplicaLoaded(
            rt.replica_id, weights_role,
            tuple(rt.pipeline_endpoint.to_wire()) if rt.pipeline_endpoint else None))

    def _cold_start_ended(self, rt: ReplicaTask) -> None:
        for cmd in self.state.handle(hs.ColdStartEnded(rt.replica_id)):
            assert isinstance(cmd, hs.RefillPool)
            self.spawn(self.pool.refill(
                after=cmd.after_hold,
                served=rt.worker if cmd.after_first_answer else None), "refill")

    async def _start_failed(self, rt: ReplicaTask, exc: Exception) -> None:
        reason = exc.message if isinstance(exc, FlashpointError) else f"{type(exc).__name__}: {exc}"
        log.warning("cold_start_failed", reason=reason)
        self.replicas.pop(rt.replica_id, None)
        self._release(rt.replica_id)
        if rt.worker is not None:
            rt.worker.replica_id = None  # the watcher must not report it twice
            await self.pool.stop_worker(rt.worker, 2.0)
        code = exc.code if isinstance(exc, FlashpointError) else "start_failed"
        await self._report("replica_failed", ch.ReplicaFailed(
            replica_id=rt.replica_id, reason=reason[:500], during_start=True, code=code))

    def _worker_device(self, rt: ReplicaTask) -> str:
        device = self.gpu.device(rt.device_id)
        return self.gpu.worker_device(device) if device is not None else "cpu"

    # model bytes (the orchestration is transfer/obtain.py) ------------------------------------
    async def _start_chain(self, conn: Any, msg: ch.StartChain) -> ch.Accepted:
        """Stream a model this host holds down a chain the controller built."""
        assert self.bytes is not None
        self.bytes.start_chain(msg)
        return ch.Accepted()

    async def _expect_transfer(self, conn: Any, msg: ch.ExpectTransfer) -> ch.Expected:
        """The controller's word that chain ``transfer_id`` will bring this host the model
        whose manifest has ``manifest_digest``: only then does the data plane accept it."""
        assert self.bytes is not None
        self.bytes.expect(msg.transfer_id, msg.manifest_digest)
        return ch.Expected()

    async def _cold_start(self, rt: ReplicaTask, spec: FunctionSpec, source: ch.SourcePlan | None,
                          manifest: Manifest | None, pinned: str | None = None) -> None:
        bind_ids(replica_id=rt.replica_id)
        model_key = spec.model_key
        assert self.bytes is not None
        try:
            began = time.perf_counter()
            got = await self.bytes.obtain(spec.model, spec.model_version, source, manifest,
                                          rt.stage, pinned)
            obtained = time.perf_counter()
            entry, label = got.entry, got.source
            self.cache.pin(model_key)
            try:
                worker = await self._assign_worker(rt, spec.name, model_key)
                device = self._worker_device(rt)
                load = hw.LoadReplica(
                    weight_slot=(from_payload(hw.WeightSlot, rt.weight_slot)
                                 if rt.weight_slot else None),
                    env=rt.env,  # applied by the worker before it initialises CUDA
                    replica_id=rt.replica_id, host_id=self.host_id, spec=spec.to_dict(),
                    cache_path=str(entry.path), manifest_json=entry.manifest_json,
                    device=device, controller_url=self.hc.controller_url, source=label,
                    stage=tuple(rt.stage) if rt.stage is not None else None,
                    fetch_s=got.fetch_s,  # a value of obtain's, never patched into the cache
                    # This host's part of the cold start (controller/cold_timings.py); the
                    # worker returns it with its own phases.
                    host_timings_s={"obtain": obtained - began,
                                    "assign": time.perf_counter() - obtained},
                    pipeline=(from_payload(hw.PipelineOptions, rt.pipeline)
                              if rt.pipeline is not None else None))
                reply = from_payload(hw.LoadReplicaReply, await worker.conn.call(
                    "load_replica", to_payload(load),
                    timeout_s=self.config.controller.deploy_timeout_s), method="load_replica")
                if rt.pipeline is not None:
                    ep = Endpoint.from_wire(reply.pipeline_endpoint)
                    if self.hc.data_advertise_host:
                        ep = Endpoint(ep.host_id, self.hc.data_advertise_host, ep.port)
                    rt.pipeline_endpoint = ep
                self._loaded(rt, worker, reply.weights)
                if rt.pipeline_endpoint is not None:
                    await self._report("stage_ready", ch.StageReady(
                        replica_id=rt.replica_id, host_id=self.host_id,
                        pipeline_endpoint=tuple(rt.pipeline_endpoint.to_wire()), source=label,
                        timings_s=reply.timings_s))
                if rt.stage is not None:
                    self.spawn(self._complete_stage(rt, entry.segment),
                                     f"complete:{rt.replica_id}")
                log.info("replica_started", source=label, timings=reply.timings_s)
            finally:
                self.cache.unpin(model_key)
                # The pool refills only now, after a hold or a first answer (HostState).
                self._cold_start_ended(rt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._start_failed(rt, exc)

    async def _complete_stage(self, rt: ReplicaTask, segment: Any) -> None:
        """Model completion: once this host holds the whole model, turn stage ``rt`` into a
        whole replica (its worker builds the whole module over the bytes it maps; its stage
        server, if any, serves until ``dissolve_stage``). A failure leaves it a stage, logged."""
        try:
            await segment.wait_complete(self.config.controller.deploy_timeout_s)
            w = rt.worker
            if w is None or self.replicas.get(rt.replica_id) is not rt or w.conn is None:
                return
            reply = from_payload(hw.CompleteReplicaReply, await w.conn.call(
                "complete_replica", to_payload(hw.CompleteReplica(replica_id=rt.replica_id)),
                timeout_s=self.config.controller.deploy_timeout_s), method="complete_replica")
            self.state.handle(hs.StageCompleted(rt.replica_id, reply.completed))
            log.info("stage_completed", replica_id=rt.replica_id, timings=reply.timings_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("stage_completion_failed", replica_id=rt.replica_id, error=repr(exc))

    async def _link_stage(self, conn: Any, msg: ch.LinkStage) -> ch.Linked:
        """Point a stage replica's pipeline server at the next stage (the controller links a
        group once every stage serves; the link opens on the first request)."""
        rt = self.replicas.get(msg.replica_id)
        if rt is None or rt.worker is None or rt.worker.conn is None or rt.pipeline is None:
            raise NotFound(f"no pipeline stage {msg.replica_id!r} on {self.host_id}")
        nxt = Endpoint.from_wire(list(msg.next_hop))
        await rt.worker.conn.call("set_next_hop", to_payload(hw.SetNextHop(next_hop=nxt.to_wire())),
                                  timeout_s=10.0)
        rt.pipeline["next_hop"] = nxt.to_wire()
        return ch.Linked()

    async def _begin_completion(self, conn: Any, msg: ch.BeginCompletion) -> ch.Released:
        """The controller's word that a stage's group answered its first request: the held
        completion fill and pool refill of the stage's model go now (stage_hold.py)."""
        released = False
        for cmd in self.state.handle(hs.CompletionAsked(msg.replica_id)):
            assert isinstance(cmd, hs.ReleaseHold)
            released = self.stage_holds.release(cmd.model_key, cmd.why) or released
        return ch.Released(released=released)

    async def _dissolve_stage(self, conn: Any, msg: ch.DissolveStage) -> ch.Dissolved:
        """Stop a stage replica's pipeline server (the controller's call, once the pipeline
        gets no more work); a completed replica keeps serving as a whole one."""
        rt = self.replicas.get(msg.replica_id)
        if rt is None or rt.worker is None or rt.worker.conn is None:
            return ch.Dissolved(dissolved=False)
        reply = from_payload(hw.DissolveStageReply, await rt.worker.conn.call(
            "dissolve_stage", to_payload(hw.DissolveStage(replica_id=rt.replica_id)),
            timeout_s=10.0), method="dissolve_stage")
        rt.pipeline_endpoint = None
        self.state.handle(hs.StageDissolved(msg.replica_id))
        return ch.Dissolved(dissolved=reply.dissolved)

    async def _stop_replica(self, conn: Any, msg: ch.StopReplica) -> ch.Stopped:
        rt = self.replicas.pop(msg.replica_id, None)
        if rt is None:
            return ch.Stopped(stopped=False)
        self._release(rt.replica_id)
        if rt.task is not None and not rt.task.done():
            rt.task.cancel()
        if rt.worker is not None:
            rt.worker.replica_id = None
            self.spawn(self.pool.stop_worker(rt.worker, 5.0), f"stop:{rt.replica_id}")
        return ch.Stopped(stopped=True)

    async def _status(self, conn: Any, msg: ch.HostStatusRequest) -> ch.HostStatus:
        return reports.status(self.state, gpu=self.gpu, cache=self.cache,
                              worker_pids=(w.proc.pid for w in self.workers.values()))

    # GPU sharing and MIG (the logic is in host/gpu.py) ------------------------------
    async def _set_replica_share(self, conn: Any, msg: ch.SetReplicaShare) -> ch.ShareSet:
        """Change a running replica's GPU share live (a tokens host; MPS answers Conflict)."""
        if msg.replica_id not in self.replicas:
            raise NotFound(f"no replica {msg.replica_id!r} on {self.host_id}")
        reply = self.gpu.set_share(msg.replica_id, msg.share)
        self.state.handle(hs.ShareChanged(msg.replica_id, msg.share))
        return ch.ShareSet(**reply)

    async def _apply_mig(self, conn: Any, msg: ch.ApplyMig) -> ch.MigApplied:
        """Apply a MIG geometry to one GPU (refused while replicas run on it: GpuBusy), then
        report the new slices to the controller as placement units."""
        def replicas_on(idx: int) -> list[str]:
            return sorted(r.replica_id for r in self.state.replicas.values()
                          if (d := self.gpu.device(r.device_id)) is not None and d.gpu_index == idx)

        reply = await self.gpu.apply_mig(msg.gpu_index, list(msg.geometry), replicas_on)
        self._set_devices(list(self.gpu.devices))
        await self._report("register_host", self._registration())
        return ch.MigApplied(**reply)

    # workers (host/workers.py) --------------------------------------------------------------
    async def _take_worker(self) -> WorkerProcess:
        """The oldest idle worker of the pool, else a new one: :meth:`WorkerPool.take`."""
        return await self.pool.take()

    async def _worker_exited(self, w: WorkerProcess, rc: int) -> None:
        """A worker that held a replica exited unasked: its replica failed."""
        if self.stopping or w.replica_id is None:
            return
        rid, during_start = w.replica_id, not w.warm
        if self.replicas.pop(rid, None) is not None:
            self._release(rid)
        log.warning("worker_died", worker_id=w.worker_id, rc=rc, replica_id=rid)
        await self._report("replica_failed", ch.ReplicaFailed(
            replica_id=rid, reason=f"worker process exited with status {rc}",
            during_start=during_start, code="worker_exited"))
