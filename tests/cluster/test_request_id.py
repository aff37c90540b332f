"""A request id given to the gateway (``X-Request-Id``) is on the controller's log line for
that request and on the worker's, so one grep follows a request through the cluster.

The cluster is a `flashpoint up` process of its own with its stderr (and so its workers',
which inherit it) in a file: the lines are read as an operator's log shipper reads them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flashpoint.config import load_config
from flashpoint.models.sources import publish
from flashpoint.registry import make_store
from flashpoint.testing.up_process import UpProcess

pytestmark = pytest.mark.timeout(240)

RID = "trace-me-0123456789"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line that is not structlog's (a library's print)
        if isinstance(rec, dict):
            out.append(rec)
    return out


def test_request_id_reaches_controller_and_worker_logs(tmp_path: Path) -> None:
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text('log_level = "DEBUG"\n[controller]\nlisten_port = 0\n'
                        f'[host]\nwarm_pool_size = 1\ncpu_devices = 1\n'
                        f'cache_dir = "{tmp_path}/cache"\n')
    store = make_store(load_config(cfg_path).with_home(tmp_path))
    asyncio.run(publish(store, "noop", "tiny", "1", model_name="noop"))
    env = {k: v for k, v in os.environ.items() if k != "FLASHPOINT_SECRET"}
    env.update(FLASHPOINT_LOG_FORMAT="json", FLASHPOINT_WORKER_LOG_LEVEL="DEBUG")
    log_path = tmp_path / "cluster.log"
    with log_path.open("w") as log_file:
        up = UpProcess(cfg_path, tmp_path, env=env, stderr=log_file)
    try:
        api = UpProcess.api_url(up.banner(120))
        r = subprocess.run([sys.executable, "-m", "flashpoint.cli", "deploy", "nf", "--model",
                            "noop", "--url", api], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, env=env)
        assert r.returncode == 0, r.stderr
        body = json.dumps({"inputs": {"x": {"data": [1.5, -2.0], "shape": [1, 2],
                                            "datatype": "FP32"}}}).encode()
        req = urllib.request.Request(f"{api}/v1/functions/nf/invoke", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "X-Request-Id": RID})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
            assert resp.headers.get("X-Request-Id") == RID
        assert answer["outputs"]["y"]["data"] == [1.5, -2.0]  # noop: y is x
        # The lines are written before the reply leaves each process; a bounded wait covers
        # the pipe's flush only.
        deadline, events = time.monotonic() + 10, set()
        while time.monotonic() < deadline:
            events = {rec.get("event") for rec in _json_lines(log_path)
                      if rec.get("request_id") == RID}
            if {"request_done", "request_served"} <= events:
                break
            time.sleep(0.1)
        # request_done: the controller's (requests.py); request_served: the worker's, with the
        # id from its bound context, not passed by the call
        assert {"request_done", "request_served"} <= events, (events, log_path.read_text()[-4000:])
    finally:
        up.stop()
