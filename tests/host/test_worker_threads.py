"""A host gives its workers' torch the cores of their CPU device (``[host] torch_threads``
auto, policy/cpu_threads.py), and a local cluster shares the machine's cores among its
hosts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashpoint.testing.harness import ClusterFactory

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _threads_of(pid: int) -> int:
    argv = _argv(pid)
    return int(argv[argv.index("--torch-threads") + 1])


async def test_auto_threads_follow_the_device_share(make_cluster: ClusterFactory) -> None:
    # Two hosts of three CPU devices each, told they own 6 cores: two threads per worker.
    c = await make_cluster(hosts=2, host={"torch_threads": 0, "cpu_cores": 6,
                                          "cpu_devices": 3})
    for host in c.hosts:
        assert host.pool.torch_threads == 2
        pids = [w.proc.pid for w in host.pool.workers.values()]
        assert pids, "the warm pool holds a worker"
        assert {_threads_of(pid) for pid in pids} == {2}
    # A cold start puts the replica on one of them, and it serves.
    await c.deploy("threads-noop", "noop")
    reply = await c.invoke("threads-noop", {"x": {"data": [1.0], "shape": [1, 1],
                                                  "datatype": "FP32"}})
    assert reply["cold"]
    held = [w for h in c.hosts for w in h.pool.workers.values() if w.replica_id]
    assert len(held) == 1 and _threads_of(held[0].proc.pid) == 2


async def test_local_cluster_shares_the_machine(make_cluster: ClusterFactory) -> None:
    cores = len(os.sched_getaffinity(0))
    c = await make_cluster(hosts=2, host={"torch_threads": 0})  # one CPU device per host
    for host in c.hosts:
        assert host.hc.cpu_cores == max(1, cores // 2)
        assert host.pool.torch_threads == max(1, cores // 2)


async def test_configured_threads_win(make_cluster: ClusterFactory) -> None:
    c = await make_cluster(hosts=1, host={"torch_threads": 3})
    (host,) = c.hosts
    assert {_threads_of(w.proc.pid) for w in host.pool.workers.values()} == {3}
