"""The API commands against a running controller: `deploy` reaches every field of a function a
user sets, `status` and `functions` print tables of what the API's JSON says (and the JSON
itself with --json), HTTP errors are the server's status, code and message in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from flashpoint.spec import FunctionSpec

from .conftest import arun_cli, assert_one_line_error

pytestmark = pytest.mark.timeout(300)

PROFILE = {"batch": 4, "points": [
    {"sm_share": s, "quota": q, "throughput_rps": 100.0 * s * q, "p99_latency_s": 0.05 / (s * q)}
    for s in (0.5, 1.0) for q in (0.5, 1.0)]}
PROTEAN = {"batch": 2, "slices": [{"slice": "7g", "solo_s": 0.01, "fbr": 0.4,
                                   "fbr_bounded": False, "mem_bytes": 1 << 20}]}
DILU = {"sm_request": 0.3, "sm_limit": 0.6, "ibs": 4, "throughput_rps": 80.0, "trials": 5}
# Every field of FunctionSpec a user sets: its flag, the text given, and the value the
# registered function must then hold (none of them the default).
FIELDS: dict[str, tuple[str, list[str], Any]] = {
    "model_version": ("--version", ["1"], "1"),
    "max_batch_size": ("--max-batch-size", ["5"], 5),
    "batch_wait_ms": ("--batch-wait-ms", ["2.5"], 2.5),
    "min_replicas": ("--min-replicas", ["1"], 1),
    "max_replicas": ("--max-replicas", ["3"], 3),
    "keep_alive_s": ("--keep-alive-s", ["12.5"], 12.5),
    "replica_concurrency": ("--replica-concurrency", ["7"], 7),
    "timeout_s": ("--timeout-s", ["9.5"], 9.5),
    "max_stages": ("--max-stages", ["2"], 2),
    "compute": ("--compute", ["0.25"], 0.25),
    "slo_ms": ("--slo-ms", ["150"], 150.0),
    "sm_share": ("--sm-share", ["0.5"], 0.5),
    "sm_limit": ("--sm-limit", ["0.75"], 0.75),
    "time_quota": ("--time-quota", ["0.5"], 0.5),
    "gpu_memory_bytes": ("--gpu-memory-bytes", [str(1 << 30)], 1 << 30),
    "fast_profile": ("--fast-profile", [json.dumps(PROFILE)], PROFILE),
    "protean_profile": ("--protean-profile", [json.dumps(PROTEAN)], PROTEAN),
    "dilu_profile": ("--dilu-profile", [json.dumps(DILU)], DILU),
    "batch_memory_bytes": ("--batch-memory-bytes", [str(1 << 20)], 1 << 20),
    "batch_fbr": ("--batch-fbr", ["0.4"], 0.4),
    "tenant_class": ("--tenant-class", ["best_effort"], "best_effort"),
    "canary_pct": ("--canary", ["40"], 40.0),
    "inputs": ("--input", ["x:FP32:-1,3", "mask:INT64:-1"],
               [{"name": "x", "datatype": "FP32", "shape": [-1, 3]},
                {"name": "mask", "datatype": "INT64", "shape": [-1]}]),
    "outputs": ("--output", ["y:fp16:-1,3"], [{"name": "y", "datatype": "FP16", "shape": [-1, 3]}]),
}


def test_the_table_covers_every_settable_field() -> None:
    settable = {f.name for f in dataclasses.fields(FunctionSpec)} - {"name", "model"}
    assert set(FIELDS) == settable
    defaults = FunctionSpec("f", "m").to_dict()
    assert [k for k, (_, _, want) in FIELDS.items() if defaults[k] == want] == ["model_version"]


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_deploy_reaches_every_field(controller: str, tmp_path: Path) -> None:
    argv = ["deploy", "every", "--model", "noop", "--url", controller]
    for flag, texts, _ in FIELDS.values():
        for text in texts:
            argv += [flag, text]
    r = await arun_cli(*argv, home=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = (await _get(f"{controller}/v1/functions/every"))["spec"]
    assert (spec["name"], spec["model"]) == ("every", "noop")
    for field, (_, _, want) in FIELDS.items():
        assert spec[field] == want, field
    # a flag not given takes the server's default, whatever an earlier deploy said (the
    # signature, not given, is the model's own)
    r = await arun_cli("deploy", "every", "--model", "noop", "--url", controller, home=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = (await _get(f"{controller}/v1/functions/every"))["spec"]
    defaults = FunctionSpec("every", "noop").to_dict()
    for field in FIELDS:
        if field not in ("inputs", "outputs"):
            assert spec[field] == defaults[field], field
    assert spec["inputs"] != FIELDS["inputs"][2] and spec["outputs"] != FIELDS["outputs"][2]
    # a value the server refuses: its status, code and message, one line
    r = await arun_cli("deploy", "every", "--model", "noop", "--url", controller,
                       "--sm-limit", "0.5", home=tmp_path)
    assert_one_line_error(r, "error 400: bad_request: ", "sm_limit")
    r = await arun_cli("deploy", "every", "--model", "noop", "--url", controller,
                       "--fast-profile", "{not json", home=tmp_path)
    assert_one_line_error(r, "error: --fast-profile is not JSON")
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    r = await arun_cli("deploy", "every", "--model", "noop", "--url", controller,
                       "--fast-profile", f"@{tmp_path / 'profile.json'}", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (await _get(f"{controller}/v1/functions/every"))["spec"]["fast_profile"] == PROFILE


def _rows(lines: list[str], title: str) -> list[list[str]]:
    """The rows (cells split on runs of two spaces) of the table titled ``title``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 2:]:  # past the title and the header
        if not line.strip():
            break
        rows.append([c.strip() for c in line.split("  ") if c.strip()])
    return rows


async def test_status_and_functions_print_tables_of_the_api_json(controller: str,
                                                                 tmp_path: Path) -> None:
    for name, batch in (("alpha", "3"), ("beta", "6")):
        r = await arun_cli("deploy", name, "--model", "noop", "--url", controller,
                           "--max-batch-size", batch, "--max-replicas", "2", home=tmp_path)
        assert r.returncode == 0, r.stderr
    want = {f["spec"]["name"]: f for f in await _get(f"{controller}/v1/functions")}
    r = await arun_cli("functions", "--url", controller, home=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["FUNCTION", "MODEL", "READY", "WARM", "STARTING", "QUEUED",
                                "REPLICAS", "BATCH"]
    rows = [line.split() for line in lines[1:]]
    assert sorted(row[0] for row in rows) == sorted(want)
    for row in rows:
        f = want[row[0]]
        assert row[1] == f"{f['spec']['model']}@{f['spec']['model_version']}"
        assert row[3:] == [str(f["replicas_warm"]), str(f["replicas_starting"]),
                           str(f["queued"]), f"0..{f['spec']['max_replicas']}",
                           str(f["spec"]["max_batch_size"])]
    r = await arun_cli("functions", "--url", controller, "--json", home=tmp_path)
    assert sorted(f["spec"]["name"] for f in json.loads(r.stdout)) == sorted(want)

    status = await _get(f"{controller}/v1/status")
    r = await arun_cli("status", "--url", controller, home=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"HOSTS ({len(status['hosts'])})" in lines
    assert f"REPLICAS ({len(status['replicas'])})" in lines
    assert [row[0] for row in _rows(lines, "FUNCTIONS")] == \
        [f["spec"]["name"] for f in status["functions"]]
    r = await arun_cli("status", "--url", controller, "--json", home=tmp_path)
    assert set(json.loads(r.stdout)) == set(status)


async def test_http_errors_and_a_closed_stdout(controller: str, tmp_path: Path) -> None:
    r = await arun_cli("invoke", "ghost", "--text", "hi", "--url", controller, home=tmp_path)
    assert_one_line_error(r, "error 404: function_not_found: ", "ghost")
    r = await arun_cli("delete", "ghost", "--url", controller, home=tmp_path)
    assert_one_line_error(r, "error 404: function_not_found: ")
    r = await arun_cli("invoke", "ghost", "--image", str(tmp_path / "no.jpg"), "--url",
                       controller, home=tmp_path)
    assert_one_line_error(r, "error: ", "no.jpg", "No such file")
    # `flashpoint functions | head` with head gone: no traceback, no "Exception ignored"
    r = await arun_cli("deploy", "alpha", "--model", "noop", "--url", controller, home=tmp_path)
    assert r.returncode == 0, r.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = await arun_cli("functions", "--url", controller, home=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    assert r.returncode == 1 and r.stderr == "", r.stderr


async def test_a_keyed_cluster_says_which_key(tmp_path: Path) -> None:
    import asyncio

    from flashpoint.config import generate_secret
    from flashpoint.controller.actor import Controller
    from flashpoint.registry import make_store

    from .conftest import controller_config

    key = generate_secret()
    cfg = controller_config(tmp_path, api_keys={key: "admin"})
    ctl = Controller(cfg, make_store(cfg))
    await asyncio.wait_for(ctl.start(), 30)
    try:
        r = await arun_cli("status", "--url", ctl.url, home=tmp_path)
        assert_one_line_error(r, "error 401: ", "pass --api-key (or set FLASHPOINT_API_KEY)")
        r = await arun_cli("status", "--url", ctl.url, "--api-key", key, home=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("HOSTS (0)"), r.stderr
        r = await arun_cli("functions", "--url", ctl.url, home=tmp_path,
                           env={"FLASHPOINT_API_KEY": key})
        assert r.returncode == 0 and r.stdout.split() == [
            "FUNCTION", "MODEL", "READY", "WARM", "STARTING", "QUEUED", "REPLICAS", "BATCH"]
    finally:
        await asyncio.wait_for(ctl.stop(), 30)
    assert isinstance(r, subprocess.CompletedProcess)
