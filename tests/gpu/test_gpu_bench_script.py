"""bench/gpu/inventory_mps.py: exits 0 with "no GPU" here, and its whole flow runs against the
fake NVML, the fake MPS control binary and CPU workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashpoint.procs import pid_alive

from .fake_mps import install_fake_mps

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "inventory_mps.py"


def _run(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s)


def test_no_gpu_exits_zero_with_message():
    from flashpoint.gpu.nvml import load_nvml

    nvml = load_nvml()
    if nvml is not None:
        nvml.nvmlShutdown()
        pytest.skip("a real GPU is present")
    out = _run([], dict(os.environ), 60)
    assert out.returncode == 0, out.stderr
    assert "no GPU" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1])["gpu"] is False


@pytest.mark.timeout(240)
def test_full_flow_with_fakes(tmp_path):
    bin_dir = install_fake_mps(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    out = _run(["--fake-nvml", "H100-80GB", "--cpu", "--seconds", "0.3", "--preset", "tiny",
                "--batch", "2"], env, 200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GPU 0: NVIDIA H100 80GB HBM3" in out.stdout
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["gpu"] is True and report["gpus"][0]["mig_current"] is False
    assert report["solo_full_gpu"]["iterations"] > 0
    mps = report["mps"]
    assert mps["started"] is True, mps
    assert [r["sm_share_env"] for r in mps["solo"]] == ["30", "70"]
    assert [r["sm_share_env"] for r in mps["together"]] == ["30", "70"]
    assert all(r["items_per_s"] > 0 for r in mps["solo"] + mps["together"])
    assert "together, MPS 70%" in out.stdout
    assert not pid_alive(mps["pid"])  # the daemon was stopped
