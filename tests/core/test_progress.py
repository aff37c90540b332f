"""flashpoint.progress: transfer bars from a status snapshot."""

from __future__ import annotations

from flashpoint.progress import bar, ready, render

STATUS = {
    "hosts": [{"host_id": "h1", "transfers": {"bert@1": [50_000_000, 200_000_000]}},
              {"host_id": "h2", "transfers": {}}],
    "replicas": [{"function": "f", "replica_id": "f-1", "host_id": "h0", "phase": "warm",
                  "source": "registry"},
                 {"function": "f", "replica_id": "f-2", "host_id": "h1", "phase": "starting",
                  "source": ""},
                 {"function": "g", "replica_id": "g-1", "host_id": "h1", "phase": "warm"}],
}


def test_bar_fills_in_proportion_and_clamps():
    assert bar(0, 100, 10) == "[..........]   0.0%"
    assert bar(25, 100, 10) == "[##........]  25.0%"
    assert bar(500, 100, 10) == "[##########] 100.0%"
    assert bar(5, 0, 4) == "[....]   0.0%"


def test_render_lists_transfers_then_the_functions_replicas():
    lines = render(STATUS, "f")
    assert len(lines) == 3
    assert "bert@1" in lines[0] and "25.0%" in lines[0] and "50.0/200.0 MB" in lines[0]
    assert lines[1].endswith("warm from registry")
    assert lines[2].endswith("starting")


def test_ready_counts_warm_replicas_of_the_function():
    assert ready(STATUS, "f", 1) and not ready(STATUS, "f", 2)
    assert ready(STATUS, "g", 1) and not ready(STATUS, "h", 1)
