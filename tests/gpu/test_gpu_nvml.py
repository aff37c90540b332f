"""The fake NVML keeps MIG's rules with pynvml's error codes; the inventory reads it."""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from flashpoint.gpu import mig_profiles
from flashpoint.gpu.fake_nvml import FakeGpu, FakeNvml
from flashpoint.gpu.inventory import discover, nvml_devices
from flashpoint.gpu.nvml import gpu_instances, load_nvml, possible_placements, read_inventory, text

SHARED = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED


@pytest.fixture
def nvml() -> FakeNvml:
    f = FakeNvml.with_gpus("A100-40GB")
    f.nvmlInit()
    return f


def _create(nvml, h, gi_profile, start, size=None):
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, gi_profile)
    pl = pynvml.c_nvmlGpuInstancePlacement_t(start, size if size is not None else 0)
    if size is None:
        pl.size = {19: 1, 20: 1, 15: 2, 14: 2, 9: 4, 5: 4, 0: 8}[info.id]
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, info.id, ctypes.byref(pl))


def test_enum_values_match_pynvml():
    assert mig_profiles.GI_PROFILE_1_SLICE == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    assert mig_profiles.GI_PROFILE_7_SLICE == pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE
    assert mig_profiles.GI_PROFILE_1_SLICE_REV1 == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    assert mig_profiles.GI_PROFILE_1_SLICE_REV2 == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2
    assert mig_profiles.CI_PROFILE_BY_SLICES[7] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE
    assert mig_profiles.CI_PROFILE_BY_SLICES[3] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE


def test_calls_before_init_are_uninitialized():
    f = FakeNvml.with_gpus("A100-40GB")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        FakeNvml(driver_loaded=False).nvmlInit()


def test_overlap_and_bad_placement_use_nvml_codes(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 0)
    # a 3g at 0 overlaps the 4g's memory slices 0-3
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 0)
    # 3g may only start at 0 or 4
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 2)
    # right start, wrong size
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 4, size=2)
    gi = _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # the GPU is full
        _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 6)
    # an unknown profile id
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            h, 77, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 1)))
    # the errors are the very classes pynvml raises, so callers catch them the same way
    assert issubclass(pynvml.NVMLError_InsufficientResources, pynvml.NVMLError)
    assert nvml.nvmlGpuInstanceGetInfo(gi).placement.start == 4


def test_destroying_a_gi_with_a_ci_is_in_use(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = _create(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 2)
    ci_prof = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, SHARED)
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # the 2g GI is full
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a 3-slice CI in a 2g GI
        nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, SHARED)
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    assert uuid.startswith("MIG-")
    nvml.set_busy(uuid)
    with pytest.raises(pynvml.NVMLError_InUse):  # a process still runs there
        nvml.nvmlComputeInstanceDestroy(ci)
    nvml.set_busy(uuid, False)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a stale handle
        nvml.nvmlGpuInstanceGetInfo(gi)


def test_mig_off_is_not_supported():
    f = FakeNvml.with_gpus("H100-80GB", mig=False)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    assert f.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceCreateGpuInstanceWithPlacement(
            h, 19, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 1)))
    assert f.nvmlDeviceGetUtilizationRates(h).gpu == 0  # reported while MIG is off


@pytest.mark.parametrize("model,starts_3g,name_1g", [
    ("A100-40GB", [(0, 4), (4, 4)], "1g.5gb"), ("A100-80GB", [(0, 4), (4, 4)], "1g.10gb"),
    ("H100-80GB", [(0, 4), (4, 4)], "1g.10gb"), ("H200-141GB", [(0, 4), (4, 4)], "1g.18gb")])
def test_placements_per_model(model, starts_3g, name_1g):
    f = FakeNvml.with_gpus(model)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    assert possible_placements(f, h, 9) == starts_3g
    assert possible_placements(f, h, 19) == [(i, 1) for i in range(7)]  # never slot 7
    assert possible_placements(f, h, 15) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert possible_placements(f, h, 0) == [(0, 8)]
    info = f.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert text(info.name) == f"MIG {name_1g}" and info.instanceCount == 7
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        f.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, arr, ctypes.byref(ctypes.c_uint(1)))


def test_inventory_reads_instances_and_uuids():
    f = FakeNvml([FakeGpu("A100-40GB"), FakeGpu("H100-80GB", mig_current=False,
                                                   mig_pending=True, utilization_gpu_pct=42)])
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    gi = _create(f, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 4)
    ci_prof = f.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, SHARED)
    f.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)
    a100, h100 = read_inventory(f)
    assert a100.mig_current is True and a100.utilization_gpu_pct is None
    assert any("utilization" in n for n in a100.notes)
    (g,) = a100.gpu_instances
    assert (g.profile_name, g.start, g.size) == ("MIG 3g.20gb", 4, 4)
    (c,) = g.compute_instances
    assert c.mig_uuid.startswith("MIG-") and c.size == 3
    assert {p.profile_id for p in a100.profiles} == {19, 20, 15, 14, 9, 5, 0}
    assert (h100.mig_current, h100.mig_pending, h100.utilization_gpu_pct) == (False, True, 42)
    assert h100.gpu_instances == () and h100.profiles == ()
    assert a100.to_dict()["gpu_instances"][0]["compute_instances"][0]["mig_uuid"] == c.mig_uuid
    assert len(gpu_instances(f, h, 9, 2)) == 1


def test_discover_keeps_working():
    f = FakeNvml.with_gpus("H200-141GB", mig=False)
    (d,) = discover(2, 1 << 30, f)
    assert d.device_id == "cuda:0" and d.name == "NVIDIA H200" and d.uuid.startswith("GPU-")
    assert f._inits == 0  # nvml_devices shut NVML down again
    cpus = discover(2, 1 << 30, FakeNvml(driver_loaded=False))
    assert [c.device_id for c in cpus] == ["cpu:0", "cpu:1"]
    assert nvml_devices(FakeNvml([])) == []
    assert load_nvml(FakeNvml(driver_loaded=False)) is None


def test_real_pynvml_without_driver_is_cpu():
    """Here (no GPU) the real library refuses to init, and discover() falls back to CPU."""
    if load_nvml() is not None:
        pynvml.nvmlShutdown()
        pytest.skip("a real NVML driver is present")
    assert discover(1, 1)[0].kind == "cpu"


@pytest.mark.gpu
def test_real_inventory_read_only():
    """On a GPU machine: the real pynvml through the same code (reads only)."""
    nvml = load_nvml()
    if nvml is None:
        pytest.skip("no NVML driver here")
    try:
        gpus = read_inventory(nvml)
    finally:
        nvml.nvmlShutdown()
    assert gpus and all(g.memory_total_bytes > 0 and g.uuid.startswith("GPU-") for g in gpus)
    for g in gpus:
        for gi in g.gpu_instances:
            assert all(c.mig_uuid.startswith("MIG-") for c in gi.compute_instances)


def test_unprivileged_inventory_still_lists_mig_devices():
    f = FakeNvml.with_gpus("H100-80GB")
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    gi = _create(f, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 0)
    f.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    f.privileged = False
    with pytest.raises(pynvml.NVMLError_NoPermission):
        _create(f, h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 6)
    (gpu,) = read_inventory(f)
    assert gpu.gpu_instances == ()
    assert any("Insufficient Permissions" in n for n in gpu.notes)
    (dev,) = gpu.mig_devices
    assert dev.uuid.startswith("MIG-") and dev.name.endswith("MIG 3g.40gb")
    assert dev.memory_total_bytes == 40 * 2**30
