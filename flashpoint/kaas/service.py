"""KaaS as the gateway sees it: an object store plus an executor pool.

:class:`KaasService` validates a request (typed 400s before it queues), checks it can fit
on an executor (413) and that its store inputs exist with the declared sizes (404/400),
then runs it on the pool. The pool only uses :class:`~flashpoint.kaas.pool.ExecutorHandle`:
:func:`local_service` builds in-process executors (tests, benchmarks); a cluster's
controller builds one over executors on GPU workers (``controller/kaas_pool.py``,
``kaas/remote.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashpoint.errors import BufferCacheFull, BufferMismatch
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.graph import GraphPlan, plan_graph
from flashpoint.kaas.library import KernelLibrary, default_library
from flashpoint.kaas.pool import ExecutorPool, LocalExecutorHandle
from flashpoint.kaas.spec import BufferKind, KaasRequest
from flashpoint.kaas.store import DataLayer, MemoryObjectStore


class KaasService:
    """Validated KaaS requests on an executor pool, inputs and outputs in ``store``.

    ``capacity_bytes``: one executor's device cache (the 413 bound) when the pool cannot
    tell (remote executors that are not up yet); by default the pool's smallest local one.
    """

    def __init__(self, store: DataLayer, pool: ExecutorPool,
                 library: KernelLibrary | None = None, *,
                 max_buffer_bytes: int | None = None,
                 capacity_bytes: int | None = None) -> None:
        self.store = store
        self.pool = pool
        # A deleted or expired key may come back with other bytes: no executor keeps a copy.
        store.add_removal_listener(pool.forget)
        self.library = library or default_library()
        cap = capacity_bytes or pool.min_capacity_bytes()
        self.max_buffer_bytes = max_buffer_bytes or cap or (1 << 31)
        self._capacity_bytes = cap

    def plan(self, req: KaasRequest) -> GraphPlan:
        """Validate ``req``: typed 400s for bad graphs, 404 for missing objects, 413 when
        its buffers cannot all be resident on one executor."""
        plan = plan_graph(req, self.library)
        if self._capacity_bytes is not None and req.total_bytes > self._capacity_bytes:
            raise BufferCacheFull(f"the request's buffers total {req.total_bytes} bytes, over "
                                  f"an executor's {self._capacity_bytes}-byte cache",
                                  need_bytes=req.total_bytes,
                                  capacity_bytes=self._capacity_bytes)
        for b in req.buffers:
            if b.kind is BufferKind.INPUT and b.key is not None:
                size = self.store.size(b.key)  # ObjectNotFound
                if size != b.size_bytes:
                    raise BufferMismatch(f"input {b.name!r}: object {b.key!r} has {size} bytes,"
                                         f" the buffer declares {b.size_bytes}", buffer=b.name)
        return plan

    async def invoke(self, plan: GraphPlan, *, client: str, request_id: str,
                     timeout_s: float | None = None) -> KaasResult:
        return await self.pool.invoke(plan, client=client, request_id=request_id,
                                      timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        return {**self.pool.status(), "kernels": self.library.names()}

    async def fetch_status(self) -> dict[str, Any]:
        return self.status()

    async def put_object(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        self.store.put(key, data, ttl_s=ttl_s)

    async def delete_object(self, key: str) -> None:
        self.store.delete(key)

    async def get_object(self, key: str) -> bytes:
        return self.store.get(key)

    async def close(self) -> None:
        await self.pool.stop()


def local_service(n_executors: int = 4, *, policy: str = "affinity",
                  capacity_bytes: int = 256 << 20, store: DataLayer | None = None,
                  devices: Sequence[str] = ("cpu",), **executor_kwargs: Any) -> KaasService:
    """A service with ``n_executors`` in-process executors (round-robin over ``devices``)."""
    from flashpoint.kaas.executor import Executor  # torch: only where executors run

    store = store or MemoryObjectStore()
    library = default_library()
    restart_s = executor_kwargs.pop("restart_s", 0.0)
    handles = [LocalExecutorHandle(
        Executor(f"exec-{i}", store, library, device=devices[i % len(devices)],
                 capacity_bytes=capacity_bytes, **executor_kwargs), restart_s=restart_s)
        for i in range(n_executors)]
    return KaasService(store, ExecutorPool(handles, policy), library)
