"""First-cut placement: choose devices for new replicas.

Order (documented so operators can predict it): live, non-draining hosts only; hosts that
already hold the model in RAM first (no download); then hosts running fewer replicas
(spreads load and uses every host's warm worker pool); then the device with the most free
memory; ties broken by fewer replicas on the device, then by id for determinism. Memory is reserved as
devices are chosen, so one decision never over-commits a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.policy.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class PlacementRequest:
    function: str
    model_key: str  # "name@version"
    count: int
    device_bytes: int  # memory one replica needs on its device
    host_bytes: int  # host RAM a cold start needs (cache copy) when the model is not cached


@dataclass(frozen=True)
class Placement:
    host_id: str
    device_id: str


def place(snapshot: ClusterSnapshot, req: PlacementRequest) -> list[Placement]:
    """Up to ``req.count`` placements; fewer when the cluster has no room."""
    free: dict[tuple[str, str], int] = {}
    replicas: dict[tuple[str, str], int] = {}
    ram: dict[str, int] = {}
    host_replicas: dict[str, int] = {}
    cached: dict[str, bool] = {}
    for host in snapshot.hosts:
        if not host.alive or host.draining:
            continue
        ram[host.host_id] = host.ram_free_bytes
        cached[host.host_id] = req.model_key in host.cached_models
        host_replicas[host.host_id] = sum(d.replicas for d in host.devices)
        for dev in host.devices:
            free[(host.host_id, dev.device_id)] = dev.memory_free_bytes
            replicas[(host.host_id, dev.device_id)] = dev.replicas
    out: list[Placement] = []
    for _ in range(req.count):
        best: tuple[str, str] | None = None
        best_key: tuple[int, int, int, int, tuple[str, str]] | None = None
        for key, mem in free.items():
            host_id = key[0]
            if mem < req.device_bytes:
                continue
            if not cached[host_id] and ram[host_id] < req.host_bytes:
                continue
            rank = (0 if cached[host_id] else 1, host_replicas[host_id], -mem, replicas[key], key)
            if best_key is None or rank < best_key:
                best, best_key = key, rank
        if best is None:
            break
        out.append(Placement(best[0], best[1]))
        free[best] -= req.device_bytes
        replicas[best] += 1
        host_replicas[best[0]] += 1
        if not cached[best[0]]:
            ram[best[0]] -= req.host_bytes
            cached[best[0]] = True  # the next replica on this host shares the download
    return out
