"""The NVML adapter and a read-only GPU inventory built on it.

``Nvml`` is the subset of the ``pynvml`` (nvidia-ml-py) module Flashpoint calls, with
pynvml's own names and signatures. Two things satisfy it: the real ``pynvml`` module itself
(:func:`load_nvml`) and :class:`flashpoint.gpu.fake_nvml.FakeNvml`, which keeps MIG's rules
and raises the same ``pynvml.NVMLError`` subclasses. Inventory and MIG code take an ``Nvml``
argument and never know which one they got, so tests exercise the production code path.

The calls that fill ctypes arrays (instances, placements) are wrapped in small helpers here
so the array/count dance lives in one place.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import pynvml

from flashpoint.gpu.mig_profiles import CI_PROFILE_BY_SLICES


class Nvml(Protocol):
    """The pynvml functions Flashpoint uses (same names and arguments as pynvml)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]: ...
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int,
                                            version: int = 2) -> Any: ...
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: Any, profile_id: int,
                                                   placements: Any, count: Any) -> int: ...
    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances: Any,
                                  count: Any) -> int: ...
    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any: ...
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int,
                                                 placement: Any) -> Any: ...
    def nvmlGpuInstanceDestroy(self, gi: Any) -> int: ...
    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, profile: int,
                                                     eng_profile: int, version: int = 2) -> Any: ...
    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, profile_id: int) -> Any: ...
    def nvmlGpuInstanceGetComputeInstances(self, gi: Any, profile_id: int, instances: Any,
                                           count: Any) -> int: ...
    def nvmlComputeInstanceDestroy(self, ci: Any) -> int: ...
    def nvmlComputeInstanceGetInfo(self, ci: Any) -> Any: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int: ...


def load_nvml(nvml: Nvml | None = None) -> Nvml | None:
    """``nvml`` (default: the real pynvml module) initialised; ``None`` when NVML refuses
    (no driver, no library).

    The caller owns the init and calls ``nvmlShutdown()`` when done.
    """
    lib: Nvml = nvml if nvml is not None else pynvml  # type: ignore[assignment]
    try:
        lib.nvmlInit()
    except pynvml.NVMLError:
        return None
    return lib


def text(value: str | bytes) -> str:
    """pynvml returns bytes on old versions and str on new ones."""
    return value.decode() if isinstance(value, bytes) else value


def _error_code(exc: pynvml.NVMLError) -> int:
    return int(getattr(exc, "value", pynvml.NVML_ERROR_UNKNOWN))


# GI profiles Flashpoint enumerates (NVML_GPU_INSTANCE_PROFILE_*: 1, 1+me, 1x2, 2, 3, 4, 7).
GI_PROFILES = (0x0, 0x7, 0x9, 0x1, 0x2, 0x3, 0x4)


def possible_placements(nvml: Nvml, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """(start, size) placements NVML allows for a GI profile id, in memory slices."""
    count = ctypes.c_uint(0)
    # A NULL array asks for the count first; instanceCount would be too small for +me.
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, arr, ctypes.byref(count))
    return [(arr[i].start, arr[i].size) for i in range(count.value)]


def gpu_instances(nvml: Nvml, handle: Any, profile_id: int, capacity: int) -> list[Any]:
    """GI handles of one profile id (``capacity`` = the profile's instanceCount)."""
    count = ctypes.c_uint(0)
    arr = (pynvml.c_nvmlGpuInstance_t * max(capacity, 1))()
    nvml.nvmlDeviceGetGpuInstances(handle, profile_id, arr, ctypes.byref(count))
    return [arr[i] for i in range(count.value)]


def compute_instances(nvml: Nvml, gi: Any, profile_id: int, capacity: int) -> list[Any]:
    """CI handles of one CI profile id inside a GI."""
    count = ctypes.c_uint(0)
    arr = (pynvml.c_nvmlComputeInstance_t * max(capacity, 1))()
    nvml.nvmlGpuInstanceGetComputeInstances(gi, profile_id, arr, ctypes.byref(count))
    return [arr[i] for i in range(count.value)]


@dataclass(frozen=True)
class ComputeInstanceInfo:
    ci_id: int
    profile_id: int
    start: int  # in compute slices of its GI
    size: int
    mig_uuid: str = ""  # "MIG-..." once matched to its MIG device


@dataclass(frozen=True)
class GpuInstanceInfo:
    gi_id: int
    profile_name: str  # from NVML ("MIG 3g.20gb") or "" on old drivers
    profile_id: int
    start: int  # memory slices
    size: int
    memory_mb: int
    compute_instances: tuple[ComputeInstanceInfo, ...]


@dataclass(frozen=True)
class MigDeviceInfo:
    """A MIG device (GI + CI) as CUDA sees it; readable without privileges."""

    gi_id: int
    ci_id: int
    uuid: str  # "MIG-..."
    name: str
    memory_total_bytes: int


@dataclass(frozen=True)
class GiProfileInfo:
    profile_id: int
    name: str
    slice_count: int
    instance_count: int
    memory_mb: int
    multiprocessor_count: int
    placements: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML reports it."""

    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    mig_current: bool | None  # None: the GPU has no MIG
    mig_pending: bool | None
    utilization_gpu_pct: int | None  # None where NVML does not report it (MIG on)
    profiles: tuple[GiProfileInfo, ...] = ()
    gpu_instances: tuple[GpuInstanceInfo, ...] = ()  # empty without privileges: see notes
    mig_devices: tuple[MigDeviceInfo, ...] = ()
    notes: tuple[str, ...] = field(default=())  # calls that failed, and why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _profile_name(info: Any) -> str:
    return text(getattr(info, "name", b"") or b"")


def read_gpu(nvml: Nvml, index: int) -> GpuInfo:
    """Everything Flashpoint wants to know about GPU ``index``; read only.

    MIG queries that the GPU or driver does not support become ``notes``, not failures: an
    inventory of an old or non-MIG GPU is still an inventory.
    """
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    notes: list[str] = []
    try:
        util: int | None = int(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
    except pynvml.NVMLError as exc:
        util = None
        notes.append(f"utilization: {exc} ({_error_code(exc)})")
    try:
        cur, pend = nvml.nvmlDeviceGetMigMode(h)
        mig_cur: bool | None = cur == pynvml.NVML_DEVICE_MIG_ENABLE
        mig_pend: bool | None = pend == pynvml.NVML_DEVICE_MIG_ENABLE
    except pynvml.NVMLError as exc:
        mig_cur = mig_pend = None
        notes.append(f"mig mode: {exc} ({_error_code(exc)})")
    profiles: list[GiProfileInfo] = []
    instances: list[GpuInstanceInfo] = []
    mig_devices: list[MigDeviceInfo] = []
    if mig_cur:
        try:
            mig_devices = read_mig_devices(nvml, h)
        except pynvml.NVMLError as exc:
            notes.append(f"mig devices: {exc} ({_error_code(exc)})")
        try:  # GI/CI enumeration and placements need a privileged user (NVML reference)
            uuids = {(d.gi_id, d.ci_id): d.uuid for d in mig_devices}
            profiles, instances = _read_mig(nvml, h, notes, uuids)
        except pynvml.NVMLError as exc:  # e.g. NO_PERMISSION: report, keep the rest
            notes.append(f"mig instances: {exc} ({_error_code(exc)})")
    return GpuInfo(index, text(nvml.nvmlDeviceGetName(h)), text(nvml.nvmlDeviceGetUUID(h)),
                   int(mem.total), int(mem.used), mig_cur, mig_pend, util, tuple(profiles),
                   tuple(sorted(instances, key=lambda g: g.start)), tuple(mig_devices),
                   tuple(notes))


def _read_mig(nvml: Nvml, h: Any, notes: list[str], uuids: dict[tuple[int, int], str]
              ) -> tuple[list[GiProfileInfo], list[GpuInstanceInfo]]:
    profiles: list[GiProfileInfo] = []
    instances: list[GpuInstanceInfo] = []
    for gp in GI_PROFILES:
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, gp)
        except pynvml.NVMLError:
            continue  # this GPU lacks the profile (NOT_SUPPORTED / INVALID_ARGUMENT)
        try:
            placements = tuple(possible_placements(nvml, h, info.id))
        except pynvml.NVMLError as exc:
            placements = ()
            notes.append(f"placements of profile {info.id}: {exc}")
        profiles.append(GiProfileInfo(info.id, _profile_name(info), info.sliceCount,
                                      info.instanceCount, int(info.memorySizeMB),
                                      info.multiprocessorCount, placements))
        for gi in gpu_instances(nvml, h, info.id, info.instanceCount):
            instances.append(_read_gi(nvml, gi, info, uuids))
    return profiles, instances


def _read_gi(nvml: Nvml, gi: Any, profile: Any, uuids: dict[tuple[int, int], str]
             ) -> GpuInstanceInfo:
    gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
    cis: list[ComputeInstanceInfo] = []
    for slices, cp in sorted(CI_PROFILE_BY_SLICES.items()):
        if slices > profile.sliceCount:
            break
        try:
            ci_prof = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, cp, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except pynvml.NVMLError:
            continue
        for ci in compute_instances(nvml, gi, ci_prof.id, ci_prof.instanceCount):
            ci_info = nvml.nvmlComputeInstanceGetInfo(ci)
            cis.append(ComputeInstanceInfo(ci_info.id, ci_info.profileId, ci_info.placement.start,
                                           ci_info.placement.size,
                                           uuids.get((gi_info.id, ci_info.id), "")))
    return GpuInstanceInfo(gi_info.id, _profile_name(profile), gi_info.profileId,
                           gi_info.placement.start, gi_info.placement.size,
                           int(profile.memorySizeMB), tuple(sorted(cis, key=lambda c: c.ci_id)))


def read_mig_devices(nvml: Nvml, handle: Any) -> list[MigDeviceInfo]:
    """Every MIG device of a GPU, in NVML's index order.

    A MIG device is a (GI, CI) pair as CUDA sees it; its UUID is what a worker binds to.
    Indexes without a device answer NOT_FOUND and are skipped.
    """
    out: list[MigDeviceInfo] = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        out.append(MigDeviceInfo(nvml.nvmlDeviceGetGpuInstanceId(mh),
                                 nvml.nvmlDeviceGetComputeInstanceId(mh),
                                 text(nvml.nvmlDeviceGetUUID(mh)),
                                 text(nvml.nvmlDeviceGetName(mh)),
                                 int(nvml.nvmlDeviceGetMemoryInfo(mh).total)))
    return out


def mig_device_uuids(nvml: Nvml, handle: Any) -> dict[tuple[int, int], str]:
    """``(gi_id, ci_id) -> "MIG-<uuid>"`` for every MIG device of a GPU."""
    return {(d.gi_id, d.ci_id): d.uuid for d in read_mig_devices(nvml, handle)}


def read_inventory(nvml: Nvml) -> tuple[GpuInfo, ...]:
    """Every GPU NVML sees (the caller has called ``nvmlInit``)."""
    return tuple(read_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
