"""Device inventory: NVML when GPUs exist, configured CPU devices otherwise."""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.log import get_logger

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


def nvml_devices() -> list[Device]:
    """GPUs seen through NVML; empty when the library or a driver is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("nvml_unavailable", reason=str(exc))
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(Device(f"cuda:{i}", "cuda", name if isinstance(name, str) else name.decode(),
                              int(mem.total), uuid if isinstance(uuid, str) else uuid.decode()))
        return out
    finally:
        pynvml.nvmlShutdown()


def discover(cpu_devices: int, cpu_memory_bytes: int) -> list[Device]:
    """GPUs if any are present, else ``cpu_devices`` CPU placement units."""
    gpus = nvml_devices()
    if gpus:
        return gpus
    return [Device(f"cpu:{i}", "cpu", "cpu", cpu_memory_bytes) for i in range(cpu_devices)]
