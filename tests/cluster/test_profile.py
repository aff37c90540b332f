"""`flashpoint profile` end to end on a tokens host with a fake GPU (the CPU stand-in: the
host places, attaches and accounts each trial's share with its token manager; the workers
compute on the CPU). The CLI, in its own process, asks the controller's route for a small
FaST grid, PROTEAN's Solo and co-located runs and Dilu's HGSS; the stored profile holds the
grid, the trials' request counts match the controller's own Prometheus counters, and the
function's share is then resolved from the stored profile (checked against the pure
policy applied to the answer's points)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import aiohttp
import prometheus_client
import pytest

from flashpoint.policy.fastgshare import FunctionProfile, ProfilePoint, share_from_profile
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
FN = "profiled-noop"  # no other test uses it: the controller's counters are process-wide
GRID = {(0.5, 0.5), (0.5, 1.0), (1.0, 0.5), (1.0, 1.0)}
REQUESTS = 12


def protean_slice(p: dict) -> dict:
    """The stored slice entry of the answer's PROTEAN profile."""
    return {k: p[k] for k in ("slice", "solo_s", "fbr", "fbr_bounded")}


def _served(prefix: str) -> float:
    """Requests the controller counted as served for functions named ``prefix``*."""
    total = 0.0
    for metric in prometheus_client.REGISTRY.collect():
        if metric.name != "flashpoint_requests":
            continue
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels.get("outcome") == "ok" \
                    and s.labels.get("function", "").startswith(prefix):
                total += s.value
    return total


async def _cli(*argv: str, timeout_s: float = 150.0) -> tuple[int, str, str]:
    """``flashpoint ARGV`` in a child process (stopped by its PID if it overruns)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flashpoint.cli", *argv, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_flashpoint_profile_stores_a_grid_that_share_resolution_reads(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("the hook needs a C compiler")
    run_dir = Path(f"/tmp/fpp-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    cfg = cluster_config(tmp_path, fake_gpus=["A100-40GB"], gpu_sharing="tokens",
                         sharing_dir=str(run_dir), warm_pool_size=2)
    c = await make_cluster(config=cfg)
    try:
        url = c.controller.url
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/functions",
                              json={"name": FN, "model": "noop", "max_replicas": 2}) as r:
                assert r.status == 201, await r.text()
        served_before = _served(f"{FN}.prof-")
        rc, out, err = await _cli(
            "profile", FN, "--url", url, "--grid", "0.5,1x0.5,1", "--requests", str(REQUESTS),
            "--protean", "--dilu", "--slo-ms", "60000", "--max-ibs", "1", "--json",
            "--timeout-s", "140")
        assert rc == 0, err
        answer = json.loads(out)

        # FaST: the full grid, every trial served every request, none failed
        fast = answer["fast_profile"]
        points = {(p["sm_share"], p["quota"]): p for p in fast["points"]}
        assert set(points) == GRID and fast["batch"] == 1
        trials = answer["trials"]
        assert all(t["ok"] == REQUESTS and t["failed"] == 0 for t in trials)
        assert all(p["throughput_rps"] > 0 and p["p99_latency_s"] > 0 for p in points.values())
        for t in trials:  # the numbers are the trial's own: served / wall, p99 within it
            assert t["throughput_rps"] * t["wall_s"] == pytest.approx(REQUESTS)
            assert 0 < t["mean_latency_s"] <= t["p99_latency_s"] <= t["wall_s"]
        for sm in (0.5, 1.0):  # more quota does not make throughput collapse (loose: the
            # CPU stand-in's quota does not throttle compute, so this bounds noise only)
            assert points[(sm, 1.0)]["throughput_rps"] >= 0.1 * points[(sm, 0.5)]["throughput_rps"]
        # the controller's own accounting: measured requests plus one warm-up per replica
        warmups = sum(t["point"]["replicas"] for t in trials)
        assert _served(f"{FN}.prof-") - served_before == len(trials) * REQUESTS + warmups
        # one replica served every one-replica trial (its share changed live on the tokens
        # host); the co-located pair needed its own
        assert answer["deploys"] == 2
        # trials ran on the sharing GPU; no trial function is left behind
        assert {t["device"] for t in trials} == {f"{c.hosts[0].host_id}/cuda:0"}
        assert set(c.controller.state.functions) == {FN}

        # PROTEAN: the co-located run put both replicas on one device; Solo time and FBR
        protean = answer["protean_profile"]
        assert protean["slice"] == "7g" and protean["solo_s"] > 0 and protean["fbr"] >= 0
        assert any(t["point"]["replicas"] == 2 and t["co_located"] for t in trials)
        # Dilu: with a 30 s budget HGSS accepts its first SMR (10%) at IBS 1 (the largest
        # asked for here), limit twice the request
        dilu = answer["dilu_profile"]
        assert (dilu["sm_request"], dilu["sm_limit"], dilu["ibs"], dilu["trials"]) == (
            0.1, 0.2, 1, 1)
        assert any(t["point"] == {"sm_share": 0.1, "time_quota": 0.1, "batch": 1,
                                  "replicas": 1, "sm_limit": 0.1} for t in trials)

        # stored on the function (and persisted), and share resolution reads it
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/functions/{FN}") as r:
                info = await r.json()
        stored = info["spec"]
        assert stored["fast_profile"] == fast
        assert stored["dilu_profile"] == {k: dilu[k] for k in stored["dilu_profile"]}
        assert stored["protean_profile"]["slices"][0] == {**protean_slice(protean),
                                                          "mem_bytes": 0}
        persisted = {spec.name: spec for spec in await c.controller.functions.table.load()}
        assert persisted[FN].fast_profile is not None
        # PROTEAN's FBR is the slice dispatcher's batch_fbr too, scaled from the trials'
        # batch (1) to the function's max_batch_size (8, the default)
        assert stored["batch_fbr"] == pytest.approx(min(100.0, protean["fbr"] * 8))
        assert persisted[FN].sm_share == 0.0  # the registered spec: the share is resolved
        ref = share_from_profile(FunctionProfile(FN, tuple(
            ProfilePoint(p["sm_share"], p["quota"], p["throughput_rps"], p["p99_latency_s"])
            for p in fast["points"])))
        rec = c.controller.state.functions[FN]
        assert (rec.spec.sm_share, rec.spec.time_quota) == (ref.sm_share, ref.time_quota)
        assert rec.share_reason.startswith(f"fast profile {ref.config}")
        assert answer["share"]["sm_share"] == ref.sm_share
    finally:
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_flashpoint_profile_errors_are_one_line(make_cluster: ClusterFactory,
                                                      tmp_path: Path) -> None:
    """An unknown function is a 404; a cluster without a sharing host says so (409)."""
    c = await make_cluster(config=cluster_config(tmp_path))
    try:
        url = c.controller.url
        rc, out, err = await _cli("profile", "no-such-fn", "--url", url, timeout_s=60)
        assert rc == 1 and err.startswith("error 404:") and "Traceback" not in err
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/functions",
                              json={"name": "profiled-unshared", "model": "noop"}) as r:
                assert r.status == 201, await r.text()
        rc, out, err = await _cli("profile", "profiled-unshared", "--url", url, timeout_s=60)
        assert rc == 1 and err.startswith("error 409:") and "gpu_sharing" in err
        assert "Traceback" not in err and out == ""
    finally:
        await asyncio.wait_for(c.stop(), 60)
