"""bench/gpu/validate.sh: dry mode in CI (no GPU here), and its judges fail without evidence.

The GPU parts cannot run here; what can be checked is that the script ends 0 and says what
it skipped, and that each part's judge fails on a skipped test, a "skipped" bench, missing
numbers or numbers out of bounds (so on a GPU machine nothing passes vacuously).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "validate.sh"
PARTS = ["cuda_ipc", "kaas_cupy", "pytest_gpu", "hook_torch", "mps", "serve_cuda"]
pytestmark = pytest.mark.timeout(120)


def _validate():
    spec = importlib.util.spec_from_file_location("fp_validate", ROOT / "bench" / "gpu" / "validate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fp_validate"] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, OUT=str(tmp_path / "res"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=100)
    return proc, json.loads((tmp_path / "res" / "summary.json").read_text())


def test_dry_run_exits_0_and_says_what_it_skipped(tmp_path):
    proc, summary = _run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert summary["gpu"] is False and summary["dry_run"] is True
    assert summary["skipped"] == PARTS and summary["passed"] == summary["failed"] == []
    for part in PARTS:
        res = json.loads((tmp_path / "res" / f"{part}.json").read_text())
        assert res["status"] == "skipped" and "dry run" in res["reason"]
        assert f"SKIPPED  {part}" in proc.stdout


def test_without_cuda_it_detects_no_gpu_and_skips(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run every part")
    proc, summary = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert summary["gpu"] is False and summary["dry_run"] is False
    assert summary["skipped"] == PARTS and "cuda" in summary["reason"].lower()


def test_pytest_judge_fails_on_skips_and_on_nothing_run():
    v = _validate()
    ran = v.Ran(0, "", "", 1.0, False)
    ok = {"tests": 2, "passed": 2, "failed": [], "skipped": []}
    assert v.judge_pytest(ran, ok, 2)["status"] == "pass"
    skipped = {**ok, "passed": 1, "skipped": ["t::cupy: needs CuPy"]}
    assert v.judge_pytest(ran, skipped, 2)["status"] == "fail"
    assert v.judge_pytest(ran, {**ok, "tests": 0, "passed": 0}, 1)["status"] == "fail"
    assert v.judge_pytest(v.Ran(0, "", "", 1.0, True), ok, 2)["status"] == "fail"


def _hook_result(share: float, overhead: float) -> dict:
    return {"overhead": {"hook_manager_overhead": overhead, "hook_only_overhead": overhead / 2},
            "shares": {"share_a_throughput": share, "share_a_manager": share},
            "pass": {"hook_engaged": True}}


def test_hook_torch_judge_holds_shares_and_overhead():
    v = _validate()
    assert v.judge_hook_torch(_hook_result(0.31, 0.02))["status"] == "pass"
    assert v.judge_hook_torch(_hook_result(0.36, 0.02))["problems"] == ["share_throughput", "share_manager"]
    assert v.judge_hook_torch(_hook_result(0.30, 0.04))["problems"] == ["overhead"]
    assert v.judge_hook_torch({"bench": "hook_torch", "skipped": "no CUDA"})["status"] == "fail"
    assert v.judge_hook_torch(None)["status"] == "fail"
    assert v.judge_hook_torch({"overhead": {}})["status"] == "fail"


def test_mps_judge_needs_mps_and_both_workers_near_solo():
    v = _validate()
    good = {"gpu": True, "mps": {"started": True, "solo": [{"items_per_s": 30.0}, {"items_per_s": 70.0}],
                                 "together": [{"items_per_s": 28.0}, {"items_per_s": 66.0}]}}
    assert v.judge_mps(good)["status"] == "pass"
    slow = {**good, "mps": {**good["mps"], "together": [{"items_per_s": 20.0}, {"items_per_s": 66.0}]}}
    assert v.judge_mps(slow)["status"] == "fail"
    same = {**good, "mps": {**good["mps"], "solo": [{"items_per_s": 70.0}, {"items_per_s": 70.0}]}}
    assert v.judge_mps(same)["status"] == "fail"  # the shares did not take effect
    assert v.judge_mps({"gpu": True, "mps": {"started": False, "reason": "no binary"}})["status"] == "fail"
    assert v.judge_mps({"gpu": False, "reason": "no GPU"})["status"] == "fail"


def test_serve_judge_needs_to_device_and_the_pinned_reference():
    v = _validate()
    row = {"row": "ram", "fetch": 0.0, "load": 0.01, "to_device": 0.1, "first_inference": 0.02}
    res = {"rows": [row, row], "outputs_match_cpu": True, "ram_to_device_s_median": 0.1,
           "model_bytes": 438_000_000}
    assert v.judge_serve(res, {"median_s": 0.09})["status"] == "pass"
    assert v.judge_serve(res, {"median_s": 0.05})["status"] == "fail"  # 2x a pinned copy
    assert v.judge_serve(res, None)["status"] == "fail"  # no reference: no verdict
    no_phase = {**res, "rows": [{**row, "to_device": 0.0}]}
    assert v.judge_serve(no_phase, {"median_s": 0.09})["status"] == "fail"
    assert v.judge_serve({**res, "outputs_match_cpu": False}, {"median_s": 0.09})["status"] == "fail"
    assert v.judge_serve({"bench": "serve_cuda", "skipped": "no GPU"}, None)["status"] == "fail"
