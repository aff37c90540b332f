"""Pure tests of the token scheduling state (FaST multi-token) and Dilu's KLC controller."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.policy.klc import KlcConfig, KlcController, KlcPhase, TenantClass
from flashpoint.policy.tokens import TenantQuota, TokenConfig, TokenState

MS = 1_000_000


def simulate(quotas: dict[int, TenantQuota], seconds: float, busy: set[int] | None = None,
             overhead_ns: int = 0) -> dict[int, int]:
    """Saturated clients (one per tenant) driven by an event clock; returns busy ns each."""
    s = TokenState(TokenConfig())
    for t, q in quotas.items():
        s.set_quota(t, q, 0)
        s.connect(t, t, 0)
    busy = set(quotas) if busy is None else busy
    seq = {t: 0 for t in quotas}
    done_at: dict[int, tuple[int, int]] = {}  # client -> (time it reports, used)
    total = {t: 0 for t in quotas}
    now, end = 0, int(seconds * 1e9)

    def take(grants):
        for g in grants:
            done_at[g.client] = (now + g.quota_ns, g.quota_ns)
            total[g.client] += g.quota_ns

    for t in sorted(busy):
        seq[t] += 1
        take(s.request(t, seq[t], 0, now))
    for _ in range(200_000):  # bounded
        nxt = min([s.next_deadline_ns()] + [d for d, _ in done_at.values()])
        if nxt >= end:
            break
        now = max(now, nxt)
        for c, (d, used) in list(done_at.items()):
            if d <= now:
                del done_at[c]
                seq[c] += 1
                take(s.request(c, seq[c], used, now + overhead_ns))
        take(s.tick(now))
    return total


def test_saturated_shares_follow_requests():
    total = simulate({1: TenantQuota(0.3, 0.3), 2: TenantQuota(0.7, 0.7)}, 5.0)
    assert abs(total[1] / (total[1] + total[2]) - 0.3) < 0.01


def test_excess_is_split_in_proportion_to_requests():
    total = simulate({1: TenantQuota(0.1, 1.0), 2: TenantQuota(0.4, 1.0)}, 5.0)
    assert abs(total[1] / (total[1] + total[2]) - 0.2) < 0.02  # raw-usage order would give ~0.5


def test_idle_neighbour_lets_tenant_reach_its_limit_not_more():
    total = simulate({1: TenantQuota(0.3, 0.6), 2: TenantQuota(0.7, 1.0)}, 5.0, busy={1})
    assert abs(total[1] / 5e9 - 0.6) < 0.01


def test_multi_token_holders_share_sms_sum_checked_inside_the_loop():
    s = TokenState()
    for t in (1, 2, 3):
        s.set_quota(t, TenantQuota(0.3, 1.0, sm_share=0.5), 0)
        s.connect(t, t, 0)
    grants = [g for t in (1, 2, 3) for g in s.request(t, 1, 0, 0)]
    assert sorted(g.client for g in grants) == [1, 2]  # 50% + 50%; the third would exceed 100%
    s2 = TokenState()
    for t in (1, 2, 3):
        s2.set_quota(t, TenantQuota(0.3, 1.0, sm_share=0.6), 0)
        s2.connect(t, t, 0)
    s2._clients[1].waiting_seq = s2._clients[2].waiting_seq = s2._clients[3].waiting_seq = 1
    # one approval pass over three waiters: FaST-Manager's code would grant all three (180%)
    assert len(s2._approve(0)) == 1


def test_waiting_order_is_largest_unmet_guarantee():
    s = TokenState()
    s.set_quota(1, TenantQuota(0.2, 1.0), 0)
    s.set_quota(2, TenantQuota(0.6, 1.0), 0)
    s.set_quota(9, TenantQuota(1.0, 1.0), 0)
    for t in (1, 2, 9):
        s.connect(t, t, 0)
    assert [g.client for g in s.request(9, 1, 0, 0)] == [9]  # holds the GPU
    s.request(1, 1, 0, 1)
    s.request(2, 1, 0, 2)
    grants = s.release(9, 5 * MS, 3 * MS)
    assert [g.client for g in grants] == [2]  # 60 ms missing beats 20 ms, whoever came first


def test_early_release_frees_the_gpu_and_charges_actual_time():
    s = TokenState()
    for t in (1, 2):
        s.set_quota(t, TenantQuota(0.5, 1.0), 0)
        s.connect(t, t, 0)
    assert s.request(1, 1, 0, 0)[0].quota_ns == 10 * MS
    assert s.request(2, 1, 0, 0) == []
    grants = s.release(1, 2 * MS, 2 * MS)
    assert [g.client for g in grants] == [2]
    assert s.usage()[1].used_ns == 2 * MS


def test_expired_token_frees_sms_and_overuse_is_charged_then_carried():
    s = TokenState(TokenConfig(window_ns=100 * MS, token_ns=10 * MS))
    s.set_quota(1, TenantQuota(0.1, 0.1), 0)
    s.connect(1, 1, 0)
    assert s.request(1, 1, 0, 0)[0].quota_ns == 10 * MS
    s.tick(11 * MS)
    assert s.holders() == [1]  # within the grace: its last kernels may still be running
    s.tick(12 * MS)
    assert s.holders() == []
    # the hook reports it really ran 30 ms (kernels queued past the token): 20 ms overuse
    assert s.request(1, 2, 30 * MS, 31 * MS) == []  # over its 10 ms limit: blocked this window
    assert s.usage()[1].used_ns == 30 * MS
    assert s.tick(100 * MS) == []  # the 20 ms over the limit carries into the next window
    assert s.usage()[1].used_ns == 20 * MS
    assert s.tick(200 * MS) == []  # 30 ms used = three windows' worth of a 10 ms limit
    assert s.usage()[1].used_ns == 10 * MS
    assert s.tick(300 * MS)[0].client == 1


def test_grant_never_exceeds_the_limit_left():
    s = TokenState(TokenConfig(window_ns=100 * MS, token_ns=10 * MS))
    s.set_quota(1, TenantQuota(0.25, 0.25), 0)
    s.connect(1, 1, 0)
    quotas, now, seq = [], 0, 0
    for _ in range(10):
        seq += 1
        grants = s.request(1, seq, quotas[-1] if quotas else 0, now)
        if not grants:
            break
        quotas.append(grants[0].quota_ns)
        now += grants[0].quota_ns
    assert quotas == [10 * MS, 10 * MS, 5 * MS]


def test_live_quota_change_grants_a_blocked_waiter():
    s = TokenState()
    s.set_quota(1, TenantQuota(0.0, 0.0 + 1e-9), 0)
    s.connect(1, 1, 0)
    assert s.request(1, 1, 0, 0) == []
    assert [g.client for g in s.set_quota(1, TenantQuota(0.5, 0.5), 1)] == [1]


def test_quota_validation():
    with pytest.raises(ValueError):
        TenantQuota(0.5, 0.4)
    with pytest.raises(ValueError):
        TenantQuota(0.1, 0.2, sm_share=0.0)


ops = st.lists(st.tuples(st.sampled_from(["req", "rel", "tick", "quota", "drop"]), st.integers(0, 3),
                         st.integers(0, 30 * MS)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, sms=st.lists(st.sampled_from([0.25, 0.5, 0.75, 1.0]), min_size=4, max_size=4))
def test_property_sm_sum_and_limits_hold(ops, sms):
    s = TokenState(TokenConfig(window_ns=100 * MS, token_ns=10 * MS))
    for t in range(4):
        s.set_quota(t, TenantQuota(0.1 * t, 0.1 * t + 0.3, sm_share=sms[t]), 0)
        s.connect(t, t, 0)
    now, seq = 0, 0
    for op, t, dt in ops:
        now += dt
        seq += 1
        if t not in s.usage() and op != "quota":
            s.connect(t, t, now)
        if op == "req":
            grants = s.request(t, seq, dt, now)
        elif op == "rel":
            grants = s.release(t, dt, now)
        elif op == "tick":
            grants = s.tick(now)
        elif op == "quota":
            grants = s.set_quota(t, TenantQuota(0.2, 0.5, sm_share=sms[t]), now)
        else:
            grants = s.disconnect(t, now)
        assert sum(s.quota(s.usage()[c].tenant).sm_share for c in s.holders()) <= 1.0 + 1e-9
        for g in grants:
            q = s.effective_quota(s.usage()[g.client].tenant)
            assert 0 < g.quota_ns <= 10 * MS
            # granted time fits under the limit (what was used before this grant + the grant)
            assert s.usage()[g.client].used_ns + g.quota_ns <= q.limit * 100 * MS + 1
        assert all(u.used_ns >= 0 for u in s.usage().values())


# ---------------- Dilu KLC controller ----------------

def run_periods(k: KlcController, periods: list[int], gap: int = 3) -> list[KlcPhase]:
    phases = []
    for p in periods:
        for _ in range(p):
            k.observe_slot({1}, {1})
        for _ in range(gap):
            phases.append(k.observe_slot(set(), {1}))
    return phases


def test_emergency_divides_by_the_ratio_not_delta_t():
    k = KlcController(KlcConfig())
    run_periods(k, [10])  # T_min = 10 slots
    run_periods(k, [17])  # T_cur/T_min = 1.7 -> EMERGENCY
    assert k.phase is KlcPhase.EMERGENCY
    # the paper's ΔT = 0.7 would *raise* the factor to 1/0.7; the ratio lowers it to 1/1.7
    assert k.factor == pytest.approx(1 / 1.7)


def test_emergency_floor_outliers_and_recovery():
    k = KlcController(KlcConfig())
    run_periods(k, [10] + [19] * 20)
    assert k.factor == pytest.approx(0.01)  # clamped at the floor, never starves to zero
    k2 = KlcController(KlcConfig())
    run_periods(k2, [10, 45])  # 4.5x: an outlier, ignored
    assert k2.factor == 1.0 and k2.phase is KlcPhase.CONTENTION
    k3 = KlcController(KlcConfig())
    run_periods(k3, [10, 17])
    low = k3.factor
    run_periods(k3, [10, 10, 10])  # 5th period overall, ratio 1.0 < 1.2 -> RECOVERY x1.3
    assert k3.phase is KlcPhase.RECOVERY and k3.factor == pytest.approx(low * 1.3)
    run_periods(k3, [4, 4, 4])  # runs of <= 6 slots are not periods
    assert k3.factor == pytest.approx(low * 1.3)


def slo_and_best_effort() -> TokenState:
    """Tenant 1 SLO-sensitive (request 0.4, limit 0.8) and tenant 2 best-effort (0.3, 0.9),
    each connected."""
    s = TokenState()
    s.set_quota(1, TenantQuota(0.4, 0.8, slo_sensitive=True), 0)
    s.set_quota(2, TenantQuota(0.3, 0.9), 0)
    s.connect(1, 1, 0)
    s.connect(2, 2, 0)
    return s


def test_best_effort_quota_follows_klc_and_returns_when_slo_idles():
    s = slo_and_best_effort()
    slot = s.config.klc.slot_ns
    s.klc.observe_slot({1}, {1})  # the SLO tenant is active
    s.klc.factor = 0.5
    q = s.effective_quota(2)
    assert q.limit == pytest.approx(0.15) and q.request == pytest.approx(0.15)  # factor x request
    assert s.effective_quota(1) == s.quota(1)  # SLO-sensitive tenants are not throttled
    for i in range(1, 130):  # 645 ms of silence from the SLO tenant
        s.tick(i * slot)
    assert s.klc.slo_idle() and s.effective_quota(2).limit == pytest.approx(0.9)


def test_no_slo_tenant_means_phase_none_and_full_limits():
    s = TokenState()
    s.set_quota(2, TenantQuota(0.3, 0.9), 0)
    s.connect(2, 2, 0)
    s.tick(50 * MS)
    assert s.klc.phase is KlcPhase.NONE and s.effective_quota(2).limit == 0.9


def test_recovery_is_capped_at_the_request_not_the_limit():
    # The authors' code, not Algorithm 2: RECOVERY grows the factor up to 1 *of the request*
    # (CONSERVATIVE_LIMIT <= UPPER, budget = CONSERVATIVE_LIMIT x request), so however long
    # an active SLO tenant runs unstretched, a best-effort tenant stays at its request.
    k = KlcController(KlcConfig())
    run_periods(k, [10, 17])
    assert k.factor < 1.0
    phases = run_periods(k, [10] * 60)  # 12 recoveries of x1.3 would pass 1 many times over
    assert KlcPhase.RECOVERY in phases and k.factor == 1.0
    s = TokenState()
    s.set_quota(1, TenantQuota(0.4, 1.0, slo_sensitive=True), 0)
    s.set_quota(2, TenantQuota(0.3, 0.9), 0)
    s.klc = k
    s.klc.observe_slot({1}, {1})
    assert s.effective_quota(2).limit == pytest.approx(0.3)  # its request, not its 0.9


def test_idle_slo_tenant_resets_the_factor_so_the_next_burst_starts_at_the_request():
    # Dilu's code: every SLO tenant idle past 120 slots -> CONSERVATIVE_LIMIT = UPPER.
    s = slo_and_best_effort()
    slot = s.config.klc.slot_ns
    assert not s.best_effort_throttled()  # the SLO tenant has not been active yet
    s.request(1, 1, 0, 0)
    s.tick(slot)
    assert s.best_effort_throttled() and s.effective_quota(2).limit == pytest.approx(0.3)
    s.klc.factor = 0.05  # an emergency's doing
    assert s.effective_quota(2).limit == pytest.approx(0.3 * 0.05)
    s.release(1, slot, slot)
    now = slot
    for _ in range(s.config.klc.idle_slots + 2):
        now += slot
        s.tick(now)
    assert not s.best_effort_throttled() and s.effective_quota(2).limit == pytest.approx(0.9)
    assert s.klc.factor == 1.0
    s.request(1, 2, 0, now + 1)  # the next burst
    s.tick(now + slot)
    assert s.best_effort_throttled() and s.effective_quota(2).limit == pytest.approx(0.3)
    assert s.effective_quota(1) == s.quota(1)  # never the SLO tenant


def test_tenant_quota_names_its_class():
    assert TenantQuota(0.3, 0.5, slo_sensitive=True).tenant_class is TenantClass.SLO
    assert TenantQuota(0.3, 0.5).tenant_class is TenantClass.BEST_EFFORT
    assert TenantClass("best_effort").value == "best_effort"
