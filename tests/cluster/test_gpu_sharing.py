"""GPU sharing end to end on fake devices: a controller with a share policy, a host with
fake NVML GPUs and an MPS or tokens sharing mode (a fake ``nvidia-cuda-mps-control`` on
PATH; the hook built and preloaded into the real warm-pool workers), a function with a
declared share. Two replicas land on one GPU with the chosen shares, the host enforces them
through the worker env, and both serve (the workers compute on the CPU: the GPUs are fake)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gpu.fake_mps import install_fake_mps

from flashpoint.procs import pid_alive
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fake_mps_path(tmp_path: Path, monkeypatch) -> None:
    bin_dir = install_fake_mps(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.parametrize("mode,policy", [("mps", "fastgshare"), ("tokens", "dilu")])
async def test_two_replicas_share_one_gpu_with_chosen_shares(make_cluster: ClusterFactory,
        tmp_path, fake_mps_path, mode,
                                                             policy):
    if mode == "tokens" and not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("the hook needs a C compiler")
    run_dir = Path(f"/tmp/fpc-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    cfg = cluster_config(tmp_path, fake_gpus=["A100-40GB", "A100-40GB"], gpu_sharing=mode,
                         sharing_dir=str(run_dir), warm_pool_size=2)
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller,
                                                                  share_policy=policy))
    c = await make_cluster(config=cfg)
    host = c.hosts[0]
    pids = [w.proc.pid for w in host.workers.values()]
    try:
        if mode == "tokens":  # the warm pool was started with the hook preloaded
            hook = host.gpu.spawn_env()["LD_PRELOAD"]
            for pid in pids:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"LD_PRELOAD={hook}".encode() in env
        url = c.controller.url
        spec = {"name": "noop-fn", "model": "noop", "min_replicas": 2, "max_replicas": 2,
                "sm_share": 0.3, "sm_limit": 0.45, "time_quota": 0.5,
                "gpu_memory_bytes": 1 << 30}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/functions", json=spec) as r:
                assert r.status == 201, await r.text()
            await wait_for("two warm replicas", lambda: sum(
                r.phase == "warm" for r in c.controller.state.replicas_of("noop-fn")) == 2, 90)
            reps = c.controller.state.replicas_of("noop-fn")
            assert {(r.host_id, r.device_id) for r in reps} == {(host.host_id, "cuda:0")}
            for r in reps:
                if policy == "fastgshare":
                    assert (r.share.sm_share, r.share.time_request) == (0.3, 0.5)
                else:  # Dilu: request 0.3, limit 0.45
                    assert (r.share.time_request, r.share.time_limit) == (0.3, 0.45)
                rt = host.replicas[r.replica_id]
                share = host.state.replicas[r.replica_id].share  # HostState holds the record
                assert share is not None and share.to_wire() == r.share.to_wire()
                unit = host.gpu.sharing.units["cuda:0"]
                assert rt.env["CUDA_VISIBLE_DEVICES"] == unit.device.uuid
                if mode == "mps":
                    assert rt.env["CUDA_MPS_PIPE_DIRECTORY"] == str(unit.daemon.pipe_dir)
                    assert rt.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
                    assert rt.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
                else:
                    assert rt.env["FP_HOOK_SOCKET"] == unit.socket_path
                    assert rt.env["FP_HOOK_MEM_LIMIT_BYTES"] == str(1 << 30)
                    q = unit.manager.state.quota(int(rt.env["FP_HOOK_TENANT"]))
                    assert (q.request, q.limit, q.sm_share) == (0.3, 0.45, 0.45)
            body = {"inputs": {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}}
            for _ in range(4):
                async with s.post(f"{url}/v1/functions/noop-fn/invoke", json=body) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
            assert np.asarray(out["outputs"]["y"]["data"]).size > 0
            if mode == "tokens":  # a live quota change through the host RPC
                rid = reps[0].replica_id
                reply = await c.controller.hosts[host.host_id].conn.call(
                    "set_replica_share", {"replica_id": rid, "share": {
                        "sm_share": 0.5, "time_request": 0.5, "time_limit": 0.7}}, timeout_s=10)
                tenant = reply["tenant"]
                q = host.gpu.sharing.units["cuda:0"].manager.state.quota(tenant)
                assert (q.request, q.limit, q.sm_share) == (0.5, 0.7, 0.5)
        daemon_pid = host.gpu.sharing.units["cuda:0"].daemon.pid if mode == "mps" else None
    finally:
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)
    if daemon_pid is not None:
        assert not pid_alive(daemon_pid)  # stopped with the host


async def test_best_effort_function_is_registered_best_effort_on_a_tokens_host(
        make_cluster: ClusterFactory, tmp_path):
    # Dilu's vertical scaling is live only if a deployed function's class reaches the token
    # manager: a best_effort function's replica must be a best-effort tenant there (KLC
    # throttles only those), an SLO one an SLO tenant.
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("the hook needs a C compiler")
    run_dir = Path(f"/tmp/fpd-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    cfg = cluster_config(tmp_path, fake_gpus=["A100-40GB"], gpu_sharing="tokens",
                         sharing_dir=str(run_dir), warm_pool_size=2)
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller,
                                                                  share_policy="dilu"))
    c = await make_cluster(config=cfg)
    host = c.hosts[0]
    try:
        specs = {"klc-slo-fn": {"sm_share": 0.5, "sm_limit": 0.7},
                 "klc-be-fn": {"sm_share": 0.3, "sm_limit": 0.6, "tenant_class": "best_effort"}}
        async with aiohttp.ClientSession() as s:
            for name, share in specs.items():
                body = {"name": name, "model": "noop", "min_replicas": 1, "max_replicas": 1,
                        **share}
                async with s.post(f"{c.controller.url}/v1/functions", json=body) as r:
                    assert r.status == 201, await r.text()
            async with s.post(f"{c.controller.url}/v1/functions", json={
                    "name": "klc-bad-fn", "model": "noop", "sm_share": 0.3,
                    "tenant_class": "bulk"}) as r:
                assert r.status == 400 and "tenant_class" in await r.text()
            async with s.get(f"{c.controller.url}/v1/functions/klc-be-fn") as r:
                assert (await r.json())["spec"]["tenant_class"] == "best_effort"
        await wait_for("both replicas warm", lambda: all(
            any(r.phase == "warm" for r in c.controller.state.replicas_of(n)) for n in specs), 90)
        status = await c.controller.hosts[host.host_id].conn.call("host_status", {},
                                                                  timeout_s=10)
        mgr = host.gpu.sharing.units["cuda:0"].manager
        for name, want in (("klc-slo-fn", True), ("klc-be-fn", False)):
            (rep,) = c.controller.state.replicas_of(name)
            assert rep.share.slo_sensitive is want  # the controller's decision ...
            tenant = int(host.replicas[rep.replica_id].env["FP_HOOK_TENANT"])
            assert mgr.state.quota(tenant).slo_sensitive is want  # ... the manager's quota
            reported = status["gpu"]["tenants"][rep.replica_id]
            assert reported["tenant_class"] == ("slo" if want else "best_effort")
            assert reported["share"]["slo_sensitive"] is want
        be_tenant = int(host.replicas[c.controller.state.replicas_of("klc-be-fn")[0]
                                      .replica_id].env["FP_HOOK_TENANT"])
        # its Dilu request and limit (KLC holds it to the request while an SLO tenant runs)
        q = mgr.state.quota(be_tenant)
        assert (q.request, q.limit) == (0.3, 0.6)
    finally:
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)
