"""The phases of a scale from zero: consecutive, complete, never invented."""

from __future__ import annotations

import pytest

from flashpoint.controller.cold_timings import (
    COLD_PHASES,
    HOST_PHASES,
    WORKER_PHASES,
    ColdStartMarks,
    cold_start_phases,
    phases_sum_s,
)

REPLICA = {"obtain": 0.001, "assign": 0.002, "worker_prepare": 0.003, "load": 0.010,
           "to_device": 0.0, "first_inference": 0.060, "announce": 0.020}


def test_phases_partition_the_wall_exactly() -> None:
    marks = ColdStartMarks(decided_s=10.002, placed_s=10.004, deployed_s=10.010, ready_s=10.200)
    out = cold_start_phases(marks, REPLICA, arrived_s=10.0, sent_s=10.205, done_s=10.300)
    assert set(out) == set(COLD_PHASES)
    assert out["decision"] == pytest.approx(0.002)
    assert out["placement"] == pytest.approx(0.002)
    assert out["deploy_rpc"] == pytest.approx(0.006)
    for k in (*HOST_PHASES, *WORKER_PHASES):
        assert out[k] == REPLICA[k]
    # deploy acked -> ready: 190 ms, of which host and worker timed 96 ms
    assert out["handoff"] == pytest.approx(0.190 - sum(REPLICA.values()))
    assert out["ready_to_dispatch"] == pytest.approx(0.005)
    assert out["request"] == pytest.approx(0.095)
    assert phases_sum_s(out) == pytest.approx(0.300)


def test_the_acknowledgements_trip_back_is_not_counted_twice() -> None:
    # The host's part (96 ms) began while its acknowledgement was on the way back: the
    # controller saw the ack 20 ms after placing, the announcement 100 ms after.
    marks = ColdStartMarks(decided_s=1.0, placed_s=1.0, deployed_s=1.02, ready_s=1.1)
    out = cold_start_phases(marks, REPLICA, arrived_s=1.0, sent_s=1.1, done_s=1.2)
    assert out["handoff"] == 0.0
    assert out["deploy_rpc"] == pytest.approx(0.100 - sum(REPLICA.values()))
    assert all(v >= 0 for v in out.values())
    assert phases_sum_s(out) == pytest.approx(0.2)


def test_no_phase_is_negative_when_host_and_worker_report_more_than_the_window() -> None:
    marks = ColdStartMarks(decided_s=1.0, placed_s=1.0, deployed_s=1.01, ready_s=1.05)
    out = cold_start_phases(marks, REPLICA, arrived_s=1.0, sent_s=1.05, done_s=1.1)
    assert out["handoff"] == 0.0 and out["deploy_rpc"] == 0.0
    assert all(v >= 0 for v in out.values())


@pytest.mark.parametrize("marks, arrived", [
    (ColdStartMarks(decided_s=1.0, placed_s=1.0, deployed_s=1.1, ready_s=1.2), 1.05),  # joined
    (ColdStartMarks(decided_s=1.0, placed_s=1.0), 0.9),  # never acknowledged / announced
])
def test_requests_that_did_not_wait_for_the_whole_start_get_no_phases(marks, arrived) -> None:
    assert cold_start_phases(marks, REPLICA, arrived_s=arrived, sent_s=1.3, done_s=1.4) == {}


def test_missing_replica_phases_count_as_zero() -> None:
    marks = ColdStartMarks(decided_s=0.0, placed_s=0.0, deployed_s=0.0, ready_s=0.1)
    out = cold_start_phases(marks, {}, arrived_s=0.0, sent_s=0.1, done_s=0.2)
    assert out["handoff"] == pytest.approx(0.1)
    assert phases_sum_s(out) == pytest.approx(0.2)
