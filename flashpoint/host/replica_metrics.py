"""A host's ``/metrics`` shows its replicas' inference counters, gathered at scrape time.

Each worker keeps a :class:`~flashpoint.worker.replica_stats.ReplicaStats` (its batcher
updates it); when the host's endpoint is scraped, :func:`replica_collectors` asks every
worker that holds a replica for a snapshot (``replica_stats`` on the host connection),
concurrently and each within ``timeout_s``. A worker that fails, times out or sends a
malformed snapshot is skipped (logged at debug): a scrape never fails because of a worker.
The snapshots are rendered by :class:`ReplicaStatsCollector` with the labels
``replica_id``, ``function`` and ``host``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from flashpoint.log import get_logger
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.host_worker import ReplicaStats, ReplicaStatsReply

log = get_logger("flashpoint.replica_metrics")

LABELS = ("replica_id", "function", "host")
SCRAPE_TIMEOUT_S = 1.0

_COUNTERS = (
    ("flashpoint_replica_requests", "requests",
     "Requests a model run of this replica finished (ok or failed)."),
    ("flashpoint_replica_batches", "batches", "Model runs (batches) of this replica."),
    ("flashpoint_replica_failed_requests", "failed_requests",
     "Requests of this replica whose model run raised."),
)
_HISTOGRAMS = (
    ("flashpoint_replica_batch_size", "batch_size", "Rows per model run of this replica."),
    ("flashpoint_replica_queue_seconds", "queue_s",
     "Per request: seconds from enqueue in the worker to the start of its batch."),
    ("flashpoint_replica_run_seconds", "run_s", "Seconds per model run of this replica."),
)


def _buckets(hist: dict[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """A snapshot histogram -> cumulative ``(le, count)`` pairs ending in +Inf, and its sum."""
    bounds, counts = list(hist["bounds"]), [int(c) for c in hist["counts"]]
    if len(counts) != len(bounds) + 1:
        raise ValueError("a histogram needs one count per bound plus +Inf")
    out, total = [], 0
    for le, c in zip([*map(float, bounds), float("inf")], counts, strict=True):
        total += c
        out.append((floatToGoString(le), float(total)))
    return out, float(hist["sum"])


class ReplicaStatsCollector:
    """Renders replica snapshots (``replica_stats`` replies) for one scrape."""

    def __init__(self, replies: Sequence[ReplicaStatsReply], host_id: str) -> None:
        self._replies = replies
        self._host_id = host_id

    def collect(self) -> Iterator[Metric]:
        counters = [CounterMetricFamily(name, doc, labels=LABELS) for name, _, doc in _COUNTERS]
        hists = [HistogramMetricFamily(name, doc, labels=LABELS) for name, _, doc in _HISTOGRAMS]
        queued = GaugeMetricFamily("flashpoint_replica_queued_requests",
                                   "Requests waiting in this replica's batcher now", labels=LABELS)
        for reply in self._replies:
            try:
                stats = reply.stats
                labels = [reply.replica_id, reply.function, self._host_id]
                # everything parsed before anything is added: a bad reply adds nothing
                values = [float(stats[key]) for _, key, _ in _COUNTERS]
                parsed = [_buckets(stats[key]) for _, key, _ in _HISTOGRAMS]
                depth = float(stats["queued"]) if "queued" in stats else None  # newer workers
            except (KeyError, TypeError, ValueError) as exc:
                log.debug("replica_stats_malformed", replica_id=reply.replica_id,
                          error=f"{type(exc).__name__}: {exc}"[:200])
                continue
            for fam, value in zip(counters, values, strict=True):
                fam.add_metric(labels, value)
            for fam, (buckets, sum_value) in zip(hists, parsed, strict=True):
                fam.add_metric(labels, buckets, sum_value)
            if depth is not None:
                queued.add_metric(labels, depth)
        yield from counters
        yield from hists
        yield queued


async def _ask(worker_id: str, conn: Any, timeout_s: float) -> ReplicaStatsReply | None:
    try:
        reply = from_payload(ReplicaStatsReply, await asyncio.wait_for(
            conn.call("replica_stats", to_payload(ReplicaStats()), timeout_s=timeout_s),
            timeout_s), method="replica_stats")
    except Exception as exc:  # a slow, dead or garbled worker costs the scrape its row only
        log.debug("replica_stats_skipped", worker_id=worker_id,
                  error=f"{type(exc).__name__}: {exc}"[:200])
        return None
    return reply if reply.stats else None


async def gather_replica_stats(workers: Iterable[Any],
                               timeout_s: float = SCRAPE_TIMEOUT_S) -> list[ReplicaStatsReply]:
    """Snapshots of the workers (``WorkerProcess``) that hold a replica, asked concurrently."""
    asks = [_ask(w.worker_id, w.conn, timeout_s) for w in list(workers)
            if w.replica_id and w.conn is not None and not w.stopping]
    replies = await asyncio.gather(*asks)
    return [r for r in replies if r is not None]


async def replica_collectors(workers: Iterable[Any], host_id: str,
                             timeout_s: float = SCRAPE_TIMEOUT_S) -> list[ReplicaStatsCollector]:
    """The host's scrape hook (:class:`~flashpoint.exposition.MetricsEndpoint` ``extra``)."""
    return [ReplicaStatsCollector(await gather_replica_stats(workers, timeout_s), host_id)]
