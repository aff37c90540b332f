"""What a host tells its controller about itself: the registration (again after every
reconnect, so a restarted controller adopts what runs here) and the ``host_status`` reply,
built from :class:`~flashpoint.host.state.HostState`'s records and the host's devices and cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from flashpoint.config import HostConfig
from flashpoint.gpu.inventory import Device
from flashpoint.host.state import HostState
from flashpoint.messages import controller_host as ch
from flashpoint.transfer.cache import HostCache
from flashpoint.transfer.plan import Endpoint


def replica_reports(state: HostState) -> tuple[ch.ReplicaReport, ...]:
    """The ``replicas`` 4-tuples: (replica id, function, device, warm as a whole replica)."""
    return tuple((r.replica_id, r.function, r.device_id, r.serving_whole)
                 for r in state.replicas.values())


def stage_reports(state: HostState) -> tuple[ch.StageReport, ...]:
    """Partition stages on this host (beside the ``replicas`` 4-tuples)."""
    return tuple(ch.StageReport(
        replica_id=r.replica_id, stage=r.stage, whole=r.whole, warm=r.warm,
        pipeline_endpoint=r.pipeline_endpoint) for r in state.replicas.values()
        if r.stage is not None)


def registration(state: HostState, hc: HostConfig, *, gpu: Any, devices: Sequence[Device],
                 cache: HostCache, data_endpoint: Endpoint | None) -> ch.RegisterHost:
    """``register_host``: devices, physical GPUs, cached models and the replicas it runs."""
    recs = state.replicas.values()
    return ch.RegisterHost(
        host_id=state.host_id, gpu_sharing=gpu.mode.value,
        devices=tuple(ch.DeviceReport(**d.to_dict()) for d in devices),
        gpus=tuple(gpu.gpus),  # physical GPUs: MIG table and mode (MIG reconfiguration)
        ram_bytes=hc.cache_bytes, leaf=hc.leaf, kind=hc.kind,
        cached_models=tuple(cache.keys()), replicas=replica_reports(state),
        # so a restarted controller adopts shared replicas with their shares
        shares={r.replica_id: r.share.to_wire() for r in recs if r.share is not None},
        # and with the model version each runs (a roll-out may be under way)
        models={r.replica_id: r.model_key for r in recs if r.model_key},
        stages=stage_reports(state),
        data_endpoint=tuple(data_endpoint.to_wire()) if data_endpoint else None)


def status(state: HostState, *, gpu: Any, cache: HostCache,
           worker_pids: Iterable[int]) -> ch.HostStatus:
    """``host_status``: replicas, stages, cache, warm pool and GPU sharing."""
    return ch.HostStatus(
        host_id=state.host_id, replicas=replica_reports(state), stages=stage_reports(state),
        cache=tuple(cache.keys()), cache_stats=cache.stats(), idle_workers=len(state.idle),
        gpu=gpu.status(), worker_pids=tuple(worker_pids))
