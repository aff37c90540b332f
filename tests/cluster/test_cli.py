"""The command line against a real local cluster: deploy, invoke, list, status, delete, each
a `flashpoint` process of its own, and an error that says what went wrong."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(180)


async def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    # subprocess.run waits for the process and kills it at the timeout: none outlives the test
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "flashpoint.cli", *argv], capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL)


async def test_deploy_invoke_list_status_delete(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    c = await make_cluster(config=cluster_config(tmp_path))
    try:
        url = c.controller.url
        r = await _cli("deploy", "nf", "--model", "noop", "--url", url, "--max-batch-size", "4")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["spec"]["name"] == "nf" and info["spec"]["max_batch_size"] == 4
        # --canary reaches the spec (a roll-out's split: tests/cluster/test_rollout.py) and a
        # bad percentage is the controller's typed 400
        r = await _cli("deploy", "nf", "--model", "noop", "--url", url, "--max-batch-size", "4",
                       "--canary", "30")
        assert r.returncode == 0 and json.loads(r.stdout)["spec"]["canary_pct"] == 30, r.stderr
        assert json.loads(r.stdout)["rollout"]["phase"] == "stable"  # one version: no split
        r = await _cli("deploy", "nf", "--model", "noop", "--url", url, "--canary", "0")
        assert r.returncode == 1 and "error 400" in r.stderr and "canary_pct" in r.stderr

        inputs = json.dumps({"x": {"data": [1.5, -2.0, 3.0], "shape": [1, 3], "datatype": "FP32"}})
        r = await _cli("invoke", "nf", "--inputs", inputs, "--url", url)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["outputs"]["y"]["data"] == [1.5, -2.0, 3.0] and out["cold"] is True

        r = await _cli("functions", "--url", url, "--json")
        assert r.returncode == 0, r.stderr
        assert [f["spec"]["name"] for f in json.loads(r.stdout)] == ["nf"]
        r = await _cli("status", "--url", url, "--json")
        assert r.returncode == 0 and len(json.loads(r.stdout)["hosts"]) == 1, r.stderr

        r = await _cli("delete", "nf", "--url", url)
        assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": "nf"}, r.stderr
        assert "nf" not in c.controller.state.functions
        r = await _cli("invoke", "nf", "--inputs", inputs, "--url", url)
        assert r.returncode == 1 and "error 404" in r.stderr and "function_not_found" in r.stderr
        assert r.stdout == "" and "Traceback" not in r.stderr
        r = await _cli("delete", "nf", "--url", url)
        assert r.returncode == 1 and "error 404" in r.stderr
        r = await _cli("invoke", "nf", "--inputs", "{x: 1", "--url", url)
        assert r.returncode == 1 and "--inputs is not JSON" in r.stderr
    finally:
        await asyncio.wait_for(c.stop(), 60)
    r = await _cli("status", "--url", url)  # the cluster is gone: nothing listens there
    assert r.returncode == 1 and f"no cluster at {url} (connection refused)" in r.stderr
    assert "`flashpoint up`" in r.stderr and len(r.stderr.splitlines()) == 1
    assert "Traceback" not in r.stderr
