"""MIG geometry validation (pure) and application through the fake NVML."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from flashpoint.errors import DeadlineExceeded, InvalidGeometry, MigFailed, MigUnavailable
from flashpoint.gpu.fake_nvml import FakeNvml
from flashpoint.gpu.mig import apply_geometry, mig_worker_env
from flashpoint.gpu.mig_profiles import SPECS, model_for, place, validate
from flashpoint.gpu.nvml import read_inventory

A100 = SPECS["A100-40GB"]


@pytest.mark.parametrize("geometry,expect", [
    (["4g", "3g"], [("4g.20gb", 0), ("3g.20gb", 4)]),
    (["4g", "2g", "1g"], [("4g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)]),
    (["1g"] * 7, [("1g.5gb", i) for i in range(7)]),
    (["3g", "3g"], [("3g.20gb", 0), ("3g.20gb", 4)]),
    (["7g"], [("7g.40gb", 0)]),
    (["1g.10gb"] * 4, [("1g.10gb", s) for s in (0, 2, 4, 6)]),
    (["1g", "2g", "4g"], [("1g.5gb", 6), ("2g.10gb", 4), ("4g.20gb", 0)]),  # any order
    # created in this order with first-fit starts the 1g's would take slots 0-2 and block the
    # 4g (which may only start at 0); placing the largest first finds the layout
    (["1g", "1g", "1g", "4g"], [("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6), ("4g.20gb", 0)]),
])
def test_place_valid(geometry, expect):
    assert [(p.profile.name, p.start) for p in place(A100, geometry)] == expect


@pytest.mark.parametrize("geometry,reason", [
    (["4g", "4g"], "too_many_instances"),
    (["4g", "3g", "1g"], "too_many_slices"),
    (["7g", "1g"], "too_many_slices"),
    (["3g", "3g", "1g"], "too_many_slices"),  # 7 compute slices but 9 memory slices
    (["5g"], "unknown_profile"),
    (["1g.20gb"], "unknown_profile"),  # an 80 GB profile on a 40 GB A100
    ([], "empty"),
])
def test_place_refuses_with_reason(geometry, reason):
    with pytest.raises(InvalidGeometry) as e:
        validate(A100, geometry)
    assert e.value.details["reason"] == reason
    assert e.value.http_status == 400


def test_no_placement_when_starts_collide():
    """Slice counts fit but the allowed starts do not (a table where 2g may only start at 0)."""
    two = dataclasses.replace(A100.profile("2g"), starts=(0,))
    spec = dataclasses.replace(A100, profiles=(*A100.profiles[:3], two, *A100.profiles[4:]))
    with pytest.raises(InvalidGeometry) as e:
        validate(spec, ["2g", "2g"])
    assert e.value.details["reason"] == "no_placement"
    assert "2g.10gb@[0]" in e.value.message


def test_unknown_profile_is_per_model():
    validate(SPECS["H200-141GB"], ["1g.18gb", "3g.71gb"])
    with pytest.raises(InvalidGeometry):  # an A100 name on an H200
        validate(SPECS["H200-141GB"], ["3g.20gb"])


def test_model_for_names():
    assert model_for("NVIDIA A100-SXM4-40GB", 40 * 2**30).model == "A100-40GB"
    assert model_for("NVIDIA A100 80GB PCIe", 80 * 2**30).model == "A100-80GB"
    assert model_for("NVIDIA H100 80GB HBM3", 81559 * 2**20).model == "H100-80GB"
    assert model_for("NVIDIA H200", 143771 * 2**20).model == "H200-141GB"
    for name, gib in (("NVIDIA H100 NVL", 94), ("Tesla T4", 16)):
        with pytest.raises(InvalidGeometry):
            model_for(name, gib * 2**30)


async def _noop() -> None:
    return None


async def test_apply_geometry_replaces_instances_after_drain():
    f = FakeNvml.with_gpus("H100-80GB")
    f.nvmlInit()
    drained = []

    async def drain() -> None:
        drained.append(len(f.calls))

    first = await apply_geometry(f, 0, ["4g", "2g", "1g"], drain)
    assert [(s.profile, s.start) for s in first] == [("4g.40gb", 0), ("2g.20gb", 4),
                                                     ("1g.10gb", 6)]
    assert all(s.uuid.startswith("MIG-") for s in first) and len({s.uuid for s in first}) == 3
    f.calls.clear()
    second = await apply_geometry(f, 0, ["4g", "3g"], drain)
    assert drained == [0, 0]  # drained before any NVML change, both times
    # everything old destroyed (CIs before their GIs) before anything new is created
    kinds = [c.split(":")[0] for c in f.calls]
    assert kinds.index("create_gi") > max(i for i, k in enumerate(kinds) if k.startswith("destroy"))
    assert kinds.count("destroy_ci") == 3 and kinds.count("destroy_gi") == 3
    (gpu,) = read_inventory(f)
    assert [(g.profile_name, g.start) for g in gpu.gpu_instances] == [("MIG 4g.40gb", 0),
                                                                    ("MIG 3g.40gb", 4)]
    assert {c.mig_uuid for g in gpu.gpu_instances for c in g.compute_instances} == \
        {s.uuid for s in second}
    assert second[1].worker_env() == {"CUDA_VISIBLE_DEVICES": second[1].uuid}
    assert mig_worker_env("abc") == {"CUDA_VISIBLE_DEVICES": "MIG-abc"}


async def test_apply_refuses_mig_off_and_invalid_before_touching():
    f = FakeNvml.with_gpus("A100-40GB", mig=False)
    f.nvmlInit()
    with pytest.raises(MigUnavailable):
        await apply_geometry(f, 0, ["4g", "3g"], _noop)
    g = FakeNvml.with_gpus("A100-40GB")
    g.nvmlInit()
    called = []

    async def drain() -> None:
        called.append(1)

    with pytest.raises(InvalidGeometry):
        await apply_geometry(g, 0, ["4g", "4g"], drain)
    assert called == [] and g.calls == []


async def test_apply_busy_slice_is_mig_failed_and_drain_timeout():
    f = FakeNvml.with_gpus("A100-80GB")
    f.nvmlInit()
    (s,) = await apply_geometry(f, 0, ["7g"], _noop)
    f.set_busy(s.uuid)  # the drain "forgot" a process
    with pytest.raises(MigFailed) as e:
        await apply_geometry(f, 0, ["4g", "3g"], _noop)
    assert e.value.details["nvml_error"] == 19  # NVML_ERROR_IN_USE

    async def stuck() -> None:
        await asyncio.sleep(10)

    with pytest.raises(DeadlineExceeded):
        await apply_geometry(f, 0, ["4g", "3g"], stuck, drain_timeout_s=0.05)


async def test_apply_without_privileges_is_mig_failed():
    f = FakeNvml.with_gpus("H200-141GB", privileged=False)
    f.nvmlInit()
    with pytest.raises(MigFailed) as e:
        await apply_geometry(f, 0, ["4g", "3g"], _noop)
    assert e.value.details["nvml_error"] == 4  # NVML_ERROR_NO_PERMISSION
