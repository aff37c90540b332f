"""Placing replicas that share GPUs: FaST-GShare's MaxRects packing or Dilu's best fit.

A function that declares a GPU share (``sm_share`` and optionally ``sm_limit``,
``time_quota``, ``gpu_memory_bytes`` in its spec) is placed on GPUs (or MIG slices) of hosts
that run a sharing mode (MPS or time tokens) by one of two pure policies, chosen by
``[controller] share_policy``:

- ``"fastgshare"`` (FaST-GShare Alg. 2, ``policy/fastgshare.py``): each replica is a
  rectangle of (time quota × SM share) packed into the GPUs' free space by best-area fit,
  repacking a GPU on a miss, then opening an empty GPU; a memory check on each GPU. The
  share it gets: ``sm_share`` (MPS thread percentage / token S), time request = limit =
  ``time_quota``.
- ``"dilu"`` (Dilu Alg. 1, ``policy/dilu.py``): best fit by the weighted leftover score with
  Σrequest ≤ Ω and Σlimit ≤ γ per GPU, affinity tier first, then active GPUs, then fresh
  ones. The share: time request = ``sm_share`` (Dilu's request), time limit = ``sm_limit``
  capped at 1; the SM cap (MPS percentage) is the limit.

The existing replicas of each GPU come in the snapshot with their shares, so a decision
never over-commits a GPU, and several replicas of one decision go where the previous ones
left room. FaST's rectangles are virtual: positions are rebuilt by replaying a GPU's pods.
Weight sharing between replicas (CUDA IPC) is not assumed in the memory check: every
replica pays for its own weights until the hosts share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from flashpoint.errors import BadRequest
from flashpoint.policy import dilu, fastgshare
from flashpoint.policy.replica_config import ReplicaConfig

POLICY_NAMES = ("fastgshare", "dilu")
SHARING_MODES = ("mps", "tokens")  # host modes that enforce a share ([host] gpu_sharing)


@dataclass(frozen=True)
class ReplicaShare:
    """One replica's share of its GPU; the wire form is the host's ``GpuShare``."""

    sm_share: float
    time_request: float
    time_limit: float
    memory_bytes: int = 0
    slo_sensitive: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"sm_share": self.sm_share, "time_request": self.time_request,
                "time_limit": self.time_limit, "memory_bytes": self.memory_bytes,
                "slo_sensitive": self.slo_sensitive}

    @classmethod
    def from_wire(cls, d: Any) -> ReplicaShare:
        """From a host's report (it validated the share when it accepted the deploy)."""
        if not isinstance(d, dict):
            raise BadRequest("a share must be a map")
        try:
            return cls(float(d["sm_share"]), float(d["time_request"]), float(d["time_limit"]),
                       int(d.get("memory_bytes", 0)), bool(d.get("slo_sensitive", True)))
        except (KeyError, TypeError, ValueError):
            raise BadRequest(f"malformed share {d!r:.200}") from None


class ProfileSource(Protocol):
    """A function's FaST profile as registered (``spec.FastProfileSpec``)."""

    def to_profile(self, function: str) -> fastgshare.FunctionProfile: ...


class DiluSource(Protocol):
    """A function's Dilu HGSS result as stored (``spec.DiluProfileSpec``)."""

    @property
    def sm_request(self) -> float: ...
    @property
    def sm_limit(self) -> float: ...
    @property
    def ibs(self) -> int: ...
    @property
    def throughput_rps(self) -> float: ...


class SharedFunction(Protocol):
    """What :func:`resolve_share` reads of a function (``spec.FunctionSpec`` has it; a
    frozen dataclass, so the answer is a copy). Named here so that policy/ does not import
    the API layer's spec module."""

    @property
    def name(self) -> str: ...
    @property
    def sm_share(self) -> float: ...
    @property
    def sm_limit(self) -> float: ...
    @property
    def slo_ms(self) -> float: ...
    @property
    def fast_profile(self) -> ProfileSource | None: ...
    @property
    def dilu_profile(self) -> DiluSource | None: ...


SpecT = TypeVar("SpecT", bound=SharedFunction)


def resolve_share(spec: SpecT, policy: str = "fastgshare") -> tuple[SpecT, str]:
    """``spec`` (a dataclass such as ``FunctionSpec``) with its GPU share filled in from its
    profiles, and why.

    An explicit ``sm_share`` wins (returned unchanged, reason ""); so does a spec without a
    profile. Otherwise the profile of the placement ``policy`` is read first, the other one
    when the spec has only that: FaST's (:func:`fastgshare.share_from_profile` picks the
    configuration from the profile and ``slo_ms``: its SM share becomes ``sm_share`` and its
    quota ``time_quota``; an ``sm_limit`` below the chosen share is raised to it), or
    Dilu's HGSS result (its request becomes ``sm_share``, its limit ``sm_limit``).
    """
    if spec.sm_share > 0 or (spec.fast_profile is None and spec.dilu_profile is None):
        return spec, ""
    dilu_first = policy == "dilu" and spec.dilu_profile is not None
    if spec.fast_profile is not None and not dilu_first:
        choice = fastgshare.share_from_profile(spec.fast_profile.to_profile(spec.name),
                                               spec.slo_ms / 1000.0)
        limit = max(spec.sm_limit, choice.sm_share) if spec.sm_limit else 0.0
        reason = (f"fast profile {choice.config}: {choice.throughput_rps:.1f} rps, "
                  f"p99 {choice.p99_latency_s * 1000:.1f} ms"
                  + ("" if choice.slo_met else f", no configuration meets slo_ms={spec.slo_ms}"))
        return replace(spec, sm_share=choice.sm_share, time_quota=choice.time_quota,
                       sm_limit=limit), reason
    d = spec.dilu_profile
    assert d is not None  # one of the two profiles is there (checked above)
    reason = (f"dilu profile: request {d.sm_request:g}, limit {d.sm_limit:g} at IBS {d.ibs}, "
              f"{d.throughput_rps:.1f} rps")
    return replace(spec, sm_share=d.sm_request, sm_limit=d.sm_limit), reason


def profile_configs(spec: SharedFunction) -> tuple[ReplicaConfig, ...]:
    """The configurations RPR may give ``spec``'s replicas (policy/rpr.py): its FaST
    profile's grid when the profile chooses the share, none when ``sm_share`` is explicit
    (the share is then the user's, for every replica) or there is no profile."""
    if spec.sm_share > 0 or spec.fast_profile is None:
        return ()
    return spec.fast_profile.to_profile(spec.name).configs()


@dataclass(frozen=True)
class SharedReplica:
    replica_id: str
    function: str
    share: ReplicaShare


@dataclass(frozen=True)
class ShareDevice:
    """A GPU (or slice) of a sharing host, with the shared replicas it runs."""

    host_id: str
    device_id: str
    memory_total_bytes: int
    replicas: tuple[SharedReplica, ...] = ()


@dataclass(frozen=True)
class ShareRequest:
    """``replica_ids`` (chosen by the caller) of ``function`` to place, each needing
    ``sm_share`` (Dilu: its request) up to ``sm_limit``, ``time_quota`` of GPU time (FaST)
    and ``memory_bytes`` of device memory."""

    function: str
    replica_ids: tuple[str, ...]
    sm_share: float
    sm_limit: float
    time_quota: float
    memory_bytes: int
    slo_sensitive: bool = True


@dataclass(frozen=True)
class SharePlacement:
    replica_id: str
    host_id: str
    device_id: str
    share: ReplicaShare


@dataclass(frozen=True)
class ShareDecision:
    placements: tuple[SharePlacement, ...]
    unplaced: int
    reason: str = ""


def _gid(d: ShareDevice) -> str:
    return f"{d.host_id}|{d.device_id}"


def place_shared(policy: str, devices: Sequence[ShareDevice], req: ShareRequest,
                 dilu_params: dilu.DiluParams | None = None) -> ShareDecision:
    """Place ``req.replica_ids`` on ``devices`` with the named policy (deterministic)."""
    if policy == "fastgshare":
        return _fast(devices, req)
    if policy == "dilu":
        return _dilu(devices, req, dilu_params or dilu.DiluParams())
    raise BadRequest(f"share policy {policy!r}: one of {list(POLICY_NAMES)}")


def _pod(rid: str, function: str, s: ReplicaShare) -> fastgshare.PodRequest:
    return fastgshare.PodRequest(rid, function, s.sm_share, s.time_request,
                                 fastgshare.PodMemory(s.memory_bytes, 0, share_weights=False))


def _fast(devices: Sequence[ShareDevice], req: ShareRequest) -> ShareDecision:
    by_gid = {_gid(d): d for d in devices}
    used: list[fastgshare.GpuBin] = []
    spare: list[fastgshare.GpuBin] = []
    for d in devices:
        bins: tuple[fastgshare.GpuBin, ...] = (fastgshare.GpuBin(_gid(d), d.memory_total_bytes),)
        ok = True
        for r in d.replicas:  # replay: rebuilds this GPU's free rectangles
            placed = fastgshare.place_pod(bins, _pod(r.replica_id, r.function, r.share))
            ok = ok and bool(placed.gpu_id)
            bins = placed.gpus
        if not ok:
            continue  # its shares no longer fit together (e.g. a smaller slice): no room
        (used if d.replicas else spare).append(bins[0])
    share = ReplicaShare(req.sm_share, req.time_quota, req.time_quota, req.memory_bytes,
                         req.slo_sensitive)
    out: list[SharePlacement] = []
    reason = ""
    gpus: tuple[fastgshare.GpuBin, ...] = tuple(used)
    for rid in req.replica_ids:
        got = fastgshare.place_pod(gpus, _pod(rid, req.function, share), spare)
        if not got.gpu_id:
            reason = f"fastgshare: {got.reason}"
            break
        gpus = got.gpus
        if got.new_gpu:
            spare = [s for s in spare if s.gpu_id != got.gpu_id]
        d = by_gid[got.gpu_id]
        out.append(SharePlacement(rid, d.host_id, d.device_id, share))
    return ShareDecision(tuple(out), len(req.replica_ids) - len(out), reason)


def _dilu(devices: Sequence[ShareDevice], req: ShareRequest,
          params: dilu.DiluParams) -> ShareDecision:
    by_gid = {_gid(d): d for d in devices}
    gpus = tuple(dilu.DiluGpu(_gid(d), d.host_id, d.memory_total_bytes, tuple(
        dilu.Reservation(r.replica_id, r.function, dilu.Kind.INFERENCE, r.share.time_request,
                         r.share.time_limit, r.share.memory_bytes) for r in d.replicas))
        for d in devices)
    limit = max(req.sm_limit, req.sm_share)
    share = ReplicaShare(min(1.0, limit), req.sm_share, min(1.0, limit), req.memory_bytes,
                         req.slo_sensitive)
    out: list[SharePlacement] = []
    reason = ""
    for rid in req.replica_ids:
        got = dilu.schedule(gpus, dilu.InstanceRequest(
            rid, req.function, dilu.Kind.INFERENCE, req.sm_share, limit, req.memory_bytes),
            params)
        if not got.gpu_ids:
            reason = f"dilu: {got.reason}"
            break
        gpus = got.gpus
        d = by_gid[got.gpu_ids[0]]
        out.append(SharePlacement(rid, d.host_id, d.device_id, share))
    return ShareDecision(tuple(out), len(req.replica_ids) - len(out), reason)
