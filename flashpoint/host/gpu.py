"""The host manager's GPU side: inventory, sharing (MPS / time tokens) and MIG geometries.

Kept out of ``host/actor.py`` (which is about models and workers). The host manager owns
one :class:`HostGpu` and calls it at start and stop, when it spawns a worker, when a replica
starts and stops, and from three RPC handlers it registers: ``set_replica_share`` (a
replica's quota, live, on a tokens host) and ``apply_mig`` (a geometry for one GPU).

**MIG and draining: refuse while busy.** ``apply_mig`` refuses with
:class:`~flashpoint.errors.GpuBusy` (listing the replicas) while any replica runs on the GPU
or one of its slices, rather than stopping or moving them itself. The controller owns
replica lifecycles and dispatch: a replica stopped here would drop its in-flight requests
behind the controller's back and be re-placed, possibly onto the very GPU being changed.
The controller drains the GPU its usual way (stop accepting, stop once idle) and asks
again. While a geometry is applied the GPU is *draining* here: deploys onto its units are
refused (``Unavailable``, retryable) until the new slices are reported, by re-registering
with the controller, as placement units bound by their ``MIG-`` UUIDs.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashpoint.config import HostConfig
from flashpoint.errors import (
    BadRequest,
    Conflict,
    GpuBusy,
    MigUnavailable,
    NotFound,
    Unavailable,
)
from flashpoint.gpu.host_sharing import GpuShare, HostSharing, SharingMode, parse_mode
from flashpoint.gpu.inventory import Device, discover_with_gpus
from flashpoint.log import get_logger

log = get_logger("flashpoint.host.gpu")

MIG_DRAIN_TIMEOUT_S = 30.0


class HostGpu:
    """Devices, their sharing daemons/managers, and MIG reconfiguration for one host."""

    def __init__(self, hc: HostConfig, host_id: str, nvml: Any = None) -> None:
        self.hc = hc
        self.host_id = host_id
        if nvml is None and hc.fake_gpus:
            from flashpoint.gpu.fake_nvml import FakeNvml

            nvml = FakeNvml.with_gpus(*hc.fake_gpus, mig=hc.fake_gpu_mig)
        self.nvml = nvml  # None: the real pynvml, loaded when needed
        self.fake = bool(hc.fake_gpus)
        self.mode: SharingMode = parse_mode(hc.gpu_sharing)
        self._run_dir = Path(hc.sharing_dir) if hc.sharing_dir else None
        self.sharing: HostSharing | None = None
        self.devices: list[Device] = []
        self.gpus: list[dict[str, object]] = []  # per physical GPU: index, MIG table, MIG on
        self.draining: set[int] = set()  # GPU indices being reconfigured
        self._health_task: asyncio.Task | None = None
        self._temp_dir: Path | None = None  # a run dir this instance made (and removes)

    async def start(self) -> list[Device]:
        """Read the inventory and start sharing on its GPU units; returns the devices."""
        self.devices, self.gpus = discover_with_gpus(self.hc.cpu_devices,
                                                     self.hc.device_memory_bytes, self.nvml)
        if self._run_dir is None:  # ours: removed at stop
            self._run_dir = self._temp_dir = Path(tempfile.mkdtemp(prefix="fpsh-"))
        run_dir = self._run_dir
        self.sharing = HostSharing(self.mode, run_dir)
        await self.sharing.start(self.devices)
        if self.mode is SharingMode.MPS and self.sharing.units:
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name=f"{self.host_id}:mps-health")
        return self.devices

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.sharing is not None:
            await self.sharing.stop()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    async def _health_loop(self) -> None:
        assert self.sharing is not None
        while True:
            await asyncio.sleep(self.hc.mps_health_interval_s)
            try:
                health = await self.sharing.check_health()
                if not all(health.values()):
                    log.warning("mps_health", health=health)
            except Exception as exc:  # the loop must not die (STYLE §4)
                log.warning("mps_health_failed", error=repr(exc))

    # workers ----------------------------------------------------------------------------
    def spawn_env(self) -> dict[str, str]:
        return self.sharing.spawn_env() if self.sharing is not None else {}

    def device(self, device_id: str) -> Device | None:
        return next((d for d in self.devices if d.device_id == device_id), None)

    def check_deployable(self, device: Device) -> None:
        """Refuse deploys onto a GPU whose geometry is being changed (retryable)."""
        if device.gpu_index in self.draining:
            raise Unavailable(f"GPU {device.gpu_index} on {self.host_id} is being "
                              "reconfigured", retry_after_s=1.0)

    def worker_device(self, device: Device) -> str:
        """The torch device a worker uses: ``cuda:0`` on a bound GPU (it sees only its own
        GPU or slice), the CPU for CPU units and fake GPUs."""
        if device.kind != "cuda" or self.fake:
            return "cpu"
        return "cuda:0" if device.uuid else device.device_id

    def weight_slot(self, device: Device, model_key: str) -> dict[str, Any] | None:
        """Where replicas of ``model_key`` on ``device`` share weights (``share_weights``
        hosts, real GPUs only), for the worker's load message; else None."""
        if not self.hc.share_weights or device.kind != "cuda" or self.fake or not device.uuid \
                or self.sharing is None:
            return None
        from flashpoint.gpu.weight_share import slot_key

        return {"dir": str(self.sharing.run_dir / "weights"),
                "key": slot_key(model_key, device.uuid)}

    def attach(self, replica_id: str, device: Device, share: GpuShare | None) -> dict[str, str]:
        """The replica's worker env (binding + MPS or hook settings); registers its quota."""
        assert self.sharing is not None
        return self.sharing.attach(replica_id, device, share)

    def bind_worker(self, replica_id: str, pid: int) -> None:
        """The worker process serving ``replica_id`` (its hook is charged to its tenant)."""
        if self.sharing is not None:
            self.sharing.bind_worker(replica_id, pid)

    def detach(self, replica_id: str) -> None:
        if self.sharing is not None:
            self.sharing.detach(replica_id)

    def set_share(self, replica_id: str, share: GpuShare) -> dict[str, Any]:
        """RPC ``set_replica_share``: change ``replica_id``'s share live."""
        if self.sharing is None:
            raise Unavailable("host not started", retry_after_s=1.0)
        return self.sharing.set_share(replica_id, share)

    def status(self) -> dict[str, Any]:
        out = self.sharing.status() if self.sharing is not None else {"mode": self.mode.value}
        out["draining_gpus"] = sorted(self.draining)
        return out

    # MIG --------------------------------------------------------------------------------
    async def apply_mig(self, idx: int, geometry: list[str],
                        replicas_on: Callable[[int], list[str]]) -> dict[str, Any]:
        """RPC ``apply_mig``: GPU ``idx`` to ``geometry`` (e.g. ``["4g", "3g"]``).

        ``replicas_on(i)`` lists the replicas running on GPU ``i`` (or its slices). Returns
        the new slices; the caller re-registers so the controller sees them. Errors are
        typed: ``InvalidGeometry`` (400), ``MigUnavailable`` (409), ``GpuBusy`` (409),
        ``MigFailed`` (500), ``NotFound`` (no such GPU).
        """
        from flashpoint.gpu.mig import apply_geometry, gpu_spec
        from flashpoint.gpu.mig_profiles import validate
        from flashpoint.gpu.nvml import load_nvml

        if isinstance(idx, bool) or not isinstance(idx, int):
            raise BadRequest("apply_mig needs an integer gpu_index")
        if not isinstance(geometry, list) or not all(isinstance(p, str) for p in geometry):
            raise BadRequest("apply_mig needs geometry: a list of profile names")
        if idx in self.draining:
            raise Conflict(f"GPU {idx} is already being reconfigured")
        nvml = load_nvml(self.nvml)
        if nvml is None:
            raise MigUnavailable(f"NVML is not available on {self.host_id}", gpu=idx)
        # Draining from here (synchronously after the check, so two calls cannot both pass):
        # no deploy lands on this GPU until the new units are reported.
        self.draining.add(idx)
        try:
            if not 0 <= idx < nvml.nvmlDeviceGetCount():
                raise NotFound(f"no GPU {idx} on {self.host_id}")
            # An impossible geometry is refused before anything else (even on a busy GPU).
            validate(await asyncio.to_thread(gpu_spec, nvml, idx), geometry)
            busy = replicas_on(idx)
            if busy:
                raise GpuBusy(f"GPU {idx} on {self.host_id} runs {len(busy)} replica(s); "
                              "drain it first", gpu=idx, replicas=busy)
            t0 = time.perf_counter()

            async def drain() -> None:  # bounded by apply_geometry's drain timeout
                while replicas_on(idx):
                    await asyncio.sleep(0.05)

            slices = await apply_geometry(nvml, idx, geometry, drain,
                                          drain_timeout_s=MIG_DRAIN_TIMEOUT_S)
            await self._refresh_units(idx)  # still draining: deploys wait for the new units
        finally:
            nvml.nvmlShutdown()
            self.draining.discard(idx)
        log.info("mig_applied", gpu=idx, geometry=geometry, seconds=round(time.perf_counter() - t0, 3),
                 slices=[s.uuid for s in slices])
        return {"gpu_index": idx, "slices": [
            {"uuid": s.uuid, "profile": s.profile, "start": s.start, "size": s.size,
             "device_id": next((d.device_id for d in self.devices if d.uuid == s.uuid), "")}
            for s in slices]}

    async def _refresh_units(self, idx: int) -> None:
        """Re-read the inventory; swap GPU ``idx``'s old units for its new slices."""
        assert self.sharing is not None
        new, self.gpus = discover_with_gpus(self.hc.cpu_devices, self.hc.device_memory_bytes,
                                            self.nvml)
        # By (id, UUID): a new slice may reuse an old one's GI id, hence its device id.
        kept = {(d.device_id, d.uuid) for d in new}
        await self.sharing.remove_units(sorted(
            d.device_id for d in self.devices
            if d.gpu_index == idx and (d.device_id, d.uuid) not in kept))
        self.devices = new
        await self.sharing.add_units([d for d in new if d.gpu_index == idx])
