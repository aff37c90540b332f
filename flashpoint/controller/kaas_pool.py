"""The controller's KaaS side: the object store and the pool of executors on workers.

Which workers form the pool: ``[controller] kaas_workers = N`` KaaS executor replicas, placed
by :class:`~flashpoint.controller.state.core.ControllerState` like model replicas (the
reserved function name :data:`~flashpoint.kaas.KAAS_FUNCTION`, a ``DeployKaas`` command), so
they share devices, host managers, warm worker processes and device-memory accounting with
model serving. Each one's worker announces itself with ``replica_ready`` over the
connection the controller keeps to every worker; once the replica is warm in the
controller's state and that connection is known (in either order), :class:`KaasPool` adds a
:class:`~flashpoint.kaas.remote.WorkerExecutorHandle` over that connection to the
:class:`~flashpoint.kaas.pool.ExecutorPool`, and removes it when the replica is forgotten or
its connection drops.

:class:`KaasPool` is the :class:`~flashpoint.kaas.backend.KaasBackend` the gateway's KaaS
routes call. With ``kaas_workers = 0`` invocations answer 503 ``kaas_unavailable``; the
object routes work either way (the native invoke's ``store_outputs`` uses the store too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashpoint.config import ControllerConfig
from flashpoint.errors import KaasUnavailable
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.graph import GraphPlan
from flashpoint.kaas.pool import ExecutorPool
from flashpoint.kaas.remote import RpcConnection, WorkerExecutorHandle, check_frame_budget
from flashpoint.kaas.service import KaasService
from flashpoint.kaas.spec import KaasRequest
from flashpoint.kaas.store import MemoryObjectStore
from flashpoint.log import get_logger

log = get_logger("flashpoint.kaas_pool")


class KaasPool:
    """KaaS for a controller: ``workers`` executors wanted, ``broken()`` says why none can
    start (the controller state's verdict after repeated failed starts), or None."""

    def __init__(self, cc: ControllerConfig,
                 broken: Callable[[], str | None] = lambda: None) -> None:
        self.workers = cc.kaas_workers
        self.cache_bytes = cc.kaas_cache_bytes
        self._broken = broken
        self.store = MemoryObjectStore(cc.kaas_store_bytes,
                                       tenant_quota_bytes=cc.kaas_store_key_bytes,
                                       default_ttl_s=cc.kaas_object_ttl_s)
        self.pool = ExecutorPool([], cc.kaas_policy, allow_empty=True)
        self.service = KaasService(self.store, self.pool, capacity_bytes=cc.kaas_cache_bytes)
        self.max_buffer_bytes = self.service.max_buffer_bytes

    # the controller's events ------------------------------------------------------------
    def ensure(self, replica_id: str, conn: RpcConnection) -> None:
        """A warm KaaS replica's worker is reachable on ``conn``: it is in the pool (a new
        handle when its connection changed: a reconnected worker is re-learnt, and the new
        handle ships what it needs once, since it does not know the worker's cache yet)."""
        handle = self.pool.get(replica_id)
        if isinstance(handle, WorkerExecutorHandle) and handle.conn is conn:
            return
        self.pool.add(WorkerExecutorHandle(replica_id, conn, self.store,
                                           capacity_bytes=self.cache_bytes))
        log.info("kaas_executor_joined", replica_id=replica_id,
                 executors=len(self.pool.handles))

    def replica_gone(self, replica_id: str) -> None:
        """The replica was forgotten or its connection dropped (idempotent)."""
        if self.pool.remove(replica_id) is not None:
            log.info("kaas_executor_left", replica_id=replica_id,
                     executors=len(self.pool.handles))

    # KaasBackend --------------------------------------------------------------------------
    def _check_enabled(self) -> None:
        if self.workers <= 0:
            raise KaasUnavailable("this cluster runs no KaaS executors; set [controller] "
                                  "kaas_workers", retry_after_s=60.0)
        reason = self._broken()
        if reason is not None and not self.pool.handles:
            raise KaasUnavailable(f"KaaS executors keep failing to start: {reason}",
                                  retry_after_s=30.0)

    def plan(self, req: KaasRequest) -> GraphPlan:
        """Validate (typed 400/404/413) once the cluster runs KaaS at all (else 503)."""
        self._check_enabled()
        plan = self.service.plan(req)
        check_frame_budget(req)
        return plan

    async def invoke(self, plan: GraphPlan, *, client: str, request_id: str,
                     timeout_s: float | None = None) -> KaasResult:
        """Queue on the pool; waits for an executor while none is warm, up to the deadline."""
        self._check_enabled()
        return await self.service.invoke(plan, client=client, request_id=request_id,
                                         timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        return {**self.service.status(), "executors_wanted": self.workers,
                "broken": self._broken(), "store": {"objects": len(self.store.keys()),
                                                   "used_bytes": self.store.used_bytes}}

    async def fetch_status(self) -> dict[str, Any]:
        return self.status()

    async def put_object(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        await self.service.put_object(key, data, ttl_s=ttl_s)

    async def delete_object(self, key: str) -> None:
        await self.service.delete_object(key)

    async def get_object(self, key: str) -> bytes:
        return await self.service.get_object(key)

    async def close(self) -> None:
        await self.pool.stop()
