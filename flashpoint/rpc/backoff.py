"""Jittered exponential backoff and the one opt-in ``retry()`` helper.

``retry`` retries only errors with ``err.retryable`` (or what ``retry_on`` accepts), bounded in
attempts and in total time, and honours a ``retry_after_s`` hint in the error's details.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from flashpoint.errors import FlashpointError
from flashpoint.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay ``n`` is ``min(max_s, initial_s * multiplier**n)`` scaled by a random factor in
    ``[1 - jitter, 1]`` ("equal jitter": never zero, never above the cap)."""

    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s) or self.multiplier < 1 or not (0 <= self.jitter <= 1):
            raise ValueError(f"invalid backoff {self}")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """An endless sequence of delays in seconds."""
        rand = (rng or random).random
        base = self.initial_s
        while True:
            yield base * (1.0 - self.jitter * rand())
            base = min(self.max_s, base * self.multiplier)


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, FlashpointError) and exc.retryable


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 3,
    total_timeout_s: float = 30.0,
    backoff: Backoff = Backoff(),
    retry_on: Callable[[BaseException], bool] = is_retryable,
    what: str = "",
    rng: random.Random | None = None,
    until_deadline: bool = False,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Await ``fn()`` until it succeeds, at most ``attempts`` times within ``total_timeout_s``.

    Non-retryable errors propagate at once; when attempts or time run out the last error
    propagates. ``total_timeout_s`` bounds the waits between attempts; each attempt bounds
    itself (pass per-call deadlines inside ``fn``). By default a wait that would end past the
    deadline gives up at once; ``until_deadline`` cuts that last wait short instead and tries
    once more (a caller that holds a request until its own deadline). ``on_retry`` sees each
    error that is about to be retried (counters).
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    deadline = time.monotonic() + total_timeout_s
    delays = backoff.delays(rng)
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except Exception as exc:
            if attempt == attempts or not retry_on(exc):
                raise
            delay = next(delays)
            hint = exc.details.get("retry_after_s") if isinstance(exc, FlashpointError) else None
            if isinstance(hint, (int, float)) and not isinstance(hint, bool):
                delay = max(delay, min(float(hint), backoff.max_s))
            left = deadline - time.monotonic()
            if until_deadline:
                if left <= 0:
                    raise
                delay = min(delay, left)
            elif delay >= left:
                raise
            if on_retry is not None:
                on_retry(exc)
            log.debug("retrying", what=what, attempt=attempt, delay_s=round(delay, 4), error=repr(exc))
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
