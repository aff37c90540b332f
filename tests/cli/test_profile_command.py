"""`flashpoint profile`'s flags, the body it sends and the table it prints (pure: no
cluster; tests/cluster/test_profile.py runs it against one)."""

from __future__ import annotations

import pytest

from flashpoint.cli import parser
from flashpoint.cli.tables import profile_lines
from flashpoint.errors import BadRequest
from flashpoint.policy.profile_trials import ProfileRequest


def _args(*argv: str):
    return parser.build().parse_args(["profile", "fn", *argv])


def test_flags_become_a_request_the_route_accepts():
    assert parser.profile_body(_args()) == {}
    body = parser.profile_body(_args("--grid", "0.25,0.5,1x0.5,1", "--requests", "5",
                                     "--protean", "--colocate", "3", "--dilu", "--max-ibs",
                                     "4", "--slo-ms", "200", "--batch", "2", "--no-fast",
                                     "--timeout-s", "60", "--inputs", '{"x": {"data": [1], '
                                     '"shape": [1, 1], "datatype": "FP32"}}'))
    req = ProfileRequest.from_dict(body)
    assert (req.sm_shares, req.quotas) == ((0.25, 0.5, 1.0), (0.5, 1.0))
    assert (req.requests, req.colocate, req.dilu_max_ibs, req.slo_ms, req.batch) == (
        5, 3, 4, 200.0, 2)
    assert (req.fast, req.protean, req.dilu, req.timeout_s) == (False, True, True, 60.0)
    assert body["inputs"]["x"]["shape"] == [1, 1]
    with pytest.raises(BadRequest, match="--inputs is not JSON"):
        parser.profile_body(_args("--inputs", "{nope"))


@pytest.mark.parametrize("grid", ["0.5,1", "0.5x", "0x1", "0.5x1.5", "axb", "1x1x1"])
def test_a_bad_grid_is_a_usage_error(grid, capsys):
    with pytest.raises(SystemExit) as exc:
        _args("--grid", grid)
    assert exc.value.code == 2
    assert "--grid" in capsys.readouterr().err


def test_the_table_shows_every_trial_and_what_was_stored():
    trial = {"point": {"sm_share": 0.5, "time_quota": 1.0, "batch": 1, "replicas": 2},
             "ok": 20, "failed": 1, "throughput_rps": 123.45, "p99_latency_s": 0.0123,
             "device": "h0/cuda:0"}
    lines = profile_lines({
        "function": "fn", "trials": [trial],
        "protean_profile": {"slice": "7g", "solo_s": 0.002, "fbr": 0.75, "fbr_bounded": True},
        "dilu_profile": {"sm_request": 0.2, "sm_limit": 0.4, "ibs": 2, "throughput_rps": 50.0,
                         "trials": 3},
        "notes": ["dilu: something"], "stored": ["fast_profile", "protean_profile"],
        "share": {"sm_share": 0.5, "time_quota": 1.0, "reason": "fast profile s50-q100"}})
    assert lines[0] == "TRIALS of fn (1)"
    assert lines[1].split() == ["SM", "QUOTA", "BATCH", "REPLICAS", "OK", "FAILED", "RPS",
                                "P99", "MS", "DEVICE"]
    assert lines[2].split() == ["0.5", "1", "1", "2", "20", "1", "123.5", "12.3", "h0/cuda:0"]
    assert "FBR 0.750 (upper bound)" in lines[3] and "solo 2.0 ms" in lines[3]
    assert "request 0.2, limit 0.4 at IBS 2" in lines[4]
    assert lines[5] == "note: dilu: something"
    assert lines[6] == ("stored: fast_profile, protean_profile; share now sm 0.5, quota 1 "
                        "(fast profile s50-q100)")
