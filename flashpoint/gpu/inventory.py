"""Device inventory: NVML when GPUs exist, configured CPU devices otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashpoint.log import get_logger

if TYPE_CHECKING:
    from flashpoint.gpu.nvml import Nvml

log = get_logger(__name__)


@dataclass(frozen=True)
class Device:
    device_id: str  # "cuda:0" or "cpu:0"
    kind: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    uuid: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"device_id": self.device_id, "kind": self.kind, "name": self.name,
                "memory_bytes": self.memory_bytes, "uuid": self.uuid}


def nvml_devices(nvml: Nvml | None = None) -> list[Device]:
    """GPUs seen through NVML; empty when the library or a driver is absent.

    ``nvml`` is the adapter (the pynvml module, or a FakeNvml in tests); by default the real
    library is loaded. Either way the same code reads it.
    """
    try:
        from flashpoint.gpu.nvml import load_nvml, read_inventory
    except ImportError:  # nvidia-ml-py missing: no GPUs to see
        return []
    nvml = load_nvml(nvml)
    if nvml is None:
        log.info("nvml_unavailable")
        return []
    try:
        return [Device(f"cuda:{g.index}", "cuda", g.name, g.memory_total_bytes, g.uuid)
                for g in read_inventory(nvml)]
    finally:
        nvml.nvmlShutdown()


def discover(cpu_devices: int, cpu_memory_bytes: int, nvml: Nvml | None = None) -> list[Device]:
    """GPUs if any are present, else ``cpu_devices`` CPU placement units."""
    gpus = nvml_devices(nvml)
    if gpus:
        return gpus
    return [Device(f"cpu:{i}", "cpu", "cpu", cpu_memory_bytes) for i in range(cpu_devices)]
