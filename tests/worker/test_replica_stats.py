"""Per-replica inference counters: the stats class, the batcher's counting, and the
snapshot -> Prometheus text rendering a host's /metrics serves."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashpoint.errors import ModelFailed
from flashpoint.host.metrics import HostWorkersCollector, host_listen
from flashpoint.host.replica_metrics import ReplicaStatsCollector, gather_replica_stats
from flashpoint.messages.host_worker import ReplicaStatsReply
from flashpoint.worker.batcher import Batcher
from flashpoint.worker.replica_stats import (
    BATCH_SIZE_BUCKETS,
    SECONDS_BUCKETS,
    Histogram,
    ReplicaStats,
)

T = 2.0  # bound on every await


def test_histogram_places_values_by_le_bound() -> None:
    h = Histogram((1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 4, 5, 100):
        h.observe(v)
    # le=1: 0.5, 1 | le=2: 1.5, 2 | le=4: 3, 4 | +Inf: 5, 100
    assert h.counts == [2, 2, 2, 2]
    assert h.count == 8
    assert h.sum == pytest.approx(117.0)


def test_stats_count_batches_requests_failures_and_snapshot_is_plain() -> None:
    s = ReplicaStats()
    s.batch_ran(3, 3, 0.002)
    s.batch_ran(2, 10, 0.3, failed=True)
    s.batch_ran(1, 100, 7.0)
    for w in (0.0, 0.0007, 0.02, 9.0):
        s.queued(w)
    snap = s.snapshot()
    assert msgpack.unpackb(msgpack.packb(snap)) == snap  # goes over the wire as is
    assert (snap["requests"], snap["batches"], snap["failed_requests"]) == (6, 3, 2)
    assert snap["batch_size"]["bounds"] == list(BATCH_SIZE_BUCKETS)
    # rows 3 -> le=4, 10 -> le=16, 100 -> +Inf
    assert snap["batch_size"]["counts"] == [0, 0, 1, 0, 1, 0, 0, 1]
    assert snap["batch_size"]["sum"] == 113
    assert snap["run_s"]["bounds"] == list(SECONDS_BUCKETS)
    run = dict(zip([*SECONDS_BUCKETS, "inf"], snap["run_s"]["counts"], strict=True))
    assert (run[0.0025], run[0.5], run["inf"]) == (1, 1, 1) and sum(run.values()) == 3
    queue = dict(zip([*SECONDS_BUCKETS, "inf"], snap["queue_s"]["counts"], strict=True))
    assert (queue[0.0005], queue[0.001], queue[0.025], queue["inf"]) == (1, 1, 1, 1)
    assert snap["queue_s"]["sum"] == pytest.approx(9.0207)


def _model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


async def test_batcher_counts_every_request_and_batch() -> None:
    b = Batcher(_model, max_batch_size=8, max_wait_s=0.05)
    b.start()
    try:
        xs = [np.ones((1, 2), np.float32)] * 5 + [np.ones((3, 2), np.float32)]
        await asyncio.wait_for(asyncio.gather(*(b.submit({"x": x}) for x in xs)), T)
        await asyncio.wait_for(b.submit({"x": np.ones((2, 2), np.float32)}), T)
    finally:
        await asyncio.wait_for(b.stop(), T)
    snap = b.stats.snapshot()
    assert snap["requests"] == 7
    assert snap["failed_requests"] == 0
    assert snap["batches"] == b.batches_run >= 2
    assert snap["batch_size"]["sum"] == 10  # every row, once
    assert sum(snap["batch_size"]["counts"]) == snap["batches"]
    assert sum(snap["run_s"]["counts"]) == snap["batches"]
    assert sum(snap["queue_s"]["counts"]) == 7  # one wait per request
    assert snap["queue_s"]["sum"] > 0  # the batched ones waited for the gathering window


async def test_inline_requests_are_counted_too() -> None:
    b = Batcher(_model, max_batch_size=8, max_wait_s=0.0)
    b._ewma_run_s = 0.0  # a fast model: idle requests run inline (not through the loop)
    b.start()
    try:
        for _ in range(4):
            await asyncio.wait_for(b.submit({"x": np.ones((2, 2), np.float32)}), T)
    finally:
        await asyncio.wait_for(b.stop(), T)
    snap = b.stats.snapshot()
    assert (snap["requests"], snap["batches"], snap["batch_size"]["sum"]) == (4, 4, 8)
    assert sum(snap["queue_s"]["counts"]) == 4 and snap["queue_s"]["sum"] == 0.0


@pytest.mark.parametrize("inline", [True, False])
async def test_failed_model_runs_count_failed_requests(inline: bool) -> None:
    gate = threading.Event()

    def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        gate.set()
        raise RuntimeError("boom")

    b = Batcher(broken, max_batch_size=8, max_wait_s=0.0 if inline else 0.05)
    if inline:
        b._ewma_run_s = 0.0
    b.start()
    try:
        n = 1 if inline else 3
        results = await asyncio.wait_for(asyncio.gather(
            *(b.submit({"x": np.ones((1, 2), np.float32)}) for _ in range(n)),
            return_exceptions=True), T)
        assert all(isinstance(r, ModelFailed) for r in results)
    finally:
        await asyncio.wait_for(b.stop(), T)
    assert gate.is_set()
    snap = b.stats.snapshot()
    assert (snap["requests"], snap["failed_requests"], snap["batches"]) == (n, n, 1)
    assert sum(snap["run_s"]["counts"]) == 1


def _parse(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam, replica_id: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for s in fam.samples
            if s.labels["replica_id"] == replica_id}


def test_snapshots_render_as_prometheus_families_with_labels() -> None:
    a, c = ReplicaStats(), ReplicaStats()
    a.batch_ran(4, 4, 0.003)
    a.batch_ran(2, 2, 0.0001)
    for _ in range(6):
        a.queued(0.004)
    c.batch_ran(1, 1, 2.0, failed=True)
    replies = [ReplicaStatsReply(replica_id="r-a", function="fa", stats={**a.snapshot(), "queued": 3}),
               ReplicaStatsReply(replica_id="r-c", function="fc", stats=c.snapshot()),
               ReplicaStatsReply(replica_id="r-bad", function="fb", stats={"requests": 1})]
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ReplicaStatsCollector(replies, "h1"))
    fams = _parse(generate_latest(reg).decode())

    req = fams["flashpoint_replica_requests"]
    assert req.type == "counter"
    assert {(s.labels["replica_id"], s.labels["function"], s.labels["host"], s.value)
            for s in req.samples} == {("r-a", "fa", "h1", 6.0), ("r-c", "fc", "h1", 1.0)}
    assert _samples(fams["flashpoint_replica_batches"], "r-a") == {
        ("flashpoint_replica_batches_total", ""): 2.0}
    assert _samples(fams["flashpoint_replica_failed_requests"], "r-c") == {
        ("flashpoint_replica_failed_requests_total", ""): 1.0}

    size = _samples(fams["flashpoint_replica_batch_size"], "r-a")
    assert fams["flashpoint_replica_batch_size"].type == "histogram"
    # cumulative: 2 rows -> le=2, 4 rows -> le=4
    assert (size[("flashpoint_replica_batch_size_bucket", "1.0")],
            size[("flashpoint_replica_batch_size_bucket", "2.0")],
            size[("flashpoint_replica_batch_size_bucket", "4.0")],
            size[("flashpoint_replica_batch_size_bucket", "+Inf")]) == (0, 1, 2, 2)
    assert size[("flashpoint_replica_batch_size_count", "")] == 2
    assert size[("flashpoint_replica_batch_size_sum", "")] == 6
    run = _samples(fams["flashpoint_replica_run_seconds"], "r-a")
    assert run[("flashpoint_replica_run_seconds_bucket", "0.0005")] == 1
    assert run[("flashpoint_replica_run_seconds_bucket", "0.0025")] == 1
    assert run[("flashpoint_replica_run_seconds_bucket", "0.005")] == 2
    assert run[("flashpoint_replica_run_seconds_count", "")] == 2
    queue = _samples(fams["flashpoint_replica_queue_seconds"], "r-a")
    assert queue[("flashpoint_replica_queue_seconds_bucket", "0.0025")] == 0
    assert queue[("flashpoint_replica_queue_seconds_bucket", "0.005")] == 6
    assert queue[("flashpoint_replica_queue_seconds_count", "")] == 6
    assert queue[("flashpoint_replica_queue_seconds_sum", "")] == pytest.approx(0.024)
    # the batcher's queue now, where the worker sent it (r-c's older worker did not)
    queued = fams["flashpoint_replica_queued_requests"]
    assert queued.type == "gauge"
    assert {(s.labels["replica_id"], s.value) for s in queued.samples} == {("r-a", 3.0)}
    # the malformed reply added nothing anywhere
    assert all(s.labels["replica_id"] != "r-bad" for f in fams.values() for s in f.samples)


class _Conn:
    def __init__(self, reply: object = None, delay_s: float = 0.0, exc: Exception | None = None):
        self.reply, self.delay_s, self.exc = reply, delay_s, exc
        self.calls: list[str] = []

    async def call(self, method: str, payload: dict, *, timeout_s: float) -> object:
        self.calls.append(method)
        await asyncio.sleep(self.delay_s)
        if self.exc is not None:
            raise self.exc
        return self.reply


class _Worker:
    def __init__(self, wid: str, conn: _Conn, replica_id: str | None = "r",
                 stopping: bool = False) -> None:
        self.worker_id, self.conn, self.replica_id, self.stopping = wid, conn, replica_id, stopping


async def test_gather_skips_failed_slow_idle_and_empty_workers() -> None:
    ok = {"replica_id": "r1", "function": "f", "stats": ReplicaStats().snapshot()}
    good = _Conn(ok)
    slow = _Conn(ok, delay_s=5.0)
    idle = _Conn(ok)
    workers = [_Worker("w1", good), _Worker("w2", slow), _Worker("w3", _Conn(exc=RuntimeError("x"))),
               _Worker("w4", idle, replica_id=None),
               _Worker("w5", _Conn({"replica_id": "", "function": "", "stats": {}})),
               _Worker("w6", _Conn({"replica_id": 7, "stats": {"requests": 1}}))]  # garbled
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    replies = await asyncio.wait_for(gather_replica_stats(workers, timeout_s=0.2), T)
    assert loop.time() - t0 < 1.0  # concurrent, and the slow one was cut off
    assert replies == [ReplicaStatsReply(replica_id="r1", function="f", stats=ok["stats"])]
    assert good.calls == ["replica_stats"] and idle.calls == []


def test_host_worker_gauges_count_starting_idle_serving_and_stopping_workers() -> None:
    workers = [_Worker("w1", _Conn(), replica_id=None), _Worker("w2", _Conn(), replica_id=None),
               _Worker("w3", _Conn(), replica_id="r3"),
               _Worker("w4", _Conn(), replica_id="r4", stopping=True),
               # spawned, still importing torch: no hello yet, so not in the warm pool
               _Worker("w5", None, replica_id=None)]  # type: ignore[arg-type]
    reg = CollectorRegistry(auto_describe=False)
    reg.register(HostWorkersCollector(workers, "h7"))
    fam = _parse(generate_latest(reg).decode())["flashpoint_host_workers"]
    assert {(s.labels["host"], s.labels["state"], s.value) for s in fam.samples} == {
        ("h7", "starting", 1.0), ("h7", "idle", 2.0), ("h7", "serving", 1.0),
        ("h7", "stopping", 1.0)}


@pytest.mark.parametrize(("listen", "index", "want"), [
    ("127.0.0.1:9101", 0, "127.0.0.1:9101"), ("127.0.0.1:9101", 2, "127.0.0.1:9103"),
    ("0.0.0.0:0", 3, "0.0.0.0:0"), ("", 1, "")])
def test_local_cluster_hosts_take_consecutive_metrics_ports(listen: str, index: int,
                                                            want: str) -> None:
    assert host_listen(listen, index) == want
