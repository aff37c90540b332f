"""Request rates for the autoscaler: λ (arrivals) and μ (completions) per function.

The thesis's Eq 4.14 needs both at a scale-up. Events are counted as they happen and turned
into a rate at every control-loop step, smoothed exponentially with time constant ``tau_s``
(a burst raises the rate within a few steps; one lull does not zero it).
"""

from __future__ import annotations

import math


class RateMeter:
    """Smoothed events per second, per key."""

    def __init__(self, tau_s: float = 5.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._counts: dict[str, int] = {}
        self._rates: dict[str, float] = {}
        self._last_s: float | None = None

    def add(self, key: str, n: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    def update(self, now_s: float) -> None:
        """Fold the events counted since the last update into the rates."""
        if self._last_s is None:
            self._last_s = now_s
            return
        dt = now_s - self._last_s
        if dt <= 0:
            return
        self._last_s = now_s
        alpha = 1.0 - math.exp(-dt / self.tau_s)
        for key in set(self._counts) | set(self._rates):
            inst = self._counts.pop(key, 0) / dt
            self._rates[key] = self._rates.get(key, 0.0) + alpha * (inst - self._rates.get(key, 0.0))

    def rate(self, key: str) -> float:
        return self._rates.get(key, 0.0)

    def forget(self, key: str) -> None:
        self._counts.pop(key, None)
        self._rates.pop(key, None)
