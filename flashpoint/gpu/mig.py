"""Apply a MIG geometry to a GPU through the NVML adapter.

Order of work (NVIDIA's MIG user guide; PROTEAN digest §7.6): the caller's drain runs first
(no new placements, in-flight work finished, since NVML refuses to destroy instances that
processes use), then every compute instance and GPU instance goes, then the new GIs are
created at the placements :func:`flashpoint.gpu.mig_profiles.place` chose, each with one
compute instance spanning it. The result is the MIG devices' UUIDs, which workers bind to
with ``CUDA_VISIBLE_DEVICES=MIG-<uuid>`` (a CUDA process sees one MIG device only).

The NVML calls block (seconds on real hardware), so they run in a worker thread; NVML
errors are translated into :class:`~flashpoint.errors.MigFailed` at this boundary.
MIG mode itself is never changed here: enabling it needs a GPU reset, an operator's job.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from flashpoint.errors import DeadlineExceeded, MigFailed, MigUnavailable
from flashpoint.gpu.mig_profiles import (
    CI_PROFILE_BY_SLICES,
    GpuModelSpec,
    Placement,
    model_for,
    place,
)
from flashpoint.gpu.nvml import (
    GI_PROFILES,
    Nvml,
    compute_instances,
    gpu_instances,
    mig_device_uuids,
    text,
)
from flashpoint.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class MigSlice:
    """One MIG device made by :func:`apply_geometry`."""

    gpu_index: int
    profile: str  # "3g.40gb"
    start: int  # memory slices
    size: int
    gi_id: int
    ci_id: int
    uuid: str  # "MIG-..."

    def worker_env(self) -> dict[str, str]:
        """Environment that binds a worker process to this slice."""
        return mig_worker_env(self.uuid)


def mig_worker_env(uuid: str) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for one MIG device (the ``MIG-`` prefix is added if missing)."""
    return {"CUDA_VISIBLE_DEVICES": uuid if uuid.startswith("MIG-") else f"MIG-{uuid}"}


def gpu_spec(nvml: Nvml, gpu_index: int) -> GpuModelSpec:
    """The profile table of GPU ``gpu_index``, from its NVML name and memory."""
    h = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
    return model_for(text(nvml.nvmlDeviceGetName(h)), int(nvml.nvmlDeviceGetMemoryInfo(h).total))


async def apply_geometry(nvml: Nvml, gpu_index: int, geometry: Sequence[str],
                         drain: Callable[[], Awaitable[None]], *,
                         drain_timeout_s: float = 60.0) -> tuple[MigSlice, ...]:
    """Reconfigure GPU ``gpu_index`` to ``geometry`` (profile names, e.g. ``["4g", "3g"]``).

    Validates first (``InvalidGeometry`` before anything is touched), refuses a GPU whose
    current MIG mode is off (``MigUnavailable``), awaits ``drain()`` for at most
    ``drain_timeout_s`` (``DeadlineExceeded``), then destroys and creates instances.
    A failure midway raises ``MigFailed``; the GPU is then left with whatever instances
    exist, which the next call destroys before it creates anything.
    """
    spec = await asyncio.to_thread(gpu_spec, nvml, gpu_index)
    plan = place(spec, geometry)  # pure; raises InvalidGeometry
    h = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(h)
    except pynvml.NVMLError as exc:
        raise MigUnavailable(f"GPU {gpu_index} has no MIG: {exc}", gpu=gpu_index) from None
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        raise MigUnavailable(f"MIG mode is off on GPU {gpu_index}; enabling it needs "
                             "`nvidia-smi -i N -mig 1` and a GPU reset", gpu=gpu_index)
    try:
        await asyncio.wait_for(drain(), drain_timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(f"GPU {gpu_index} did not drain in {drain_timeout_s} s",
                               gpu=gpu_index) from None
    log.info("mig_reconfigure", gpu=gpu_index, geometry=list(geometry))
    return await asyncio.to_thread(_apply_sync, nvml, gpu_index, plan)


def _apply_sync(nvml: Nvml, gpu_index: int, plan: Sequence[Placement]) -> tuple[MigSlice, ...]:
    step = "destroy"
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
        destroy_all(nvml, h)
        made: list[tuple[Placement, int, int]] = []
        for p in plan:
            step = f"create {p.profile.name}@{p.start}"
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, p.profile.gi_profile)
            placement = pynvml.c_nvmlGpuInstancePlacement_t(p.start, p.size)
            # The C API takes a pointer to the placement; pynvml passes the argument through.
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, info.id, ctypes.byref(placement))
            ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, p.profile.ci_profile, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
            made.append((p, nvml.nvmlGpuInstanceGetInfo(gi).id,
                         nvml.nvmlComputeInstanceGetInfo(ci).id))
        step = "list MIG devices"
        uuids = mig_device_uuids(nvml, h)
    except pynvml.NVMLError as exc:
        raise MigFailed(f"GPU {gpu_index}: NVML refused '{step}': {exc}", gpu=gpu_index,
                        step=step, nvml_error=int(getattr(exc, "value", -1))) from None
    return tuple(MigSlice(gpu_index, p.profile.name, p.start, p.size, gi_id, ci_id,
                          uuids.get((gi_id, ci_id), "")) for p, gi_id, ci_id in made)


def destroy_all(nvml: Nvml, handle: Any) -> int:
    """Destroy every CI, then every GI, of a MIG-enabled GPU; returns how many GIs went.

    CIs first: NVML answers IN_USE to destroying a GI that still has CIs. A CI a process
    still uses answers IN_USE too, which surfaces as an NVMLError (the drain was not done).
    """
    destroyed = 0
    for gp in GI_PROFILES:
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, gp)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue  # a profile this GPU lacks
        for gi in gpu_instances(nvml, handle, info.id, info.instanceCount):
            for slices, cp in CI_PROFILE_BY_SLICES.items():
                if slices > info.sliceCount:
                    continue
                try:
                    ci_prof = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, cp, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                    continue
                for ci in compute_instances(nvml, gi, ci_prof.id, ci_prof.instanceCount):
                    nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
            destroyed += 1
    return destroyed
