"""GPU-share placement: the pure policies (FaST MaxRects, Dilu best fit) over sharing hosts'
GPUs, and ControllerState choosing shares and sending them with DeployReplica."""

from __future__ import annotations

import pytest

from flashpoint.config import load_config
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    DeployReplica,
    DeviceRecord,
    FunctionUpserted,
    HostRegistered,
    Tick,
)
from flashpoint.errors import BadRequest
from flashpoint.policy.fastgshare import exclusive_time_sharing_gpus
from flashpoint.policy.share_placement import (
    ReplicaShare,
    ShareDevice,
    SharedReplica,
    ShareRequest,
    place_shared,
)
from flashpoint.spec import FunctionSpec

from .test_controller_state import load, of

GIB = 1 << 30


def _apply(devices: list[ShareDevice], placements) -> list[ShareDevice]:
    """Feed a decision back as the replicas the GPUs now run (what the state does)."""
    out = []
    for d in devices:
        mine = tuple(SharedReplica(p.replica_id, fn, p.share) for p, fn in placements
                     if (p.host_id, p.device_id) == (d.host_id, d.device_id))
        out.append(ShareDevice(d.host_id, d.device_id, d.memory_total_bytes, d.replicas + mine))
    return out


def test_fast_packs_the_paper_example_into_one_gpu_one_function_at_a_time():
    # FaST §5.4: 4×ResNet(12% SM, 40% quota) + 2×RNNT(24%, 40%) + 2×BERT(50%, 60%) fit one
    # GPU; exclusive time sharing needs four. Functions arrive one scale-up at a time and
    # each decision sees the previous ones' replicas (replayed rectangles).
    devices = [ShareDevice("h0", f"cuda:{i}", 40 * GIB) for i in range(4)]
    for fn, sm, quota, n in (("resnet", 0.12, 0.4, 4), ("rnnt", 0.24, 0.4, 2),
                             ("bert", 0.5, 0.6, 2)):
        req = ShareRequest(fn, tuple(f"{fn}-{i}" for i in range(n)), sm, sm, quota, GIB)
        dec = place_shared("fastgshare", devices, req)
        assert dec.unplaced == 0, dec.reason
        for p in dec.placements:
            assert p.share == ReplicaShare(sm, quota, quota, GIB)
        devices = _apply(devices, [(p, fn) for p in dec.placements])
    used = [d for d in devices if d.replicas]
    assert [d.device_id for d in used] == ["cuda:0"] and len(used[0].replicas) == 8
    from flashpoint.policy.fastgshare import PodMemory, PodRequest

    pods = [PodRequest(r.replica_id, r.function, r.share.sm_share, r.share.time_request,
                       PodMemory(GIB, 0)) for r in used[0].replicas]
    assert exclusive_time_sharing_gpus(pods) == 4  # what FaST saves against


def test_fast_memory_check_opens_another_gpu():
    devices = [ShareDevice("h0", "cuda:0", 3 * GIB), ShareDevice("h1", "cuda:0", 3 * GIB)]
    dec = place_shared("fastgshare", devices,
                       ShareRequest("f", ("a", "b", "c"), 0.1, 0.1, 0.1, GIB + 1))
    assert [(p.host_id, p.device_id) for p in dec.placements] == [
        ("h0", "cuda:0"), ("h0", "cuda:0"), ("h1", "cuda:0")]
    full = place_shared("fastgshare", devices[:1],
                        ShareRequest("f", ("a", "b", "c"), 0.1, 0.1, 0.1, GIB + 1))
    assert full.unplaced == 1 and "fastgshare" in full.reason


def test_dilu_request_and_limit_caps_per_gpu():
    devices = [ShareDevice("h0", "cuda:0", 40 * GIB), ShareDevice("h0", "cuda:1", 40 * GIB)]
    # request 0.4, limit 0.6: two per GPU (Σrequest 0.8 ≤ 1, Σlimit 1.2 ≤ 1.5), not three
    dec = place_shared("dilu", devices, ShareRequest("f", ("a", "b", "c", "d", "e"),
                                                     0.4, 0.6, 1.0, GIB))
    where = [p.device_id for p in dec.placements]
    assert where == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"] and dec.unplaced == 1
    assert "dilu" in dec.reason
    assert dec.placements[0].share == ReplicaShare(0.6, 0.4, 0.6, GIB)
    # the decision respects what already runs there (best fit: the tighter GPU first)
    busy = [ShareDevice("h0", "cuda:0", 40 * GIB, (SharedReplica(
        "x", "g", ReplicaShare(0.5, 0.5, 0.5, GIB)),)), ShareDevice("h0", "cuda:1", 40 * GIB)]
    dec = place_shared("dilu", busy, ShareRequest("f", ("a",), 0.4, 0.6, 1.0, GIB))
    assert dec.placements[0].device_id == "cuda:0"  # active before fresh, and it admits


def test_unknown_policy_is_refused():
    with pytest.raises(BadRequest):
        place_shared("nope", [], ShareRequest("f", ("a",), 0.5, 0.5, 1.0, 0))
    with pytest.raises(BadRequest, match="share_policy"):
        load_config(overrides={"controller": {"share_policy": "binpack"}})
    with pytest.raises(BadRequest):
        FunctionSpec(name="f", model="m", sm_limit=0.5)  # a limit without a share
    with pytest.raises(BadRequest):
        FunctionSpec(name="f", model="m", sm_share=0.6, sm_limit=0.5)


def _state(policy: str, sharing: str = "mps") -> ControllerState:
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0,
                         share_policy=policy)
    devs = (DeviceRecord("cuda:0", "cuda", 40 * GIB), DeviceRecord("cuda:1", "cuda", 40 * GIB))
    st.handle(HostRegistered("h0", devs, 64 * GIB, frozenset(), (), 0.0,
                             gpu_sharing=sharing))
    return st


@pytest.mark.parametrize("policy,expect", [
    ("fastgshare", ReplicaShare(0.3, 0.5, 0.5, 2 * GIB)),
    ("dilu", ReplicaShare(0.45, 0.3, 0.45, 2 * GIB)),
])
def test_state_places_two_replicas_on_one_gpu_with_shares(policy, expect):
    st = _state(policy)
    st.handle(FunctionUpserted(FunctionSpec(
        name="fn", model="m", replica_concurrency=1, min_replicas=2, sm_share=0.3,
        sm_limit=0.45, time_quota=0.5, gpu_memory_bytes=2 * GIB), 100 << 20))
    deploys = of(st.handle(Tick(0.1, {"fn": load()})), DeployReplica)
    assert len(deploys) == 2
    assert {(d.host_id, d.device_id) for d in deploys} == {("h0", "cuda:0")}
    assert all(d.share == expect for d in deploys)
    assert all(st.replicas[d.replica_id].share == expect for d in deploys)
    assert all(st.replicas[d.replica_id].device_bytes == 2 * GIB for d in deploys)
    # a later scale-up sees them: a third lands where its policy puts it, never overcommits
    st.handle(FunctionUpserted(FunctionSpec(
        name="fn", model="m", replica_concurrency=1, min_replicas=5, max_replicas=8,
        sm_share=0.3, sm_limit=0.45, time_quota=0.5, gpu_memory_bytes=2 * GIB), 100 << 20))
    more = of(st.handle(Tick(0.2, {"fn": load()})), DeployReplica)
    per_gpu: dict[str, list] = {}
    for r in st.replicas.values():
        per_gpu.setdefault(r.device_id, []).append(r.share)
    for shares in per_gpu.values():
        if policy == "dilu":
            assert sum(s.time_request for s in shares) <= 1.0 + 1e-9
            assert sum(s.time_limit for s in shares) <= 1.5 + 1e-9
        else:  # rectangles of 0.3 SM x 0.5 time: at most 6 fit the unit square
            assert sum(s.sm_share * s.time_request for s in shares) <= 1.0 + 1e-9
    assert len(more) == 3


def test_no_sharing_host_places_whole_devices_without_share():
    st = _state("fastgshare", sharing="none")
    st.handle(FunctionUpserted(FunctionSpec(name="fn", model="m", min_replicas=2,
                                            sm_share=0.3), 100 << 20))
    deploys = of(st.handle(Tick(0.1, {"fn": load()})), DeployReplica)
    assert len(deploys) == 2 and all(d.share is None for d in deploys)
    assert {d.device_id for d in deploys} == {"cuda:0", "cuda:1"}  # spread as before


def test_restarted_controller_adopts_shares_the_host_reports():
    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(FunctionUpserted(FunctionSpec(name="fn", model="m", sm_share=0.3), 100 << 20))
    share = ReplicaShare(0.3, 0.5, 0.5, GIB)
    st.handle(HostRegistered(
        "h0", (DeviceRecord("cuda:0", "cuda", 40 * GIB),), 64 * GIB, frozenset(),
        (("fn-a", "fn", "cuda:0", True), ("fn-b", "fn", "cuda:0", True)), 0.0,
        gpu_sharing="mps", shares={"fn-a": ReplicaShare.from_wire(share.to_wire())}))
    assert st.replicas["fn-a"].share == share
    assert st.replicas["fn-b"].share is None  # not reported: unshared, its GPU exclusive
    # so its GPU takes no further shared replica
    st.handle(FunctionUpserted(FunctionSpec(name="fn", model="m", sm_share=0.3,
                                            min_replicas=3), 100 << 20))
    assert of(st.handle(Tick(0.1, {"fn": load()})), DeployReplica) == []
    assert "fastgshare" in st.functions["fn"].unplaced
    with pytest.raises(BadRequest):
        ReplicaShare.from_wire({"sm_share": 0.3})


@pytest.mark.parametrize("policy", ["fastgshare", "dilu"])
def test_the_spec_tenant_class_travels_in_every_share(policy):
    # Dilu's KLC throttles only best-effort shares: the class must reach the deploy (and
    # the record a restarted controller rebuilds from the host's report).
    st = _state(policy, sharing="tokens")
    st.handle(FunctionUpserted(FunctionSpec(
        name="slo-fn", model="m", min_replicas=1, sm_share=0.4, sm_limit=0.6), 100 << 20))
    st.handle(FunctionUpserted(FunctionSpec(
        name="be-fn", model="m", min_replicas=1, sm_share=0.3, sm_limit=0.6,
        tenant_class="best_effort"), 100 << 20))
    deploys = of(st.handle(Tick(0.1, {"slo-fn": load(), "be-fn": load()})), DeployReplica)
    by_fn = {d.spec.name: d for d in deploys}
    assert set(by_fn) == {"slo-fn", "be-fn"}
    assert by_fn["slo-fn"].share.slo_sensitive is True
    assert by_fn["be-fn"].share.slo_sensitive is False
    assert st.replicas[by_fn["be-fn"].replica_id].share.slo_sensitive is False
    wire = by_fn["be-fn"].share.to_wire()
    assert wire["slo_sensitive"] is False
    assert ReplicaShare.from_wire(wire) == by_fn["be-fn"].share
