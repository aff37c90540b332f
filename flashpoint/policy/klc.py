"""Dilu's introspective elasticity (ASPLOS '25, §3.4.1, Algorithm 2) as a pure controller.

Every slot (~5 ms) the token manager tells :class:`KlcController` which tenants were active
(requested or held a token).  For each SLO-sensitive tenant it measures the
**kernel-launch cycle (KLC)**: the length, in slots, of a contiguous run of active slots
(one batch or one iteration).  Contention with co-located tenants stretches KLC; the
controller reacts by moving the **best-effort** tenants' budget, expressed here as a factor
in ``[floor, 1]`` applied to their time quotas (Dilu moves a block budget; we move a time
budget, the unit our tokens use).  A function's class is its spec's ``tenant_class``
(:class:`TenantClass`), carried in its replicas' shares to the host's token manager.

States (per GPU, never a process-global as in Dilu's code, which shares one
``CONSERVATIVE_LIMIT`` across GPUs — a bug the digest flags):

* EMERGENCY  ``T_cur/T_min >= 1.6`` (and below the 4x outlier cap):
  ``factor = max(factor / (T_cur/T_min), floor)``.
  The paper's Algorithm 2 divides by ``ΔT = (T_cur - T_min)/T_min``; just above the
  threshold ``ΔT < 1``, so that division would *raise* the best-effort budget in an
  emergency.  Dilu's code divides by the ratio ``T_cur/T_min = 1 + ΔT`` (>= 1.6) and
  clamps at 1% — we follow the code (digest 002, §6 item 1).
* RECOVERY   ``T_cur/T_min < 1.2`` on every 5th period: ``factor = min(1.3 * factor, 1)``.
* CONTENTION otherwise: unchanged.
* NONE       no SLO-sensitive tenant: best-effort tenants run at their full limits.

**Where we follow the authors' code, not the paper** (``sigserverless/Dilu``, digest 002
§4.1 [R]):

* *The RECOVERY cap.*  Algorithm 2 grows a best-effort tenant's issue in RECOVERY up to
  ``MaxTokens·limit`` (its limit).  The code grows ``CONSERVATIVE_LIMIT`` up to ``UPPER``
  only, and a best-effort tenant's budget is ``CONSERVATIVE_LIMIT·request`` while an SLO
  tenant is active: the factor here is capped at 1 *of the request*
  (``TokenState.effective_quota``: ``min(limit, factor·request)``), so while an SLO tenant
  is active a best-effort tenant never runs above its request, however long it recovers.
  It reaches its limit only once every SLO tenant of the GPU has been idle ``idle_slots``
  (600 ms) — also the code's rule (``UPPER·Σ low_limits``), which the paper does not state.
* *The idle reset.*  After that idle spell the factor is reset to 1 (the code resets
  ``CONSERVATIVE_LIMIT = UPPER``), so the next burst of an SLO tenant starts from the
  best-effort tenant's request rather than from an old emergency's floor.
* *The EMERGENCY divisor* (above) and the ``floor``.

KLC is counted in slots, not timed with CUDA events: no syncs are added (that overhead is
what the paper holds against FaST-GShare).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TenantClass(enum.StrEnum):
    """Dilu's two tenant classes (a function spec's ``tenant_class``): SLO-sensitive
    tenants (inference, the paper's "high priority") are never throttled; best-effort
    tenants (the paper's training jobs, "low priority") give way to them."""

    SLO = "slo"
    BEST_EFFORT = "best_effort"


class KlcPhase(enum.StrEnum):
    """Dilu's global state for the best-effort tenants of one GPU."""

    NONE = "none"
    EMERGENCY = "emergency"
    RECOVERY = "recovery"
    CONTENTION = "contention"


@dataclass(frozen=True)
class KlcConfig:
    """Dilu's constants (digest 002, §4.1 [R]); slots are ``slot_ns`` long."""

    slot_ns: int = 5_000_000
    min_period_slots: int = 6  # only runs longer than this (30 ms) define T_min
    emergency_ratio: float = 1.6  # OVERFLOW_RATE_D
    outlier_ratio: float = 4.0  # OVERFLOW_RATE_U: ignore periods stretched >= 4x
    recovery_ratio: float = 1.2  # OVERFLOW_RATE_A
    recovery_every: int = 5  # recover only on every 5th period
    increase: float = 1.3  # INCREASE_FACTOR (η_increase)
    floor: float = 0.01  # CONTROL_FACTOR: best-effort never fully starves
    idle_slots: int = 120  # SLO tenants silent this long (600 ms): best-effort at full limit
    initial_factor: float = 1.0  # Dilu starts at 0.1; we start at the guarantee (see tokens.py)


@dataclass
class _Klc:
    run_slots: int = 0
    min_period: int | None = None
    periods: int = 0
    last_active_slot: int = -(10**9)


@dataclass
class KlcController:
    """Per-GPU KLC tracker; :meth:`observe_slot` once per slot, read :attr:`factor`."""

    config: KlcConfig = field(default_factory=KlcConfig)
    factor: float = 1.0
    phase: KlcPhase = KlcPhase.NONE
    slot: int = 0
    _tenants: dict[int, _Klc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.factor = self.config.initial_factor

    def observe_slot(self, active: set[int], slo_tenants: set[int]) -> KlcPhase:
        """Advance one slot; ``active`` are tenants with launches (token activity) in it."""
        self.slot += 1
        for gone in set(self._tenants) - slo_tenants:
            del self._tenants[gone]
        if not slo_tenants:
            self.phase = KlcPhase.NONE
            self.factor = 1.0
            return self.phase
        if self.phase is KlcPhase.NONE:  # an SLO tenant arrived: hold until KLC says more
            self.phase = KlcPhase.CONTENTION
        for tenant in slo_tenants:
            k = self._tenants.setdefault(tenant, _Klc())
            if tenant in active:
                k.run_slots += 1
                k.last_active_slot = self.slot
            elif k.run_slots:
                self._period_ended(k, k.run_slots)
                k.run_slots = 0
        if self.slo_idle():
            # Dilu's code: every SLO tenant idle past the threshold resets the budget
            # (CONSERVATIVE_LIMIT = UPPER); the next burst starts from the request.
            self.factor = 1.0
        return self.phase

    def slo_idle(self) -> bool:
        """True when every SLO-sensitive tenant has been silent for ``idle_slots``."""
        return all(self.slot - k.last_active_slot > self.config.idle_slots
                   for k in self._tenants.values())

    def _period_ended(self, k: _Klc, period: int) -> None:
        c = self.config
        if period <= c.min_period_slots:
            return
        k.periods += 1
        if k.min_period is None or period < k.min_period:
            k.min_period = period
        overflow = period / k.min_period  # T_cur / T_min = 1 + ΔT
        if c.emergency_ratio <= overflow < c.outlier_ratio:
            self.phase = KlcPhase.EMERGENCY
            self.factor = max(self.factor / overflow, c.floor)  # ratio, not ΔT (see module doc)
        elif overflow < c.recovery_ratio and k.periods % c.recovery_every == 0:
            self.phase = KlcPhase.RECOVERY
            self.factor = min(self.factor * c.increase, 1.0)
        else:
            self.phase = KlcPhase.CONTENTION
