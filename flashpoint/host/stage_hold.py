"""Background work of a partitioned start waits for the pipeline's first answer.

A partition stage pulls its own byte range first and serves as soon as that is in
(execute-while-load). Two more things then happen on its host: the rest of the model arrives
(model completion, thesis §4.2.5) and the warm pool is refilled (a new Python + torch
process). Started at once, both land on the pipeline's first pass, the one request the
partitioned start exists for: the completion stream shares the stage host's link with the
activations coming from the previous stage, and the refill's interpreter start competes for
the CPU that drives the stage. Measured here (bert base, 4 stage hosts at 250 Mbit/s, 2
vCPUs): the first pass took 2.9 s with both running and 0.3 s with both held, which is the
difference between missing and meeting the partitioned cold-start target.

The thesis starts completion immediately; it models the stages' links and GPUs as free of
other traffic, which its own completion traffic contradicts. So a stage's host holds that
work until the controller reports the group's first answer (``begin_completion``), never
longer than ``[host] completion_hold_s`` (a group that never gets a request, or a lost
controller, must not leave the model incomplete), and releases it at once when something on
the host needs the whole model (a whole replica of the same model).
"""

from __future__ import annotations

import asyncio
import contextlib

from flashpoint.log import get_logger

log = get_logger(__name__)


class StageHolds:
    """Per model key: an open hold on a stage's background work, until released or timed out."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._events: dict[str, asyncio.Event] = {}

    def hold(self, key: str) -> asyncio.Event:
        """Open (or join) the hold for ``key``; released holds are forgotten."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = asyncio.Event()
        return event

    def held(self, key: str) -> bool:
        return key in self._events

    def release(self, key: str, why: str) -> bool:
        """Let ``key``'s held work go now; False when nothing was held."""
        event = self._events.pop(key, None)
        if event is None:
            return False
        event.set()
        log.info("stage_hold_released", model=key, why=why)
        return True

    async def wait(self, key: str) -> None:
        """Return when ``key``'s hold is released, or after ``hold_s`` (then release it).
        Returns at once when the hold is off (``hold_s <= 0``) or nothing holds ``key``."""
        event = self._events.get(key)
        if event is None:
            return
        if self.hold_s <= 0:
            self.release(key, "hold off")
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), self.hold_s)
        if not event.is_set():
            self.release(key, f"no answer within {self.hold_s:g}s")
