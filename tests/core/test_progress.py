"""flashpoint.progress: transfer bars from a status snapshot."""

from __future__ import annotations

from flashpoint.progress import bar, ready, render, rolling, rollout_done, rollout_failed, rollout_line

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


def _view(phase: str, replicas: dict[str, dict[str, int]], canary: float | None = None,
          reason: str = "") -> dict:
    counts = {k: {"starting": 0, "warm": 0, "stopping": 0, **v} for k, v in replicas.items()}
    return {"phase": phase, "version": "2", "previous_version": "1", "canary_pct": canary,
            "reason": reason, "replicas": counts}


def test_rollout_line_counts_old_and_new_warm_replicas():
    view = _view("rolling", {"m@1": {"warm": 2, "stopping": 1}, "m@2": {"warm": 1,
                                                                      "starting": 1}})
    assert rolling(view)
    assert rollout_line("f", view) == ("f: roll-out 1 -> 2 (rolling) old 2 warm, new 1 warm, "
                                       "2 starting/stopping")
    assert "canary 30%" in rollout_line("f", _view("canary", {}, canary=30.0))
    assert rollout_line("f", _view("failed", {}, reason="oom")).endswith(": oom")


def test_rollout_done_once_settled_on_the_target_or_its_canary_split():
    assert not rollout_done(_view("rolling", {"m@1": {"warm": 1}, "m@2": {"warm": 1}}))
    assert not rollout_done(_view("stable", {"m@2": {"warm": 1, "starting": 1}}))
    assert not rollout_done(_view("stable", {"m@1": {"warm": 1}, "m@2": {"warm": 1}}))
    assert rollout_done(_view("stable", {"m@1": {}, "m@2": {"warm": 2}}))
    assert not rollout_done(_view("canary", {"m@2": {"warm": 1}}))
    assert rollout_done(_view("canary", {"m@1": {"warm": 1}, "m@2": {"warm": 1}}))
    assert rollout_failed(_view("failed", {})) and not rollout_failed(_view("rolling", {}))
    # one version only (a first deploy, or a settled one) is no roll-out to wait for
    assert not rolling({"phase": "stable", "version": "1", "previous_version": None})
    assert not rolling({})


def test_a_settled_view_keeps_the_old_version_named():
    view = {**_view("stable", {"m@2": {"warm": 1}}), "previous_version": None}
    assert rollout_line("f", view, "1").startswith("f: roll-out 1 -> 2 (stable) old 0 warm")
