"""Admission control for invocations: per-caller token buckets, an in-flight cap, and the
gateway's deadline backstop around every backend call.

The token bucket is a plain state class with ``now_s`` passed in, so tests need no clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from flashpoint.config import GatewayConfig
from flashpoint.errors import DeadlineExceeded, Overloaded
from flashpoint.gateway.backend import InvokeBackend, InvokeResult

_MAX_BUCKETS = 10_000
T = TypeVar("T")


@dataclass
class TokenBucket:
    """``rate_per_s`` tokens a second up to ``burst``; each request takes one."""

    rate_per_s: float
    burst: float
    tokens: float
    last_s: float

    def take(self, now_s: float) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is available."""
        elapsed = max(0.0, now_s - self.last_s)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
        self.last_s = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class Admission:
    """Decides whether an invocation may start; counts the ones in flight."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self.inflight = 0

    def _check_rate(self, caller: str) -> None:
        rate = self._config.rate_limit_rps
        if rate <= 0:
            return
        now = self._clock()
        burst = float(self._config.rate_limit_burst or max(1.0, math.ceil(rate)))
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:  # forget idle callers (they are full)
                self._buckets.clear()
            bucket = self._buckets[caller] = TokenBucket(rate, burst, burst, now)
        wait_s = bucket.take(now)
        if wait_s > 0:
            raise Overloaded(f"rate limit of {rate:g} requests/s exceeded",
                             retry_after_s=round(wait_s, 3))

    def _admit(self, caller: str) -> None:
        """Rate limit and in-flight cap; on success the caller holds one in-flight slot."""
        self._check_rate(caller)
        limit = self._config.max_inflight_requests
        if limit and self.inflight >= limit:
            raise Overloaded(f"gateway has {limit} requests in flight", retry_after_s=1.0)
        self.inflight += 1

    async def invoke(self, backend: InvokeBackend, caller: str, name: str,
                     inputs: dict[str, np.ndarray], *, request_id: str,
                     timeout_s: float, request_class: str = "strict") -> InvokeResult:
        """Admit, then run one invocation; the backstop fires ``deadline_grace_s`` late.

        A backend that declares ``enforces_deadline`` (the in-process Controller: its own
        timer fails the request at ``timeout_s`` or sooner) gets no backstop timer: it could
        never fire first, and arming and cancelling it is work on every request. Remote
        and test backends keep it.
        """
        if getattr(backend, "enforces_deadline", False) is True:
            self._admit(caller)
            try:
                return await backend.invoke(name, inputs, request_id=request_id,
                                            timeout_s=timeout_s, request_class=request_class)
            finally:
                self.inflight -= 1
        return await self.run(caller, repr(name), lambda: backend.invoke(
            name, inputs, request_id=request_id, timeout_s=timeout_s,
            request_class=request_class), timeout_s=timeout_s)

    @contextlib.contextmanager
    def admitted(self, caller: str) -> Iterator[None]:
        """Admit ``caller`` (rate limit, in-flight cap) for work the caller bounds itself
        (a stream, which ends at its backend's deadline or its client's disconnect)."""
        self._admit(caller)
        try:
            yield
        finally:
            self.inflight -= 1

    async def run(self, caller: str, what: str, call: Callable[[], Awaitable[T]], *,
                  timeout_s: float) -> T:
        """Admit ``caller`` (rate limit, in-flight cap), then await ``call()`` under the
        deadline backstop; ``what`` names the work in the timeout message."""
        self._admit(caller)
        try:
            async with asyncio.timeout(timeout_s + self._config.deadline_grace_s):
                return await call()
        except TimeoutError:
            raise DeadlineExceeded(f"request to {what} did not finish within {timeout_s:g} s",
                                   timeout_s=timeout_s) from None
        finally:
            self.inflight -= 1


def effective_timeout_s(requested_s: Any, spec_timeout_s: float | None,
                        config: GatewayConfig) -> float:
    """The request's deadline: what it asked for, else the function's, capped by the config."""
    chosen = requested_s if requested_s is not None else (spec_timeout_s or
                                                          config.default_timeout_s)
    return float(min(chosen, config.max_timeout_s))
