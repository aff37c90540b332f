"""Dilu scheduling (flashpoint/policy/dilu.py): best-fit, affinity tier, caps, LLM, gang."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.policy.dilu import (
    DiluGpu,
    DiluParams,
    InstanceRequest,
    Kind,
    Reservation,
    affinity_gpus,
    release,
    schedule,
)

GB = 10**9
P = DiluParams()


def _cluster(nodes: int = 2, per_node: int = 4, mem_gb: int = 40) -> tuple[DiluGpu, ...]:
    return tuple(DiluGpu(f"n{n}g{g}", f"n{n}", mem_gb * GB)
                 for n in range(nodes) for g in range(per_node))


def _inf(iid: str, fn: str, req: float, lim: float, mem_gb: float) -> InstanceRequest:
    return InstanceRequest(iid, fn, Kind.INFERENCE, req, lim, int(mem_gb * GB))


def _train(iid: str, fn: str, req: float, lim: float, mems_gb) -> InstanceRequest:
    return InstanceRequest(iid, fn, Kind.TRAINING, req, lim,
                           worker_memory_bytes=tuple(int(m * GB) for m in mems_gb))


def _check_caps(gpus, params=P) -> None:
    for g in gpus:
        assert g.request_sum <= params.omega + 1e-9, g
        assert g.limit_sum <= params.gamma + 1e-9, g
        assert g.memory_used_bytes <= g.memory_total_bytes, g


def test_bert_dp4_training_leaves_room_for_one_inference_per_gpu_spread_by_affinity():
    """The reference deploy configs (digest §2.4): BERT DP-4 training 0.3/0.9 with 33 GB per
    worker on A100-40GB; BERT inference 0.1/0.2/5 GB. The gang lands on one node; the
    first inference replica best-fits next to a worker; the next three follow the affinity
    tier to the *sibling* workers' GPUs (one each: symmetric interference, no lagger); the
    fifth finds 38 + 5 > 40 GB everywhere and opens a fresh GPU."""
    gpus = _cluster()
    d = schedule(gpus, _train("bert-train", "bert-train", 0.3, 0.9, [33] * 4))
    assert d.tier == "gang" and len(d.gpu_ids) == 4
    assert {gid[:2] for gid in d.gpu_ids} == {"n0"}  # one node
    train_gpus = set(d.gpu_ids)
    gpus = d.gpus
    first = schedule(gpus, _inf("i0", "bert", 0.1, 0.2, 5))
    assert first.tier == "active" and first.gpu_ids[0] in train_gpus
    gpus = first.gpus
    seen = {first.gpu_ids[0]}
    for k in range(1, 4):
        d = schedule(gpus, _inf(f"i{k}", "bert", 0.1, 0.2, 5))
        assert d.tier == "affinity" and d.gpu_ids[0] in train_gpus - seen
        seen.add(d.gpu_ids[0])
        gpus = d.gpus
    assert seen == train_gpus
    fifth = schedule(gpus, _inf("i4", "bert", 0.1, 0.2, 5))
    assert fifth.tier == "fresh" and fifth.gpu_ids[0] not in train_gpus
    _check_caps(fifth.gpus)


def test_affinity_beats_a_tighter_fit_elsewhere():
    """§3.3 Principle 1 / Fig. "workload-aware": Func-a trains on GPU 0 and GPU 1; Func-b's
    instance-1 runs beside Func-a's worker on GPU 0. Func-b's instance-2 goes beside
    Func-a's other worker (GPU 1), not to GPU 2 (Func-c), although GPU 2 fits tighter."""
    gpus = _cluster(1, 3)
    gpus = schedule(gpus, _train("a", "func-a", 0.3, 0.6, [10, 10])).gpus
    gpus = schedule(gpus, _inf("b1", "func-b", 0.2, 0.4, 5)).gpus
    gpus = schedule(gpus, _inf("c1", "func-c", 0.75, 0.75, 30)).gpus  # too big beside a
    assert [g.gpu_id for g in gpus if any(r.function == "func-c" for r in g.reservations)] \
        == ["n0g2"]
    assert [gpus[i].gpu_id for i in affinity_gpus(gpus, "func-b")] == ["n0g1"]
    d = schedule(gpus, _inf("b2", "func-b", 0.2, 0.4, 5))
    assert (d.gpu_ids, d.tier) == (("n0g1",), "affinity")
    # without the tier, best-fit alone would have chosen Func-c's GPU (less leftover)
    assert gpus[2].score(0.2, 5 * GB, P) < gpus[1].score(0.2, 5 * GB, P)


def test_best_fit_takes_the_least_leftover():
    gpus = _cluster(1, 3)
    gpus = schedule(gpus, _inf("x", "x", 0.5, 0.5, 10)).gpus  # n0g0 (all fresh: first)
    gpus = schedule(gpus, _inf("y", "y", 0.7, 0.7, 10)).gpus  # 0.5+0.7 > 1: fresh n0g1
    d = schedule(gpus, _inf("z", "z", 0.2, 0.2, 1))  # tighter on n0g1 (0.9 after)
    assert d.gpu_ids == ("n0g1",) and d.tier == "active"


def test_request_cap_and_limit_cap_each_bind():
    gpus = _cluster(1, 2)
    gpus = schedule(gpus, _inf("a", "a", 0.6, 0.6, 1)).gpus
    assert schedule(gpus, _inf("b", "b", 0.5, 0.5, 1)).tier == "fresh"  # Σreq 1.1 > Ω
    assert schedule(gpus, _inf("c", "c", 0.4, 0.4, 1)).tier == "active"  # Σreq exactly 1
    gpus = schedule(_cluster(1, 2), _inf("a", "a", 0.3, 0.8, 1)).gpus
    assert schedule(gpus, _inf("b", "b", 0.3, 0.8, 1)).tier == "fresh"  # Σlim 1.6 > γ
    assert schedule(gpus, _inf("c", "c", 0.3, 0.7, 1)).tier == "active"  # Σlim 1.5 = γ
    ten = _cluster(1, 1)
    for k in range(10):  # ten requests of 0.1 sum to 1 despite binary floating point
        ten = schedule(ten, _inf(f"t{k}", "t", 0.1, 0.15, 1)).gpus
    assert len(ten[0].reservations) == 10
    none = schedule(ten, _inf("t10", "t", 0.1, 0.1, 1))
    assert none.gpu_ids == () and none.reason and none.gpus == ten
    one = _cluster(1, 1)
    for k, r in enumerate((0.2, 0.4, 0.3, 0.1)):  # their float sum is 1.0000000000000002
        one = schedule(one, _inf(f"s{k}", "s", r, r, 1)).gpus
    assert len(one[0].reservations) == 4


def test_llm_worst_fit_then_pipeline_split_on_one_node_then_fresh():
    gpus = _cluster(2, 2)
    gpus = schedule(gpus, _inf("a", "a", 0.2, 0.4, 25)).gpus  # n0g0
    gpus = schedule(gpus, _inf("b", "b", 0.9, 0.9, 5)).gpus  # fresh n0g1 (req cap)
    llm = InstanceRequest("l1", "llama", Kind.LLM_INFERENCE, 0.05, 0.1, 10 * GB)
    d = schedule(gpus, llm)  # both admit; n0g1 has more free memory
    assert (d.gpu_ids, d.tier) == (("n0g1",), "worst-fit")
    # 50 GB fits no single GPU; node n0 has 15 + 35 GB free with SM headroom
    big = InstanceRequest("l2", "llama", Kind.LLM_INFERENCE, 0.05, 0.1, 50 * GB)
    d = schedule(gpus, big)
    assert d.tier == "pipeline" and d.gpu_ids == ("n0g1", "n0g0")  # most free first
    assert sum(r.memory_bytes for g in d.gpus for r in g.reservations
               if r.instance_id == "l2") == 50 * GB
    _check_caps(d.gpus)
    huge = InstanceRequest("l3", "llama", Kind.LLM_INFERENCE, 0.5, 0.5, 39 * GB)
    assert schedule(gpus, huge).tier == "fresh"


def test_gang_prefers_active_gpus_of_one_node_and_never_splits_nodes():
    gpus = _cluster(2, 2)
    gpus = schedule(gpus, _inf("x", "x", 0.1, 0.1, 1)).gpus  # n0g0 active
    gpus = schedule(gpus, _inf("y", "y", 0.95, 0.95, 1)).gpus  # n0g1 (fresh), now full
    d = schedule(gpus, _train("t", "t", 0.3, 0.6, [20, 20]))
    assert d.gpu_ids and {g[:2] for g in d.gpu_ids} == {"n1"}  # n0 has one usable GPU
    assert schedule(d.gpus, _train("u", "u", 0.3, 0.6, [20] * 3)).gpu_ids == ()


def test_gang_fills_active_gpus_before_opening_fresh_ones():
    """Node n0 is empty, node n1 has room on its active GPUs: the job goes to n1 and opens
    no GPU, although n0 comes first."""
    res = Reservation("x", "x", Kind.INFERENCE, 0.1, 0.1, GB)
    gpus = tuple(DiluGpu(f"n{n}g{g}", f"n{n}", 40 * GB, (res,) if n == 1 else ())
                 for n in range(2) for g in range(2))
    d = schedule(gpus, _train("t", "t", 0.3, 0.6, [20, 20]))
    assert sorted(d.gpu_ids) == ["n1g0", "n1g1"]


def test_release_returns_the_gpu_to_fresh():
    d = schedule(_cluster(1, 1), _inf("a", "a", 0.5, 0.5, 1))
    gpus = release(d.gpus, "a")
    assert not gpus[0].active and gpus[0].request_sum == 0


def test_bad_requests_are_refused():
    with pytest.raises(BadRequest):
        _inf("a", "a", 0.5, 0.4, 1)  # limit below request
    with pytest.raises(BadRequest):
        InstanceRequest("t", "t", Kind.TRAINING, 0.3, 0.6)  # no workers
    with pytest.raises(BadRequest):
        DiluParams(omega=2.0, gamma=1.5)


req_st = st.tuples(
    st.sampled_from([Kind.INFERENCE, Kind.INFERENCE, Kind.LLM_INFERENCE, Kind.TRAINING]),
    st.sampled_from(["f", "g", "h"]), st.integers(1, 100), st.integers(0, 100),
    st.integers(1, 45), st.integers(1, 4))


def _req(i: int, spec) -> InstanceRequest:
    kind, fn, req, extra, mem, workers = spec
    lim = min(1.5, req / 100 * (1 + extra / 100))
    if kind is Kind.TRAINING:
        return _train(f"i{i}", fn, req / 100, lim, [mem] * workers)
    return InstanceRequest(f"i{i}", fn, kind, req / 100, lim, mem * GB)


@settings(max_examples=120, deadline=None)
@given(st.lists(req_st, max_size=25), st.lists(st.integers(0, 24), max_size=6))
def test_caps_never_violated_and_placement_exists_when_a_gpu_admits(specs, releases):
    gpus = _cluster(2, 3)
    for i, spec in enumerate(specs):
        req = _req(i, spec)
        d = schedule(gpus, req)
        _check_caps(d.gpus)
        assert [g.gpu_id for g in d.gpus] == [g.gpu_id for g in gpus]  # order kept
        whole = [g for g in gpus if g.admits(req.sm_request, req.sm_limit, req.memory_bytes, P)]
        if req.kind is not Kind.TRAINING:
            # a single GPU that admits the whole instance always suffices
            assert bool(d.gpu_ids) or not whole
        else:
            assert len(d.gpu_ids) in (0, len(req.worker_memory_bytes))
            assert len({gid[:2] for gid in d.gpu_ids}) <= 1  # one node
            fresh_nodes = {}
            for g in gpus:
                if not g.active and g.admits(req.sm_request, req.sm_limit,
                                             max(req.worker_memory_bytes), P):
                    fresh_nodes[g.node_id] = fresh_nodes.get(g.node_id, 0) + 1
            if any(n >= len(req.worker_memory_bytes) for n in fresh_nodes.values()):
                assert d.gpu_ids  # enough empty GPUs on one node: never refused
        gpus = d.gpus
        if i in releases:
            gpus = release(gpus, f"i{i // 2}")
            _check_caps(gpus)
