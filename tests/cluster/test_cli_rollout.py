"""`flashpoint deploy --wait` of a new version on a live function waits for the roll-out and
shows it: the old and new versions' warm replicas, a line per change when its output is not
a terminal (a CI log reads as a history: no carriage returns, no cursor movement)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashpoint.models.sources import publish
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(240)


async def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    # subprocess.run waits for the process and kills it at the timeout: none outlives the test
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "flashpoint.cli", *argv], capture_output=True,
        text=True, timeout=180, stdin=subprocess.DEVNULL)


async def test_deploy_wait_draws_a_roll_out_until_it_settles(make_cluster: ClusterFactory,
        tmp_path: Path) -> None:
    c = await make_cluster(hosts=2, config=cluster_config(tmp_path))
    await publish(c.store, "noop", "tiny", "2", model_name="noop")
    url = c.controller.url
    r = await _cli("deploy", "nf", "--model", "noop", "--url", url, "--min-replicas", "1",
                   "--keep-alive-s", "300", "--wait", "--wait-timeout-s", "120")
    assert r.returncode == 0, r.stderr
    assert "roll-out" not in r.stderr  # a first deploy is no roll-out

    r = await _cli("deploy", "nf", "--model", "noop", "--version", "2", "--url", url,
                   "--min-replicas", "1", "--keep-alive-s", "300", "--wait",
                   "--wait-timeout-s", "120")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rollout"]["phase"] == "rolling"
    assert "\r" not in r.stderr and "\x1b" not in r.stderr  # not a terminal: plain lines
    lines = [x for x in r.stderr.splitlines() if "roll-out 1 -> 2" in x]
    assert lines and lines[0].startswith("nf: roll-out 1 -> 2 (rolling) old 1 warm"), \
        r.stderr
    assert lines[-1] == "nf: roll-out 1 -> 2 (stable) old 0 warm, new 1 warm, " \
                        "0 starting/stopping", r.stderr
    # one line per change: the same state is never written twice in a row
    assert all(a != b for a, b in zip(lines, lines[1:], strict=False)), r.stderr
    # the controller, asked on its own, agrees that the roll-out is done
    view = c.controller.get_function("nf").to_dict()["rollout"]
    assert view["phase"] == "stable" and view["version"] == "2", view
    warm = {k: n["warm"] for k, n in view["replicas"].items() if n["warm"]}
    assert warm == {"noop@2": 1}, view
