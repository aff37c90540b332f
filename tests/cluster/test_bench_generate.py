"""bench/generate.py --quick: the whole benchmark flow (a local cluster serving a tiny causal
LM, streams through the OpenAI route, a scale from zero out of host RAM, the in-process
``generate`` baseline) runs to its JSON line within a bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "generate.py"


@pytest.mark.timeout(300)
def test_generate_bench_quick_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                         text=True, env=env, timeout=280)  # killed (by pid) past it
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "generate" and result["quick"] is True
    assert [lv["streams"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        assert 0 < lv["tokens"] <= lv["streams"] * result["max_tokens"]
        assert lv["tokens_per_s"] > 0 and lv["ttft_p50_ms"] > 0
        assert lv["ratio"] == pytest.approx(lv["tokens_per_s"] / lv["baseline_tokens_per_s"])
    assert result["ram_sources"] == ["local"]  # the scale from zero came out of host RAM
    assert result["migration"] is None  # only with --migration (bench/migration.py's run)
    assert "ratio vs generate" in out.stdout
