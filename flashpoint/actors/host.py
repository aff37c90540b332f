"""HostManager: owns one machine — devices, the model cache, and worker processes.

It never makes cluster-wide decisions: it registers with the controller (again after every
reconnect, reporting the replicas it runs so a restarted controller adopts them), heartbeats,
and carries out ``deploy_replica`` / ``stop_replica``. Deploys are idempotent by replica id
and acknowledged at once; the cold start runs in the background and ends with the worker
announcing itself to the controller, or with ``replica_failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashpoint.config import ClusterConfig
from flashpoint.errors import BadRequest, FlashpointError
from flashpoint.gpu.inventory import Device, discover
from flashpoint.ids import new_id
from flashpoint.log import bind_ids, get_logger
from flashpoint.spec import FunctionSpec
from flashpoint.transfer.cache import HostCache, default_cache_dir

log = get_logger("flashpoint.host")


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


@dataclass
class ReplicaTask:
    replica_id: str
    function: str
    device_id: str
    task: asyncio.Task | None = None
    worker: WorkerProcess | None = None
    started_s: float = field(default_factory=time.monotonic)


class HostManager:
    """The per-host actor."""

    def __init__(self, config: ClusterConfig, store: Any, *, host_id: str | None = None) -> None:
        self.config = config
        self.hc = config.host
        self.store = store
        self.host_id = host_id or self.hc.host_id or socket.gethostname()
        self.secret = config.secret.encode()
        cache_dir = (Path(self.hc.cache_dir) / self.host_id if self.hc.cache_dir
                     else default_cache_dir(f"{self.host_id}-{os.getpid()}"))
        self.cache = HostCache(cache_dir, self.hc.cache_bytes, self.host_id)
        self.devices: list[Device] = []
        self.workers: dict[str, WorkerProcess] = {}
        self.idle: list[WorkerProcess] = []
        self.replicas: dict[str, ReplicaTask] = {}
        self._server: Any = None
        self._local_url = ""
        self._controller: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._refill_lock = asyncio.Lock()
        self._stopping = False

    # lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        from flashpoint.rpc import ReconnectingClient, RpcServer

        bind_ids(host_id=self.host_id)
        self.devices = discover(self.hc.cpu_devices, self.hc.device_memory_bytes)
        self.cache.start()
        self._server = RpcServer({"worker_hello": self._worker_hello}, secret=self.secret)
        host, port = await self._server.start(self.hc.listen_host, 0)
        self._local_url = f"ws://{host}:{port}/rpc"
        self._spawn_task(self._refill(), "refill")
        self._controller = ReconnectingClient(
            self.hc.controller_url,
            {"deploy_replica": self._deploy, "stop_replica": self._stop_replica,
             "host_status": self._status},
            secret=self.secret, on_connected=self._register,
        )
        await self._controller.start()
        self._spawn_task(self._heartbeat_loop(), "heartbeat")
        log.info("host_started", devices=[d.device_id for d in self.devices], url=self._local_url)

    async def wait_pool_ready(self, timeout_s: float) -> bool:
        """Wait until the warm pool is full (a cold start then pays only for model bytes)."""
        deadline = time.monotonic() + timeout_s
        while len(self.idle) < self.hc.warm_pool_size and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.idle) >= self.hc.warm_pool_size

    async def stop(self, timeout_s: float = 10.0) -> None:
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
            warm = bool(r.worker and r.worker.warm)
            out.append([r.replica_id, r.function, r.device_id, warm])
        return out

    async def _register(self, conn: Any) -> None:
        await conn.call("register_host", {
            "host_id": self.host_id,
            "devices": [d.to_dict() for d in self.devices],
            "ram_bytes": self.hc.cache_bytes,
            "cached_models": self.cache.keys(),
            "replicas": self._replica_reports(),
        }, timeout_s=10.0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.hc.heartbeat_interval_s)
            try:
                await self._controller.notify("heartbeat", {
                    "host_id": self.host_id, "cached_models": self.cache.keys(),
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
        spec = FunctionSpec.from_dict(payload.get("spec"))
        device_id = str(payload.get("device_id", ""))
        if device_id not in {d.device_id for d in self.devices}:
            raise BadRequest(f"unknown device {device_id!r} on host {self.host_id}")
        rt = ReplicaTask(replica_id, spec.name, device_id)
        self.replicas[replica_id] = rt
        rt.task = self._spawn_task(self._cold_start(rt, spec), f"coldstart:{replica_id}")
        return {"accepted": True}

    async def _cold_start(self, rt: ReplicaTask, spec: FunctionSpec) -> None:
        bind_ids(replica_id=rt.replica_id)
        model_key = f"{spec.model}@{spec.model_version}"
        try:
            entry, hit = await self.cache.ensure(self.store, spec.model, spec.model_version)
            self.cache.pin(model_key)
            try:
                worker = await self._take_worker()
                worker.replica_id, worker.device_id = rt.replica_id, rt.device_id
                worker.function, worker.model_key = spec.name, model_key
                rt.worker = worker
                device = rt.device_id if rt.device_id.startswith("cuda") else "cpu"
                reply = await worker.conn.call("load_replica", {
                    "replica_id": rt.replica_id, "host_id": self.host_id, "spec": spec.to_dict(),
                    "cache_path": str(entry.path), "manifest_json": entry.manifest_json,
                    "device": device, "controller_url": self.hc.controller_url,
                    "fetch_s": 0.0 if hit else entry.fetch_s,
                }, timeout_s=self.config.controller.deploy_timeout_s)
                worker.warm = True
                log.info("replica_started", cache_hit=hit, timings=reply.get("timings_s"))
            finally:
                self.cache.unpin(model_key)
                # Refill the warm pool only now: starting a Python+torch process while a
                # cold start loads would steal the CPU that the cold start is waiting for.
                self._spawn_task(self._refill(), "refill")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = exc.message if isinstance(exc, FlashpointError) else f"{type(exc).__name__}: {exc}"
            log.warning("cold_start_failed", reason=reason)
            self.replicas.pop(rt.replica_id, None)
            if rt.worker is not None:
                rt.worker.replica_id = None  # the watcher must not report it twice
                await self._stop_worker(rt.worker, 2.0)
            await self._report("replica_failed", {
                "replica_id": rt.replica_id, "reason": reason[:500], "during_start": True})

    async def _stop_replica(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        rt = self.replicas.pop(str(payload.get("replica_id", "")), None)
        if rt is None:
            return {"stopped": False}
        if rt.task is not None and not rt.task.done():
            rt.task.cancel()
        if rt.worker is not None:
            rt.worker.replica_id = None
            self._spawn_task(self._stop_worker(rt.worker, 5.0), f"stop:{rt.replica_id}")
        return {"stopped": True}

    async def _status(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        return {"host_id": self.host_id, "replicas": self._replica_reports(),
                "cache": self.cache.keys(), "idle_workers": len(self.idle),
                "worker_pids": [w.proc.pid for w in self.workers.values()]}

    # workers ----------------------------------------------------------------------------
    async def _worker_hello(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        w = self.workers.get(str(payload.get("worker_id")))
        if w is None:
            raise BadRequest("unknown worker")
        w.conn = conn
        if not w.hello.done():
            w.hello.set_result(True)
        return {"ok": True}

    async def _spawn_worker(self) -> WorkerProcess:
        worker_id = new_id(f"w-{self.host_id}")
        env = dict(os.environ)
        env["FLASHPOINT_SECRET"] = self.config.secret
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flashpoint.actors.worker", "--host-url", self._local_url,
            "--worker-id", worker_id, "--torch-threads", str(self.hc.torch_threads),
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

    async def _refill(self) -> None:
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
            self.replicas.pop(rid, None)
            log.warning("worker_died", worker_id=w.worker_id, rc=rc, replica_id=rid)
            await self._report("replica_failed", {
                "replica_id": rid, "reason": f"worker process exited with status {rc}",
                "during_start": during_start})

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
