"""Dynamic batching inside a worker: gather requests up to a row limit or a wait limit.

Requests are concatenated along their first (batch) dimension when their inputs agree in
names, dtypes and trailing shapes (inputs in ``pad_values``, such as token ids, may differ
in length along their second axis: they are padded to the batch's longest with that
value); a request that does not fit the current batch waits for the next one. Strict
requests go before best-effort ones (FIFO within each class).
The model runs on one dedicated thread so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from flashpoint.errors import FlashpointError, ModelFailed, Unavailable
from flashpoint.worker.replica_stats import ReplicaStats

INLINE_BELOW_S = 0.0005

RunBatch = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class _Item:
    inputs: dict[str, np.ndarray]
    rows: int
    key: tuple
    future: asyncio.Future
    order: tuple[int, int]  # (0 strict | 1 best-effort, arrival sequence): queue position
    enqueued_s: float = field(default_factory=time.perf_counter)


def _signature(inputs: dict[str, np.ndarray], padded: Mapping[str, int]) -> tuple:
    if not padded:
        return tuple(sorted((k, v.dtype.str, v.shape[1:]) for k, v in inputs.items()))
    return tuple(sorted((k, v.dtype.str, v.shape[2:] if k in padded else v.shape[1:], v.ndim)
                        for k, v in inputs.items()))


def _merge(items: list[_Item], padded: Mapping[str, int]) -> dict[str, np.ndarray]:
    """One batch of several requests' inputs, padded along axis 1 where ``padded`` says."""
    out: dict[str, np.ndarray] = {}
    for k in items[0].inputs:
        parts = [b.inputs[k] for b in items]
        value = padded.get(k)
        if value is None or parts[0].ndim < 2:
            out[k] = np.concatenate(parts)
            continue
        length = max(p.shape[1] for p in parts)
        rows = sum(p.shape[0] for p in parts)
        merged = np.full((rows, length, *parts[0].shape[2:]), value, dtype=parts[0].dtype)
        r = 0
        for p in parts:
            merged[r:r + p.shape[0], :p.shape[1]] = p
            r += p.shape[0]
        out[k] = merged
    return out


class Batcher:
    """Runs ``run_batch`` over batches of queued requests."""

    def __init__(self, run_batch: RunBatch, max_batch_size: int, max_wait_s: float,
                 *, pad_values: Mapping[str, int] | None = None) -> None:
        self._run = run_batch
        self._pad = dict(pad_values or {})
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        # (class, sequence, item): strict before best-effort, FIFO within a class. A request
        # that did not fit a batch goes back with its own position, so it is first again.
        self._queue: asyncio.PriorityQueue[tuple[int, int, _Item]] = asyncio.PriorityQueue()
        self._seq = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._task: asyncio.Task | None = None
        self.batches_run = 0
        self.stats = ReplicaStats()  # what /metrics shows for this replica (replica_stats.py)
        # EWMA of batch run time. Batches this fast run on the event loop itself: handing
        # them to the model thread costs two thread wake-ups, more than the work (no-op and
        # tiny models), while blocking the loop for under INLINE_BELOW_S is harmless.
        self._ewma_run_s = 1.0
        self._busy = False  # the loop holds a batch (gathering or running it)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        leftovers = []
        while not self._queue.empty():
            leftovers.append(self._queue.get_nowait()[2])
        _fail(leftovers)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    async def submit(self, inputs: dict[str, np.ndarray], *, alone: bool = True,
                     best_effort: bool = False
                     ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Queue one request (batch dim first); returns its outputs and timings.

        ``alone=False`` says more requests are being submitted in the same step (one frame
        of several), so this one must wait for the batching loop to gather them;
        ``best_effort`` requests wait behind every queued strict one.
        """
        rows = _rows(inputs)
        if (alone and self.max_wait_s <= 0 and not self._busy
                and self._queue.empty() and self._ewma_run_s < INLINE_BELOW_S):
            # Nothing to batch with and the model is fast: run it here, which saves the two
            # task switches of a trip through the batching loop on every idle request.
            return self._run_inline(inputs, rows)
        return await self._enqueue(inputs, rows, best_effort)

    def enqueue(self, inputs: dict[str, np.ndarray], *, best_effort: bool = False
                ) -> asyncio.Future:
        """Queue one request without waiting: a future of ``(outputs, timings)``.

        For a caller queueing several at once (one frame of many requests), which then awaits
        the futures: no task per request, and all are queued before the batching loop runs.
        A future the caller stops waiting for should be cancelled (its batch skips it).
        """
        return self._enqueue(inputs, _rows(inputs), best_effort)

    def _enqueue(self, inputs: dict[str, np.ndarray], rows: int,
                 best_effort: bool) -> asyncio.Future:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._seq += 1
        item = _Item(inputs, rows, _signature(inputs, self._pad), fut,
                     (int(best_effort), self._seq))
        self._queue.put_nowait((*item.order, item))
        return fut

    def _run_inline(self, inputs: dict[str, np.ndarray],
                    rows: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        stats = self.stats
        stats.queued(0.0)
        started = time.perf_counter()
        try:
            outputs = self._run(inputs)
        except Exception as exc:
            stats.batch_ran(1, rows, time.perf_counter() - started, failed=True)
            if isinstance(exc, FlashpointError):
                raise
            raise ModelFailed(f"model raised {type(exc).__name__}: {exc}"[:500]) from None
        run_s = time.perf_counter() - started
        stats.batch_ran(1, rows, run_s)
        self._ran(run_s)
        return outputs, {"batch_wait": 0.0, "inference": run_s, "batch_rows": float(rows)}

    def _timed_run(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        # Timed where it runs: a run handed to the model thread must not count the thread
        # hand-off, or a slow wake-up would keep a fast model off the inline path for good.
        started = time.perf_counter()
        outputs = self._run(inputs)
        return outputs, time.perf_counter() - started

    def _ran(self, run_s: float) -> None:
        """Count a batch whose model run took ``run_s``."""
        self.batches_run += 1
        self._ewma_run_s = run_s if self.batches_run == 1 else 0.8 * self._ewma_run_s + 0.2 * run_s

    async def _next(self, timeout_s: float | None) -> _Item | None:
        if timeout_s is None:
            return (await self._queue.get())[2]
        if timeout_s <= 0:
            return self._queue.get_nowait()[2] if not self._queue.empty() else None
        try:
            return (await asyncio.wait_for(self._queue.get(), timeout_s))[2]
        except TimeoutError:
            return None

    async def _loop(self) -> None:
        batch: list[_Item] = []
        try:
            await self._serve(batch)
        except asyncio.CancelledError:
            _fail(batch)  # gathered or running when stopped: never leave a caller waiting
            raise

    async def _serve(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        stats = self.stats
        while True:
            self._busy = False
            batch.clear()
            first = await self._next(None)
            assert first is not None
            self._busy = True
            batch.append(first)
            rows = first.rows
            deadline = time.perf_counter() + self.max_wait_s
            while rows < self.max_batch_size:
                nxt = await self._next(deadline - time.perf_counter())
                if nxt is None:
                    break
                if nxt.key != first.key or rows + nxt.rows > self.max_batch_size:
                    self._queue.put_nowait((*nxt.order, nxt))  # first of the next batch
                    break
                batch.append(nxt)
                rows += nxt.rows
            started = time.perf_counter()
            merged = batch[0].inputs if len(batch) == 1 else _merge(batch, self._pad)
            try:
                if self._ewma_run_s < INLINE_BELOW_S:
                    outputs, run_s = self._timed_run(merged)
                else:
                    outputs, run_s = await loop.run_in_executor(self._pool, self._timed_run, merged)
            except Exception as exc:  # the model raised: every request of the batch fails
                stats.batch_ran(len(batch), rows, time.perf_counter() - started, failed=True)
                err = exc if isinstance(exc, FlashpointError) else ModelFailed(
                    f"model raised {type(exc).__name__}: {exc}"[:500])
                for b in batch:
                    stats.queued(started - b.enqueued_s)
                    if not b.future.done():
                        b.future.set_exception(err)
                continue
            stats.batch_ran(len(batch), rows, run_s)
            self._ran(run_s)
            infer_s = time.perf_counter() - started
            offset = 0
            for b in batch:
                part = {k: v[offset: offset + b.rows] for k, v in outputs.items()}
                offset += b.rows
                wait_s = started - b.enqueued_s
                stats.queued(wait_s)
                if not b.future.done():
                    b.future.set_result((part, {
                        "batch_wait": wait_s, "inference": infer_s,
                        "batch_rows": float(rows),
                    }))


def _rows(inputs: dict[str, np.ndarray]) -> int:
    """The request's batch rows: the leading dimension every input shares."""
    rows = {a.shape[0] if a.ndim else 1 for a in inputs.values()}
    if len(rows) != 1 or any(a.ndim == 0 for a in inputs.values()):
        raise FlashpointError("inputs must share a leading batch dimension")
    return rows.pop()


def _fail(items: list[_Item]) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(Unavailable("replica stopping", retry_after_s=0.1))
