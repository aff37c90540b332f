"""KaaS pool policies (pure): affinity picks the warmest executor, the fair-share term stops a
hot client starving others, round-robin cycles, exclusive keeps per-client pools."""

from __future__ import annotations

import pytest

from flashpoint.policy.kaas import (
    ClientUsage,
    KaasPendingSnapshot,
    KaasPolicyMemory,
    KaasPoolSnapshot,
    KaasWorkerSnapshot,
    decide,
    record_completion,
)

MB = 1 << 20


def req(rid: str, client: str, keys: tuple[str, ...] = (), t: float = 0.0,
        private: int = 0) -> KaasPendingSnapshot:
    bufs = tuple((k, MB) for k in keys) + ((None, private),) * bool(private)
    return KaasPendingSnapshot(rid, client, t, bufs)


def workers(*specs: tuple[str, bool, tuple[str, ...]]) -> tuple[KaasWorkerSnapshot, ...]:
    return tuple(KaasWorkerSnapshot(w, idle, frozenset(keys)) for w, idle, keys in specs)


def pairs(decision) -> list[tuple[str, str]]:
    return [(a.request_id, a.worker_id) for a in decision.assignments]


def test_affinity_picks_the_warmest_worker():
    snap = KaasPoolSnapshot(0.0, workers(("w0", True, ("a",)), ("w1", True, ("a", "b", "c")),
                                         ("w2", True, ("a", "b"))),
                            (req("r1", "c1", ("a", "b", "c")),))
    mem = KaasPolicyMemory(usage={"c1": ClientUsage(0.0, 0.01)})
    decision, _ = decide("affinity", snap, mem)
    assert pairs(decision) == [("r1", "w1")]
    # w1 busy: the next warmest, not the first in order
    snap = KaasPoolSnapshot(0.0, workers(("w0", True, ("a",)), ("w1", False, ("a", "b", "c")),
                                         ("w2", True, ("a", "b"))), snap.pending)
    assert pairs(decide("affinity", snap, mem)[0]) == [("r1", "w2")]


def test_affinity_sends_each_client_to_its_own_cache():
    snap = KaasPoolSnapshot(0.0, workers(("w0", True, ("b",)), ("w1", True, ("a",))),
                            (req("ra", "A", ("a",)), req("rb", "B", ("b",))))
    mem = KaasPolicyMemory(usage={"A": ClientUsage(0, 0.01), "B": ClientUsage(0, 0.01)})
    assert sorted(pairs(decide("affinity", snap, mem)[0])) == [("ra", "w1"), ("rb", "w0")]


def test_fair_share_penalty_prevents_starvation():
    """A hot client whose data is cached everywhere vs a cold one cached nowhere, with one
    executor: the cold client must be served after a bounded amount of hot-client time."""
    hot_keys = ("h",)
    mem = KaasPolicyMemory()
    served = {"hot": 0, "cold": 0}
    first_cold = None
    service_s = {"hot": 0.01, "cold": 0.01}
    n = 0
    for step in range(200):  # bounded: 200 dispatches
        pending = (req(f"h{step}", "hot", hot_keys, t=step), req(f"c{step}", "cold", ("x",), t=step))
        snap = KaasPoolSnapshot(float(step), workers(("w0", True, hot_keys)), pending)
        decision, mem = decide("affinity", snap, mem)
        (a,) = decision.assignments
        client = "hot" if a.request_id.startswith("h") else "cold"
        served[client] += 1
        if client == "cold" and first_cold is None:
            first_cold = step
        mem = record_completion(mem, client, service_s[client], a.charge_s)
        n += 1
    # K=10: the hot client runs ahead by at most ~K·L of executor time, i.e. about 10 calls
    assert first_cold is not None and first_cold <= 12
    # and in the long run both get about the same executor time
    assert abs(served["hot"] - served["cold"]) <= 12
    assert n == 200


def test_without_the_fair_share_term_affinity_alone_would_starve():
    """Sanity check of the test above: ranking by cached bytes alone serves only the hot one."""
    snap = KaasPoolSnapshot(0.0, workers(("w0", True, ("h",))),
                            (req("h0", "hot", ("h",)), req("c0", "cold", ("x",))))
    mem = KaasPolicyMemory(usage={"hot": ClientUsage(0.0, 0.01), "cold": ClientUsage(0.0, 0.01)})
    assert pairs(decide("affinity", snap, mem)[0]) == [("h0", "w0")]
    mem = KaasPolicyMemory(usage={"hot": ClientUsage(0.2, 0.01), "cold": ClientUsage(0.0, 0.01)})
    assert pairs(decide("affinity", snap, mem)[0]) == [("c0", "w0")]


def test_returning_client_starts_at_min_vtime():
    mem = KaasPolicyMemory(usage={"a": ClientUsage(5.0, 0.1), "idle": ClientUsage(0.0, 0.1)},
                           active=frozenset({"a"}))
    snap = KaasPoolSnapshot(0.0, workers(("w0", False, ())),
                            (req("r1", "a"), req("r2", "idle")))
    _, mem = decide("affinity", snap, mem)
    assert mem.usage["idle"].vtime_s == 5.0 and mem.active == {"a", "idle"}


def test_dispatch_charges_then_completion_corrects():
    snap = KaasPoolSnapshot(0.0, workers(("w0", True, ())), (req("r1", "a"),))
    mem = KaasPolicyMemory(usage={"a": ClientUsage(1.0, 0.5)})
    decision, mem = decide("affinity", snap, mem)
    assert decision.assignments[0].charge_s == 0.5 and mem.usage["a"].vtime_s == 1.5
    mem = record_completion(mem, "a", 0.25, 0.5)
    assert mem.usage["a"].vtime_s == pytest.approx(1.25)
    assert mem.usage["a"].avg_service_s == pytest.approx(0.2 * 0.25 + 0.8 * 0.5)


def test_round_robin_cycles_over_idle_workers():
    ws = workers(("w0", True, ()), ("w1", True, ()), ("w2", True, ()))
    mem = KaasPolicyMemory()
    got = []
    for i in range(6):
        snap = KaasPoolSnapshot(0.0, ws, (req(f"r{i}", "c"),))
        decision, mem = decide("round_robin", snap, mem)
        got += [w for _, w in pairs(decision)]
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2"]
    busy = workers(("w0", True, ()), ("w1", False, ()), ("w2", True, ()))
    decision, mem = decide("round_robin", KaasPoolSnapshot(0, busy, (req("a", "c"), req("b", "c"),
                                                                      req("z", "c"))), mem)
    assert pairs(decision) == [("a", "w0"), ("b", "w2")]  # z waits: nobody idle


def test_exclusive_keeps_a_client_on_its_own_workers():
    mem = KaasPolicyMemory()
    ws = workers(("w0", True, ()), ("w1", True, ()))
    decision, mem = decide("exclusive", KaasPoolSnapshot(0, ws, (req("a1", "A"),)), mem)
    assert [(a.request_id, a.worker_id, a.restart) for a in decision.assignments] == [
        ("a1", "w0", True)]  # first use: a cold start
    decision, mem = decide("exclusive", KaasPoolSnapshot(1, ws, (req("a2", "A"),)), mem)
    assert [(a.worker_id, a.restart) for a in decision.assignments] == [("w0", False)]
    # B takes the free worker; A, while w0 is busy, waits rather than take B's
    decision, mem = decide("exclusive", KaasPoolSnapshot(2, ws, (req("b1", "B"),)), mem)
    assert pairs(decision) == [("b1", "w1")]
    ws_busy = workers(("w0", False, ()), ("w1", True, ()))
    decision, mem = decide("exclusive", KaasPoolSnapshot(3, ws_busy, (req("a3", "A"),)), mem)
    assert decision.assignments == ()
    assert mem.owners == {"w0": "A", "w1": "B"}


def test_exclusive_takes_from_the_largest_pool_with_hysteresis():
    ws = workers(("w0", True, ()), ("w1", True, ()), ("w2", True, ()), ("w3", False, ()))
    mem = KaasPolicyMemory(owners={"w0": "A", "w1": "A", "w2": "A", "w3": "B"})
    # C has nothing: takes an idle worker of the largest pool (A), restarting it
    decision, mem = decide("exclusive", KaasPoolSnapshot(5, ws, (req("c1", "C"),)), mem)
    assert [(a.worker_id, a.restart) for a in decision.assignments] == [("w0", True)]
    assert mem.owners["w0"] == "C" and mem.taken_at_s["A"] == 5
    # B has 1 busy, A has 2: 1 + 1 < 2 is false, so B waits (no ping-pong)
    ws = workers(("w0", False, ()), ("w1", True, ()), ("w2", True, ()), ("w3", False, ()))
    decision, mem = decide("exclusive", KaasPoolSnapshot(6, ws, (req("b1", "B"),)), mem)
    assert decision.assignments == ()


def test_every_policy_assigns_each_request_and_worker_at_most_once():
    ws = workers(("w0", True, ("k",)), ("w1", True, ("k",)), ("w2", False, ()))
    pending = tuple(req(f"r{i}", f"c{i % 3}", ("k",), t=i) for i in range(7))
    for name in ("exclusive", "round_robin", "affinity"):
        decision, _ = decide(name, KaasPoolSnapshot(0, ws, pending), KaasPolicyMemory())
        rids = [a.request_id for a in decision.assignments]
        wids = [a.worker_id for a in decision.assignments]
        assert len(set(rids)) == len(rids) and len(set(wids)) == len(wids), name
        assert set(wids) <= {"w0", "w1"}, name
        assert len(rids) == 2, name  # work-conserving: both idle workers get work


def test_unknown_policy():
    with pytest.raises(ValueError):
        decide("fifo", KaasPoolSnapshot(0, (), ()), KaasPolicyMemory())


def test_affinity_ties_go_to_the_emptiest_worker():
    ws = (KaasWorkerSnapshot("w0", True, frozenset({"other"}), free_bytes=MB),
          KaasWorkerSnapshot("w1", True, frozenset(), free_bytes=4 * MB))
    snap = KaasPoolSnapshot(0.0, ws, (req("r1", "new", ("k",)),))
    assert pairs(decide("affinity", snap, KaasPolicyMemory())[0]) == [("r1", "w1")]
