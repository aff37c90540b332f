"""GPU sharing on one host: MPS daemons or time-token managers per GPU or MIG slice.

The host manager owns one :class:`HostSharing`; it chooses its mode from ``[host]
gpu_sharing``:

- ``"none"``: every worker is bound to its GPU or MIG slice by UUID
  (``CUDA_VISIBLE_DEVICES``) and nothing else.
- ``"mps"``: one MPS control daemon per GPU or MIG instance (``gpu/mps.py``: its own pipe and
  log directories); a replica's worker gets ``CUDA_MPS_PIPE_DIRECTORY`` of its unit's daemon,
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its SM share) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its memory). Where the binary is absent (or a daemon
  does not start) the host logs ``mps_unavailable`` with the reason and runs that unit
  without MPS: workers are still bound, they just share the GPU by time-slicing.
- ``"tokens"``: one :class:`~flashpoint.gpu.tokens.TokenManager` per unit on its own Unix
  socket; every worker process is *started* with the hook in ``LD_PRELOAD`` (the loader reads
  it only at exec), and a replica's worker gets ``FP_HOOK_SOCKET``, ``FP_HOOK_TENANT`` and
  ``FP_HOOK_MEM_LIMIT_BYTES``; the replica's quota is registered as its tenant's. Quotas
  change live (:meth:`HostSharing.set_share`).

**Warm pool ordering.** CUDA reads the ``CUDA_*`` variables at ``cuInit`` and the hook reads
``FP_HOOK_*`` on the first driver call it intercepts (``fp_config`` runs once, lazily), never
at load. A pre-started worker has imported torch but has not touched CUDA (``import torch``
does not initialise it), so it can take all of these from the deploy message and put them
into its own environment (``gpu/worker_env.apply_env``: ``os.environ`` calls ``putenv``, so
C's ``getenv`` sees them) *before* it moves the module to the device. A worker that had
initialised CUDA refuses the deploy (``Conflict``) instead of silently running unshared.
Only ``LD_PRELOAD`` cannot be set late, which is why a tokens host starts its whole warm pool
with the hook preloaded (inert until a socket is configured).

All waits are bounded (``gpu/mps.py`` deadlines; :data:`STOP_TIMEOUT_S` for managers).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from flashpoint.errors import BadRequest, Conflict, FlashpointError, MpsUnavailable, NotFound
from flashpoint.gpu.inventory import Device
from flashpoint.gpu.mps import MpsConfig, MpsDaemon
from flashpoint.log import get_logger

log = get_logger(__name__)

STOP_TIMEOUT_S = 5.0
TENANT_FIRST = 1  # tenant 0 is the hook's default: never given to a replica


class SharingMode(StrEnum):
    NONE = "none"
    MPS = "mps"
    TOKENS = "tokens"


def parse_mode(value: str) -> SharingMode:
    """``[host] gpu_sharing`` as a mode, or a BadRequest that lists the choices."""
    try:
        return SharingMode(value)
    except ValueError:
        raise BadRequest(f"host.gpu_sharing {value!r}: one of "
                         f"{[m.value for m in SharingMode]}") from None


@dataclass(frozen=True)
class GpuShare:
    """What one replica may use of its GPU or slice (the controller decides it).

    ``sm_share``: fraction of SMs (MPS ``ACTIVE_THREAD_PERCENTAGE``; the token manager's S);
    ``time_request``/``time_limit``: guaranteed and capped fraction of GPU time (token
    quotas; FaST's quota request, Dilu's request/limit); ``memory_bytes``: device memory cap
    (0 = none); ``slo_sensitive``: Dilu's tenant class, from the function spec's
    ``tenant_class`` (a tokens host's KLC holds best-effort tenants to their request, or
    less, while an SLO-sensitive tenant of the unit is active; ``policy/klc.py``).
    """

    sm_share: float
    time_request: float
    time_limit: float
    memory_bytes: int = 0
    slo_sensitive: bool = True

    def __post_init__(self) -> None:
        for v in (self.sm_share, self.time_request, self.time_limit):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadRequest("share fractions must be finite numbers")
        if not 0.0 < self.sm_share <= 1.0:
            raise BadRequest(f"sm_share must be in (0, 1], got {self.sm_share}")
        if not 0.0 <= self.time_request <= self.time_limit <= 1.0:
            raise BadRequest("need 0 <= time_request <= time_limit <= 1, got "
                             f"{self.time_request}, {self.time_limit}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) \
                or self.memory_bytes < 0:
            raise BadRequest("share memory_bytes must be an integer >= 0")

    def to_wire(self) -> dict[str, Any]:
        return {"sm_share": self.sm_share, "time_request": self.time_request,
                "time_limit": self.time_limit, "memory_bytes": self.memory_bytes,
                "slo_sensitive": self.slo_sensitive}

    @classmethod
    def from_wire(cls, data: Any) -> GpuShare:
        if not isinstance(data, dict):
            raise BadRequest("a share must be a map")
        unknown = set(data) - {"sm_share", "time_request", "time_limit", "memory_bytes",
                               "slo_sensitive"}
        if unknown:
            raise BadRequest(f"unknown share fields: {sorted(unknown)}")
        try:
            return cls(data["sm_share"], data.get("time_request", data["sm_share"]),
                       data.get("time_limit", 1.0), data.get("memory_bytes", 0),
                       bool(data.get("slo_sensitive", True)))
        except KeyError:
            raise BadRequest("a share needs sm_share") from None

    @property
    def thread_percentage(self) -> int:
        """MPS's active thread percentage: the SM share rounded up (never 0)."""
        return max(1, min(100, math.ceil(self.sm_share * 100 - 1e-9)))


def bind_env(device: Device) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` that binds a worker to exactly this GPU or MIG slice (by UUID:
    indices change with MIG geometry and ``CUDA_DEVICE_ORDER``); nothing for CPU units."""
    return {"CUDA_VISIBLE_DEVICES": device.uuid} if device.kind == "cuda" and device.uuid else {}


@dataclass
class _Unit:
    device: Device
    daemon: MpsDaemon | None = None
    manager: Any = None  # a TokenManager
    socket_path: str = ""
    index: int = 0  # names its run directory (stable: never reused within this host)


@dataclass
class _Tenant:
    replica_id: str
    device_id: str
    tenant: int
    share: GpuShare | None
    # Its worker processes, once bound (a token manager charges a connection by its pid).
    pids: set[int] = field(default_factory=set)


class HostSharing:
    """MPS daemons or token managers for a host's GPU units, and each replica's worker env."""

    def __init__(self, mode: SharingMode, run_dir: Path, *, mps_search_path: str | None = None,
                 hook_path: Path | None = None, token_config: Any = None,
                 mps_timeout_s: float = 10.0) -> None:
        self.mode = mode
        self.run_dir = Path(run_dir)
        self._mps_path = mps_search_path
        self._hook_path = hook_path
        self._token_config = token_config
        self._mps_timeout_s = mps_timeout_s
        self.units: dict[str, _Unit] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._tenant_ids = itertools.count(TENANT_FIRST)
        self._unit_ids = itertools.count()
        self.notes: list[str] = []  # why a mode is degraded, for status and logs

    # lifecycle ------------------------------------------------------------------------
    async def start(self, devices: Sequence[Device]) -> None:
        """Prepare the hook (tokens) and start one daemon or manager per GPU unit."""
        if self.mode is SharingMode.TOKENS and self._hook_path is None:
            from flashpoint.gpu.hookbuild import build_hook

            try:
                self._hook_path = await asyncio.to_thread(build_hook)
            except FlashpointError as exc:
                self._degrade(f"the hook did not build ({exc.message}); running without "
                              "time tokens")
        await self.add_units(devices)

    async def add_units(self, devices: Sequence[Device]) -> None:
        """Start sharing on new units (at start, and after a MIG geometry changed)."""
        for d in devices:
            if d.kind != "cuda" or not d.uuid or d.device_id in self.units:
                continue
            unit = _Unit(d, index=next(self._unit_ids))
            self.units[d.device_id] = unit
            if self.mode is SharingMode.MPS:
                await self._start_daemon(unit)
            elif self.mode is SharingMode.TOKENS and self._hook_path is not None:
                await self._start_manager(unit)

    async def remove_units(self, device_ids: Sequence[str]) -> None:
        """Stop the daemons or managers of units that no longer exist (a MIG reconfigure)."""
        for dev_id in device_ids:
            unit = self.units.pop(dev_id, None)
            if unit is not None:
                await self._stop_unit(unit)

    async def stop(self) -> None:
        """Stop every daemon and manager (idempotent; each bounded)."""
        units, self.units = list(self.units.values()), {}
        await asyncio.gather(*(self._stop_unit(u) for u in units), return_exceptions=True)

    async def _stop_unit(self, unit: _Unit) -> None:
        if unit.daemon is not None:
            await unit.daemon.stop()
            unit.daemon = None
        if unit.manager is not None:
            await unit.manager.stop(STOP_TIMEOUT_S)
            unit.manager = None

    def _dir(self, unit: _Unit) -> Path:
        return self.run_dir / f"u{unit.index}"  # short: MPS pipe paths must fit a Unix socket name

    async def _start_daemon(self, unit: _Unit) -> None:
        cfg = MpsConfig(self._dir(unit), device=unit.device.uuid, search_path=self._mps_path,
                        command_timeout_s=self._mps_timeout_s,
                        start_timeout_s=self._mps_timeout_s, stop_timeout_s=self._mps_timeout_s)
        daemon = MpsDaemon(cfg)
        try:
            await daemon.start()
        except MpsUnavailable as exc:
            self._degrade(f"{unit.device.device_id}: {exc.message}")
            return
        unit.daemon = daemon
        log.info("mps_started", device_id=unit.device.device_id, uuid=unit.device.uuid,
                 pid=daemon.pid, pipe_dir=str(daemon.pipe_dir))

    async def _start_manager(self, unit: _Unit) -> None:
        from flashpoint.gpu.tokens import TokenManager

        d = self._dir(unit)
        d.mkdir(parents=True, exist_ok=True)
        unit.socket_path = str(d / "tokens.sock")
        # verify_peers: a connection's tenant is the one bound to its process (bind_worker).
        mgr = TokenManager(unit.socket_path, self._token_config, name=unit.device.device_id,
                           verify_peers=True)
        await mgr.start()
        unit.manager = mgr
        for t in self._tenants.values():  # quotas registered before a restart of the unit
            if t.device_id == unit.device.device_id:
                for pid in t.pids:
                    mgr.bind_pid(pid, t.tenant)
            if t.device_id == unit.device.device_id and t.share is not None:
                mgr.set_quota(t.tenant, _token_quota(t.share))
                mgr.set_memory_limit(t.tenant, t.share.memory_bytes)
        log.info("token_manager_started", device_id=unit.device.device_id,
                 socket=unit.socket_path)

    def _degrade(self, why: str) -> None:
        self.notes.append(why)
        log.warning("mps_unavailable" if self.mode is SharingMode.MPS else "tokens_unavailable",
                    reason=why)

    async def check_health(self) -> dict[str, bool]:
        """Health of every MPS daemon; a dead or silent one is stopped and started again
        once, so replicas started afterwards get MPS. Workers that were clients of the dead
        daemon lost their MPS server with it (CUDA calls fail there), so their replicas
        fail and are replaced by the controller's usual path."""
        out: dict[str, bool] = {}
        for dev_id, unit in list(self.units.items()):
            if unit.daemon is None:
                continue
            ok = await unit.daemon.healthy()
            if not ok:
                log.warning("mps_unhealthy", device_id=dev_id, pid=unit.daemon.pid)
                with contextlib.suppress(MpsUnavailable):
                    await unit.daemon.stop()
                unit.daemon = None
                await self._start_daemon(unit)
                ok = unit.daemon is not None
            out[dev_id] = ok
        return out

    # workers ----------------------------------------------------------------------------
    def spawn_env(self) -> dict[str, str]:
        """Extra environment of every worker process this host starts (the warm pool):
        the hook preloaded on a tokens host (``LD_PRELOAD`` is read only at exec)."""
        if self.mode is SharingMode.TOKENS and self._hook_path is not None:
            return {"LD_PRELOAD": str(self._hook_path)}
        return {}

    def attach(self, replica_id: str, device: Device, share: GpuShare | None) -> dict[str, str]:
        """Register ``replica_id`` on its unit and return its worker's environment (applied
        by the worker before it initialises CUDA). Idempotent by replica id."""
        if share is not None and self.mode is SharingMode.NONE:
            raise BadRequest(f"a share for {replica_id} but this host has gpu_sharing = none")
        env = bind_env(device)
        unit = self.units.get(device.device_id)
        if unit is None:
            return env
        t = self._tenants.get(replica_id)
        if t is None:
            t = _Tenant(replica_id, device.device_id, next(self._tenant_ids), share)
            self._tenants[replica_id] = t
        if unit.daemon is not None:
            env.update(unit.daemon.client_env(
                share.thread_percentage if share else None,
                share.memory_bytes if share and share.memory_bytes else None))
        elif unit.manager is not None:
            env.update({"FP_HOOK_SOCKET": unit.socket_path, "FP_HOOK_TENANT": str(t.tenant)})
            if share is not None:
                if share.memory_bytes:
                    # Per process in the hook (strict, also without the manager), and per
                    # replica across its processes through the manager's caps.
                    env["FP_HOOK_MEM_LIMIT_BYTES"] = str(share.memory_bytes)
                unit.manager.set_quota(t.tenant, _token_quota(share))
                unit.manager.set_memory_limit(t.tenant, share.memory_bytes)
        return env

    def bind_worker(self, replica_id: str, pid: int) -> None:
        """The worker process ``pid`` (and its children) serves ``replica_id``: its hook's
        connection is charged to that replica's tenant, whatever its HELLO claims; a hooked
        process bound to no replica is refused. Called before the worker is told to load
        (so before its CUDA initialises); a replica may have several processes."""
        t = self._tenants.get(replica_id)
        unit = self.units.get(t.device_id) if t is not None else None
        if t is None or unit is None or unit.manager is None:
            return
        t.pids.add(pid)
        unit.manager.bind_pid(pid, t.tenant)

    def detach(self, replica_id: str) -> None:
        """Forget a stopped replica (its tenant keeps its lifetime accounting)."""
        t = self._tenants.pop(replica_id, None)
        unit = self.units.get(t.device_id) if t is not None else None
        if t is not None and unit is not None and unit.manager is not None:
            for pid in t.pids:
                unit.manager.unbind_pid(pid)

    def set_share(self, replica_id: str, share: GpuShare) -> dict[str, Any]:
        """Change a running replica's share live (tokens); MPS fixes a client's thread
        percentage and memory limit at its start, so there the answer is ``Conflict``."""
        t = self._tenants.get(replica_id)
        if t is None:
            raise NotFound(f"no shared replica {replica_id!r} on this host")
        unit = self.units.get(t.device_id)
        if unit is None or unit.manager is None:
            raise Conflict(f"replica {replica_id}'s share cannot change live here "
                           f"(gpu_sharing = {self.mode.value}; MPS fixes it at process start)")
        t.share = share
        unit.manager.set_quota(t.tenant, _token_quota(share))
        unit.manager.set_memory_limit(t.tenant, share.memory_bytes)
        return {"tenant": t.tenant, "share": share.to_wire()}

    def tenant_of(self, replica_id: str) -> int | None:
        t = self._tenants.get(replica_id)
        return t.tenant if t is not None else None

    def status(self) -> dict[str, Any]:
        """For ``host_status``: mode, units and what runs on them, and degradation notes."""
        return {"mode": self.mode.value, "notes": list(self.notes),
                "units": {k: {"uuid": u.device.uuid,
                              "mps_pid": u.daemon.pid if u.daemon else None,
                              "token_socket": u.socket_path if u.manager else None}
                          for k, u in self.units.items()},
                "tenants": {r: {"tenant": t.tenant, "device_id": t.device_id,
                                "share": t.share.to_wire() if t.share else None,
                                "tenant_class": _token_quota(t.share).tenant_class.value
                                if t.share else None}
                            for r, t in self._tenants.items()}}


def _token_quota(share: GpuShare) -> Any:
    from flashpoint.policy.tokens import TenantQuota

    return TenantQuota(share.time_request, share.time_limit, share.sm_share, share.slo_sensitive)

