"""Device inventory: NVML when GPUs exist, configured CPU devices otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashpoint.log import get_logger

if TYPE_CHECKING:
    from flashpoint.gpu.nvml import GpuInfo, Nvml

log = get_logger(__name__)


@dataclass(frozen=True)
class Device:
    device_id: str  # "cuda:0" or "cpu:0"
    kind: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    uuid: str = ""  # "GPU-..." or, for a MIG slice, "MIG-..." (what workers bind to)
    gpu_index: int = -1  # the physical GPU's NVML index (-1: a CPU unit)
    mig_profile: str = ""  # "3g.40gb" for a MIG slice, "" for a whole GPU

    def to_dict(self) -> dict[str, object]:
        return {"device_id": self.device_id, "kind": self.kind, "name": self.name,
                "memory_bytes": self.memory_bytes, "uuid": self.uuid,
                "gpu_index": self.gpu_index, "mig_profile": self.mig_profile}


def gpu_units(gpus: Sequence[GpuInfo]) -> list[Device]:
    """Placement units of an inventory: a whole GPU, or each MIG device of a GPU with MIG on
    (bound by its ``MIG-`` UUID). A MIG-enabled GPU without instances offers no unit until a
    geometry is applied to it."""
    out: list[Device] = []
    for g in gpus:
        if not g.mig_current:
            out.append(Device(f"cuda:{g.index}", "cuda", g.name, g.memory_total_bytes, g.uuid,
                              g.index))
            continue
        for m in g.mig_devices:
            profile = m.name.split("MIG", 1)[-1].strip() if "MIG" in m.name else m.name
            out.append(Device(f"cuda:{g.index}/gi{m.gi_id}ci{m.ci_id}", "cuda", m.name,
                              m.memory_total_bytes, m.uuid, g.index, profile))
    return out


def read_gpus(nvml: Nvml | None = None) -> tuple[GpuInfo, ...] | None:
    """The GPUs NVML sees, or ``None`` when the library or a driver is absent.

    ``nvml`` is the adapter (the pynvml module, or a FakeNvml in tests); by default the real
    library is loaded. Either way the same code reads it.
    """
    try:
        from flashpoint.gpu.nvml import load_nvml, read_inventory
    except ImportError:  # nvidia-ml-py missing: no GPUs to see
        return None
    nvml = load_nvml(nvml)
    if nvml is None:
        log.info("nvml_unavailable")
        return None
    try:
        return read_inventory(nvml)
    finally:
        nvml.nvmlShutdown()


def nvml_devices(nvml: Nvml | None = None) -> list[Device]:
    """GPU placement units seen through NVML (:func:`gpu_units`); empty without NVML."""
    return gpu_units(read_gpus(nvml) or ())


def discover(cpu_devices: int, cpu_memory_bytes: int, nvml: Nvml | None = None) -> list[Device]:
    """GPU units if the host has GPUs (none at all while every GPU has MIG on and no
    instances), else ``cpu_devices`` CPU placement units."""
    return discover_with_gpus(cpu_devices, cpu_memory_bytes, nvml)[0]


def discover_with_gpus(cpu_devices: int, cpu_memory_bytes: int, nvml: Nvml | None = None
                       ) -> tuple[list[Device], list[dict[str, object]]]:
    """:func:`discover`, plus what the controller's MIG reconfigurator needs to know of
    each physical GPU: ``{"gpu_index", "model"}`` (its MIG table name, "" if none) and
    ``"mig"`` (MIG mode on) — one NVML session for both."""
    gpus = read_gpus(nvml)
    if gpus:
        return gpu_units(gpus), [gpu_summary(g) for g in gpus]
    return [Device(f"cpu:{i}", "cpu", "cpu", cpu_memory_bytes) for i in range(cpu_devices)], []


def gpu_summary(g: GpuInfo) -> dict[str, object]:
    from flashpoint.errors import InvalidGeometry
    from flashpoint.gpu.mig_profiles import model_for

    try:
        model = model_for(g.name, g.memory_total_bytes).model
    except InvalidGeometry:  # no MIG table for this GPU: never reconfigured
        model = ""
    return {"gpu_index": g.index, "model": model, "mig": bool(g.mig_current)}
