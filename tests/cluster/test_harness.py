"""The cluster harness itself (flashpoint/testing/harness.py): its API serves a real cluster,
and its teardown names what a test leaked — a process, a Flashpoint task, a listening socket —
instead of passing. The leaks are made on purpose here with a factory of the test's own, so
the ``make_cluster`` fixture's check of this test stays clean."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import numpy as np
import pytest

from flashpoint.errors import Unauthorized
from flashpoint.testing.harness import ClusterFactory, InProcessCluster, NetnsCluster, wait_for
from flashpoint.testing.leaks import alive

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("netns", [False, True], ids=["in-process", "netns"])
async def test_one_api_in_process_and_over_network_namespaces(make_cluster: ClusterFactory,
                                                             netns: bool) -> None:
    c = await make_cluster(hosts=2, models=("noop",), netns=netns)
    assert isinstance(c, NetnsCluster if netns else InProcessCluster)
    await c.deploy("hf", "noop", min_replicas=1)
    warm = await c.wait_warm("hf", count=1)
    assert len(warm) == 1
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    reply = await c.invoke("hf", {"x": {"data": x.ravel().tolist(), "shape": [2, 3],
                                        "datatype": "FP32"}})
    y = reply["outputs"]["y"]
    np.testing.assert_array_equal(np.asarray(y["data"], np.float32).reshape(y["shape"]), x)
    async with c.client() as fp:  # the Python client, on the same cluster
        r = await fp.invoke("hf", {"x": x})
        np.testing.assert_array_equal(r.outputs["y"], x)
    status = await c.status()
    assert sorted(h["host_id"] for h in status["hosts"]) == ["host0", "host1"]


async def test_an_api_key_cluster_hands_its_admin_key_to_its_clients(
        make_cluster: ClusterFactory) -> None:
    c = await make_cluster(api_keys={"harness-admin-key-01": "admin",
                                     "harness-invoke-key-1": "invoke"})
    assert c.api_key == "harness-admin-key-01"
    await c.deploy("kf", "noop")  # an admin call, with the handle's own key
    async with c.client(api_key=None) as anonymous:
        with pytest.raises(Unauthorized):
            await anonymous.status()


async def test_a_wait_that_times_out_says_what_it_saw(make_cluster: ClusterFactory) -> None:
    c = await make_cluster()
    with pytest.raises(AssertionError, match=r"waiting for: never-deployed warm.*last seen: \[\]"):
        await c.wait_warm("never-deployed", timeout_s=0.3)
    with pytest.raises(AssertionError, match=r"waiting for: two.*state: 1"):
        await wait_for("two", lambda: False, timeout_s=0.2, state=lambda: 1)


async def test_teardown_names_a_leaked_process_task_and_socket(tmp_path: Path) -> None:
    factory = ClusterFactory(tmp_path)
    c = await factory(hosts=1)
    assert isinstance(c, InProcessCluster)
    worker_pids = c.worker_pids()
    assert worker_pids
    # A process, a task running Flashpoint code and a listening socket, all left behind.
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    task = asyncio.ensure_future(c.local.wait_hosts(99, 60.0))
    task.set_name("leaky-wait")
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    try:
        with pytest.raises(AssertionError) as err:
            await asyncio.wait_for(factory.aclose(), 90)
        text = str(err.value)
        assert f"process {proc.pid} still running" in text and "sleep 60" in text
        assert "'leaky-wait'" in text and "wait_hosts" in text
        assert f"listening socket left open: tcp 127.0.0.1:{port}" in text
        # ... and only those: the cluster's own workers were stopped
        assert not any(f"process {p} " in text for p in worker_pids)
        assert not any(alive(p) for p in worker_pids)
        await asyncio.wait_for(proc.wait(), 10)  # the check killed it (by PID)
        assert task.cancelled() or task.done()
    finally:
        sock.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
