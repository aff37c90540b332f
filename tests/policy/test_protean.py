"""PROTEAN policies: η, Algorithm 1 (job distribution), Algorithm 2 (reconfigurator)."""

from __future__ import annotations

import pytest

from flashpoint.errors import BadRequest
from flashpoint.gpu.mig_profiles import SPECS, place
from flashpoint.policy.protean import (
    Batch,
    DistributionSnapshot,
    GpuReconfigSnapshot,
    ProteanProfiles,
    ReconfigMemory,
    ReconfigParams,
    ReconfigSnapshot,
    SliceProfile,
    SliceSnapshot,
    distribute_jobs,
    eta,
    reconfigure,
    target_geometry,
)

GB = 10**9
SLOWER = {"1g": 4.0, "2g": 2.2, "3g": 1.5, "4g": 1.2, "7g": 1.0}  # RDF by slice


def _profiles(fbr: dict[str, float], mem_gb: dict[str, float]) -> ProteanProfiles:
    return ProteanProfiles(tuple(
        SliceProfile(m, s, 0.1 * SLOWER[s], fbr[m], int(mem_gb[m] * GB))
        for m in fbr for s in SLOWER))


P = _profiles({"shufflenet": 0.3, "dpn92": 0.6, "gpt2": 0.9},
              {"shufflenet": 2, "dpn92": 5.48, "gpt2": 4})
A100_SLICES = (SliceSnapshot("g0/4g", "4g", 20 * GB), SliceSnapshot("g0/2g", "2g", 10 * GB),
               SliceSnapshot("g0/1g", "1g", 5 * GB))


def test_eta_clamp_and_rdf():
    assert P.rdf("dpn92", "3g") == pytest.approx(1.5)
    assert eta(1.5, 0.3, [0.4]) == pytest.approx(1.5)  # Σ FBR 0.7 < 1: co-location is free
    assert eta(1.5, 0.6, [0.6]) == pytest.approx(1.8)  # Σ FBR 1.2 includes the job's own
    with pytest.raises(BadRequest):
        P.get("bert", "1g")


def test_be_packed_small_strict_on_large():
    q = (Batch("s1", "shufflenet", True), Batch("b1", "shufflenet", False),
         Batch("b2", "shufflenet", False), Batch("s2", "shufflenet", True))
    d = distribute_jobs(DistributionSnapshot(A100_SLICES, q), P)
    assert [b for b, _ in d.assignments] == ["s1", "s2", "b1", "b2"]  # strict first
    assert d.slice_of("b1") == d.slice_of("b2") == "g0/1g"  # 4 GB of BE fit the 1g (5 GB)
    assert d.slice_of("s1") == d.slice_of("s2") == "g0/4g"  # least η: the big slice
    assert d.tags["g0/1g"] == pytest.approx(0.8) and d.tags["g0/4g"] == 0.0


def test_fully_tagged_slice_is_off_limits_to_strict():
    q = (Batch("b1", "dpn92", False), Batch("b2", "dpn92", False), Batch("s", "shufflenet", True))
    d = distribute_jobs(DistributionSnapshot(A100_SLICES, q), P)
    assert d.tags["g0/1g"] == 1.0 and d.tags["g0/2g"] == pytest.approx(0.596, abs=1e-3)
    assert d.slice_of("s") == "g0/4g"
    # the BE spill: 2 × 5.48 GB fit neither the 1g nor, together, the 2g
    assert d.slice_of("b1") == "g0/2g" and d.slice_of("b2") == "g0/4g"


def test_saturated_large_slice_sends_strict_to_a_smaller_one():
    """The GPT case (§6.2): when the 4g is crowded, argmin η picks a smaller slice."""
    crowded = (SliceSnapshot("g0/4g", "4g", 20 * GB, ("gpt2",) * 3),
               SliceSnapshot("g0/3g", "3g", 20 * GB))
    d = distribute_jobs(DistributionSnapshot(crowded, (Batch("s", "gpt2", True),)), P)
    # 4g: 1.2 · (0.9·4) = 4.32; 3g: 1.5 · max(0.9, 1) = 1.5
    assert d.slice_of("s") == "g0/3g" and d.etas["s"] == pytest.approx(1.5)
    full = (SliceSnapshot("g0/1g", "1g", 1 * GB),)
    assert distribute_jobs(DistributionSnapshot(full, (Batch("s", "gpt2", True),)),
                           P).slice_of("s") is None  # no room: it waits


def test_target_geometry_paths():
    spec, p = SPECS["A100-40GB"], ReconfigParams()
    assert target_geometry(spec, 6 * GB, p) == ("4g", "2g", "1g")  # fits [1g,2g] = 15 GB
    assert target_geometry(spec, 16.4 * GB, p) == ("4g", "3g")  # fits [3g] = 20 GB only
    assert target_geometry(spec, 30 * GB, p) == ("4g", "3g")  # fits nothing: fallback
    assert target_geometry(spec, 0.1 * GB, p) == ("4g", "3g")  # below T_low
    # slice memory comes from the GPU's table: 16.4 GB fits [1g,2g] = 30 GB on an H100
    assert target_geometry(SPECS["H100-80GB"], 16.4 * GB, p) == ("4g", "2g", "1g")
    for g in (("4g", "2g", "1g"), ("4g", "3g")):
        place(spec, g)  # both reachable geometries exist on the GPU


def _fleet(be_mem: int, geometries: dict[str, tuple[str, ...]],
           reconfiguring: frozenset[str] = frozenset()) -> ReconfigSnapshot:
    return ReconfigSnapshot(tuple(
        GpuReconfigSnapshot(gid, "A100-40GB", geo, 3.0, be_mem, gid in reconfiguring)
        for gid, geo in geometries.items()))


def test_fig7_be_model_switch_reconfigures_to_4g3g():
    """Fig. 7: ShuffleNet strict; the BE model switches to DPN 92 (2.74× the memory), the BE
    batches spill out of (2g,1g); after the wait limit Alg. 2 moves GPUs to (4g,3g), at most
    2 of 8 (30%) at a time."""
    params = ReconfigParams()
    geo = {f"gpu{i}": ("4g", "2g", "1g") for i in range(8)}
    mem = ReconfigMemory()
    # before the switch: 3 BE batches × 2 GB of ShuffleNet fit (2g,1g); nothing changes
    for _ in range(5):
        d, mem = reconfigure(_fleet(2 * GB, geo), params, mem)
        assert d.reconfigure == () and set(d.targets.values()) == {("4g", "2g", "1g")}
    dpn = int(5.48 * GB)  # 3 × 5.48 GB = 16.4 GB > 15 GB
    for _ in range(params.wait_limit):  # mismatches waited out
        d, mem = reconfigure(_fleet(dpn, geo), params, mem)
        assert d.reconfigure == () and set(d.targets.values()) == {("4g", "3g")}
    d, mem = reconfigure(_fleet(dpn, geo), params, mem)
    assert d.reconfigure == (("gpu0", ("4g", "3g")), ("gpu1", ("4g", "3g")))
    assert len(d.deferred) == 6
    busy = frozenset({"gpu0", "gpu1"})
    d, mem = reconfigure(_fleet(dpn, geo, busy), params, mem)
    assert d.reconfigure == ()  # the cap is taken by the two still reconfiguring
    geo.update({g: ("4g", "3g") for g in busy})
    d, mem = reconfigure(_fleet(dpn, geo), params, mem)
    assert [g for g, _ in d.reconfigure] == ["gpu2", "gpu3"]
    assert mem.wait["gpu0"] == 0  # matched now


def test_fallback_path_also_waits_then_reconfigures():
    """The digest's correction: the mismatch check runs on the fallback path too."""
    params = ReconfigParams(wait_limit=2)
    geo = {"gpu0": ("4g", "2g", "1g")}
    mem = ReconfigMemory()
    seen = []
    for _ in range(4):
        d, mem = reconfigure(_fleet(10 * GB, geo), params, mem)  # 30 GB: fits no set
        seen.append(d.reconfigure)
    assert seen == [(), (), (("gpu0", ("4g", "3g")),), ()]  # one GPU: the cap rounds up to 1


def test_hysteresis_resets_on_match_and_ewma_smooths():
    params = ReconfigParams(alpha=0.5, wait_limit=3)
    geo = {"gpu0": ("4g", "2g", "1g")}
    mem = ReconfigMemory()
    d, mem = reconfigure(_fleet(int(5.48 * GB), geo), params, mem)
    d, mem = reconfigure(_fleet(int(5.48 * GB), geo), params, mem)
    assert mem.wait["gpu0"] == 2
    d, mem = reconfigure(_fleet(2 * GB, geo), params, mem)  # a blip, then a match
    assert mem.wait["gpu0"] == 0 and d.reconfigure == ()
    snap = ReconfigSnapshot((GpuReconfigSnapshot("gpu0", "A100-40GB", geo["gpu0"], 9.0, GB),))
    _, mem = reconfigure(snap, params, mem)
    assert mem.ewma["gpu0"] == pytest.approx(0.5 * 9 + 0.5 * 3)



def test_thresholds_in_alg1():
    """T_high keeps strict batches off a slice tagged above it; below T_low a slice's tag
    does not shrink the memory strict batches may use (digest §2.5's thresholds read as BE
    occupancies of a slice)."""
    mems = {"be": {"1g": 0.3, "2g": 0.3, "3g": 0.5, "4g": 0.5, "7g": 0.5},  # smaller on 1g
            "big": dict.fromkeys(SLOWER, 4.6), "small": dict.fromkeys(SLOWER, 0.1)}
    profiles = ProteanProfiles(tuple(
        SliceProfile(m, s, 0.1 * SLOWER[s], 0.1, int(mem[s] * GB))
        for m, mem in mems.items() for s in SLOWER))
    one = (SliceSnapshot("1g", "1g", 5 * GB),)
    q = (Batch("b", "be", False), Batch("s", "big", True))
    # tag 0.5/5 = 0.1 (the 7g footprint), first fit leaves 4.7 GB: strict may use 4.5
    assert distribute_jobs(DistributionSnapshot(one, q), profiles).slice_of("s") is None
    d = distribute_jobs(DistributionSnapshot(one, q), profiles, t_low=0.2, t_high=1.0)
    assert d.slice_of("s") == "1g" and d.slice_of("b") == "1g"  # below T_low: all 4.7 GB
    # A crowded 4g (Σ FBR 5.0): η 4g = 1.2 · 5.1 = 6.12, η 1g = 4.0 · max(0.1 + 0.9, 1) = 4.
    two = (SliceSnapshot("1g", "1g", 5 * GB), SliceSnapshot("4g", "4g", 20 * GB,
                                                            resident_fbr=5.0))
    q = (*(Batch(f"b{i}", "be", False) for i in range(9)), Batch("s", "small", True))
    d = distribute_jobs(DistributionSnapshot(two, q), profiles)
    assert d.tags["1g"] == pytest.approx(0.9)  # 9 × 0.5 GB of the 1g's 5
    assert d.slice_of("s") == "1g" and d.etas["s"] == pytest.approx(4.0)
    d = distribute_jobs(DistributionSnapshot(two, q), profiles, t_low=0.05, t_high=0.85)
    assert d.slice_of("s") == "4g" and d.etas["s"] == pytest.approx(6.12)  # 0.9 > T_high
    with pytest.raises(BadRequest):
        distribute_jobs(DistributionSnapshot(two, q), profiles, t_low=0.9, t_high=0.8)
    with pytest.raises(BadRequest):
        ReconfigParams(t_low=0.6, t_high=0.4)
