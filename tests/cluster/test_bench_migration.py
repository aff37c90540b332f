"""bench/migration.py: the live-migration gap benchmark (issue 21 item 7) runs end to end --
a two-host local cluster, two greedy streams, a spot drain of host1 mid-stream, the moved
stream's ids checked against ``transformers``' ``generate`` by the bench itself -- to its
JSON line, within a bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "migration.py"


@pytest.mark.timeout(300)
def test_migration_bench_one_trial_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    out = subprocess.run([sys.executable, str(SCRIPT), "--streams", "2", "--trials", "1"],
                         capture_output=True, text=True, env=env,
                         timeout=280)  # killed (by pid) past it
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "migration" and result["replace"] is False
    # host1's replica ran one of the two streams; it moved (a stream that differs from
    # generate fails the bench before this line)
    two = result["streams_2"]
    assert two["moved"] == 1, result
    assert two["parked"] == 1  # multi-round by default, a lone move included
    assert two["gap_ms_max"] > 0 and two["prefill_ms_p50"] > 0 and two["tpot_ms_p50"] > 0
    assert 0 <= two["met"] <= two["moved"]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("streams=2 "))
    assert "gap=" in line and "target<=" in line
