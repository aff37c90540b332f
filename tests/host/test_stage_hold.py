"""StageHolds: a stage's background work waits for its group's first answer, bounded."""

from __future__ import annotations

import asyncio
import time

from flashpoint.host.stage_hold import StageHolds


async def test_release_lets_every_waiter_go_and_forgets_the_hold() -> None:
    holds = StageHolds(hold_s=30.0)
    holds.hold("m@1")
    waiters = [asyncio.ensure_future(holds.wait("m@1")) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters) and holds.held("m@1")
    assert holds.release("m@1", "group answered")
    await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert not holds.held("m@1")
    assert not holds.release("m@1", "again")  # nothing held any more


async def test_a_hold_nobody_releases_ends_after_hold_s() -> None:
    holds = StageHolds(hold_s=0.2)
    holds.hold("m@1")
    t = time.monotonic()
    await asyncio.wait_for(holds.wait("m@1"), 2.0)
    assert 0.15 <= time.monotonic() - t < 1.5
    assert not holds.held("m@1")


async def test_no_hold_or_hold_off_returns_at_once() -> None:
    await asyncio.wait_for(StageHolds(hold_s=30.0).wait("never-held@1"), 0.1)
    off = StageHolds(hold_s=0.0)
    off.hold("m@1")
    await asyncio.wait_for(off.wait("m@1"), 0.1)
    assert not off.held("m@1")
