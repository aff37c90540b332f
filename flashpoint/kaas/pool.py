"""A pool of KaaS executors behind one scheduling policy (pure, ``policy/kaas.py``).

The pool talks to executors only through :class:`ExecutorHandle`: :class:`LocalExecutorHandle`
runs an in-process :class:`~flashpoint.kaas.executor.Executor` on a thread; a handle over a
worker's RPC connection (``Executor.run_wire`` on the far side) fits the same protocol.

Dispatch is pull-based: on every arrival and every completion the pool snapshots executors
(idle or busy, the cache keys they hold) and pending requests, asks the policy for
assignments, and starts them. Requests of one client are served in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from flashpoint.actor import Actor
from flashpoint.errors import DeadlineExceeded, PeerLost
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.graph import GraphPlan, cache_key
from flashpoint.log import get_logger
from flashpoint.policy.kaas import (
    POLICY_NAMES,
    KaasAssignment,
    KaasPendingSnapshot,
    KaasPolicyMemory,
    KaasPolicyParams,
    KaasPoolSnapshot,
    KaasWorkerSnapshot,
    decide,
    record_completion,
)

if TYPE_CHECKING:  # the executor imports torch; a controller's pool has remote handles only
    from flashpoint.kaas.executor import Executor

log = get_logger(__name__)


class ExecutorHandle(Protocol):
    """The one object that reaches an executor (in process, or a worker over RPC)."""

    executor_id: str

    def cached_keys(self) -> frozenset[str]:
        """The device cache's keys as last known (for affinity)."""
        ...

    def free_bytes(self) -> int:
        """Room left in the device cache as last known."""
        ...

    async def run(self, plan: GraphPlan, client: str, request_id: str = "") -> KaasResult:
        """Run ``plan`` for ``client``; ``request_id`` travels to a remote executor."""
        ...

    async def restart(self) -> None:
        """Start over with empty caches (exclusive reassignment: a cold start)."""
        ...

    def forget(self, keys: list[str]) -> None:
        """Objects ``keys`` were deleted or expired: drop cached copies before the next
        request runs (their keys may come back with other bytes)."""
        ...


class LocalExecutorHandle:
    """An in-process executor, run on a thread so the event loop stays free.

    ``restart_s``: extra seconds a restart costs (a process start and imports on a real
    worker; benchmarks set it to price the exclusive baseline's cold starts).
    """

    def __init__(self, executor: Executor, *, restart_s: float = 0.0) -> None:
        self.executor = executor
        self.executor_id = executor.executor_id
        self.restart_s = restart_s
        self.restarts = 0
        self._forget: set[str] = set()

    def cached_keys(self) -> frozenset[str]:
        return self.executor.cached_keys()

    def free_bytes(self) -> int:
        return self.executor.cache.free_bytes

    async def run(self, plan: GraphPlan, client: str, request_id: str = "") -> KaasResult:
        forget, self._forget = sorted(self._forget), set()
        return await asyncio.to_thread(self._run, plan, client, forget)

    def _run(self, plan: GraphPlan, client: str, forget: list[str]) -> KaasResult:
        if forget:
            self.executor.forget(forget)
        return self.executor.run(plan, client=client)

    def forget(self, keys: list[str]) -> None:
        # Applied by the next run: the listener may be called on the executor's own thread
        # (an expiry noticed while it reads the store), which holds the executor's lock.
        self._forget.update(keys)

    async def restart(self) -> None:
        self.restarts += 1
        await asyncio.to_thread(self.executor.reset)
        if self.restart_s:
            await asyncio.sleep(self.restart_s)


@dataclass
class _Pending:
    request_id: str
    client: str
    plan: GraphPlan
    arrival_s: float
    snapshot: KaasPendingSnapshot
    future: asyncio.Future[KaasResult] = field(repr=False)


class ExecutorPool(Actor):
    """Runs validated requests on ``handles`` as the named policy decides.

    Handles may come and go (:meth:`add`, :meth:`remove`: executors on workers that warm up
    or die); requests queue while no executor is there, until their deadline.
    """

    def __init__(self, handles: Sequence[ExecutorHandle], policy: str = "affinity", *,
                 params: KaasPolicyParams | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 allow_empty: bool = False) -> None:
        super().__init__("kaas-pool")  # each running request is one of its tasks
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown KaaS pool policy {policy!r}; known: {POLICY_NAMES}")
        if not handles and not allow_empty:
            raise ValueError("a pool needs at least one executor")
        self.policy = policy
        self.params = params or KaasPolicyParams()
        self._handles = {h.executor_id: h for h in handles}
        self._clock = clock
        self._memory = KaasPolicyMemory()
        self._pending: list[_Pending] = []
        self._busy: dict[str, str] = {}  # executor id -> client
        self.completed = 0

    @property
    def handles(self) -> list[ExecutorHandle]:
        return list(self._handles.values())

    def get(self, executor_id: str) -> ExecutorHandle | None:
        return self._handles.get(executor_id)

    def add(self, handle: ExecutorHandle) -> None:
        """A new executor (or a reconnected one under the same id, replacing the old handle)."""
        self._handles[handle.executor_id] = handle
        self._pump()

    def remove(self, executor_id: str) -> ExecutorHandle | None:
        """Forget an executor; a request running on it fails with its connection's error."""
        handle = self._handles.pop(executor_id, None)
        if executor_id in self._memory.owners:
            owners = {w: c for w, c in self._memory.owners.items() if w != executor_id}
            self._memory = replace(self._memory, owners=owners)
        return handle

    def forget(self, keys: list[str]) -> None:
        """Objects ``keys`` left the data layer: every executor drops its cached copies."""
        for handle in self._handles.values():
            handle.forget(keys)

    def min_capacity_bytes(self) -> int | None:
        caps = [h.executor.cache.capacity_bytes for h in self._handles.values()
                if isinstance(h, LocalExecutorHandle)]
        return min(caps) if caps else None

    async def invoke(self, plan: GraphPlan, *, client: str, request_id: str,
                     timeout_s: float | None = None) -> KaasResult:
        """Queue ``plan`` for ``client`` and wait for its result (or the deadline)."""
        loop = asyncio.get_running_loop()
        snap = KaasPendingSnapshot(
            request_id, client, self._clock(),
            tuple((cache_key(b, client), b.size_bytes) for b in plan.request.buffers))
        item = _Pending(request_id, client, plan, snap.arrival_s, snap, loop.create_future())
        self._pending.append(item)
        self._pump()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(item.future)
        except TimeoutError:
            # A request already running finishes anyway; nobody will read its outcome.
            item.future.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise DeadlineExceeded(f"KaaS request did not finish within {timeout_s:g} s",
                                   timeout_s=timeout_s) from None
        finally:
            if item in self._pending:  # still queued: it will not run
                self._pending.remove(item)
                self._pump()

    def status(self) -> dict[str, Any]:
        """Queue, busy executors and every local executor's cumulative cache counters."""
        execs = []
        for h in self._handles.values():
            entry: dict[str, Any] = {"executor_id": h.executor_id,
                                     "busy": h.executor_id in self._busy}
            if isinstance(h, LocalExecutorHandle):
                cache = h.executor.cache
                entry.update(requests=h.executor.requests, restarts=h.restarts,
                             cache={**cache.stats.to_dict(), "used_bytes": cache.used_bytes,
                                    "capacity_bytes": cache.capacity_bytes,
                                    "buffers": len(cache)})
            elif hasattr(h, "status"):  # a remote handle reports what it last heard
                entry.update(h.status())
            execs.append(entry)
        return {"policy": self.policy, "queued": len(self._pending),
                "completed": self.completed, "executors": execs}

    def _pump(self) -> None:
        if self.stopping or not self._pending or all(w in self._busy for w in self._handles):
            return
        snap = KaasPoolSnapshot(
            now_s=self._clock(),
            workers=tuple(KaasWorkerSnapshot(h.executor_id, h.executor_id not in self._busy,
                                             h.cached_keys(), self._busy.get(h.executor_id),
                                             h.free_bytes())
                          for h in self._handles.values()),
            pending=tuple(p.snapshot for p in self._pending))
        decision, self._memory = decide(self.policy, snap, self._memory, self.params)
        by_id = {p.request_id: p for p in self._pending}
        for a in decision.assignments:
            item = by_id[a.request_id]
            if a.worker_id not in self._handles:
                continue
            self._pending.remove(item)
            self._busy[a.worker_id] = item.client
            self.spawn(self._run(item, a), f"kaas-{a.request_id}")

    async def _run(self, item: _Pending, a: KaasAssignment) -> None:
        handle = self._handles.get(a.worker_id)
        start = self._clock()
        try:
            if handle is None:  # removed between the decision and this task's start
                raise PeerLost(f"KaaS executor {a.worker_id} left the pool")
            if a.restart:
                await handle.restart()
            result = await handle.run(item.plan, item.client, item.request_id)
        except BaseException as e:  # typed errors reach the caller; the pool lives on
            if not item.future.done():
                item.future.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        else:
            result.timings_s["queue"] = start - item.arrival_s
            if not item.future.done():
                item.future.set_result(result)
        finally:
            self.completed += 1
            self._memory = record_completion(self._memory, item.client,
                                             self._clock() - start, a.charge_s, self.params)
            self._busy.pop(a.worker_id, None)
            self._pump()
