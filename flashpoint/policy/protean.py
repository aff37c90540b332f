"""PROTEAN's GPU-sharing policies (seed 000, digest 000-protean.md), as pure functions.

- Profiles per (model, MIG slice): ``Solo`` time, ``FBR`` (fractional bandwidth requirement),
  batch memory. ``RDF = Solo(slice) / Solo(7g)``.
- η (Eq. 2) = RDF · max(FBR_k + Σ FBR_i, 1): the predicted slowdown of a strict batch on a
  slice. The clamp matters: below a summed FBR of 1 co-location is free (digest §7.2).
- Algorithm 1 (:func:`distribute_jobs`): tag slices, smallest first, with the share of their
  memory the queued best-effort (BE) batches will take; BE batches go first-fit into the
  smallest slices; each strict batch goes to the slice of least η among slices with tag < 1.
- Algorithm 2 (:func:`reconfigure`): every interval, forecast the BE batch count with an
  EWMA, turn it into memory with the current BE model's footprint, pick the smallest BE
  slice set that holds it ([1g,2g], else [3g]), add the 4g for strict work, fall back to
  (4g,3g); reconfigure a GPU only after ``wait_limit`` consecutive mismatches and at most
  ~30% of GPUs at once.

Corrections to the paper, following the digest:
- The mismatch check runs after *both* branches of Alg. 2 (digest §2.5, "indentation"):
  as printed it sits inside ``else``, so a fallback to (4g,3g) could never reconfigure.
- FBR is profiled per (model, slice), not once against the whole GPU: bandwidth is
  partitioned per slice, so one FBR would be wrong on small slices (digest §2.3).
- Slice memory comes from the GPU's MIG table (flashpoint.policy.mig_table): the paper's
  15 GB / 20 GB thresholds hold only on an A100-40GB (digest §7.16).
Choices the paper leaves open (digest §7.17), made here and configurable: how tags enter η
(the FBRs of the BE batches first-fit puts on the slice are added), α, T_low, T_high, and the
fleet cap rounding (⌊0.3·n⌋, at least 1, so a one-GPU host can still reconfigure).
T_low and T_high are BE occupancies (digest §2.5); Alg. 2 judges the BE slice set's
predicted occupancy by them, and Alg. 1 reads a slice's tag (its BE occupancy) the same
way: a slice tagged above T_high is kept for BE work (strict batches go elsewhere, as at
tag 1), and one tagged below T_low counts as untagged for strict work (its BE share is too
small to matter). :func:`distribute_jobs` defaults to (0, 1), the paper as printed; the
controller passes ``[controller] protean_t_low``/``protean_t_high`` to both algorithms.

Pure: no clock (``now`` is not needed), no NVML, no asyncio (tests/core/test_import_rule.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from flashpoint.errors import BadRequest
from flashpoint.policy.mig_table import SPECS, GpuModelSpec

FULL_SLICE = "7g"


# ------------------------------------------------------------------------------ profiles ---

@dataclass(frozen=True)
class SliceProfile:
    """What profiling measured for one model on one slice type (``slice`` is "1g".."7g")."""

    model: str
    slice: str
    solo_s: float  # isolated batch time on this slice
    fbr: float  # fractional bandwidth requirement of one batch on this slice (Eq. 1)
    mem_bytes: int  # memory one batch takes on this slice


@dataclass(frozen=True)
class ProteanProfiles:
    """All (model, slice) profiles; RDF and FBR are looked up here."""

    entries: tuple[SliceProfile, ...]

    def __post_init__(self) -> None:
        # An index, not a scan: the dispatcher asks for profiles on every routing round.
        object.__setattr__(self, "_index", {(e.model, e.slice): e for e in self.entries})

    def get(self, model: str, slice_: str) -> SliceProfile:
        e = self._index.get((model, slice_))  # type: ignore[attr-defined]
        if e is None:
            raise BadRequest(f"no PROTEAN profile for model {model!r} on slice {slice_!r}")
        return e

    def rdf(self, model: str, slice_: str) -> float:
        """Resource Deficiency Factor: Solo(slice) / Solo(7g) (digest §2.3)."""
        return self.get(model, slice_).solo_s / self.get(model, FULL_SLICE).solo_s


def eta(rdf: float, own_fbr: float, other_fbrs: Sequence[float]) -> float:
    """Eq. 2: η = RDF · max(FBR_k + Σ FBR_i, 1); the sum includes the job's own FBR."""
    return rdf * max(own_fbr + sum(other_fbrs), 1.0)


# ------------------------------------------------------------------------- Algorithm 1 ---

@dataclass(frozen=True)
class Batch:
    batch_id: str
    model: str
    strict: bool


@dataclass(frozen=True)
class SliceSnapshot:
    """One MIG slice of a GPU as the distributor sees it."""

    slice_id: str
    slice: str  # "1g", "2g", "3g", "4g", "7g"
    available_mem_bytes: int
    resident_models: tuple[str, ...] = ()  # batches already running there (their FBRs count)
    resident_fbr: float = 0.0  # summed FBR of other work running there, not named by model


@dataclass(frozen=True)
class DistributionSnapshot:
    slices: tuple[SliceSnapshot, ...]
    queue: tuple[Batch, ...]  # arrival order; strict batches are moved ahead here


@dataclass(frozen=True)
class Distribution:
    """Where each batch goes (``None``: no slice can take it this round; it waits)."""

    assignments: tuple[tuple[str, str | None], ...]  # (batch_id, slice_id)
    tags: Mapping[str, float]  # slice_id -> share of its memory reserved for BE
    etas: Mapping[str, float] = field(default_factory=dict)  # strict batch_id -> chosen η

    def slice_of(self, batch_id: str) -> str | None:
        return dict(self.assignments)[batch_id]


def _slice_order(s: SliceSnapshot) -> tuple[int, str]:
    return (int(s.slice.rstrip("g")), s.slice_id)


def distribute_jobs(snap: DistributionSnapshot, profiles: ProteanProfiles, *,
                    t_low: float = 0.0, t_high: float = 1.0) -> Distribution:
    """Algorithm 1: BE tagging, then strict by argmin η, BE first-fit (digest §2.4).

    ``t_low``/``t_high`` (0 <= t_low < t_high <= 1): a slice tagged above ``t_high`` is
    off limits to strict batches, one tagged below ``t_low`` keeps all its free memory for
    them (module docstring). Among slices of equal η a strict batch takes the larger one,
    then the one with more memory left for strict work (so equal slices share the load).
    """
    if not 0.0 <= t_low < t_high <= 1.0:
        raise BadRequest(f"need 0 <= t_low < t_high <= 1, got {t_low}, {t_high}")
    order = sorted(snap.slices, key=_slice_order)  # smallest slice first
    be = [b for b in snap.queue if not b.strict]
    strict = [b for b in snap.queue if b.strict]  # two-class reorder, FIFO inside a class
    # Lines 1-7: tag slices with the share of their memory the queued BE batches will take.
    be_mem = sum(profiles.get(b.model, FULL_SLICE).mem_bytes for b in be)
    tags = {s.slice_id: 0.0 for s in order}
    for s in order:
        if be_mem <= 0:
            break
        if s.available_mem_bytes > 0:
            tags[s.slice_id] = min(1.0, be_mem / s.available_mem_bytes)
            be_mem = max(0, be_mem - s.available_mem_bytes)
    # BE first-fit into as few, small slices as possible (line 13). It is computed before the
    # strict batches so their η can count the BE FBRs expected on each slice (our reading of
    # how tags enter η: option (b) of digest §2.4, with all queued BE batches rather than those
    # before the strict one, since strict batches come first); strict work gets untagged memory.
    free = {s.slice_id: s.available_mem_bytes for s in order}
    fbrs: dict[str, list[float]] = {
        s.slice_id: [s.resident_fbr, *(profiles.get(m, s.slice).fbr for m in s.resident_models)]
        for s in order}
    out: dict[str, str | None] = {}
    for b in be:
        for s in order:
            need = profiles.get(b.model, s.slice).mem_bytes
            if need <= free[s.slice_id]:
                out[b.batch_id] = s.slice_id
                free[s.slice_id] -= need
                fbrs[s.slice_id].append(profiles.get(b.model, s.slice).fbr)
                break
        else:
            out[b.batch_id] = None
    # The epsilon keeps float error from losing a unit: 3 * (1 - 1/3) must stay 2.
    strict_free = {s.slice_id: free[s.slice_id] if tags[s.slice_id] < t_low else
                   min(free[s.slice_id],
                       math.floor(s.available_mem_bytes * (1.0 - tags[s.slice_id]) + 1e-9))
                   for s in order}
    etas: dict[str, float] = {}
    for b in strict:
        best: tuple[tuple[float, int, int, int], SliceSnapshot] | None = None
        for i, s in enumerate(order):
            p = profiles.get(b.model, s.slice)
            tag = tags[s.slice_id]
            if tag >= 1.0 or tag > t_high or p.mem_bytes > strict_free[s.slice_id]:
                continue  # a (nearly) fully BE-tagged slice is off limits to strict (§7.4)
            e = eta(profiles.rdf(b.model, s.slice), p.fbr, fbrs[s.slice_id])
            # ties: the larger slice, then the one with more room left for strict work
            key = (e, -int(s.slice.rstrip("g")), -strict_free[s.slice_id], -i)
            if best is None or key < best[0]:
                best = (key, s)
        if best is None:
            out[b.batch_id] = None
            continue
        (e, *_), s = best
        out[b.batch_id] = s.slice_id
        etas[b.batch_id] = e
        strict_free[s.slice_id] -= profiles.get(b.model, s.slice).mem_bytes
        fbrs[s.slice_id].append(profiles.get(b.model, s.slice).fbr)
    ordered = [b.batch_id for b in (*strict, *be)]  # the sorted batch queue, strict first
    return Distribution(tuple((bid, out[bid]) for bid in ordered), tags, etas)


# ------------------------------------------------------------------------- Algorithm 2 ---

@dataclass(frozen=True)
class ReconfigParams:
    alpha: float = 0.5  # EWMA weight of the newest observation (paper: not given)
    wait_limit: int = 3  # consecutive mismatches waited out before reconfiguring (§4.4)
    fleet_fraction: float = 0.3  # at most this share of GPUs reconfiguring at once (§4.4)
    # BE occupancy of [1g,2g] below which (4g,3g) is better, and above which co-locating
    # strict and BE there hurts (ours; [controller] protean_t_low / protean_t_high)
    t_low: float = 0.05
    t_high: float = 0.95
    be_slice_sets: tuple[tuple[str, ...], ...] = (("1g", "2g"), ("3g",))
    strict_slice: str = "4g"
    fallback: tuple[str, ...] = ("4g", "3g")

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or self.wait_limit < 0 or not 0 < self.fleet_fraction <= 1:
            raise BadRequest("alpha in (0,1], wait_limit >= 0, fleet_fraction in (0,1]")
        if not 0.0 <= self.t_low < self.t_high <= 1.0:
            raise BadRequest(f"need 0 <= t_low < t_high <= 1, got {self.t_low}, {self.t_high}")


@dataclass(frozen=True)
class GpuReconfigSnapshot:
    gpu_id: str
    model: str  # MIG table name, "A100-40GB"
    geometry: tuple[str, ...]  # current, e.g. ("4g", "2g", "1g")
    be_batches: float  # BE batches observed in the queue this interval
    be_batch_mem_bytes: int  # footprint of one batch of the current BE model
    reconfiguring: bool = False


@dataclass(frozen=True)
class ReconfigSnapshot:
    gpus: tuple[GpuReconfigSnapshot, ...]


@dataclass(frozen=True)
class ReconfigMemory:
    """What Alg. 2 carries between intervals, per GPU: the EWMA and the wait counter."""

    ewma: Mapping[str, float] = field(default_factory=dict)
    wait: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReconfigDecision:
    reconfigure: tuple[tuple[str, tuple[str, ...]], ...]  # (gpu_id, new geometry)
    targets: Mapping[str, tuple[str, ...]]  # the geometry Alg. 2 wants for each GPU
    deferred: tuple[str, ...] = ()  # due, but over the fleet cap this interval


def _canon(geometry: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(geometry, key=lambda s: -int(s.rstrip("g"))))


def target_geometry(spec: GpuModelSpec, pred_be_mem_bytes: float,
                    params: ReconfigParams) -> tuple[str, ...]:
    """Lines 5-22 of Alg. 2: the geometry one GPU should have for a predicted BE memory."""
    def set_mem(members: Sequence[str]) -> int:
        return sum(spec.profile(m).memory_gb for m in members) * 10**9

    for members in sorted(params.be_slice_sets, key=set_mem):  # smallest total memory first
        cap = set_mem(members)
        if cap >= pred_be_mem_bytes:
            occupancy = pred_be_mem_bytes / cap
            # T_low/T_high judge the set that shares strict and BE work on small slices; a
            # single-slice set ([3g]) with the 4g *is* the fallback geometry.
            if len(members) > 1 and not params.t_low <= occupancy <= params.t_high:
                return _canon(params.fallback)
            return _canon((params.strict_slice, *members))
    return _canon(params.fallback)  # the BE load fits no small set


def reconfigure(snap: ReconfigSnapshot, params: ReconfigParams, memory: ReconfigMemory
                ) -> tuple[ReconfigDecision, ReconfigMemory]:
    """Algorithm 2 for every GPU, with hysteresis and the fleet cap (digest §2.5, §7.6)."""
    ewma = dict(memory.ewma)
    wait = dict(memory.wait)
    targets: dict[str, tuple[str, ...]] = {}
    due: list[GpuReconfigSnapshot] = []
    for g in snap.gpus:
        prev = ewma.get(g.gpu_id)
        ewma[g.gpu_id] = g.be_batches if prev is None else \
            params.alpha * g.be_batches + (1 - params.alpha) * prev
        if g.reconfiguring:
            continue  # it is changing already; judge it on its new geometry
        target = target_geometry(SPECS[g.model], ewma[g.gpu_id] * g.be_batch_mem_bytes, params)
        targets[g.gpu_id] = target
        # Lines 24-29, run after both branches (the digest's correction).
        if _canon(g.geometry) == target:
            wait[g.gpu_id] = 0
        elif wait.get(g.gpu_id, 0) >= params.wait_limit:
            due.append(g)
        else:
            wait[g.gpu_id] = wait.get(g.gpu_id, 0) + 1
    cap = max(1, math.floor(params.fleet_fraction * len(snap.gpus)))
    room = max(0, cap - sum(g.reconfiguring for g in snap.gpus))
    due.sort(key=lambda g: (-wait.get(g.gpu_id, 0), g.gpu_id))  # longest waiting first
    go, deferred = due[:room], due[room:]
    for g in go:
        wait[g.gpu_id] = 0
    return (ReconfigDecision(tuple((g.gpu_id, targets[g.gpu_id]) for g in go), targets,
                             tuple(g.gpu_id for g in deferred)),
            replace(memory, ewma=ewma, wait=wait))
