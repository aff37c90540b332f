"""FaST-GShare (seed 001): the profile table and pod placement with MaxRects, pure.

Two parts of the paper's FaST-Scheduler, digest 001-fastgshare.md §3–§5:

1. **Profile table** (§3.2, §5.2): per function, throughput and tail latency measured over a
   (SM%, time-quota) grid — the paper's 7 SM shares × 5 quotas. :class:`FunctionProfile`
   looks points up and interpolates between them (bilinearly, inside the grid only: outside
   it, the saturation in SM% and the token waits at low quota make extrapolation a guess),
   and turns the grid into :class:`ReplicaConfig` values so that RPR's Algorithm 1
   (``flashpoint.policy.rpr``, already built) and its "just sufficient" choice are reused,
   not rewritten: :func:`just_sufficient_config` is that choice plus the SLO filter.
2. **Placement** (§3.4.2, Algorithm 2): pods are rectangles (time quota × SM%) packed onto
   GPUs with MaxRects (``flashpoint.policy.maxrects``) by *global* best-area-fit over every
   GPU's free rectangles, a new GPU only when none fits. Corrections and additions, each
   from the digest:

   - the width is ``Q_request``, the guaranteed quota; ``Q_limit`` is elastic and is never
     reserved (digest §4.2, §8 item 9);
   - GPU memory is not part of MRA in the paper; here a GPU is a candidate only if the pod's
     memory fits too (digest §4.2, "[I] add a check Σ mem ≤ GPU mem");
   - **model sharing** (§3.5): replicas of one function on one GPU share a single copy of the
     weights through CUDA IPC, so the weights (plus the model store's fixed CUDA-context
     cost, ≈300 MB on a V100) are counted once per (GPU, function) and only the private part
     (context, activations, workspace) per pod. Sharing is across instances of the *same*
     function only, never across models. With one pod the shared footprint is *larger* than
     without sharing (Fig. 13: 5080 vs 4735 MB for ViT-Huge), which this accounting keeps;
   - release recomputes the maximal free rectangles from the pods that remain instead of
     "keep-restructure" (see :func:`flashpoint.policy.maxrects.free_space`), and
     :func:`repack` is the paper's reset-and-replace, which keeps the old layout if the new
     one would not fit (the paper does not say what happens then).

Pure: frozen values in, new values out; no clock, no I/O (tests/core/test_import_rule.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flashpoint.errors import BadRequest
from flashpoint.policy import maxrects
from flashpoint.policy.maxrects import SM_UNITS, TIME_UNITS, Rect
from flashpoint.policy.replica_config import ReplicaConfig
from flashpoint.policy.rpr import eligible_configs, just_sufficient, most_efficient

# The paper's profiling grid (§5.2): quotas at equal steps because throughput is about
# proportional to quota; SM shares finer at the low end, where small models gain most.
PAPER_QUOTAS = (0.2, 0.4, 0.6, 0.8, 1.0)
PAPER_SM_SHARES = (0.06, 0.12, 0.24, 0.5, 0.6, 0.8, 1.0)

_EPS = 1e-9


# ------------------------------------------------------------------------ profile table ---

@dataclass(frozen=True)
class ProfilePoint:
    """One profiled configuration: quota_request = quota_limit = ``quota`` while profiling."""

    sm_share: float
    quota: float
    throughput_rps: float
    p99_latency_s: float


@dataclass(frozen=True)
class FunctionProfile:
    """FaST-Profiler's table for one function: a full (SM share × quota) grid."""

    function: str
    points: tuple[ProfilePoint, ...]
    batch: int = 1

    def __post_init__(self) -> None:
        sms, quotas = self.sm_shares, self.quotas
        keys = {(p.sm_share, p.quota) for p in self.points}
        if not self.points or len(keys) != len(self.points) or len(keys) != len(sms) * len(quotas):
            raise BadRequest(f"profile of {self.function!r} must be a full grid without "
                             f"duplicates ({len(sms)} SM shares × {len(quotas)} quotas)")

    @property
    def sm_shares(self) -> tuple[float, ...]:
        return tuple(sorted({p.sm_share for p in self.points}))

    @property
    def quotas(self) -> tuple[float, ...]:
        return tuple(sorted({p.quota for p in self.points}))

    def lookup(self, sm_share: float, quota: float) -> ProfilePoint | None:
        """The measured point at exactly (``sm_share``, ``quota``), if profiled."""
        for p in self.points:
            if abs(p.sm_share - sm_share) <= _EPS and abs(p.quota - quota) <= _EPS:
                return p
        return None

    def interpolate(self, sm_share: float, quota: float) -> ProfilePoint:
        """Bilinear interpolation of throughput and latency between the four grid points
        around (``sm_share``, ``quota``); exact at grid points. Outside the grid: BadRequest.
        """
        s0, s1 = _bracket(self.sm_shares, sm_share, "sm_share", self.function)
        q0, q1 = _bracket(self.quotas, quota, "quota", self.function)
        by_key = {(p.sm_share, p.quota): p for p in self.points}  # a full grid: all present
        corners = [by_key[(s, q)] for s in (s0, s1) for q in (q0, q1)]
        ts = (sm_share - s0) / (s1 - s0) if s1 > s0 else 0.0
        tq = (quota - q0) / (q1 - q0) if q1 > q0 else 0.0
        weights = [(1 - ts) * (1 - tq), (1 - ts) * tq, ts * (1 - tq), ts * tq]
        thr = sum(w * p.throughput_rps for w, p in zip(weights, corners, strict=True))
        lat = sum(w * p.p99_latency_s for w, p in zip(weights, corners, strict=True))
        return ProfilePoint(sm_share, quota, thr, lat)

    def configs(self) -> tuple[ReplicaConfig, ...]:
        """The grid as RPR configurations (named ``s<SM%>-q<quota%>``), for rpr.plan."""
        return tuple(
            ReplicaConfig(f"s{round(p.sm_share * 100)}-q{round(p.quota * 100)}", p.sm_share,
                          p.quota, self.batch, p.throughput_rps, p.p99_latency_s)
            for p in sorted(self.points, key=lambda p: (p.sm_share, p.quota))
            if p.throughput_rps > 0)


def _bracket(grid: tuple[float, ...], v: float, what: str, fn: str) -> tuple[float, float]:
    """The grid values on either side of ``v`` (equal when ``v`` is on the grid)."""
    if not (grid[0] - _EPS <= v <= grid[-1] + _EPS):
        raise BadRequest(f"{what} {v} outside the profiled range [{grid[0]}, {grid[-1]}] "
                         f"of {fn!r}")
    for lo, hi in zip(grid, grid[1:], strict=False):
        if abs(v - lo) <= _EPS:
            return lo, lo
        if lo < v < hi:
            return lo, hi
    return grid[-1], grid[-1]


def just_sufficient_config(profile: FunctionProfile, residual_rps: float,
                           slo_s: float = 0.0) -> ReplicaConfig:
    """p_ideal of Algorithm 1: the least throughput still covering ``residual_rps`` among
    configurations meeting the SLO, ties to the smallest S·Q (rpr.just_sufficient).

    The paper has no SLO filter although it promises SLOs (digest §4.1): configurations
    whose p99 exceeds ``slo_s`` are skipped (0 = no SLO). If no configuration covers the
    residual on its own, the highest-throughput one: the caller adds more replicas.
    """
    configs, _ = eligible_configs(profile.configs(), slo_s)
    if not any(c.throughput_rps >= residual_rps - _EPS for c in configs):
        return max(configs, key=lambda c: (c.throughput_rps, -c.resource, c.name))
    return just_sufficient(configs, residual_rps)


@dataclass(frozen=True)
class ShareChoice:
    """The share a replica gets from its profile: SM share and time quota of one profiled
    configuration (``config`` names it), and whether that configuration meets the SLO."""

    sm_share: float
    time_quota: float
    config: str
    slo_met: bool
    throughput_rps: float
    p99_latency_s: float


def share_from_profile(profile: FunctionProfile, slo_s: float = 0.0,
                       tie_tolerance: float = 0.02) -> ShareChoice:
    """The share a new replica of a function gets when it declares a profile but no share.

    RPR (Alg. 1, ``policy/rpr.py``) adds replicas in p_eff, the configuration with the most
    throughput per GPU share held (T / (S·Q)) among those whose profiled p99 meets the SLO
    (``slo_s``; 0 = none); a replica placed before any load is seen is such a replica. If
    no configuration meets the SLO, the fastest one (``slo_met`` False): serving late beats
    not serving. Ties within ``tie_tolerance`` go to the lowest latency (rpr.most_efficient).
    """
    configs, met = eligible_configs(profile.configs(), slo_s)
    if not configs:
        raise BadRequest(f"profile of {profile.function!r} has no configuration with "
                         "throughput > 0")
    best = most_efficient(configs, tie_tolerance)
    return ShareChoice(best.sm_share, best.quota, best.name, met, best.throughput_rps,
                       best.p99_latency_s)


# --------------------------------------------------------------------------- memory ---

@dataclass(frozen=True)
class PodMemory:
    """A pod's GPU memory, split as FaST's model sharing needs it (§3.5).

    ``weights_bytes`` are the model's tensors, shareable between replicas of one function;
    ``private_bytes`` the rest of a pod (CUDA context, activations, workspace);
    ``store_bytes`` the model store's fixed cost per (GPU, function) when sharing (its own
    CUDA context, ≈300 MB on a V100 in the paper).
    """

    weights_bytes: int
    private_bytes: int
    store_bytes: int = 0
    share_weights: bool = True

    def __post_init__(self) -> None:
        if min(self.weights_bytes, self.private_bytes, self.store_bytes) < 0:
            raise BadRequest("pod memory sizes must be >= 0")

    def footprint_bytes(self, pods: int) -> int:
        """Memory ``pods`` replicas of one function take on one GPU."""
        if pods <= 0:
            return 0
        if self.share_weights:
            return self.store_bytes + self.weights_bytes + pods * self.private_bytes
        return pods * (self.weights_bytes + self.private_bytes)


# ------------------------------------------------------------------------ placement ---

@dataclass(frozen=True)
class PodRequest:
    """One pod to place: its SM share, its guaranteed quota (the rectangle) and memory."""

    pod_id: str
    function: str
    sm_share: float
    quota_request: float
    memory: PodMemory

    def __post_init__(self) -> None:
        _ = self.size  # shares outside (0, 1] are refused here, not at placement time

    @property
    def size(self) -> tuple[int, int]:
        """(w, h) in MaxRects units: quota along time, SM share along SMs."""
        return (maxrects.to_units(self.quota_request, TIME_UNITS),
                maxrects.to_units(self.sm_share, SM_UNITS))


@dataclass(frozen=True)
class PlacedPod:
    pod: PodRequest
    rect: Rect


@dataclass(frozen=True)
class GpuBin:
    """One GPU as the packer sees it: its pods and its maximal free rectangles."""

    gpu_id: str
    memory_total_bytes: int
    pods: tuple[PlacedPod, ...] = ()
    free: tuple[Rect, ...] = (Rect(0, 0, TIME_UNITS, SM_UNITS),)

    def memory_used_bytes(self, extra: PodRequest | None = None) -> int:
        """Σ over pods of their private memory, plus the weights (and the store's context)
        once per function whose pods share them; a pod that does not share pays its own.

        Replicas of one function carry the same weights; should two pods disagree, the
        larger copy is counted, so the check can only err on the safe side.
        """
        pods = [p.pod for p in self.pods] + ([extra] if extra is not None else [])
        shared: dict[str, int] = {}
        total = 0
        for p in pods:
            m = p.memory
            total += m.private_bytes
            if m.share_weights:
                shared[p.function] = max(shared.get(p.function, 0),
                                          m.weights_bytes + m.store_bytes)
            else:
                total += m.weights_bytes
        return total + sum(shared.values())

    def memory_fits(self, pod: PodRequest) -> bool:
        return self.memory_used_bytes(pod) <= self.memory_total_bytes

    def with_pod(self, pod: PodRequest, hole: Rect) -> GpuBin:
        w, h = pod.size
        rect = Rect(hole.x, hole.y, w, h)  # bottom-left of the hole (Alg. 2 line 5)
        return replace(self, pods=self.pods + (PlacedPod(pod, rect),),
                       free=maxrects.free_after(self.free, rect))


@dataclass(frozen=True)
class FastPlacement:
    """Where a pod went (``gpu_id`` "" = nowhere) and the GPUs afterwards.

    ``repacked``: the GPU was re-packed to make room, so the rectangles of its other pods
    moved too; positions are virtual, so nothing changes at run time (module docstring).
    """

    gpu_id: str
    rect: Rect | None
    gpus: tuple[GpuBin, ...]
    new_gpu: bool = False
    reason: str = ""
    repacked: bool = False


def place_pod(gpus: Sequence[GpuBin], pod: PodRequest, spare_gpus: Sequence[GpuBin] = (),
              repack_on_miss: bool = True) -> FastPlacement:
    """Algorithm 2: the best-area-fit hole over *all* GPUs in use whose memory also holds
    the pod; else (``repack_on_miss``) a GPU in use whose pods, re-packed offline together
    with the new one, all fit; else the first spare (empty) GPU that holds it; else nowhere.

    Ties go to the smaller leftover short side (Jylänki's BAF), then the GPU's order in
    ``gpus``, then the hole's position, so the decision is deterministic.

    Repacking on a miss is our trigger for the paper's reset-and-replace, whose own trigger
    (free-list length above a threshold) has no value in the paper. Online best-area-fit
    alone packs §5.4's eight pods into two GPUs when the small ResNet pods arrive first:
    they split the time axis, and the BERT pods need 60% of it in one piece. Positions are
    virtual (module docstring), so a repack changes nothing at run time, and a miss is the
    moment fragmentation would cost a GPU.
    """
    w, h = pod.size
    best: tuple[tuple[int, int], int, maxrects.Fit] | None = None
    for i, g in enumerate(gpus):
        if not g.memory_fits(pod):
            continue
        fit = maxrects.best_fit(g.free, w, h)
        if fit is not None and (best is None or (fit.key[:2], i) < (best[0], best[1])):
            best = (fit.key[:2], i, fit)
    if best is not None:
        i, fit = best[1], best[2]
        new = gpus[i].with_pod(pod, fit.hole)
        return FastPlacement(new.gpu_id, new.pods[-1].rect, _swap(gpus, i, new))
    if repack_on_miss:
        for i, g in sorted(enumerate(gpus), key=lambda ig: (_free_area(ig[1]), ig[0])):
            if _free_area(g) < w * h or not g.memory_fits(pod):
                continue  # cheap rejections first: no layout can beat the free area
            new = _repacked(g, g.pods + (PlacedPod(pod, Rect(0, 0, w, h)),))
            if new is not None:
                rect = next(p.rect for p in new.pods if p.pod.pod_id == pod.pod_id)
                return FastPlacement(new.gpu_id, rect, _swap(gpus, i, new), repacked=True)
    for spare in spare_gpus:
        if spare.pods:
            raise BadRequest(f"spare GPU {spare.gpu_id!r} is not empty")
        fit = maxrects.best_fit(spare.free, w, h)
        if fit is not None and spare.memory_fits(pod):
            new = spare.with_pod(pod, fit.hole)
            return FastPlacement(new.gpu_id, new.pods[-1].rect, tuple(gpus) + (new,), True)
    reason = ("no GPU in use has a free rectangle and memory for the pod, "
              + ("and no spare GPU holds it" if spare_gpus else "and no spare GPU is left"))
    return FastPlacement("", None, tuple(gpus), reason=reason)


def _swap(gpus: Sequence[GpuBin], i: int, new: GpuBin) -> tuple[GpuBin, ...]:
    return tuple(gpus[:i]) + (new,) + tuple(gpus[i + 1:])


def _free_area(gpu: GpuBin) -> int:
    return TIME_UNITS * SM_UNITS - sum(p.rect.area for p in gpu.pods)


# Offline orders tried by a repack, best first: Jylänki sorts by area; height (SM) and width
# (time) first catch the layouts where tall or long pods must go in before small ones.
_REPACK_ORDERS = (
    lambda p: (-p.rect.area, -p.rect.h, -p.rect.w, p.pod.pod_id),
    lambda p: (-p.rect.h, -p.rect.w, p.pod.pod_id),
    lambda p: (-p.rect.w, -p.rect.h, p.pod.pod_id),
)


def _repacked(gpu: GpuBin, pods: Sequence[PlacedPod]) -> GpuBin | None:
    """``gpu`` emptied and refilled with ``pods`` by best-area-fit in the first of a few
    offline orders that fits them all; None if none does. Bounded: 3 orders × len(pods)."""
    for order in _REPACK_ORDERS:
        fresh = replace(gpu, pods=(), free=(Rect(0, 0, TIME_UNITS, SM_UNITS),))
        for p in sorted(pods, key=order):
            fit = maxrects.best_fit(fresh.free, p.rect.w, p.rect.h)
            if fit is None:
                break
            fresh = fresh.with_pod(p.pod, fit.hole)
        else:
            return fresh
    return None


def pack(pods: Sequence[PodRequest], spare_gpus: Sequence[GpuBin], gpus: Sequence[GpuBin] = (),
         repack_on_miss: bool = True) -> tuple[tuple[GpuBin, ...], tuple[PodRequest, ...]]:
    """Place ``pods`` one by one in the given order (online, as scaling asks for them).

    Returns the GPUs in use and the pods that found no room. Spare GPUs are opened in order.
    """
    used = tuple(gpus)
    spares = list(spare_gpus)
    unplaced: list[PodRequest] = []
    for pod in pods:
        got = place_pod(used, pod, spares, repack_on_miss)
        if not got.gpu_id:
            unplaced.append(pod)
            continue
        if got.new_gpu:
            spares = [s for s in spares if s.gpu_id != got.gpu_id]
        used = got.gpus
    return used, tuple(unplaced)


def release_pod(gpu: GpuBin, pod_id: str) -> GpuBin:
    """The GPU without ``pod_id``; the other pods keep their positions, and the free list
    is rebuilt as the exact maximal free rectangles (not the paper's keep-restructure)."""
    pods = tuple(p for p in gpu.pods if p.pod.pod_id != pod_id)
    if len(pods) == len(gpu.pods):
        raise BadRequest(f"pod {pod_id!r} is not on GPU {gpu.gpu_id!r}")
    return replace(gpu, pods=pods,
                   free=maxrects.free_space(TIME_UNITS, SM_UNITS, (p.rect for p in pods)))


def repack(gpu: GpuBin) -> GpuBin:
    """The paper's reset: empty the GPU and re-place its pods, largest first.

    Positions are virtual, so this costs nothing at run time. If no offline order holds
    every pod (online and offline orders differ), the old layout is kept: the paper does
    not say what happens when re-placement fails, and dropping a running pod is worse.
    """
    new = _repacked(gpu, gpu.pods)
    return gpu if new is None else new


def exclusive_time_sharing_gpus(pods: Sequence[PodRequest]) -> int:
    """GPUs that time sharing alone needs (KubeShare, the paper's baseline): every pod at
    100% SM, so only quotas add up; first-fit decreasing over quotas (exact for §5.4)."""
    loads: list[int] = []
    for w in sorted((p.size[0] for p in pods), reverse=True):
        for i, used in enumerate(loads):
            if used + w <= TIME_UNITS:
                loads[i] += w
                break
        else:
            loads.append(w)
    return len(loads)


def area_lower_bound(pods: Sequence[PodRequest]) -> int:
    """⌈Σ S·Q⌉: no packing uses fewer GPUs (digest §8 item 3: the GPU's capacity is an
    area, not a sum of quotas)."""
    total = sum(p.size[0] * p.size[1] for p in pods)
    return math.ceil(total / (TIME_UNITS * SM_UNITS))
