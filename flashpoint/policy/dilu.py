"""Dilu's resourcing-complementary scheduling (seed 002 §3.3, Algorithm 1), pure.

Digest 002-ie.md §3. Each instance reserves ``<request, limit>`` SM rates (fractions of a
GPU, from :mod:`flashpoint.policy.dilu_profile`) and memory. Per GPU (Eq. 4 and §3.3
Principle 3):

    Σ request ≤ Ω = 1      requests are never oversubscribed
    Σ limit   ≤ γ = 1.5    limits are, conservatively: bursts rarely coincide
    Σ memory  ≤ M          memory never is

``SelectOptGPU`` is best-fit: among GPUs that admit the instance, the least weighted
leftover after placing it, score = α·(1 − R/SM_total) + β·(1 − Mem/M) with α = 0.6,
β = 0.4 (values from the reference code; the paper gives none), SM_total = 1.

Placement by kind (the paper states the principles; the concrete tiers are the reference
scheduler's, digest §3.4, with its bugs fixed):

- **inference**, three tiers, each best-fit: (1) G_WA, *workload affinity*: for every GPU
  where this function already has a replica next to a training job, that job's other GPUs
  (its sibling data-parallel workers), so every DP worker sees the same co-tenant and none
  becomes the lagger (Principle 1, the barrel effect); (2) the other active GPUs;
  (3) a fresh GPU. The reference removes the current GPU from the set once per training
  instance on it (a ``KeyError`` with two) and keeps GPUs that already hold a replica of
  this function; here the affinity set is the siblings minus every GPU already holding one;
- **LLM inference**: memory worst-fit on one active GPU (most free memory, Principle 2,
  so the model is split into the fewest pipeline stages); else a pipeline split over
  active GPUs of one node with SM headroom, most free memory first (the reference sorts by
  *used* memory, which contradicts the paper's stated goal); else a fresh GPU. Each stage
  reserves the instance's request and limit (the reference reserves the request twice);
- **training**: gang placement of all data-parallel workers on one node, first-fit, one
  worker per GPU, active GPUs before fresh ones. Training is never scored (reference).

Lazy horizontal scaling (§3.4.2) is already :func:`flashpoint.policy.autoscalers.dilu`.
Pure: frozen values in, a decision with the new GPUs out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from flashpoint.errors import BadRequest

_EPS = 1e-9  # requests are float fractions summed: ten of 0.1 must fit a GPU


class Kind(StrEnum):
    INFERENCE = "inference"
    LLM_INFERENCE = "llm-inference"
    TRAINING = "training"


@dataclass(frozen=True)
class DiluParams:
    """Ω, γ (per-GPU caps on Σ request and Σ limit) and the score's weights α, β."""

    omega: float = 1.0
    gamma: float = 1.5
    alpha: float = 0.6
    beta: float = 0.4

    def __post_init__(self) -> None:
        if not (0 < self.omega <= self.gamma and self.alpha >= 0 and self.beta >= 0):
            raise BadRequest("dilu: need 0 < omega <= gamma and alpha, beta >= 0")


@dataclass(frozen=True)
class Reservation:
    """What one instance (or one stage or worker of it) holds on one GPU."""

    instance_id: str
    function: str
    kind: Kind
    sm_request: float
    sm_limit: float
    memory_bytes: int


@dataclass(frozen=True)
class DiluGpu:
    gpu_id: str
    node_id: str
    memory_total_bytes: int
    reservations: tuple[Reservation, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.reservations)

    @property
    def request_sum(self) -> float:
        return sum(r.sm_request for r in self.reservations)

    @property
    def limit_sum(self) -> float:
        return sum(r.sm_limit for r in self.reservations)

    @property
    def memory_used_bytes(self) -> int:
        return sum(r.memory_bytes for r in self.reservations)

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - self.memory_used_bytes

    def admits(self, sm_request: float, sm_limit: float, memory_bytes: int,
               params: DiluParams) -> bool:
        """Σ request ≤ Ω, Σ limit ≤ γ and Σ memory ≤ M once the newcomer is added."""
        return (self.request_sum + sm_request <= params.omega + _EPS
                and self.limit_sum + sm_limit <= params.gamma + _EPS
                and self.memory_used_bytes + memory_bytes <= self.memory_total_bytes)

    def score(self, sm_request: float, memory_bytes: int, params: DiluParams) -> float:
        """Weighted leftover after placing (lower = tighter fit): α·(1−R) + β·(1−Mem/M)."""
        r = self.request_sum + sm_request
        mem = (self.memory_used_bytes + memory_bytes) / self.memory_total_bytes
        return params.alpha * (1 - r) + params.beta * (1 - mem)

    def with_(self, res: Reservation) -> DiluGpu:
        return replace(self, reservations=self.reservations + (res,))


@dataclass(frozen=True)
class InstanceRequest:
    """One instance to place. ``worker_memory_bytes`` lists a training job's per-worker
    memory (one GPU each); other kinds use ``memory_bytes`` on one GPU."""

    instance_id: str
    function: str
    kind: Kind
    sm_request: float
    sm_limit: float
    memory_bytes: int = 0
    worker_memory_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for v in (self.sm_request, self.sm_limit):
            if not (math.isfinite(v) and 0 < v):
                raise BadRequest(f"{self.instance_id}: SM request and limit must be > 0")
        if self.sm_limit < self.sm_request:
            raise BadRequest(f"{self.instance_id}: limit below request")
        if self.kind is Kind.TRAINING and not self.worker_memory_bytes:
            raise BadRequest(f"{self.instance_id}: training needs worker_memory_bytes")
        if min((self.memory_bytes, *self.worker_memory_bytes)) < 0:
            raise BadRequest(f"{self.instance_id}: memory must be >= 0")

    def reservation(self, memory_bytes: int) -> Reservation:
        return Reservation(self.instance_id, self.function, self.kind, self.sm_request,
                           self.sm_limit, memory_bytes)


@dataclass(frozen=True)
class DiluDecision:
    """Where the instance went: GPU ids (one per stage or worker; empty = nowhere), the tier
    that answered ("affinity", "active", "fresh", "worst-fit", "pipeline", "gang") or the
    reason it could not be placed, and the GPUs afterwards (same order as given)."""

    gpu_ids: tuple[str, ...]
    tier: str
    gpus: tuple[DiluGpu, ...]
    reason: str = ""


def select_opt_gpu(gpus: Sequence[DiluGpu], candidates: Sequence[int],
                   req: InstanceRequest, params: DiluParams) -> int | None:
    """SelectOptGPU (Algorithm 1): the admitting candidate of least score; ties to the
    earlier GPU in ``gpus``. Returns an index into ``gpus`` or None."""
    best: tuple[float, int] | None = None
    for i in candidates:
        g = gpus[i]
        if g.admits(req.sm_request, req.sm_limit, req.memory_bytes, params):
            key = (g.score(req.sm_request, req.memory_bytes, params), i)
            if best is None or key < best:
                best = key
    return None if best is None else best[1]


def affinity_gpus(gpus: Sequence[DiluGpu], function: str) -> list[int]:
    """G_WA: the sibling GPUs of every training job that shares a GPU with a replica of
    ``function``, minus the GPUs that already hold a replica of it (indices, in order)."""
    jobs: set[str] = set()
    hosting: set[int] = set()
    for i, g in enumerate(gpus):
        if any(r.function == function for r in g.reservations):
            hosting.add(i)
            jobs |= {r.instance_id for r in g.reservations if r.kind is Kind.TRAINING}
    return [i for i, g in enumerate(gpus) if i not in hosting
            and any(r.kind is Kind.TRAINING and r.instance_id in jobs for r in g.reservations)]


def schedule(gpus: Sequence[DiluGpu], req: InstanceRequest,
             params: DiluParams = DiluParams()) -> DiluDecision:
    """ScheduleInstances (Algorithm 1) for one instance, by kind (module docstring)."""
    gpus = tuple(gpus)
    if req.kind is Kind.TRAINING:
        return _gang(gpus, req, params)
    if req.kind is Kind.LLM_INFERENCE:
        return _llm(gpus, req, params)
    wa = affinity_gpus(gpus, req.function)
    active = [i for i, g in enumerate(gpus) if g.active and i not in wa]
    fresh = [i for i, g in enumerate(gpus) if not g.active]
    for tier, cands in (("affinity", wa), ("active", active), ("fresh", fresh)):
        i = select_opt_gpu(gpus, cands, req, params)
        if i is not None:
            return _placed(gpus, [(i, req.memory_bytes)], req, tier)
    return DiluDecision((), "", gpus, "no GPU admits the instance (Σrequest ≤ Ω, "
                                      "Σlimit ≤ γ, memory)")


def _placed(gpus: tuple[DiluGpu, ...], parts: Sequence[tuple[int, int]],
            req: InstanceRequest, tier: str) -> DiluDecision:
    out = list(gpus)
    for i, mem in parts:
        out[i] = out[i].with_(req.reservation(mem))
    return DiluDecision(tuple(gpus[i].gpu_id for i, _ in parts), tier, tuple(out))


def _llm(gpus: tuple[DiluGpu, ...], req: InstanceRequest, params: DiluParams) -> DiluDecision:
    """Worst-fit by memory on one active GPU; else a same-node pipeline split; else fresh."""
    active = [i for i, g in enumerate(gpus) if g.active]
    fits = [i for i in active if gpus[i].admits(req.sm_request, req.sm_limit,
                                                req.memory_bytes, params)]
    if fits:
        i = min(fits, key=lambda i: (gpus[i].memory_used_bytes, i))
        return _placed(gpus, [(i, req.memory_bytes)], req, "worst-fit")
    for node in sorted({gpus[i].node_id for i in active}):
        room = sorted((i for i in active if gpus[i].node_id == node
                       and gpus[i].admits(req.sm_request, req.sm_limit, 0, params)
                       and gpus[i].memory_free_bytes > 0),
                      key=lambda i: (-gpus[i].memory_free_bytes, i))
        if sum(gpus[i].memory_free_bytes for i in room) < req.memory_bytes:
            continue
        parts, left = [], req.memory_bytes
        for i in room:  # most free first: the fewest stages
            if left <= 0:
                break
            take = min(gpus[i].memory_free_bytes, left)
            parts.append((i, take))
            left -= take
        return _placed(gpus, parts, req, "pipeline")
    fresh = [i for i, g in enumerate(gpus) if not g.active]
    i = select_opt_gpu(gpus, fresh, req, params)
    if i is not None:
        return _placed(gpus, [(i, req.memory_bytes)], req, "fresh")
    return DiluDecision((), "", gpus, "no GPU or node has room for the LLM instance")


def _gang(gpus: tuple[DiluGpu, ...], req: InstanceRequest, params: DiluParams) -> DiluDecision:
    """All workers on one node, one per GPU, first-fit; nodes whose active GPUs alone hold
    the job first (no fresh GPU opened), then active plus fresh GPUs of one node."""
    nodes = sorted({g.node_id for g in gpus})
    for allow_fresh in (False, True):
        for node in nodes:
            on_node = [i for i, g in enumerate(gpus) if g.node_id == node
                       and (g.active or allow_fresh)]
            on_node.sort(key=lambda i: (not gpus[i].active, i))  # active first
            parts = _first_fit_workers(gpus, on_node, req, params)
            if parts is not None:
                return _placed(gpus, parts, req, "gang")
    return DiluDecision((), "", gpus, f"no node can take all {len(req.worker_memory_bytes)} "
                                      f"workers, one per GPU")


def _first_fit_workers(gpus: tuple[DiluGpu, ...], order: Sequence[int], req: InstanceRequest,
                       params: DiluParams) -> list[tuple[int, int]] | None:
    """Each worker, largest memory first, on the first unused GPU in ``order`` that admits
    it; None if some worker finds none. Bounded: workers × GPUs of one node."""
    used: set[int] = set()
    parts = []
    for mem in sorted(req.worker_memory_bytes, reverse=True):
        for i in order:
            if i not in used and gpus[i].admits(req.sm_request, req.sm_limit, mem, params):
                used.add(i)
                parts.append((i, mem))
                break
        else:
            return None
    return parts


def release(gpus: Sequence[DiluGpu], instance_id: str) -> tuple[DiluGpu, ...]:
    """The GPUs without ``instance_id``'s reservations (a GPU left empty is fresh again)."""
    return tuple(replace(g, reservations=tuple(r for r in g.reservations
                                               if r.instance_id != instance_id))
                 for g in gpus)
