"""A fake NVML that keeps MIG's rules, for tests and for hosts without GPUs.

:class:`FakeNvml` has the same function names, arguments and return types as the ``pynvml``
module for the calls in :class:`flashpoint.gpu.nvml.Nvml`. Handles are ctypes pointers with
made-up addresses (never dereferenced), results are pynvml's own ctypes structures, array
calls fill caller-provided ctypes arrays, and refusals raise ``pynvml.NVMLError`` with the
code the real library returns (NVML API reference, "Multi Instance GPU Management"):

- MIG calls on a GPU whose current MIG mode is off: ``NVML_ERROR_NOT_SUPPORTED``;
- a placement that is not one of the profile's allowed starts/sizes, an unknown profile id, a
  stale handle: ``NVML_ERROR_INVALID_ARGUMENT``;
- a placement overlapping an existing GI, or one instance too many: ``NVML_ERROR_INSUFFICIENT_RESOURCES``;
- destroying a GI that still has compute instances, or a CI a process uses: ``NVML_ERROR_IN_USE``;
- an unknown GI id or an empty MIG device index: ``NVML_ERROR_NOT_FOUND``;
- any call before ``nvmlInit``: ``NVML_ERROR_UNINITIALIZED``;
- utilisation on a MIG-enabled GPU or a MIG device: ``NVML_ERROR_NOT_SUPPORTED``;
- with ``privileged=False``, the calls NVML documents as "Requires privileged user"
  (placements, creating and destroying instances) and, conservatively, listing GPU and
  compute instances: ``NVML_ERROR_NO_PERMISSION``. MIG device handles and UUIDs stay readable.

The profile tables are the ones in :mod:`flashpoint.gpu.mig_profiles`. The fake is not thread
safe; callers use it from one thread at a time (as :mod:`flashpoint.gpu.mig` does).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from flashpoint.gpu.mig_profiles import (
    CI_PROFILE_BY_SLICES,
    COMPUTE_SLICES,
    SPECS,
    GpuModelSpec,
    MigProfile,
)

# Names and total memory as nvidia-smi reports them for the SXM parts.
_NAMES = {"A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960),
          "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
          "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559),
          "H200-141GB": ("NVIDIA H200", 143771)}
_MAX_MIG_DEVICES = 7
_MIB = 2**20


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass


def _uuid(prefix: str, seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _deref(ref: Any) -> Any:
    """The object behind ``ctypes.byref(x)`` (or ``x`` itself)."""
    return getattr(ref, "_obj", ref)


@dataclass
class _Ci:
    ci_id: int
    profile_id: int
    start: int
    size: int
    uuid: str
    addr: int
    mig_addr: int
    busy: bool = False  # a process runs on it


@dataclass
class _Gi:
    gi_id: int
    profile: MigProfile
    start: int
    addr: int
    cis: dict[int, _Ci] = field(default_factory=dict)


@dataclass
class FakeGpu:
    """One fake GPU: its model table and MIG mode (current, pending)."""

    model: str = "A100-40GB"
    mig_current: bool = True
    mig_pending: bool | None = None  # None: same as current
    utilization_gpu_pct: int = 0
    memory_used_bytes: int = 0
    index: int = 0
    addr: int = 0
    gis: dict[int, _Gi] = field(default_factory=dict)

    @property
    def spec(self) -> GpuModelSpec:
        return SPECS[self.model]


class FakeNvml:
    """An in-memory NVML with the given GPUs (see the module docstring for its rules)."""

    def __init__(self, gpus: Sequence[FakeGpu] = (), *, driver_loaded: bool = True,
                 privileged: bool = True) -> None:
        self.gpus = list(gpus)
        self.driver_loaded = driver_loaded
        self.privileged = privileged
        self._inits = 0
        self._next_addr = 0x1000
        self._objs: dict[int, Any] = {}
        self._serial = 0
        self.calls: list[str] = []  # names of mutating calls, in order (tests check the order)
        for i, g in enumerate(self.gpus):
            g.index = i
            g.addr = self._register(g)

    @classmethod
    def with_gpus(cls, *models: str, mig: bool = True, privileged: bool = True) -> FakeNvml:
        """GPUs of the given models (``"H100-80GB"``), all with MIG on or all off."""
        return cls([FakeGpu(m, mig_current=mig) for m in models], privileged=privileged)

    # -- test helpers (not part of pynvml) --------------------------------------------------

    def set_busy(self, mig_uuid: str, busy: bool = True) -> None:
        """Pretend a process runs on a MIG device, so destroying it answers IN_USE."""
        for g in self.gpus:
            for gi in g.gis.values():
                for ci in gi.cis.values():
                    if ci.uuid == mig_uuid:
                        ci.busy = busy
                        return
        raise KeyError(mig_uuid)

    # -- plumbing -----------------------------------------------------------------------------

    def _register(self, obj: Any) -> int:
        addr = self._next_addr
        self._next_addr += 0x10
        self._objs[addr] = obj
        return addr

    def _check(self) -> None:
        if self._inits <= 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _get(self, handle: Any, kind: type) -> Any:
        self._check()
        try:
            addr = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        obj = self._objs.get(addr or 0)
        if not isinstance(obj, kind):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return obj

    def _gpu(self, handle: Any) -> FakeGpu:
        return self._get(handle, FakeGpu)

    def _mig_gpu(self, handle: Any) -> FakeGpu:
        g = self._gpu(handle)
        if not g.mig_current:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g

    def _privileged(self) -> None:
        if not self.privileged:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)

    @staticmethod
    def _ptr(addr: int, ctype: Any) -> Any:
        return ctypes.cast(ctypes.c_void_p(addr), ctype)

    def _profile_by_id(self, g: FakeGpu, profile_id: int) -> MigProfile:
        for p in g.spec.profiles:
            if p.profile_id == profile_id:
                return p
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _owner(self, ci: _Ci) -> tuple[FakeGpu, _Gi]:
        for g in self.gpus:
            for gi in g.gis.values():
                if gi.cis.get(ci.ci_id) is ci:
                    return g, gi
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gi_owner(self, gi: _Gi) -> FakeGpu:
        for g in self.gpus:
            if g.gis.get(gi.gi_id) is gi:
                return g
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    # -- init ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise _err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._inits += 1  # NVML counts inits; each needs a shutdown

    def nvmlShutdown(self) -> None:
        self._check()
        self._inits -= 1

    # -- devices ------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._ptr(self.gpus[index].addr, pynvml.c_nvmlDevice_t)

    def _mig_device(self, handle: Any) -> tuple[FakeGpu, _Gi, _Ci] | None:
        self._check()
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        for g in self.gpus:
            for gi in g.gis.values():
                for ci in gi.cis.values():
                    if ci.mig_addr == addr:
                        return g, gi, ci
        return None

    def nvmlDeviceGetName(self, handle: Any) -> str:
        mig = self._mig_device(handle)
        if mig:
            return f"{_NAMES[mig[0].model][0]} MIG {mig[1].profile.name}"
        return _NAMES[self._gpu(handle).model][0]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._mig_device(handle)
        if mig:
            return mig[2].uuid
        g = self._gpu(handle)
        return _uuid("GPU", f"gpu{g.index}{g.model}")

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        mig = self._mig_device(handle)
        if mig:
            total = mig[1].profile.memory_gb * 1024 * _MIB
            return pynvml.c_nvmlMemory_t(total, total, 0)
        g = self._gpu(handle)
        total = _NAMES[g.model][1] * _MIB
        return pynvml.c_nvmlMemory_t(total, total - g.memory_used_bytes, g.memory_used_bytes)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        if self._mig_device(handle):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        g = self._gpu(handle)
        if g.mig_current:  # NVML reports no utilisation while MIG is on
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(g.utilization_gpu_pct, 0)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        g = self._gpu(handle)
        pend = g.mig_current if g.mig_pending is None else g.mig_pending
        return [int(g.mig_current), int(pend)]

    # -- GPU instances ------------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int,
                                            version: int = 2) -> Any:
        g = self._mig_gpu(handle)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for p in g.spec.profiles:
            if p.gi_profile == profile:
                info = (pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2
                        else pynvml.c_nvmlGpuInstanceProfileInfo_t())
                info.id, info.isP2pSupported = p.profile_id, 0
                info.sliceCount, info.instanceCount = p.compute_slices, p.max_count
                info.multiprocessorCount, info.copyEngineCount = p.sm_count, p.compute_slices
                info.memorySizeMB = p.memory_gb * 1024
                if version == 2:
                    info.name = f"MIG {p.name}".encode()
                return info
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a profile this GPU does not have

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: Any, profile_id: int,
                                                   placements: Any, count: Any) -> int:
        # NVML returns every possible placement "regardless of whether MIG is enabled".
        p = self._profile_by_id(self._gpu(handle), profile_id)
        self._privileged()
        counter = _deref(count)
        if placements is None:
            counter.value = len(p.starts)
            return pynvml.NVML_SUCCESS
        if len(placements) < len(p.starts):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, s in enumerate(p.starts):
            placements[i].start, placements[i].size = s, p.memory_slices
        counter.value = len(p.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances: Any,
                                  count: Any) -> int:
        g = self._mig_gpu(handle)
        self._privileged()
        p = self._profile_by_id(g, profile_id)
        found = sorted((gi for gi in g.gis.values() if gi.profile == p), key=lambda x: x.gi_id)
        if len(instances) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(found):
            instances[i] = self._ptr(gi.addr, pynvml.c_nvmlGpuInstance_t)
        _deref(count).value = len(found)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        g = self._mig_gpu(handle)
        if gi_id not in g.gis:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return self._ptr(g.gis[gi_id].addr, pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int,
                                                 placement: Any) -> Any:
        g = self._mig_gpu(handle)
        self._privileged()
        p = self._profile_by_id(g, profile_id)
        pl = _deref(placement)
        if pl is None or pl.start not in p.starts or pl.size != p.memory_slices:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if sum(gi.profile == p for gi in g.gis.values()) >= p.max_count:
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        want = set(range(pl.start, pl.start + pl.size))
        for gi in g.gis.values():
            if want & set(range(gi.start, gi.start + gi.profile.memory_slices)):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if sum(gi.profile.compute_slices for gi in g.gis.values()) + p.compute_slices \
                > COMPUTE_SLICES:
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = min(set(range(1, 15)) - set(g.gis))
        gi = _Gi(gi_id, p, pl.start, 0)
        gi.addr = self._register(gi)
        g.gis[gi_id] = gi
        self.calls.append(f"create_gi:{g.index}:{p.name}@{pl.start}")
        return self._ptr(gi.addr, pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceDestroy(self, gi_handle: Any) -> int:
        gi = self._get(gi_handle, _Gi)
        self._privileged()
        g = self._gi_owner(gi)
        if gi.cis:
            raise _err(pynvml.NVML_ERROR_IN_USE)
        del g.gis[gi.gi_id]
        del self._objs[gi.addr]
        self.calls.append(f"destroy_gi:{g.index}:{gi.gi_id}")
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetInfo(self, gi_handle: Any) -> Any:
        gi = self._get(gi_handle, _Gi)
        g = self._gi_owner(gi)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._ptr(g.addr, pynvml.c_nvmlDevice_t)
        info.id, info.profileId = gi.gi_id, gi.profile.profile_id
        info.placement.start, info.placement.size = gi.start, gi.profile.memory_slices
        return info

    # -- compute instances --------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi_handle: Any, profile: int,
                                                     eng_profile: int, version: int = 2) -> Any:
        gi = self._get(gi_handle, _Gi)
        if eng_profile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or \
                not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = {v: k for k, v in CI_PROFILE_BY_SLICES.items()}.get(profile)
        if slices is None or slices > gi.profile.compute_slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (pynvml.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2
                else pynvml.c_nvmlComputeInstanceProfileInfo_t())
        info.id, info.sliceCount = profile, slices
        info.instanceCount = gi.profile.compute_slices // slices
        info.multiprocessorCount = (gi.profile.sm_count if slices == gi.profile.compute_slices
                                    else gi.profile.sm_count // gi.profile.compute_slices * slices)
        if version == 2:
            info.name = f"MIG {slices}c.{gi.profile.name}".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi_handle: Any, profile_id: int) -> Any:
        gi = self._get(gi_handle, _Gi)
        self._privileged()
        g = self._gi_owner(gi)
        slices = {v: k for k, v in CI_PROFILE_BY_SLICES.items()}.get(profile_id)
        if slices is None or slices > gi.profile.compute_slices:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        used = {s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.size)}
        for start in range(0, gi.profile.compute_slices - slices + 1, slices):
            if not used & set(range(start, start + slices)):
                break
        else:
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = min(set(range(0, 8)) - set(gi.cis))
        self._serial += 1
        ci = _Ci(ci_id, profile_id, start, slices,
                 _uuid("MIG", f"{g.index}/{gi.gi_id}/{ci_id}/{self._serial}"), 0, 0)
        ci.addr = self._register(ci)
        ci.mig_addr = self._register(("mig", ci))
        gi.cis[ci_id] = ci
        self.calls.append(f"create_ci:{g.index}:{gi.gi_id}:{slices}")
        return self._ptr(ci.addr, pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(self, gi_handle: Any, profile_id: int, instances: Any,
                                           count: Any) -> int:
        gi = self._get(gi_handle, _Gi)
        self._privileged()
        found = sorted((c for c in gi.cis.values() if c.profile_id == profile_id),
                       key=lambda c: c.ci_id)
        if len(instances) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            instances[i] = self._ptr(ci.addr, pynvml.c_nvmlComputeInstance_t)
        _deref(count).value = len(found)
        return pynvml.NVML_SUCCESS

    def nvmlComputeInstanceDestroy(self, ci_handle: Any) -> int:
        ci = self._get(ci_handle, _Ci)
        self._privileged()
        g, gi = self._owner(ci)
        if ci.busy:
            raise _err(pynvml.NVML_ERROR_IN_USE)
        del gi.cis[ci.ci_id]
        del self._objs[ci.addr]
        del self._objs[ci.mig_addr]
        self.calls.append(f"destroy_ci:{g.index}:{gi.gi_id}:{ci.ci_id}")
        return pynvml.NVML_SUCCESS

    def nvmlComputeInstanceGetInfo(self, ci_handle: Any) -> Any:
        ci = self._get(ci_handle, _Ci)
        g, gi = self._owner(ci)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._ptr(g.addr, pynvml.c_nvmlDevice_t)
        info.gpuInstance = self._ptr(gi.addr, pynvml.c_nvmlGpuInstance_t)
        info.id, info.profileId = ci.ci_id, ci.profile_id
        info.placement.start, info.placement.size = ci.start, ci.size
        return info

    # -- MIG devices --------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._gpu(handle)
        return _MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        g = self._mig_gpu(handle)
        if not 0 <= index < _MAX_MIG_DEVICES:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = [ci for _, gi in sorted(g.gis.items()) for _, ci in sorted(gi.cis.items())]
        if index >= len(devices):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return self._ptr(devices[index].mig_addr, pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        mig = self._mig_device(handle)
        if not mig:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig[1].gi_id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        mig = self._mig_device(handle)
        if not mig:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig[2].ci_id
