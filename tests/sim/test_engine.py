"""The discrete-event engine: order, ties, cancellation, run-until, the event limit."""

from __future__ import annotations

import math

import pytest

from flashpoint.sim import Engine, EventLimitExceeded


def test_events_run_in_time_order_and_clock_follows():
    e = Engine()
    seen: list[tuple[str, float]] = []
    for name, t in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
        e.schedule(t, lambda name=name: seen.append((name, e.now_s)))
    assert e.run() == 3
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert e.now_s == 3.0 and e.events_processed == 3 and e.pending == 0


def test_ties_run_in_scheduling_order():
    e = Engine()
    seen: list[int] = []
    for i in range(50):
        e.schedule(1.0, lambda i=i: seen.append(i))
    e.run()
    assert seen == list(range(50))


def test_event_scheduled_now_from_a_callback_runs_after_the_current_ties():
    e = Engine()
    seen: list[str] = []
    e.schedule(1.0, lambda: (seen.append("a"), e.schedule_in(0.0, lambda: seen.append("c"))))
    e.schedule(1.0, lambda: seen.append("b"))
    e.run()
    assert seen == ["a", "b", "c"]


def test_cancel_is_lazy_and_idempotent():
    e = Engine()
    seen: list[str] = []
    h = e.schedule(1.0, lambda: seen.append("x"))
    e.schedule(2.0, lambda: seen.append("y"))
    assert e.pending == 2
    assert e.cancel(h) is True and e.cancel(h) is False
    assert not h.pending and e.pending == 1
    assert e.peek_s() == 2.0
    assert e.run() == 1
    assert seen == ["y"] and e.events_processed == 1


def test_cancel_after_run_is_a_no_op():
    e = Engine()
    h = e.schedule(1.0, lambda: None)
    e.run()
    assert e.cancel(h) is False and e.pending == 0


def test_callback_can_cancel_a_later_tie():
    e = Engine()
    seen: list[str] = []
    later = e.schedule(1.0, lambda: seen.append("later"))
    e.schedule(0.5, lambda: e.cancel(later))
    e.run()
    assert seen == []


def test_many_cancellations_keep_the_heap_bounded():
    e = Engine()
    h = e.schedule(10.0, lambda: None)
    for i in range(5000):  # reschedule-on-every-change pattern
        e.cancel(h)
        h = e.schedule(10.0 + i, lambda: None)
    assert e.pending == 1
    assert e.heap_entries < 2100  # compaction: at most ~2x live entries or the minimum size
    assert e.run() == 1 and e.now_s == 10.0 + 4999


def test_run_until_is_inclusive_and_advances_idle_clock():
    e = Engine()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        e.schedule(t, lambda: seen.append(e.now_s))
    assert e.run(until_s=2.0) == 2
    assert seen == [1.0, 2.0] and e.now_s == 2.0
    assert e.run(until_s=2.5) == 0 and e.now_s == 2.5
    assert e.peek_s() == 3.0
    assert e.run(until_s=10.0) == 1 and e.now_s == 10.0
    assert e.peek_s() == math.inf


def test_schedule_in_is_relative_to_now():
    e = Engine(start_s=5.0)
    seen: list[float] = []
    e.schedule_in(1.5, lambda: seen.append(e.now_s))
    e.run()
    assert seen == [6.5]


@pytest.mark.parametrize("at_s", [0.5, math.nan, math.inf, -math.inf])
def test_schedule_rejects_past_nan_and_infinite_times(at_s):
    e = Engine(start_s=1.0)
    with pytest.raises(ValueError):
        e.schedule(at_s, lambda: None)


def test_bad_arguments_rejected():
    e = Engine(start_s=1.0)
    with pytest.raises(ValueError):
        e.schedule_in(-0.1, lambda: None)
    with pytest.raises(ValueError):
        e.run(until_s=0.5)
    with pytest.raises(ValueError):
        e.run(until_s=math.nan)
    with pytest.raises(ValueError):
        Engine(max_events=0)


def test_max_events_stops_a_runaway_loop_and_leaves_engine_consistent():
    e = Engine(max_events=100)
    count = [0]

    def tick() -> None:
        count[0] += 1
        e.schedule_in(0.0, tick)  # zero-delay self-rescheduling: would never end

    e.schedule(0.0, tick)
    with pytest.raises(EventLimitExceeded):
        e.run()
    assert count[0] == 100 and e.events_processed == 100 and e.pending == 1
    with pytest.raises(EventLimitExceeded):
        e.run(max_events=5)
    assert count[0] == 105 and e.pending == 1

def test_max_events_per_call_override():
    e = Engine(max_events=3)
    for t in range(10):
        e.schedule(float(t), lambda: None)
    with pytest.raises(EventLimitExceeded):
        e.run()
    assert e.events_processed == 3
    assert e.run(max_events=100) == 7


def test_callback_exception_propagates_and_event_counts_as_run():
    e = Engine()

    def boom() -> None:
        raise RuntimeError("bug in a state class")

    e.schedule(1.0, boom)
    e.schedule(2.0, lambda: None)
    with pytest.raises(RuntimeError):
        e.run()
    assert e.now_s == 1.0 and e.events_processed == 1 and e.pending == 1
    assert e.run() == 1
