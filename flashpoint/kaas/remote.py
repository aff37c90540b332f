"""KaaS executors in GPU worker processes: the worker's side and the controller's handle.

Objects reach workers by **shipping on miss**. The controller keeps the object store (the
data layer); a worker keeps no copy of it, only its executor's two cache tiers. Every reply
says which object keys the worker's executor holds (device or host tier), and the handle
ships, inline with the next request, the bytes of exactly the store inputs the worker does
not hold. Outputs stored under a key come back in the reply and the controller puts them
into the store (their device copy stays cached on the worker as that object).

Cost of this choice: every input byte crosses the controller once per worker that misses
it (the controller's link is the bottleneck for large constants on many workers; a
registry/S3-backed store that workers read directly would remove that), and each reply
carries the list of held keys (O(cached objects) per request, small next to the data).
It needs nothing new to reach: the bytes ride the RPC connection the controller already
holds to each worker. Hence one limit: a request and its reply are one RPC frame each, so
what a request may move each way is bounded up front (:func:`check_frame_budget`, a 413);
chunked shipping (or workers reading the store themselves) would lift it.

Two races are closed explicitly:

* the held set can be stale (a failed request evicted something, or the host tier evicted
  an object while loading another one of the same request): the worker then fails the
  request with ``ObjectNotFound`` before any kernel runs, and the handle retries once with
  every store input shipped;
* a stored output whose key another writer won in the meantime (``ObjectExists`` at the
  controller) would leave the worker caching bytes the data layer does not hold: the handle
  tells the worker to ``forget`` that key with its next request.

Wire messages (version 1; their types are in messages/controller_worker.py)::

    kaas_run    KaasRun {version, request_id, client, request: KaasRequest dict,
                         objects: {key: bytes}, forget: [key]}
             -> KaasRunReply {version, result: KaasResult wire dict, objects: {key: bytes},
                              held: [object key], cached: [cache key], free_bytes,
                              capacity_bytes}
    kaas_reset  KaasReset {} -> KaasState {held, cached, free_bytes, capacity_bytes}
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Protocol

from flashpoint.errors import BadRequest, ObjectExists, ObjectNotFound, PayloadTooLarge
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.graph import GraphPlan
from flashpoint.kaas.spec import BufferKind, KaasRequest
from flashpoint.kaas.store import MemoryObjectStore, ObjectStore
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.controller_worker import KaasReset, KaasRun, KaasRunReply, KaasState

if TYPE_CHECKING:  # torch: only the worker side builds an executor
    from flashpoint.kaas.executor import Executor

WIRE_VERSION = 1
# What one request may move each way: an RPC frame (rpc.frames.DEFAULT_MAX_FRAME_BYTES,
# 16 MiB) less room for the request's description and the reply's counters.
FRAME_BUDGET_BYTES = 15 << 20


def check_frame_budget(req: KaasRequest, budget_bytes: int = FRAME_BUDGET_BYTES) -> None:
    """PayloadTooLarge (413) when ``req`` could not travel to a worker or back in one frame:
    its store inputs (shipped on a miss) plus inline inputs (base64 in the request), or
    its outputs (returned inline or as stored objects)."""
    inbound = sum(b.size_bytes if b.key is not None else 4 * math.ceil(b.size_bytes / 3)
                  for b in req.buffers if b.kind is BufferKind.INPUT)
    outbound = sum(b.size_bytes for b in req.buffers if b.kind is BufferKind.OUTPUT)
    if max(inbound, outbound) > budget_bytes:
        raise PayloadTooLarge(
            f"this request moves {inbound} bytes to a worker and {outbound} back; KaaS on "
            f"workers moves at most {budget_bytes} bytes each way per request (one RPC frame)",
            inbound_bytes=inbound, outbound_bytes=outbound, budget_bytes=budget_bytes)


class WorkerKaasRuntime:
    """A worker's KaaS side: one :class:`Executor`, created on first use, on ``device``.

    ``capacity_bytes``: its device cache (None: device memory minus a reserve, see
    :func:`~flashpoint.kaas.executor.default_capacity_bytes`). Synchronous: the worker
    calls :meth:`run` on a thread. Requests are serialised (one stream, serial kernels).
    """

    def __init__(self, executor_id: str, device: str = "cpu", *,
                 capacity_bytes: int | None = None) -> None:
        self.executor_id = executor_id
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._executor: Executor | None = None
        self._lock = threading.Lock()

    def executor(self) -> Executor:
        """The executor, built on first use (imports torch, and on a GPU makes the context)."""
        with self._lock:
            if self._executor is None:
                from flashpoint.kaas.executor import Executor

                self._executor = Executor(self.executor_id, MemoryObjectStore(),
                                          device=self.device,
                                          capacity_bytes=self.capacity_bytes)
            return self._executor

    def state(self) -> KaasState:
        """What the controller's handle needs to route and ship: held objects, cache keys."""
        ex = self.executor()
        return KaasState(held=ex.held_objects(), cached=sorted(ex.cached_keys()),
                         free_bytes=ex.cache.free_bytes, capacity_bytes=ex.cache.capacity_bytes)

    def run(self, msg: KaasRun) -> KaasRunReply:
        """One ``kaas_run``: stage the shipped objects, run, return stored outputs' bytes."""
        if msg.version != WIRE_VERSION:
            raise BadRequest(f"kaas_run version {msg.version!r}; this worker "
                             f"speaks {WIRE_VERSION}")
        objects, forget = msg.objects, msg.forget
        ex = self.executor()
        with self._lock:  # one request at a time owns the staging store
            ex.forget(list(forget))
            # A fresh staging store per request: shipped inputs live only until the host
            # cache has them, stored outputs only until they are in the reply.
            staging = MemoryObjectStore()
            for key, data in objects.items():
                staging.put(key, data)
            ex.store = staging
            result = ex.run_wire({"request": msg.request, "client": msg.client})
            out = {key: staging.get(key) for key in result["stored"].values()}
        st = self.state()
        return KaasRunReply(version=WIRE_VERSION, result=result, objects=out, held=st.held,
                            cached=st.cached, free_bytes=st.free_bytes,
                            capacity_bytes=st.capacity_bytes)

    def reset(self) -> KaasState:
        """Drop every cached buffer (an exclusive reassignment's cold start)."""
        self.executor().reset()
        return self.state()


class RpcConnection(Protocol):
    """The part of an RPC connection the handle uses (tests pass a fake)."""

    async def call(self, method: str, payload: dict[str, Any], *, timeout_s: float,
                   trace: str | None = None) -> dict[str, Any]: ...


class WorkerExecutorHandle:
    """An :class:`~flashpoint.kaas.pool.ExecutorHandle` for the executor of one worker,
    over the controller's RPC connection to it; ships the store inputs it lacks.

    ``run_timeout_s`` bounds one call (the pool's own deadline answers the caller sooner).
    """

    def __init__(self, executor_id: str, conn: RpcConnection, store: ObjectStore, *,
                 capacity_bytes: int, run_timeout_s: float = 300.0) -> None:
        self.executor_id = executor_id
        self.conn = conn
        self.store = store
        self.run_timeout_s = run_timeout_s
        self.capacity_bytes = capacity_bytes
        self._held: frozenset[str] = frozenset()  # object keys the worker holds
        self._cached: frozenset[str] = frozenset()  # its device cache keys (affinity)
        self._free_bytes = capacity_bytes
        self._forget: set[str] = set()
        self.requests = 0
        self.restarts = 0
        self.shipped_bytes = 0  # object bytes sent to the worker, cumulative
        self.returned_bytes = 0  # stored-output bytes received from it, cumulative
        self.retries = 0  # requests re-sent with every input (a stale held set)

    # ExecutorHandle -------------------------------------------------------------------
    def cached_keys(self) -> frozenset[str]:
        return self._cached

    def free_bytes(self) -> int:
        return self._free_bytes

    async def run(self, plan: GraphPlan, client: str, request_id: str = "") -> KaasResult:
        msg, shipped = self._request(plan, client, request_id, ship_all=False)
        try:
            reply = await self._call_run(msg, request_id)
        except ObjectNotFound:
            # The worker lost an object we thought it held; nothing ran yet. Once more with
            # every store input on board.
            self.retries += 1
            msg, more = self._request(plan, client, request_id, ship_all=True)
            shipped += more
            reply = await self._call_run(msg, request_id)
        self._forget -= set(msg.forget)
        self._absorb(reply)
        self.requests += 1
        result = KaasResult.from_wire(reply.result)
        result.cache["shipped_bytes"] = shipped
        for key, data in reply.objects.items():
            self.returned_bytes += len(data)
            try:
                self.store.put(key, data)
            except ObjectExists:
                # The worker now caches bytes the data layer does not hold under this key.
                self._forget.add(key)
                self._held -= {key}
                self._cached -= {f"obj:{key}"}
                raise
        return result

    def forget(self, keys: list[str]) -> None:
        """Deleted or expired objects: the worker drops them with the next request."""
        self._forget.update(keys)
        self._held -= set(keys)
        self._cached -= {f"obj:{k}" for k in keys}

    async def restart(self) -> None:
        self.restarts += 1
        reply = await self.conn.call("kaas_reset", to_payload(KaasReset()),
                                     timeout_s=self.run_timeout_s)
        self._absorb(from_payload(KaasState, reply, method="kaas_reset"))

    # internals --------------------------------------------------------------------------
    async def _call_run(self, msg: KaasRun, request_id: str) -> KaasRunReply:
        reply = await self.conn.call("kaas_run", to_payload(msg), timeout_s=self.run_timeout_s,
                                     trace=request_id or None)
        return from_payload(KaasRunReply, reply, method="kaas_run")

    def _request(self, plan: GraphPlan, client: str, request_id: str, *,
                 ship_all: bool) -> tuple[KaasRun, int]:
        objects: dict[str, bytes] = {}
        for b in plan.request.buffers:
            if (b.kind is BufferKind.INPUT and b.key is not None and b.key not in objects
                    and (ship_all or b.key not in self._held)):
                objects[b.key] = self.store.get(b.key)
        shipped = sum(len(v) for v in objects.values())
        self.shipped_bytes += shipped
        return (KaasRun(version=WIRE_VERSION, request_id=request_id, client=client,
                        request=plan.request.to_dict(), objects=objects,
                        forget=sorted(self._forget)), shipped)

    def _absorb(self, reply: KaasRunReply | KaasState) -> None:
        self._held = frozenset(reply.held)
        self._cached = frozenset(reply.cached)
        self._free_bytes = reply.free_bytes
        self.capacity_bytes = reply.capacity_bytes

    def status(self) -> dict[str, Any]:
        """Counters for ``/v1/kaas/status`` (cache contents as of the last reply)."""
        return {"requests": self.requests, "restarts": self.restarts,
                "shipped_bytes": self.shipped_bytes, "returned_bytes": self.returned_bytes,
                "retries": self.retries, "held_objects": len(self._held),
                "cache": {"capacity_bytes": self.capacity_bytes,
                          "used_bytes": self.capacity_bytes - self._free_bytes,
                          "buffers": len(self._cached)}}
