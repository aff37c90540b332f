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
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashpoint import heap
from flashpoint.host.gpu import HostGpu
from flashpoint.host.metrics import host_collectors
from flashpoint.host.stage_hold import StageHolds
from flashpoint.config import ClusterConfig, HostConfig, check_secret
from flashpoint.errors import (
    BadRequest,
    FlashpointError,
    IntegrityError,
    ModelNotFound,
    NoCapacity,
    NotFound,
)
from flashpoint.exposition import MetricsEndpoint
from flashpoint.gpu.host_sharing import GpuShare
from flashpoint.gpu.inventory import Device
from flashpoint.ids import ModelKey, new_id
from flashpoint.log import bind_ids, get_logger
from flashpoint.registry.manifest import Manifest
from flashpoint.rpc import roles
from flashpoint.spec import FunctionSpec
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.cache import CacheEntry, HostCache, default_cache_dir
from flashpoint.transfer.plan import Endpoint

log = get_logger("flashpoint.host")

# Test-only fault injection (tests/netns/test_cluster_netns.py): when set, a FaultPlan as JSON
# (the keys of flashpoint.transfer.plan.FaultPlan.from_dict, e.g. '{"corrupt_forward": [3]}')
# that this host's data-plane server applies to what it relays, stores and serves as a chain
# receiver/peer. Never set in production; a host started with it logs a warning.
DATAPLANE_FAULT_ENV = "FLASHPOINT_DATAPLANE_FAULT"


@dataclass
class WorkerProcess:
    worker_id: str
    proc: asyncio.subprocess.Process
    hello: asyncio.Future
    conn: Any = None
    replica_id: str | None = None
    device_id: str | None = None
    function: str | None = None
    model_key: str | None = None
    warm: bool = False
    stopping: bool = False
    # Set when its replica has answered its first request (the worker's replica_served).
    served: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ReplicaTask:
    replica_id: str
    function: str
    device_id: str
    task: asyncio.Task | None = None
    worker: WorkerProcess | None = None
    started_s: float = field(default_factory=time.monotonic)
    stage: Any = None  # [first, last] layer of a partition stage, or None for a whole model
    pipeline: Any = None  # a stage's pipeline options (listen_host, port, next_hop), or None
    pipeline_endpoint: Endpoint | None = None  # where its StageServer listens, once started
    whole: bool = False  # a stage that has completed into a whole replica
    device_bytes: int = 0  # reserved on its device from the moment the cold start began
    share: GpuShare | None = None  # its GPU share (MPS / tokens), as the deploy asked
    env: dict[str, str] = field(default_factory=dict)  # its worker's GPU env (host_gpu.py)
    weight_slot: dict[str, Any] | None = None  # where its weights are shared (CUDA IPC)
    weights_role: str = ""  # "exporter" / "reader" once loaded with a weight slot
    process_bytes: int = 0  # host RAM reserved for its worker process
    model_key: str = ""  # the model version it runs ("name@version"), for a restarted controller


class HostManager:
    """The per-host actor."""

    def __init__(self, config: ClusterConfig, store: Any, *, host_id: str | None = None) -> None:
        self.config = config
        self.hc = config.host
        self.store = store
        self.host_id = host_id or self.hc.host_id or socket.gethostname()
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
        self._device_used: dict[str, int] = {}
        self.devices: list[Device] = []
        self.gpu = HostGpu(self.hc, self.host_id)  # inventory, MPS/tokens, MIG (host_gpu.py)
        self.workers: dict[str, WorkerProcess] = {}
        self.idle: list[WorkerProcess] = []
        self.replicas: dict[str, ReplicaTask] = {}
        self._server: Any = None
        self.metrics: MetricsEndpoint | None = None  # [host] metrics_listen
        self._local_url = ""
        self._controller: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._refill_lock = asyncio.Lock()
        # A stage's completion fill and pool refill wait for its group's first answer.
        self.stage_holds = StageHolds(self.hc.completion_hold_s)
        self._stopping = False
        self._stop_task: asyncio.Future | None = None
        self.notice: Any = None  # the EvictionNotice once one arrived
        self.evicted = asyncio.Event()  # set when this host has left (its deadline passed)

    # lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        from flashpoint.rpc import ReconnectingClient, RpcServer

        bind_ids(host_id=self.host_id)
        check_secret(self.config.secret, self.hc.data_listen_host, f"host {self.host_id}'s data plane")
        if self.hc.tls_ca_path:
            from flashpoint.rpc.client import TLS_CA_ENV

            # This process's RPC clients and the workers it spawns trust the cluster's CA.
            os.environ[TLS_CA_ENV] = self.hc.tls_ca_path
        from flashpoint.transfer.dataplane import DataPlaneServer
        from flashpoint.transfer.sources import RegistrySource

        # Before the warm pool: a tokens host starts its workers with the hook preloaded.
        self.devices = await self.gpu.start()
        self.cache.start()
        self._registry_source = RegistrySource(self.store, span_bytes=self.hc.registry_span_bytes)
        fault = None
        if fault_json := os.environ.get(DATAPLANE_FAULT_ENV):
            from flashpoint.transfer.plan import FaultPlan

            fault = FaultPlan.from_dict(json.loads(fault_json))
            log.warning("dataplane_fault_injected", fault=fault_json)
        self.dataplane = DataPlaneServer(
            self.cache, self.secret, host_id=self.host_id, listen_host=self.hc.data_listen_host,
            port=self.hc.data_port, registry_source=self._registry_source, fault=fault,
            admission=self.admission)
        bound = await self.dataplane.start()
        self.data_endpoint = Endpoint(self.host_id, self.hc.data_advertise_host or bound.addr, bound.port)
        self._server = RpcServer({"worker_hello": self._worker_hello,
                                  "replica_served": self._replica_served},
                                 secret=roles.host_keyring(self.host_id, self.credential.key))
        host, port = await self._server.start(self.hc.listen_host, 0)
        self._local_url = f"ws://{host}:{port}/rpc"
        self._spawn_task(self._refill(), "refill")
        self._controller = ReconnectingClient(
            self.hc.controller_url,
            {"deploy_replica": self._deploy, "stop_replica": self._stop_replica,
             "start_chain": self._start_chain, "expect_transfer": self._expect_transfer,
             "host_status": self._status,
             "dissolve_stage": self._dissolve_stage, "link_stage": self._link_stage,
             "begin_completion": self._begin_completion,
             "set_replica_share": self._set_replica_share, "apply_mig": self._apply_mig},
            secret=self.credential.key, name=self.credential.principal,
            on_connected=self._register,
        )
        await self._controller.start()
        self._spawn_task(self._heartbeat_loop(), "heartbeat")
        from flashpoint.spot.notice import watch, watchers_from

        watchers = watchers_from(self.hc.spot_notice, self.hc.imds_endpoint)
        if watchers:
            self._spawn_task(watch(watchers, self.on_eviction_notice,
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

    async def wait_pool_ready(self, timeout_s: float) -> bool:
        """Wait until the warm pool is full (a cold start then pays only for model bytes)."""
        deadline = time.monotonic() + timeout_s
        while len(self.idle) < self.hc.warm_pool_size and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.idle) >= self.hc.warm_pool_size

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop workers, servers and the cache (idempotent: later calls wait for the first)."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(timeout_s))
        await asyncio.shield(self._stop_task)

    async def _stop(self, timeout_s: float) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop_worker(w, timeout_s / 2) for w in list(self.workers.values())),
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

    def _spawn_task(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.host_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # controller side ----------------------------------------------------------------------
    def _replica_reports(self) -> list[list[Any]]:
        out = []
        for r in self.replicas.values():
            # A stage is a whole replica only once it has completed (a controller that adopts
            # it after a restart must not dispatch whole requests to a stage).
            warm = bool(r.worker and r.worker.warm) and (r.stage is None or r.whole)
            out.append([r.replica_id, r.function, r.device_id, warm])
        return out

    def _stage_reports(self) -> list[dict[str, Any]]:
        """Partition stages on this host (beside the ``replicas`` 4-tuples): the layers,
        the pipeline endpoint (wire form, or None) and whether it has completed."""
        return [{"replica_id": r.replica_id, "stage": r.stage, "whole": r.whole,
                 "warm": bool(r.worker and r.worker.warm),
                 "pipeline_endpoint": r.pipeline_endpoint.to_wire() if r.pipeline_endpoint else None}
                for r in self.replicas.values() if r.stage is not None]

    async def _register(self, conn: Any) -> None:
        await conn.call("register_host", self._registration(), timeout_s=10.0)

    def _registration(self) -> dict[str, Any]:
        return {
            "host_id": self.host_id, "gpu_sharing": self.gpu.mode.value,
            "devices": [d.to_dict() for d in self.devices],
            "gpus": self.gpu.gpus,  # physical GPUs: MIG table and mode (MIG reconfiguration)
            "ram_bytes": self.hc.cache_bytes, "leaf": self.hc.leaf, "kind": self.hc.kind,
            "cached_models": self.cache.keys(),
            "replicas": self._replica_reports(),
            # so a restarted controller adopts shared replicas with their shares
            "shares": {r.replica_id: r.share.to_wire() for r in self.replicas.values()
                       if r.share is not None},
            # and with the model version each runs (a roll-out may be under way)
            "models": {r.replica_id: r.model_key for r in self.replicas.values() if r.model_key},
            "stages": self._stage_reports(),
            "data_endpoint": self.data_endpoint.to_wire() if self.data_endpoint else None,
        }

    async def on_eviction_notice(self, notice: Any) -> None:
        """This host is going away at ``notice.deadline_s``: tell the controller (it stops
        placing here, starts replacements elsewhere, moves queued work, and has this host push
        its cached models to peers), and leave at the deadline whatever is still running."""
        if self.notice is not None:
            return
        self.notice = notice
        log.warning("host_draining", action=notice.action, source=notice.source,
                    remaining_s=round(notice.remaining_s(), 1))
        await self._report("host_draining", {"host_id": self.host_id,
                                             "remaining_s": notice.remaining_s(),
                                             "action": notice.action})
        asyncio.get_running_loop().call_later(notice.remaining_s(), self._leave)

    def _leave(self) -> None:
        """The deadline: the VM is gone. Stop everything (outside our own task set)."""
        if self._stopping:
            return
        log.warning("host_evicted")
        task = asyncio.get_running_loop().create_task(self.stop())
        task.add_done_callback(lambda _t: self.evicted.set())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.hc.heartbeat_interval_s)
            try:
                await self._controller.notify("heartbeat", {
                    "host_id": self.host_id, "cached_models": self.cache.keys(),
                    "transfers": self.cache.progress(), "replicas": list(self.replicas),
                    **({"draining_s": self.notice.remaining_s()} if self.notice else {}),
                })
            except FlashpointError as exc:
                log.debug("heartbeat_failed", error=exc.code)

    async def _report(self, method: str, payload: dict[str, Any]) -> None:
        try:
            await self._controller.call(method, payload, timeout_s=10.0)
        except FlashpointError as exc:
            # The controller re-learns the truth from our next registration.
            log.warning("report_failed", method=method, error=exc.code)

    async def _deploy(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        replica_id = str(payload.get("replica_id", ""))
        if not replica_id:
            raise BadRequest("deploy needs a replica_id")
        if replica_id in self.replicas:
            return {"accepted": True, "duplicate": True}
        if payload.get("kind") == "kaas":
            return self._deploy_kaas(replica_id, payload)
        spec = FunctionSpec.from_dict(payload.get("spec"))
        device_id = str(payload.get("device_id", ""))
        device = next((d for d in self.devices if d.device_id == device_id), None)
        if device is None:
            raise BadRequest(f"unknown device {device_id!r} on host {self.host_id}")
        source = payload.get("source")
        if source is not None and not isinstance(source, dict):
            raise BadRequest("deploy source must be a map")
        manifest_json = payload.get("manifest_json")
        manifest = Manifest.from_json(manifest_json) if isinstance(manifest_json, str) else None
        pinned = _pinned_digest(payload, manifest)
        if source is not None and source.get("kind") == "chain" and pinned:
            self.admission.announce(str(source.get("transfer_id", "")), pinned)
        self.gpu.check_deployable(device)
        rt = ReplicaTask(replica_id, spec.name, device_id, model_key=spec.model_key)
        if payload.get("share") is not None:
            rt.share = GpuShare.from_wire(payload["share"])
        stage = payload.get("stage")
        if stage is not None:
            if not (isinstance(stage, list) and len(stage) == 2
                    and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in stage)):
                raise BadRequest("stage must be [first_layer, last_layer]")
            rt.stage = stage
        pipeline = payload.get("pipeline")
        if pipeline is not None:
            if stage is None or not isinstance(pipeline, dict):
                raise BadRequest("pipeline options need a stage and must be a map")
            nxt = pipeline.get("next_hop")
            if nxt is not None:
                Endpoint.from_wire(nxt)  # BadRequest now, not in the worker
            port = pipeline.get("port", 0)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise BadRequest("pipeline port must be an integer in [0, 65536)")
            # Stages on other hosts dial it: it listens where the data plane does.
            rt.pipeline = {"listen_host": str(pipeline.get("listen_host") or self.hc.data_listen_host),
                           "port": port, "next_hop": nxt}
        # A cold start reserves its device memory and its worker's host RAM when it begins,
        # so concurrent starts can never overcommit either.
        need = (manifest.blob_size if manifest else 0) + self.config.controller.replica_overhead_bytes
        self._reserve(rt, device, need)
        try:
            rt.env = self.gpu.attach(replica_id, device, rt.share)
        except BaseException:
            self._release(rt)
            raise
        self.replicas[replica_id] = rt
        rt.task = self._spawn_task(self._cold_start(rt, spec, source, manifest, pinned),
                                   f"coldstart:{replica_id}")
        return {"accepted": True}

    def _reserve(self, rt: ReplicaTask, device: Device, need: int) -> None:
        """Reserve ``need`` bytes of ``device`` and a worker's host RAM for ``rt``, or raise
        NoCapacity; from the moment its cold start begins, so concurrent starts can never
        overcommit either."""
        used = self._device_used.get(device.device_id, 0)
        if used + need > device.memory_bytes:
            raise NoCapacity(f"device {device.device_id} on {self.host_id}: {need} bytes "
                             f"needed, {device.memory_bytes - used} free", retry_after_s=5.0)
        self.cache.reserve_process(self.hc.worker_memory_bytes)
        rt.process_bytes, rt.device_bytes = self.hc.worker_memory_bytes, need
        self._device_used[device.device_id] = used + need

    def _deploy_kaas(self, replica_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A KaaS executor replica: no model to fetch, a worker whose executor's device cache
        is ``cache_bytes``; reserves ``device_bytes`` of its device like a model replica."""
        from flashpoint.kaas import KAAS_FUNCTION

        device_id = str(payload.get("device_id", ""))
        device = next((d for d in self.devices if d.device_id == device_id), None)
        if device is None:
            raise BadRequest(f"unknown device {device_id!r} on host {self.host_id}")
        need, cache_bytes = payload.get("device_bytes"), payload.get("cache_bytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                   for v in (need, cache_bytes)):
            raise BadRequest("a KaaS deploy needs positive integer device_bytes and cache_bytes")
        self.gpu.check_deployable(device)
        rt = ReplicaTask(replica_id, KAAS_FUNCTION, device_id)
        self._reserve(rt, device, need)
        rt.env = self.gpu.attach(replica_id, device, None)
        self.replicas[replica_id] = rt
        rt.task = self._spawn_task(self._start_kaas(rt, cache_bytes), f"kaas:{replica_id}")
        return {"accepted": True}

    async def _start_kaas(self, rt: ReplicaTask, cache_bytes: int) -> None:
        from flashpoint.kaas import KAAS_FUNCTION

        bind_ids(replica_id=rt.replica_id)
        try:
            try:
                worker = await self._take_worker()
                worker.replica_id, worker.device_id = rt.replica_id, rt.device_id
                worker.function = KAAS_FUNCTION
                self.gpu.bind_worker(rt.replica_id, worker.proc.pid)  # before its CUDA starts
                rt.worker = worker
                reply = await worker.conn.call("load_kaas", {
                    "replica_id": rt.replica_id, "host_id": self.host_id,
                    "device": self._worker_device(rt), "env": rt.env,
                    "cache_bytes": cache_bytes, "controller_url": self.hc.controller_url,
                }, timeout_s=self.config.controller.deploy_timeout_s)
                worker.warm = True
                log.info("kaas_executor_started", timings=reply.get("timings_s"))
            finally:
                self._spawn_task(self._refill(), "refill")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._start_failed(rt, exc)

    async def _start_failed(self, rt: ReplicaTask, exc: Exception) -> None:
        reason = exc.message if isinstance(exc, FlashpointError) else f"{type(exc).__name__}: {exc}"
        log.warning("cold_start_failed", reason=reason)
        self.replicas.pop(rt.replica_id, None)
        self._release(rt)
        if rt.worker is not None:
            rt.worker.replica_id = None  # the watcher must not report it twice
            await self._stop_worker(rt.worker, 2.0)
        code = exc.code if isinstance(exc, FlashpointError) else "start_failed"
        await self._report("replica_failed", {
            "replica_id": rt.replica_id, "reason": reason[:500], "during_start": True,
            "code": code})

    def _worker_device(self, rt: ReplicaTask) -> str:
        device = self.gpu.device(rt.device_id)
        return self.gpu.worker_device(device) if device is not None else "cpu"

    def _release(self, rt: ReplicaTask) -> None:
        """Give back a replica's reservations (idempotent)."""
        self.gpu.detach(rt.replica_id)
        if rt.device_bytes:
            self._device_used[rt.device_id] = max(0, self._device_used.get(rt.device_id, 0) - rt.device_bytes)
            rt.device_bytes = 0
        if rt.process_bytes:
            self.cache.release_process(rt.process_bytes)
            rt.process_bytes = 0

    # model bytes -------------------------------------------------------------------------
    def _chain_fallback(self, wires: Any) -> list[Any]:
        """A chain header's fallback list: peers as endpoints, the registry as our source."""
        return [self._registry_source if w == "registry" else Endpoint.from_wire(w)
                for w in wires or ()] or [self._registry_source]

    def _sources(self, wires: Any) -> list[Any]:
        """Pull sources from a deploy's wire list (peer endpoints, "registry"); the registry
        when the list names none."""
        from flashpoint.transfer.sources import sources_from_wire

        return sources_from_wire(wires or (), secret=self.secret, host_id=self.host_id,
                                 registry=self._registry_source) or [self._registry_source]

    async def _ready(self, segment: Any, need: tuple[int, int] | None, timeout_s: float) -> None:
        """Execute-while-load: a stage needs only its own byte range, a whole replica all."""
        if need is None:
            await segment.wait_complete(timeout_s)
        else:
            await segment.wait_range(need[0], need[1], timeout_s)

    async def _publish_when_complete(self, segment: Any, timeout_s: float) -> None:
        try:
            await segment.wait_complete(timeout_s)
        except Exception as exc:
            self.cache.abort(segment.key, exc)
            return
        self.cache.on_complete(segment)

    async def _fill_logged(self, manifest: Manifest, sources: list[Any], timeout_s: float,
                           first: tuple[int, int] | None = None) -> None:
        key = manifest.key
        try:
            await self.cache.ensure(manifest, sources, timeout_s=timeout_s, first=first,
                                    hold=lambda: self.stage_holds.wait(key))
        except Exception as exc:  # waiters on the segment see it; this is the log line
            log.warning("fill_failed", model=key, error=repr(exc))
            self.stage_holds.release(key, "fill failed")  # nothing left to hold back

    async def _obtain(self, spec: FunctionSpec, source: dict[str, Any] | None,
                      manifest: Manifest | None, stage: Any = None,
                      pinned: str | None = None) -> tuple[CacheEntry, str]:
        """The model in this host's RAM, from where the controller's plan says; returns the
        entry and a label of where its bytes came from. With ``stage`` (first and last layer)
        it returns as soon as that stage's byte range is verified, while the rest still
        arrives (execute-while-load). Whatever it returns was verified against the manifest
        the controller pinned (``pinned``, its digest), or the registry's own when none was
        sent; a cached copy with another digest is never used (entry_for)."""
        from flashpoint.registry.manifest import byte_range_for_layers
        from flashpoint.transfer.chain import send_chain

        key = spec.model_key
        timeout_s = self.config.controller.deploy_timeout_s
        if manifest is None:  # the registry is the root of trust, never a cached copy
            manifest = await self.store.get_manifest(spec.model, spec.model_version)
        if pinned and manifest.digest != pinned:
            raise IntegrityError(f"{key}: the registry's manifest is not the one the "
                                 "controller pinned")
        entry = self.cache.entry_for(manifest)
        need = byte_range_for_layers(manifest, stage[0], stage[1]) if stage is not None else None
        if entry is not None:  # held, or being filled already: one transfer per host and model
            joined = not entry.complete
            if need is None:  # a whole replica needs the rest now
                self.stage_holds.release(key, "a whole replica needs the model")
            await self._ready(entry.segment, need, timeout_s)
            return entry, (entry.source if joined else "local")
        src = source or {}
        kind = str(src.get("kind", ""))
        fallback = self._sources(src.get("fallback"))
        if kind == "chain":
            arrived = await self.cache.wait_entry(key, self.hc.chain_wait_s)
            if arrived is not None and arrived.digest != manifest.digest:
                raise IntegrityError(f"{key}: the chain brought another manifest than the "
                                     "pinned one")
            if arrived is not None:
                self.cache.set_source(key, f"chain:{src.get('sender', '?')}")
                await self._ready(arrived.segment, need, timeout_s)
                # HostCache.on_complete (which sets fetch_s) runs in the data plane only after
                # the upstream's END frame; the segment completes before that, so a cold start
                # read fetch_s == 0. Time the fetch here when it has not been set yet.
                if not arrived.fetch_s:
                    arrived.fetch_s = time.perf_counter() - arrived.started_s
                return arrived, arrived.source
            log.warning("chain_never_arrived", transfer_id=src.get("transfer_id"), model=key)
        elif kind == "chain_head" and src.get("chain"):
            chain = [Endpoint.from_wire(e) for e in src["chain"]]
            upstream = self._sources(src.get("upstream"))
            segment = self.cache.open_for_receive(manifest, source="chain:registry")
            tid = str(src.get("transfer_id", ""))
            self._spawn_task(self._relay(send_chain(
                segment, chain, secret=self.secret, transfer_id=tid, upstream=upstream,
                fallback=self._chain_fallback(src.get("fallback")), host_id=self.host_id,
                stall_timeout_s=self.hc.chain_stall_timeout_s,
                orphan_grace_s=self.hc.orphan_grace_s), tid, key, pinned=False), f"chain:{tid}")
            self._spawn_task(self._publish_when_complete(segment, timeout_s), f"publish:{key}")
            await self._ready(segment, need, timeout_s)
            if segment.complete:
                self.cache.on_complete(segment)  # now, so this cold start reports its fetch time
            done = self.cache.entry(key)
            if done is None:
                raise ModelNotFound(f"{key} left the cache as soon as it arrived")
            return done, "chain:registry"
        if need is None:
            entry, _ = await self.cache.ensure(manifest, fallback, timeout_s=timeout_s)
            return entry, entry.source
        self._registry_source.break_spans_at(manifest, manifest.chunks_for_range(*need))
        self.stage_holds.hold(key)
        self._spawn_task(self._fill_logged(manifest, fallback, timeout_s, need), f"fill:{key}")
        entry = await self.cache.wait_entry(key, timeout_s)  # opened at the fill's first step
        if entry is None:
            raise ModelNotFound(f"{key}: the fill did not start")
        await self._ready(entry.segment, need, timeout_s)
        return entry, entry.source

    async def _relay(self, coro: Any, transfer_id: str, key: str, *, pinned: bool = True) -> None:
        """Run one chain this host heads; its outcome is logged (receivers report their own)."""
        try:
            result = await coro
            log.info("chain_finished", transfer_id=transfer_id, model=key,
                     completed=result.completed, failed=result.failed,
                     seconds=round(result.seconds, 3))
        except Exception as exc:
            log.warning("chain_failed", transfer_id=transfer_id, model=key, error=repr(exc))
        finally:
            if pinned:
                self.cache.unpin(key)

    async def _start_chain(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Stream a model this host holds down a chain the controller built."""
        from flashpoint.transfer.chain import send_chain

        key = ModelKey.of(str(payload.get("model")), str(payload.get("version")))
        entry = self.cache.get(key)
        if entry is None:
            raise ModelNotFound(f"{key} is not in host {self.host_id}'s RAM")
        pinned = payload.get("manifest_digest")
        if pinned is not None and entry.digest != pinned:
            raise IntegrityError(f"{key} in host {self.host_id}'s RAM is not the pinned manifest")
        chain = [Endpoint.from_wire(e) for e in payload.get("chain") or []]
        tid = str(payload.get("transfer_id", ""))
        self.cache.pin(key)  # not evicted while it streams
        self._spawn_task(self._relay(send_chain(
            entry.segment, chain, secret=self.secret, transfer_id=tid, host_id=self.host_id,
            fallback=self._chain_fallback(payload.get("fallback")),
            stall_timeout_s=self.hc.chain_stall_timeout_s,
            orphan_grace_s=self.hc.orphan_grace_s), tid, key), f"chain:{tid}")
        return {"accepted": True}

    async def _expect_transfer(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """The controller's word that chain ``transfer_id`` will bring this host the model
        whose manifest has ``manifest_digest``: only then does the data plane accept it."""
        tid, digest = payload.get("transfer_id"), payload.get("manifest_digest")
        if not (isinstance(tid, str) and tid and isinstance(digest, str) and digest):
            raise BadRequest("expect_transfer needs a transfer_id and a manifest_digest")
        self.admission.announce(tid, digest)
        return {"expected": True}

    async def _cold_start(self, rt: ReplicaTask, spec: FunctionSpec, source: dict[str, Any] | None,
                          manifest: Manifest | None, pinned: str | None = None) -> None:
        bind_ids(replica_id=rt.replica_id)
        model_key = spec.model_key
        try:
            began = time.perf_counter()
            entry, label = await self._obtain(spec, source, manifest, rt.stage, pinned)
            obtained = time.perf_counter()
            hit = label == "local"
            self.cache.pin(model_key)
            try:
                worker = await self._take_worker()
                worker.replica_id, worker.device_id = rt.replica_id, rt.device_id
                worker.function, worker.model_key = spec.name, model_key
                self.gpu.bind_worker(rt.replica_id, worker.proc.pid)  # before its CUDA starts
                rt.worker = worker
                device = self._worker_device(rt)
                dev = self.gpu.device(rt.device_id)
                if rt.stage is None and dev is not None:
                    rt.weight_slot = self.gpu.weight_slot(dev, model_key)
                reply = await worker.conn.call("load_replica", {
                    **({"weight_slot": rt.weight_slot} if rt.weight_slot else {}),
                    "env": rt.env,  # applied by the worker before it initialises CUDA
                    "replica_id": rt.replica_id, "host_id": self.host_id, "spec": spec.to_dict(),
                    "cache_path": str(entry.path), "manifest_json": entry.manifest_json,
                    "device": device, "controller_url": self.hc.controller_url,
                    "source": label, "stage": rt.stage,
                    # A stage starts before its entry completes: its fetch is until now.
                    "fetch_s": 0.0 if hit else (entry.fetch_s
                                                or time.perf_counter() - entry.started_s),
                    # This host's part of the cold start (controller/cold_timings.py); the
                    # worker returns it with its own phases.
                    "host_timings_s": {"obtain": obtained - began,
                                       "assign": time.perf_counter() - obtained},
                    **({"pipeline": rt.pipeline} if rt.pipeline is not None else {}),
                }, timeout_s=self.config.controller.deploy_timeout_s)
                if rt.pipeline is not None:
                    ep = Endpoint.from_wire(reply.get("pipeline_endpoint"))
                    if self.hc.data_advertise_host:
                        ep = Endpoint(ep.host_id, self.hc.data_advertise_host, ep.port)
                    rt.pipeline_endpoint = ep
                worker.warm = True
                rt.weights_role = str(reply.get("weights") or "")
                if rt.pipeline_endpoint is not None:
                    await self._report("stage_ready", {
                        "replica_id": rt.replica_id, "host_id": self.host_id,
                        "pipeline_endpoint": rt.pipeline_endpoint.to_wire(), "source": label,
                        "timings_s": reply.get("timings_s") or {}})
                if rt.stage is not None:
                    self._spawn_task(self._complete_stage(rt, entry.segment),
                                     f"complete:{rt.replica_id}")
                log.info("replica_started", source=label, timings=reply.get("timings_s"))
            finally:
                self.cache.unpin(model_key)
                # Refill the warm pool only now: starting a Python+torch process while a
                # cold start loads would steal the CPU that the cold start is waiting for
                # (and a stage's, that its first pass needs: stage_hold.py); a whole
                # replica's refill waits for its first answer too (the request that waited
                # for this cold start), at most refill_hold_s.
                self._spawn_task(self._refill(
                    after=model_key if rt.stage is not None else None,
                    served=rt.worker if rt.stage is None else None), "refill")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._start_failed(rt, exc)

    async def _complete_stage(self, rt: ReplicaTask, segment: Any) -> None:
        """Model completion: once this host holds the whole model, turn the stage replica
        ``rt`` into a whole one (its worker builds the whole module over the bytes it maps;
        its stage server, if any, keeps serving until ``dissolve_stage``). A failure leaves
        it a working stage and is logged."""
        try:
            await segment.wait_complete(self.config.controller.deploy_timeout_s)
            w = rt.worker
            if w is None or self.replicas.get(rt.replica_id) is not rt or w.conn is None:
                return
            reply = await w.conn.call("complete_replica", {"replica_id": rt.replica_id},
                                      timeout_s=self.config.controller.deploy_timeout_s)
            rt.whole = bool(reply.get("completed"))
            log.info("stage_completed", replica_id=rt.replica_id, timings=reply.get("timings_s"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("stage_completion_failed", replica_id=rt.replica_id, error=repr(exc))

    async def _link_stage(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Point a stage replica's pipeline server at the next stage (the controller links a
        group once every stage serves; the link opens on the first request)."""
        rt = self.replicas.get(str(payload.get("replica_id", "")))
        if rt is None or rt.worker is None or rt.worker.conn is None or rt.pipeline is None:
            raise NotFound(f"no pipeline stage {payload.get('replica_id')!r} on {self.host_id}")
        nxt = Endpoint.from_wire(payload.get("next_hop"))  # BadRequest here, not in the worker
        await rt.worker.conn.call("set_next_hop", {"next_hop": nxt.to_wire()}, timeout_s=10.0)
        rt.pipeline["next_hop"] = nxt.to_wire()
        return {"linked": True}

    async def _begin_completion(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """The controller's word that a stage's group answered its first request: the held
        completion fill and pool refill of the stage's model go now (stage_hold.py)."""
        rt = self.replicas.get(str(payload.get("replica_id", "")))
        if rt is None or rt.worker is None or rt.worker.model_key is None:
            return {"released": False}
        return {"released": self.stage_holds.release(rt.worker.model_key, "group answered")}

    async def _dissolve_stage(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Stop a stage replica's pipeline server (the controller's call, once the pipeline
        gets no more work); a completed replica keeps serving as a whole one."""
        rt = self.replicas.get(str(payload.get("replica_id", "")))
        if rt is None or rt.worker is None or rt.worker.conn is None:
            return {"dissolved": False}
        reply = await rt.worker.conn.call("dissolve_stage", {}, timeout_s=10.0)
        rt.pipeline_endpoint = None
        return {"dissolved": bool(reply.get("dissolved"))}

    async def _stop_replica(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        rt = self.replicas.pop(str(payload.get("replica_id", "")), None)
        if rt is None:
            return {"stopped": False}
        self._release(rt)
        if rt.weights_role == "exporter" and any(
                r.weight_slot == rt.weight_slot for r in self.replicas.values()):
            # CUDA IPC memory is the exporter's: its readers lose their weights with it.
            log.warning("weights_exporter_stopped_before_readers", replica_id=rt.replica_id,
                        readers=[r.replica_id for r in self.replicas.values()
                                 if r.weight_slot == rt.weight_slot])
        if rt.task is not None and not rt.task.done():
            rt.task.cancel()
        if rt.worker is not None:
            rt.worker.replica_id = None
            self._spawn_task(self._stop_worker(rt.worker, 5.0), f"stop:{rt.replica_id}")
        return {"stopped": True}

    async def _status(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        return {"host_id": self.host_id, "replicas": self._replica_reports(),
                "stages": self._stage_reports(),
                "cache": self.cache.keys(), "cache_stats": self.cache.stats(),
                "idle_workers": len(self.idle), "gpu": self.gpu.status(),
                "worker_pids": [w.proc.pid for w in self.workers.values()]}

    # GPU sharing and MIG (the logic is in host/gpu.py) ------------------------------
    async def _set_replica_share(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Change a running replica's GPU share live (a tokens host; MPS answers Conflict)."""
        rid = str(payload.get("replica_id", ""))
        rt = self.replicas.get(rid)
        if rt is None:
            raise NotFound(f"no replica {rid!r} on {self.host_id}")
        reply = self.gpu.set_share(payload)
        rt.share = GpuShare.from_wire(payload.get("share"))
        return reply

    async def _apply_mig(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Apply a MIG geometry to one GPU (refused while replicas run on it: GpuBusy), then
        report the new slices to the controller as placement units."""
        def replicas_on(idx: int) -> list[str]:
            return sorted(r.replica_id for r in self.replicas.values()
                          if (d := self.gpu.device(r.device_id)) is not None and d.gpu_index == idx)

        reply = await self.gpu.apply_mig(payload, replicas_on)
        self.devices = list(self.gpu.devices)
        await self._report("register_host", self._registration())
        return reply

    # workers ----------------------------------------------------------------------------
    async def _worker_hello(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        w = self.workers.get(str(payload.get("worker_id")))
        if w is None:
            raise BadRequest("unknown worker")
        w.conn = conn
        if not w.hello.done():
            w.hello.set_result(True)
        return {"ok": True}

    async def _replica_served(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """A worker's replica answered its first request: the warm pool may refill now."""
        w = self.workers.get(str(payload.get("worker_id")))
        if w is None or w.conn is not conn:
            raise BadRequest("unknown worker")
        w.served.set()
        return {"ok": True}

    async def _spawn_worker(self) -> WorkerProcess:
        worker_id = new_id(f"w-{self.host_id}")
        env = dict(os.environ)
        # Workers get the data plane's key and their own credential, never the host's.
        env["FLASHPOINT_SECRET"] = self.secret.decode()
        env[roles.CREDENTIAL_ENV] = roles.Credential(
            roles.worker_principal(self.host_id), roles.worker_key(self.credential.key)).token()
        env.update(self.gpu.spawn_env())  # LD_PRELOAD of the hook on a tokens host
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flashpoint.worker.actor", "--host-url", self._local_url,
            "--worker-id", worker_id, "--torch-threads", str(self.hc.torch_threads),
            *(["--preload-transformers"] if _preload(self.hc) else []),
            env=env, stdin=asyncio.subprocess.DEVNULL,
        )
        w = WorkerProcess(worker_id, proc, asyncio.get_running_loop().create_future())
        self.workers[worker_id] = w
        self._spawn_task(self._watch(w), f"watch:{worker_id}")
        try:
            await asyncio.wait_for(asyncio.shield(w.hello), self.hc.worker_start_timeout_s)
        except BaseException:
            await self._stop_worker(w, 1.0)
            raise
        return w

    async def _take_worker(self) -> WorkerProcess:
        return self.idle.pop(0) if self.idle else await self._spawn_worker()

    async def _refill(self, after: str | None = None,
                      served: WorkerProcess | None = None) -> None:
        if after is not None:
            await self.stage_holds.wait(after)
        if served is not None and served.warm:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(served.served.wait(), self.hc.refill_hold_s)
        async with self._refill_lock:
            while not self._stopping and len(self.idle) < self.hc.warm_pool_size:
                try:
                    self.idle.append(await self._spawn_worker())
                except Exception as exc:  # keep serving; the next deploy spawns on demand
                    log.warning("warm_pool_spawn_failed", error=repr(exc))
                    return

    async def _watch(self, w: WorkerProcess) -> None:
        rc = await w.proc.wait()
        self.workers.pop(w.worker_id, None)
        if w in self.idle:
            self.idle.remove(w)
        if not w.hello.done():
            w.hello.set_exception(FlashpointError(f"worker exited with {rc} before hello"))
            w.hello.exception()
        if w.replica_id is not None and not w.stopping and not self._stopping:
            rid, during_start = w.replica_id, not w.warm
            rt = self.replicas.pop(rid, None)
            if rt is not None:
                self._release(rt)
            log.warning("worker_died", worker_id=w.worker_id, rc=rc, replica_id=rid)
            await self._report("replica_failed", {
                "replica_id": rid, "reason": f"worker process exited with status {rc}",
                "during_start": during_start, "code": "worker_exited"})

    async def _stop_worker(self, w: WorkerProcess, timeout_s: float) -> None:
        w.stopping = True
        if w.proc.returncode is None and w.conn is not None and not w.conn.closed:
            with contextlib.suppress(Exception):
                await w.conn.call("shutdown", {}, timeout_s=min(1.0, timeout_s))
        try:
            await asyncio.wait_for(w.proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()  # by PID, through the process handle we started
            await w.proc.wait()


def _pinned_digest(payload: dict[str, Any], manifest: Manifest | None) -> str | None:
    """The manifest digest a deploy pins: the one it names (it must match the manifest it
    carries: IntegrityError), else its manifest's; None when it has neither."""
    digest = payload.get("manifest_digest")
    if digest is not None and not isinstance(digest, str):
        raise BadRequest("manifest_digest must be a string")
    if manifest is not None:
        if digest is not None and digest != manifest.digest:
            raise IntegrityError(f"deploy of {manifest.key}: its manifest "
                                 "does not have the digest it pins")
        return manifest.digest
    return digest


def _preload(hc: HostConfig) -> bool:
    """Whether idle workers import transformers: the config, unless the environment says
    ``FLASHPOINT_PRELOAD_TRANSFORMERS=0`` (the test suite does: its clusters start hundreds
    of workers, few of which serve a Hugging Face model)."""
    return hc.preload_transformers and os.environ.get("FLASHPOINT_PRELOAD_TRANSFORMERS") != "0"
