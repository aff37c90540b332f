"""FaST-GShare (flashpoint/policy/fastgshare.py): profile table, memory with model sharing,
MaxRects placement on the paper's §5.4 workload."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashpoint.errors import BadRequest
from flashpoint.policy import fastgshare as fg
from flashpoint.policy.fastgshare import (
    FunctionProfile,
    GpuBin,
    PodMemory,
    PodRequest,
    ProfilePoint,
    pack,
    place_pod,
)
from flashpoint.policy.maxrects import SM_UNITS, TIME_UNITS, best_fit, free_space
from flashpoint.policy.rpr import plan

MIB = 2**20
GIB = 2**30


# ------------------------------------------------------------------------ profile table ---

def _saturating(sm: float, quota: float) -> float:
    """ResNet-like (Fig. 8): linear in quota, flat in SM% above 24%."""
    return 300.0 * min(sm, 0.24) / 0.24 * quota


def _profile(fn=_saturating) -> FunctionProfile:
    pts = tuple(ProfilePoint(s, q, fn(s, q), 0.02 / q)
                for s in fg.PAPER_SM_SHARES for q in fg.PAPER_QUOTAS)
    return FunctionProfile("resnet", pts, batch=4)


def test_grid_lookup_and_interpolation():
    prof = _profile()
    assert len(prof.points) == 35  # the paper's 7 SM shares × 5 quotas
    assert prof.lookup(0.12, 0.4).throughput_rps == pytest.approx(60.0)
    assert prof.lookup(0.13, 0.4) is None
    # exact at grid points, linear between them along each axis, bilinear inside a cell
    assert prof.interpolate(0.24, 0.6).throughput_rps == pytest.approx(180.0)
    assert prof.interpolate(0.24, 0.5).throughput_rps == pytest.approx(150.0)
    assert prof.interpolate(0.18, 0.4).throughput_rps == pytest.approx(90.0)
    mid = prof.interpolate(0.18, 0.5)
    corners = [prof.lookup(s, q).throughput_rps for s in (0.12, 0.24) for q in (0.4, 0.6)]
    assert mid.throughput_rps == pytest.approx(sum(corners) / 4)
    assert mid.p99_latency_s == pytest.approx((0.05 + 0.02 / 0.6) / 2)
    with pytest.raises(BadRequest):
        prof.interpolate(0.05, 0.4)  # below the profiled SM range: no extrapolation
    with pytest.raises(BadRequest):
        prof.interpolate(0.5, 0.1)


def test_profile_must_be_a_full_grid():
    pts = _profile().points
    with pytest.raises(BadRequest):
        FunctionProfile("f", pts[:-1])
    with pytest.raises(BadRequest):
        FunctionProfile("f", pts + pts[:1])


def test_just_sufficient_is_the_least_covering_config_then_smallest_share():
    prof = _profile()
    # 45 rps: 6% SM at 60% quota gives exactly 45; (12%, 40%) gives 60, a larger excess
    c = fg.just_sufficient_config(prof, 44.0)
    assert (c.sm_share, c.quota, c.throughput_rps) == (0.06, 0.6, pytest.approx(45.0))
    # 60 rps from (6%, 80%), (12%, 40%) and (24%, 20%): equal T and S·Q, the name decides
    assert fg.just_sufficient_config(prof, 50.0).name == "s12-q40"
    # throughput is flat above 24% SM: the tie on T goes to the smallest S·Q
    c = fg.just_sufficient_config(prof, 300.0)
    assert (c.sm_share, c.quota) == (0.24, 1.0)
    # an SLO filter removes low quotas (latency 0.02/q): 0.04 s leaves q >= 0.6 only
    c = fg.just_sufficient_config(prof, 50.0, slo_s=0.04)
    assert c.quota >= 0.6 and c.throughput_rps >= 50.0
    # more than any config sustains: the largest one, and the caller adds replicas
    assert fg.just_sufficient_config(prof, 1e6).throughput_rps == pytest.approx(300.0)


def test_profile_feeds_rpr_algorithm_1():
    """The table's configurations run through rpr.plan (reused, not rewritten): the most
    efficient pods (small SM, where throughput per share peaks) plus one just-sufficient."""
    configs = _profile().configs()
    pods = plan(130.0, [], configs, tie_tolerance=0.02)
    assert sum(c.throughput_rps for _, c in pods) >= 130.0
    assert all(c.sm_share <= 0.24 for _, c in pods)  # never pay for flat SM


# --------------------------------------------------------------------------- memory ---

def test_model_sharing_counts_weights_once_per_gpu_vit_huge():
    """§5.5 / Fig. 13, ViT-Huge: 4735 MB per pod alone; with sharing 2101 MB per pod plus
    2979 MB in the store (2634 MB of weights + its CUDA context)."""
    vit = PodMemory(weights_bytes=2634 * MIB, private_bytes=2101 * MIB, store_bytes=345 * MIB)
    alone = PodMemory(2634 * MIB, 2101 * MIB, share_weights=False)
    assert alone.footprint_bytes(1) == 4735 * MIB
    assert alone.footprint_bytes(3) == 14205 * MIB
    assert vit.footprint_bytes(1) == 5080 * MIB  # one pod costs more with sharing
    assert vit.footprint_bytes(3) == 9282 * MIB  # 4923 MB saved at three pods
    assert vit.footprint_bytes(0) == 0


def _vit(i: int, share: bool = True) -> PodRequest:
    mem = PodMemory(2634 * MIB, 2101 * MIB, 345 * MIB if share else 0, share)
    return PodRequest(f"vit{i}", "vit", 0.12, 0.2, mem)


def test_memory_check_with_and_without_sharing_on_a_16gb_gpu():
    """Sharing lets more replicas of one function onto a V100-16GB (the paper's ResNeXt
    case went from 4 to 7 pods; here ViT-Huge goes from 3 to 6)."""
    for share, fits in ((False, 3), (True, 6)):
        used, unplaced = pack([_vit(i, share) for i in range(8)], [GpuBin("g0", 16 * 1000 * MIB)])
        assert len(used[0].pods) == fits and len(unplaced) == 8 - fits
        assert used[0].memory_used_bytes() <= used[0].memory_total_bytes


def test_pod_shares_are_checked_at_construction():
    for sm, q in ((0.0, 0.5), (0.5, 1.2), (float("nan"), 0.5)):
        with pytest.raises(BadRequest):
            PodRequest("p", "f", sm, q, PodMemory(0, 0))
    with pytest.raises(BadRequest):
        PodMemory(-1, 0)


def test_sharing_is_per_function_not_across_models():
    g = GpuBin("g0", 100 * GIB)
    a = PodRequest("a", "f", 0.1, 0.1, PodMemory(GIB, GIB))
    b = PodRequest("b", "g", 0.1, 0.1, PodMemory(GIB, GIB))
    used, _ = pack([a, b], [g])
    assert used[0].memory_used_bytes() == 4 * GIB


# ------------------------------------------------------------------------ placement ---

def _fig11_pods() -> list[PodRequest]:
    """§5.4: 4×ResNet (12% SM, 40% quota), 2×RNNT (24%, 40%), 2×BERT (50%, 60%), each
    (SM%, quota) per pod as written (digest §4.2 worked check)."""
    mem = PodMemory(GIB // 2, GIB)
    spec = [("resnet", 4, 0.12, 0.4), ("rnnt", 2, 0.24, 0.4), ("bert", 2, 0.5, 0.6)]
    return [PodRequest(f"{f}{i}", f, s, q, mem) for f, n, s, q in spec for i in range(n)]


def _spares(n: int = 4, mem: int = 16 * GIB) -> list[GpuBin]:
    return [GpuBin(f"g{i}", mem) for i in range(n)]


def _assert_valid(gpus) -> None:
    for g in gpus:
        rects = [p.rect for p in g.pods]
        for a, b in itertools.combinations(rects, 2):
            assert not a.intersects(b)
        assert all(r.x >= 0 and r.y >= 0 and r.right <= TIME_UNITS and r.top <= SM_UNITS
                   for r in rects)
        assert g.free == free_space(TIME_UNITS, SM_UNITS, rects)
        assert g.memory_used_bytes() <= g.memory_total_bytes


def test_fig11_eight_pods_fit_one_gpu_where_time_sharing_needs_four():
    pods = _fig11_pods()
    assert fg.exclusive_time_sharing_gpus(pods) == 4  # Σ quotas = 3.6 at 100% SM each
    assert fg.area_lower_bound(pods) == 1  # Σ S·Q = 0.984
    used, unplaced = pack(pods, _spares())
    assert unplaced == () and len(used) == 1 and len(used[0].pods) == 8
    _assert_valid(used)


def test_fig11_holds_in_every_arrival_order():
    pods = _fig11_pods()
    rng = random.Random(7)
    for _ in range(60):  # bounded sample of the 8! orders
        rng.shuffle(pods)
        used, unplaced = pack(pods, _spares())
        assert unplaced == () and len(used) == 1, [p.pod_id for p in pods]
        _assert_valid(used)


def test_without_repack_on_miss_small_pods_first_fragment_the_time_axis():
    """Why place_pod repacks on a miss: plain online best-area-fit with the ResNet pods
    first opens a second GPU (their 40% quotas split the time axis the BERTs need)."""
    used, _ = pack(_fig11_pods(), _spares(), repack_on_miss=False)
    assert len(used) == 2
    gpus: tuple[GpuBin, ...] = ()
    flags = []
    for pod in _fig11_pods():  # with it, the first BERT triggers a repack of GPU 0
        got = place_pod(gpus, pod, _spares())
        gpus, flags = got.gpus, flags + [got.repacked]
    assert len(gpus) == 1 and flags.count(True) >= 1 and not any(flags[:6])
    big_first = sorted(_fig11_pods(), key=lambda p: -p.size[0] * p.size[1])
    assert len(pack(big_first, _spares(), repack_on_miss=False)[0]) == 1


def test_best_area_fit_is_global_over_gpus():
    """The tightest hole on any GPU in use wins, not the first GPU that fits."""
    mem = PodMemory(0, GIB)
    big = PodRequest("big", "f", 1.0, 0.7, mem)
    half = PodRequest("half", "f", 1.0, 0.5, mem)
    used, _ = pack([big, half], _spares(2))  # two GPUs: 30% and 50% of time free
    got = place_pod(used, PodRequest("p", "f", 1.0, 0.3, mem))
    assert got.gpu_id == "g0" and not got.new_gpu


def test_memory_excludes_a_gpu_with_room_in_time_and_sm():
    mem = PodMemory(0, 10 * GIB)
    used, _ = pack([PodRequest("a", "f", 0.1, 0.1, mem)], _spares(2, mem=16 * GIB))
    got = place_pod(used, PodRequest("b", "g", 0.1, 0.1, mem), _spares(2, 16 * GIB)[1:])
    assert got.gpu_id == "g1" and got.new_gpu
    none = place_pod(used, PodRequest("c", "g", 0.1, 0.1, PodMemory(0, 20 * GIB)),
                     _spares(2, 16 * GIB)[1:])
    assert none.gpu_id == "" and none.rect is None and none.reason


def test_release_frees_the_rectangle_and_repack_compacts():
    used, _ = pack(_fig11_pods(), _spares())
    g = fg.release_pod(used[0], "bert0")
    assert len(g.pods) == 7
    _assert_valid([g])
    # the freed slot takes the next BERT pod again
    back = place_pod((g,), PodRequest("bert9", "bert", 0.5, 0.6, PodMemory(GIB // 2, GIB)))
    assert back.gpu_id == g.gpu_id
    with pytest.raises(BadRequest):
        fg.release_pod(g, "bert0")
    r = fg.repack(g)
    assert {p.pod.pod_id for p in r.pods} == {p.pod.pod_id for p in g.pods}
    _assert_valid([r])


pod_st = st.tuples(st.sampled_from(["f", "g", "h"]), st.integers(1, 100), st.integers(1, 100),
                   st.integers(0, 8))


@settings(max_examples=80, deadline=None)
@given(st.lists(pod_st, max_size=14))
@example([("f", 1, 1, 0), ("f", 17, 1, 0), ("f", 29, 100, 3)])  # replicas' private sizes differ
def test_packing_never_overlaps_or_overcommits_and_opens_a_gpu_only_when_needed(specs):
    pods = [PodRequest(f"p{i}", f, sm / 100, q / 100, PodMemory(GIB, gb * GIB))
            for i, (f, sm, q, gb) in enumerate(specs)]
    spares = _spares(len(pods) or 1, mem=16 * GIB)
    used: tuple[GpuBin, ...] = ()
    for pod in pods:
        w, h = pod.size
        got = place_pod(used, pod, [s for s in spares if s.gpu_id not in {g.gpu_id for g in used}])
        # each pod fits an empty 16 GiB GPU and there are enough spares: always placed
        assert got.gpu_id and got.rect is not None and (got.rect.w, got.rect.h) == (w, h)
        if got.new_gpu:  # only when no GPU in use had a hole and the memory for it
            assert not any(g.memory_fits(pod) and best_fit(g.free, w, h) for g in used)
        if not got.repacked:  # plain placements never move other pods
            before = {p.pod.pod_id: p.rect for g in used for p in g.pods}
            after = {p.pod.pod_id: p.rect for g in got.gpus for p in g.pods}
            assert all(after[k] == r for k, r in before.items())
        used = got.gpus
        _assert_valid(used)
    assert sum(len(g.pods) for g in used) == len(pods)
    assert len(used) >= fg.area_lower_bound(pods)
