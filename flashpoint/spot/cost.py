"""What the hosts cost: host-hours by kind (spot or on-demand) times configured prices.

Defaults are PROTEAN's Table 3 (seed 000): the hourly price of one 8×A100 instance, averaged
over US-east and US-west. The meter is a plain state class: callers pass ``now_s`` (no clock
reads), so the controller and the simulator account the same way. A report also gives what
the same host-hours would have cost all on-demand, i.e. what spot saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# $/hour for one 8xA100 instance (PROTEAN Table 3).
TABLE3_PRICES: dict[str, dict[str, float]] = {
    "aws": {"ondemand": 32.7726, "spot": 9.8318},
    "azure": {"ondemand": 32.7700, "spot": 18.0235},
    "gcp": {"ondemand": 30.0846, "spot": 8.8147},
}
KINDS = ("spot", "ondemand")


@dataclass
class CostMeter:
    """Accumulates host-seconds per kind; ``prices`` are $/hour per kind."""

    prices: Mapping[str, float] = field(default_factory=lambda: dict(TABLE3_PRICES["aws"]))
    _running: dict[str, tuple[str, float]] = field(default_factory=dict)  # host -> (kind, since)
    _seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def start(self, host_id: str, kind: str, now_s: float) -> None:
        """``host_id`` runs from ``now_s`` (idempotent while it runs)."""
        if kind not in KINDS:
            raise ValueError(f"host kind must be one of {KINDS}, got {kind!r}")
        self._running.setdefault(host_id, (kind, now_s))

    def stop(self, host_id: str, now_s: float) -> None:
        """``host_id`` is gone (idempotent)."""
        run = self._running.pop(host_id, None)
        if run is not None:
            self._seconds[run[0]] += max(0.0, now_s - run[1])

    def report(self, now_s: float) -> dict[str, float]:
        """Hours and dollars by kind so far, the total, and the all-on-demand equivalent."""
        seconds = dict(self._seconds)
        for kind, since in self._running.values():
            seconds[kind] += max(0.0, now_s - since)
        out: dict[str, float] = {}
        total = 0.0
        for kind in KINDS:
            hours = seconds[kind] / 3600.0
            cost = hours * self.prices[kind]
            out[f"{kind}_hours"], out[f"{kind}_usd"] = hours, cost
            total += cost
        ondemand_equiv = (seconds["spot"] + seconds["ondemand"]) / 3600.0 * self.prices["ondemand"]
        out.update(total_usd=total, ondemand_equivalent_usd=ondemand_equiv,
                   saved_usd=ondemand_equiv - total)
        return out
