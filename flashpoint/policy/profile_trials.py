"""What a profiler run measures and how its trials become the papers' profiles, pure.

``flashpoint profile FUNCTION`` (``controller/profiler.py`` runs the trials through the live
system) asks for up to three profiles, each from its paper's own measurement:

- **FaST-GShare** (seed 001 §3.2, ``policy/fastgshare.py``): one trial per point of an
  (SM share × time quota) grid at one batch size; each trial's throughput and p99 latency
  make a :class:`~flashpoint.policy.fastgshare.ProfilePoint` (:func:`fast_profile`).
- **PROTEAN** (``policy/protean.py``, ``policy/protean_fit.py``): a *Solo* run (one
  replica alone with the whole device) and co-located runs (``n`` replicas of the function
  on one device, each its 1/n of the SMs and all of the time, so they compete as PROTEAN's
  co-located batches do); the slowdown solo / co-located per replica is fitted to FBR by
  :func:`~flashpoint.policy.protean_fit.fit_fbr` (:func:`protean_fit`).
- **Dilu** (seed 002 §3.2, ``policy/dilu_profile.py``): HGSS over a measure callback; each
  (IBS, SMR%) it asks for is one trial at SM share = time quota = SMR, batch = IBS
  (:func:`dilu_point`, :func:`dilu_trial`).

A trial is described by a :class:`TrialPoint` and summarised as a :class:`TrialResult`
(:func:`summarise`: requests served, throughput, p99 by nearest rank). Pure: no clock, no
I/O (tests/core/test_import_rule.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from flashpoint.errors import BadRequest
from flashpoint.policy.dilu_profile import HgssParams, HgssResult, Trial
from flashpoint.policy.fastgshare import FunctionProfile, ProfilePoint
from flashpoint.policy.protean_fit import CoLocationRun, FbrFit, fit_fbr
from flashpoint.policy.share_placement import ReplicaShare

MAX_GRID_VALUES = 8  # per axis: the paper's grid is 7 SM shares x 5 quotas
MAX_REQUESTS = 10_000  # per trial
MAX_COLOCATE = 8


@dataclass(frozen=True)
class TrialPoint:
    """One configuration a trial deploys: ``replicas`` replicas of the function, each with
    this SM share, SM cap (0 = the share), time quota and batch size."""

    sm_share: float
    time_quota: float
    batch: int = 1
    replicas: int = 1
    sm_limit: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured. ``device``: where its replicas ran ("host/device", several
    joined by "," when they did not all land on one); ``slice``: the device's slice type
    (PROTEAN's "1g".."7g"; "7g" for a whole GPU)."""

    point: TrialPoint
    ok: int
    failed: int
    wall_s: float
    throughput_rps: float
    p99_latency_s: float
    mean_latency_s: float
    device: str = ""
    slice: str = "7g"
    trial_function: str = ""  # the shadow function it ran as (its requests' metric label)

    @property
    def co_located(self) -> bool:
        return "," not in self.device

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["co_located"] = self.co_located
        return d


def summarise(point: TrialPoint, latencies_s: Sequence[float], failed: int, wall_s: float,
              device: str = "", slice_: str = "7g", trial_function: str = "") -> TrialResult:
    """A trial's numbers from its served requests' latencies and its measured wall time:
    throughput = served / wall, p99 by nearest rank (no interpolation past the data)."""
    ok = len(latencies_s)
    if ok == 0 or wall_s <= 0:
        return TrialResult(point, ok, failed, max(wall_s, 0.0), 0.0, 0.0, 0.0, device, slice_,
                           trial_function)
    ordered = sorted(latencies_s)
    p99 = ordered[max(0, math.ceil(0.99 * ok) - 1)]
    return TrialResult(point, ok, failed, wall_s, ok / wall_s, p99, sum(ordered) / ok,
                       device, slice_, trial_function)


def trial_share(policy: str, point: TrialPoint, current: ReplicaShare) -> ReplicaShare:
    """The share a trial replica gets when ``point`` is applied to it live: what placement
    would give a replica of that spec under ``policy`` (``share_placement``: FaST's time
    request = limit = quota; Dilu's request = SM share, limit = the cap), its memory and
    class kept."""
    if policy == "dilu":
        limit = min(1.0, max(point.sm_limit, point.sm_share))
        return ReplicaShare(limit, point.sm_share, limit, current.memory_bytes,
                            current.slo_sensitive)
    return ReplicaShare(point.sm_share, point.time_quota, point.time_quota,
                        current.memory_bytes, current.slo_sensitive)


def _fractions(raw: Any, what: str) -> tuple[float, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_GRID_VALUES or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 for v in raw):
        raise BadRequest(f"{what} must be a list of 1..{MAX_GRID_VALUES} fractions in (0, 1]")
    values = tuple(sorted({float(v) for v in raw}))
    if len(values) != len(raw):
        raise BadRequest(f"{what} lists a value twice")
    return values


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in {lo}..{hi}")
    return v


@dataclass(frozen=True)
class ProfileRequest:
    """What a profiler run measures (the body of ``POST /v1/functions/{name}/profile``).

    ``sm_shares`` × ``quotas``: FaST's grid (the paper's is 7 × 5; small by default so a run
    is short); ``requests``: measured requests per trial (after one warm-up request per
    replica); ``protean``: add the Solo and co-location runs (``colocate`` replicas);
    ``dilu``: add HGSS (IBS up to ``dilu_max_ibs``) against ``slo_ms`` (0 = the function's);
    ``timeout_s``: the whole run's limit.
    """

    sm_shares: tuple[float, ...] = (0.5, 1.0)
    quotas: tuple[float, ...] = (0.5, 1.0)
    batch: int = 1
    requests: int = 20
    fast: bool = True
    protean: bool = False
    colocate: int = 2
    dilu: bool = False
    dilu_max_ibs: int = 8
    slo_ms: float = 0.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not (self.fast or self.protean or self.dilu):
            raise BadRequest("nothing to profile: ask for fast, protean or dilu")

    @classmethod
    def from_dict(cls, d: Any) -> ProfileRequest:
        """From untrusted JSON; unknown keys and values out of range are a BadRequest."""
        if not isinstance(d, dict):
            raise BadRequest("a profile request must be a JSON object")
        known = set(cls.__dataclass_fields__) | {"inputs"}  # inputs: decoded by the route
        if set(d) - known:
            raise BadRequest(f"unknown profile fields: {sorted(set(d) - known)}")
        for key in ("fast", "protean", "dilu"):
            if key in d and not isinstance(d[key], bool):
                raise BadRequest(f"{key} must be true or false")
        for key, hi in (("slo_ms", 3_600_000.0), ("timeout_s", 3600.0)):
            v = d.get(key, getattr(cls, key))
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= hi \
                    or (key == "timeout_s" and v == 0):
                raise BadRequest(f"{key} must be a number in {'(' if key == 'timeout_s' else '['}"
                                 f"0, {hi}]")
        return cls(
            sm_shares=_fractions(d.get("sm_shares", list(cls.sm_shares)), "sm_shares"),
            quotas=_fractions(d.get("quotas", list(cls.quotas)), "quotas"),
            batch=_int(d, "batch", cls.batch, 1, 1024),
            requests=_int(d, "requests", cls.requests, 1, MAX_REQUESTS),
            fast=d.get("fast", cls.fast), protean=d.get("protean", cls.protean),
            colocate=_int(d, "colocate", cls.colocate, 2, MAX_COLOCATE),
            dilu=d.get("dilu", cls.dilu),
            dilu_max_ibs=_int(d, "dilu_max_ibs", cls.dilu_max_ibs, 1, 1024),
            slo_ms=float(d.get("slo_ms", cls.slo_ms)),
            timeout_s=float(d.get("timeout_s", cls.timeout_s)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sm_shares"], d["quotas"] = list(self.sm_shares), list(self.quotas)
        return d

    def fast_grid(self) -> tuple[TrialPoint, ...]:
        """FaST's grid, SM share major, quota minor (one replica, ``batch``)."""
        return tuple(TrialPoint(s, q, self.batch) for s in self.sm_shares for q in self.quotas)

    def solo_point(self) -> TrialPoint:
        """PROTEAN's Solo run: one replica with the whole device."""
        return TrialPoint(1.0, 1.0, self.batch)

    def colocated_point(self) -> TrialPoint:
        """``colocate`` replicas on one device, each 1/n of its SMs and all of its time."""
        return TrialPoint(round(1.0 / self.colocate, 6), 1.0, self.batch, self.colocate)

    def hgss_params(self) -> HgssParams:
        return HgssParams(max_ibs=self.dilu_max_ibs)


def fast_profile(function: str, results: Sequence[TrialResult], batch: int) -> FunctionProfile:
    """FaST's table from one trial per grid point (BadRequest if the grid is not full)."""
    return FunctionProfile(function, tuple(
        ProfilePoint(r.point.sm_share, r.point.time_quota, r.throughput_rps, r.p99_latency_s)
        for r in results), batch)


@dataclass(frozen=True)
class ProteanResult:
    """PROTEAN's numbers for one slice type: a batch's time alone, the fitted FBR."""

    slice: str
    solo_s: float
    fbr: float
    fbr_bounded: bool
    rms: float
    slowdowns: tuple[float, ...]


def protean_fit(function: str, solo: TrialResult,
                colocated: Sequence[TrialResult]) -> ProteanResult:
    """Solo time (mean latency of a batch alone) and FBR fitted from the co-located runs
    that did land on one device (BadRequest if none did, or Solo served nothing)."""
    if solo.throughput_rps <= 0:
        raise BadRequest(f"PROTEAN Solo run of {function!r} served no request")
    runs = [CoLocationRun(r.slice, {function: r.point.replicas},
                          {function: solo.throughput_rps},
                          {function: r.throughput_rps / r.point.replicas})
            for r in colocated if r.co_located and r.throughput_rps > 0]
    if not runs:
        raise BadRequest(f"no co-located run of {function!r} landed its replicas on one "
                         "device (placement spread them): FBR cannot be fitted")
    fit: FbrFit = fit_fbr(runs)
    key = (function, runs[0].slice)
    return ProteanResult(runs[0].slice, solo.mean_latency_s, fit.fbr[key],
                         key in fit.bounded, fit.rms, tuple(r.slowdown() for r in runs))


def dilu_point(ibs: int, smr_pct: int) -> TrialPoint:
    """The trial of HGSS's (IBS, SMR%): SM share = cap = time quota = SMR, batch = IBS."""
    f = smr_pct / 100.0
    return TrialPoint(f, f, ibs, 1, f)


def dilu_trial(result: TrialResult) -> Trial:
    """HGSS's view of a trial: the batch latency it budgets (p99: the budget is a bound)
    and the throughput. A trial that served nothing misses any budget."""
    if result.ok == 0:
        return Trial(math.inf, 0.0)
    return Trial(result.p99_latency_s, result.throughput_rps)


@dataclass(frozen=True)
class ProfileReport:
    """A profiler run: every trial, and the profiles it produced (None = not asked for, or
    it could not be made: ``notes`` say why)."""

    function: str
    request: ProfileRequest
    trials: tuple[TrialResult, ...]
    fast: FunctionProfile | None = None
    protean: ProteanResult | None = None
    dilu: HgssResult | None = None
    notes: tuple[str, ...] = ()
    deploys: int = 0  # trial deployments (the others changed a replica's share live)

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function, "request": self.request.to_dict(),
            "trials": [t.to_dict() for t in self.trials],
            "fast_profile": None if self.fast is None else {
                "batch": self.fast.batch, "points": [asdict(p) for p in self.fast.points]},
            "protean_profile": None if self.protean is None else asdict(self.protean),
            "dilu_profile": None if self.dilu is None else asdict(self.dilu),
            "notes": list(self.notes), "deploys": self.deploys,
        }
