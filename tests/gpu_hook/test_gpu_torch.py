"""On a real GPU: torch under the hook is gated (grants happen) and 30/70 shares hold.
Skips cleanly without CUDA; bench/gpu/hook_torch.py is the full measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_torch_under_the_hook_is_gated_and_shares_hold():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "hook_torch.py"), "--seconds", "5",
                          "--preset", "small"], env=env, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["pass"]["hook_engaged"], res
    assert res["pass"]["share_manager_within_5pct"], res["shares"]
