"""What a host manager's ``/metrics`` adds to its process registry at each scrape.

The host's own gauges (its workers: starting, idle in the warm pool, holding a replica,
stopping) and, through :mod:`flashpoint.host.replica_metrics`, every replica's inference
counters. Read at
scrape time from what the host already keeps, so nothing on the request or deploy path
updates a metric. The host's endpoint (``[host] metrics_listen``) is
:class:`~flashpoint.exposition.MetricsEndpoint`; in a local cluster each host gets its own
port (:func:`host_listen`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from flashpoint.exposition import parse_listen
from flashpoint.host.replica_metrics import replica_collectors


class HostWorkersCollector:
    """``flashpoint_host_workers{host,state}``: starting (spawned, not yet said hello),
    idle (warm pool), serving, stopping."""

    def __init__(self, workers: Iterable[Any], host_id: str) -> None:
        self._counts = {"starting": 0, "idle": 0, "serving": 0, "stopping": 0}
        for w in workers:
            # A worker still importing torch is not in the warm pool yet: counting it idle
            # would say the pool is full seconds before a cold start could take it.
            state = ("stopping" if w.stopping else "serving" if w.replica_id
                     else "starting" if w.conn is None else "idle")
            self._counts[state] += 1
        self._host_id = host_id

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("flashpoint_host_workers",
                                "Worker processes of this host by state", labels=["host", "state"])
        for state, n in self._counts.items():
            fam.add_metric([self._host_id, state], n)
        yield fam


async def host_collectors(workers: Iterable[Any], host_id: str) -> list[Any]:
    """The host's scrape hook (:class:`~flashpoint.exposition.MetricsEndpoint` ``extra``):
    its worker gauges, then its replicas' counters (asked of each worker)."""
    workers = list(workers)
    return [HostWorkersCollector(workers, host_id),
            *await replica_collectors(workers, host_id)]


def host_listen(listen: str, index: int) -> str:
    """The ``metrics_listen`` of the ``index``-th host of a local cluster, whose hosts share
    one machine: ``listen``'s port plus ``index`` (port 0 stays 0: each picks a free one)."""
    if not listen:
        return listen
    host, port = parse_listen(listen)
    return f"{host}:{port + index if port else 0}"
