"""Per-replica inference counters, kept by the worker's batcher (plain Python, no locks).

Counts what an operator of a serving platform expects per replica (Triton's request, exec,
batch-size, queue and compute statistics): requests, batches (model runs), failed requests,
the batch size in rows, each request's queue wait (enqueue -> its batch starts) and each
batch's run time. Only the batcher's event-loop code touches it, so no lock; a batch costs a
few integer/float adds and a per-request queue observation costs one bisect and one add.

The host manager asks each worker for :meth:`ReplicaStats.snapshot` (``replica_stats`` on
the host connection) when its ``/metrics`` is scraped and renders the snapshots with
:mod:`flashpoint.host.replica_metrics`; no prometheus_client multiprocess mode.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Upper bounds (``le``) of the finite buckets; every histogram has one more, +Inf.
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Fixed-bucket histogram: per-bucket (not cumulative) counts plus the sum.

    ``counts[i]`` counts values ``<= bounds[i]`` and above the previous bound (Prometheus'
    ``le``); ``counts[-1]`` counts values above the last bound (+Inf).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, so a value equal to a bound is in its bucket
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict[str, Any]:
        """Plain (msgpack-able) form: ``{"bounds", "counts", "sum"}``."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class ReplicaStats:
    """One replica's inference counters since its batcher started."""

    __slots__ = ("requests", "batches", "failed_requests", "batch_size", "queue_s", "run_s")

    def __init__(self) -> None:
        self.requests = 0  # requests a model run finished (ok or failed)
        self.batches = 0  # model runs (ok or failed)
        self.failed_requests = 0  # requests whose model run raised
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)  # rows per model run
        self.queue_s = Histogram(SECONDS_BUCKETS)  # per request: enqueue -> batch start
        self.run_s = Histogram(SECONDS_BUCKETS)  # per model run

    def batch_ran(self, requests: int, rows: int, run_s: float, *, failed: bool = False) -> None:
        """Count one model run over ``requests`` requests of ``rows`` rows in all.

        Queue waits are observed separately (:meth:`queued`), one per request, by the
        caller's own loop over the batch (no list built for them).
        """
        self.requests += requests
        self.batches += 1
        if failed:
            self.failed_requests += requests
        self.batch_size.observe(rows)
        self.run_s.observe(run_s)

    def queued(self, wait_s: float) -> None:
        """One request waited ``wait_s`` seconds from enqueue to the start of its batch."""
        self.queue_s.observe(wait_s)

    def snapshot(self) -> dict[str, Any]:
        """Plain (msgpack-able) dict of every counter and histogram."""
        return {
            "requests": self.requests, "batches": self.batches,
            "failed_requests": self.failed_requests,
            "batch_size": self.batch_size.snapshot(), "queue_s": self.queue_s.snapshot(),
            "run_s": self.run_s.snapshot(),
        }
