"""The actor base: start/stop with a deadline, named background tasks it owns, loop-lag metric.

Every long-running object of a process (a stand-alone gateway's backend, a pipeline stage
server, the KaaS executor pool, ...) has background loops. They are started only in
:meth:`Actor.start` (never in a constructor), each under a name (logs, ``asyncio`` debugging,
:meth:`Actor.task_names`), and owned here: :meth:`Actor.stop` cancels all of them and returns
within its timeout.

Why not one :class:`asyncio.TaskGroup` per actor: a group cancels every sibling when one task
fails, and a control loop that crashes must not take the others down (STYLE §4: it is logged
and the rest go on); and a group's exit waits for every task without a bound, while ``stop``
must return in time even when a task swallows its cancellation. The base keeps the part of a
TaskGroup that fits: one owner, tasks that cannot outlive it, failures that are never silent.

Loop lag (STYLE §13): a blocked event loop looks like a network failure to peers, so an actor
that represents its process (``loop_lag_interval_s`` set) runs a small periodic task that
measures how late its timer fires and observes it in ``flashpoint_event_loop_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from prometheus_client import Histogram

from flashpoint.log import get_logger

log = get_logger(__name__)

LOOP_LAG = Histogram(
    "flashpoint_event_loop_lag_seconds",
    "How late a periodic timer fired on the event loop (time the loop was busy elsewhere)",
    ["actor"],
    buckets=(1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
DEFAULT_STOP_TIMEOUT_S = 5.0
# A task that ignored a cancellation is cancelled again this often until stop's deadline.
_RECANCEL_S = 0.02


class Actor:
    """Base of an object with background tasks. Subclasses put their own start-up and
    shut-down in :meth:`on_start` / :meth:`on_stop` and start loops with :meth:`spawn`.

    ``name`` labels its logs and its loop-lag series; ``loop_lag_interval_s`` (None: off)
    is how often the loop's lag is sampled.
    """

    def __init__(self, name: str, *, loop_lag_interval_s: float | None = None) -> None:
        if loop_lag_interval_s is not None and not loop_lag_interval_s > 0:
            raise ValueError("loop_lag_interval_s must be > 0")
        self.actor_name = name
        self.loop_lag_interval_s = loop_lag_interval_s
        self.loop_lag_s = 0.0  # the latest sample
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._started = False
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Run :meth:`on_start`, then the loop-lag sampler when configured. Once only."""
        if self._started:
            raise RuntimeError(f"{self.actor_name} already started")
        self._started = True
        await self.on_start()
        if self.loop_lag_interval_s is not None:
            self.spawn(self._sample_loop_lag(self.loop_lag_interval_s), "loop-lag")

    async def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Cancel every owned task and wait for them, within ``timeout_s`` in all: a task
        that ignores a cancellation is cancelled again until the deadline, and one still
        running then is logged and left. Then :meth:`on_stop` (given what is left of the
        deadline). Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(_RECANCEL_S, left))
        if pending:
            log.warning("actor_tasks_left_running", actor=self.actor_name,
                        tasks=sorted(self._tasks[t] for t in pending if t in self._tasks))
        await self.on_stop(max(0.0, deadline - time.monotonic()))

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` began: the actor starts nothing new."""
        return self._stopping

    async def on_start(self) -> None:
        """The subclass's start-up (connections, listeners); spawn its loops here."""

    async def on_stop(self, timeout_s: float) -> None:
        """The subclass's shut-down after its tasks are gone, within ``timeout_s``."""

    # -- tasks -------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a background task named ``name``, owned by this actor: cancelled
        by :meth:`stop`, and its failure logged (never lost with the task object)."""
        if self._stopping:
            coro.close()
            raise RuntimeError(f"{self.actor_name} is stopping: no new task {name!r}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.actor_name}:{name}")
        self._tasks[task] = name
        task.add_done_callback(self._reap)
        return task

    def task_names(self) -> list[str]:
        """The names of the tasks running now (status pages, tests)."""
        return sorted(name for task, name in self._tasks.items() if not task.done())

    def _reap(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.pop(task, "?")
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("actor_task_failed", actor=self.actor_name, task=name,
                      error=repr(exc), exc_info=exc)

    # -- loop lag ----------------------------------------------------------------------------
    async def _sample_loop_lag(self, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        series = LOOP_LAG.labels(self.actor_name)
        while True:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            self.loop_lag_s = max(0.0, loop.time() - due)
            series.observe(self.loop_lag_s)
