"""The actor base: named, owned tasks cancelled on stop; stop keeps its deadline even when a
task swallows a cancellation; a failed task is logged; the loop-lag histogram sees a blocked
loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from flashpoint.actor import Actor


class Looper(Actor):
    """Two loops started in on_start; records what its hooks saw."""

    def __init__(self, **kw: float) -> None:
        super().__init__("looper-test", **kw)
        self.cancelled: list[str] = []
        self.running = {"tick": asyncio.Event(), "tock": asyncio.Event()}
        self.stopped_with_s: float | None = None

    async def on_start(self) -> None:
        self.spawn(self._loop("tick"), "tick")
        self.spawn(self._loop("tock"), "tock")

    async def on_stop(self, timeout_s: float) -> None:
        self.stopped_with_s = timeout_s

    async def _loop(self, name: str) -> None:
        self.running[name].set()
        try:
            await asyncio.Event().wait()  # forever, until cancelled
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise


async def test_tasks_are_named_owned_and_cancelled_on_stop() -> None:
    actor = Looper()
    await actor.start()
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in actor.running.values())), 2.0)
    assert actor.task_names() == ["tick", "tock"]
    assert {t.get_name() for t in asyncio.all_tasks()} >= {"looper-test:tick", "looper-test:tock"}
    await actor.stop(timeout_s=2.0)
    assert sorted(actor.cancelled) == ["tick", "tock"]
    assert actor.task_names() == []
    assert not any(t.get_name().startswith("looper-test:") for t in asyncio.all_tasks())
    assert actor.stopped_with_s is not None and 0 < actor.stopped_with_s <= 2.0
    with pytest.raises(RuntimeError):
        actor.spawn(asyncio.sleep(0), "late")  # a stopped actor starts nothing new
    await actor.stop()  # idempotent


async def test_stop_keeps_its_deadline_when_a_task_ignores_cancellation_once() -> None:
    actor = Actor("stubborn-test")
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # ignores the first cancellation ...
        await asyncio.Event().wait()  # ... and waits again: the second one ends it

    task = actor.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)  # let it reach its first wait
    t0 = time.monotonic()
    await actor.stop(timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0
    assert swallowed.is_set() and task.cancelled()


async def test_stop_returns_at_its_deadline_when_a_task_never_ends() -> None:
    actor = Actor("deaf-test")
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():  # bounded: released at the end of the test
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = actor.spawn(deaf(), "deaf")
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await actor.stop(timeout_s=0.2)
    took = time.monotonic() - t0
    assert 0.2 <= took < 0.6 and not task.done()
    release.set()
    await asyncio.wait_for(task, 1.0)


async def test_a_failed_task_is_logged_not_lost() -> None:
    actor = Actor("failing-test")

    async def boom() -> None:
        raise ValueError("kaput")

    with capture_logs() as logs:
        task = actor.spawn(boom(), "boom")
        await asyncio.wait([task], timeout=1.0)
        await asyncio.sleep(0)  # the done callback runs on the next loop step
    assert actor.task_names() == []
    failed = [e for e in logs if e["event"] == "actor_task_failed"]
    assert len(failed) == 1 and failed[0]["task"] == "boom" and "kaput" in failed[0]["error"]
    await actor.stop(timeout_s=1.0)


def _lag(name: str, what: str) -> float:
    return REGISTRY.get_sample_value(f"flashpoint_event_loop_lag_seconds_{what}",
                                     {"actor": name}) or 0.0


async def _next_sample(name: str, count: float) -> None:
    for _ in range(200):  # bounded: at most ~2 s for the sampler's next turn
        if _lag(name, "count") > count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no loop-lag sample after {count:g} within 2 s")


async def test_loop_lag_observes_a_blocked_loop() -> None:
    actor = Actor("lag-test", loop_lag_interval_s=0.01)
    await actor.start()
    assert actor.task_names() == ["loop-lag"]
    await _next_sample("lag-test", 0.0)  # the sampler is in its sleep now
    before = _lag("lag-test", "count")
    time.sleep(0.3)  # block the loop: the sampler's timer fires ~0.3 s late
    await _next_sample("lag-test", before)
    assert actor.loop_lag_s >= 0.25
    assert _lag("lag-test", "sum") >= 0.25
    assert REGISTRY.get_sample_value("flashpoint_event_loop_lag_seconds_bucket",
                                     {"actor": "lag-test", "le": "0.25"}) < \
        _lag("lag-test", "count")  # the blocked sample lands above 0.25 s
    await actor.stop(timeout_s=1.0)
    assert actor.task_names() == []
