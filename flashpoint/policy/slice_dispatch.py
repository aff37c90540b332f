"""PROTEAN's job distribution (Alg. 1) in the live dispatcher: which replica, on which MIG
slice, each queued request of one function goes to (seed 000, digest §2.4).

:func:`route_to_slices` is a pure function of a :class:`SliceRoutingSnapshot` (the
function's accepting replicas with the slice each runs on and its free credits, how many
strict and best-effort requests are queued, the load already on each slice) and returns a
:class:`SliceRoutingDecision`. It calls :func:`flashpoint.policy.protean.distribute_jobs`
unchanged; this module only maps the dispatcher's terms onto the paper's. The mapping
(digest §7.17 leaves it open):

- A *batch* of Alg. 1 is one queued request: the worker forms the batches, and the
  dispatcher hands out requests.
- A *slice* is a MIG unit holding accepting replicas of the function. Its available memory
  is their free credits, and a request takes one: every request of one function takes the
  same memory, so Alg. 1's memory shares (the BE tags, first fit) come out the same counted
  in request slots, and the dispatcher's rule that a replica never gets more than its
  credits holds.
- RDF(slice) = 7 / the slice's compute slices (Solo time inversely proportional to compute,
  the ideal of a compute-bound batch), so η prefers the larger slice until interference
  outweighs it.
- The FBR of one request is its function's ``batch_fbr / max_batch_size`` (a batch's memory
  traffic grows with its rows); a slice's residents are the requests in flight on it, of
  every function, each with its own function's per-request FBR (``resident_fbr``). With no
  FBR profiled, η is the RDF: strict requests fill the largest slice first.
- Strict before best-effort, as everywhere in the dispatcher: the BE requests Alg. 1 sees
  in one round are at most the free credits the queued strict requests leave. BE tags and
  first fit both fill the smallest slices first with the same amounts, so the strict
  requests have room on the untagged rest; where slices tagged above T_high would still
  turn one away, fewer BE requests go this round (the most that leave every strict one a
  slice). A strict request never waits behind BE work.

Among replicas of the function on the slice Alg. 1 picks, the one with the most free
credits takes the request (ties: replica id), as the least-loaded rule elsewhere.

Pure: no clock, no I/O (tests/core/test_import_rule.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from flashpoint.errors import BadRequest
from flashpoint.policy.protean import (
    Batch,
    Distribution,
    DistributionSnapshot,
    ProteanProfiles,
    SliceProfile,
    SliceSnapshot,
    distribute_jobs,
)

SLICE_NAMES = ("1g", "2g", "3g", "4g", "7g")  # MIG profile short names (compute slices)
_JOB_MODEL = "request"  # the one model of a routing round (one function's requests)


def short_profile(mig_profile: str) -> str:
    """``"4g"`` for ``"4g.20gb"`` (or ``"1g.10gb+me"``); BadRequest for anything else."""
    short = mig_profile.split(".", 1)[0]
    if short not in SLICE_NAMES:
        raise BadRequest(f"not a MIG profile PROTEAN routes over: {mig_profile!r}")
    return short


@dataclass(frozen=True)
class SliceReplica:
    """One accepting replica of the function and the MIG slice it runs on."""

    replica_id: str
    slice_id: str  # the MIG unit ("host/device"); replicas on one unit share it
    slice: str  # its profile's short name, "1g".."7g"
    free: int  # requests it has room for now (free credits)


@dataclass(frozen=True)
class SliceRoutingSnapshot:
    """One dispatch round of one function over MIG slices."""

    replicas: tuple[SliceReplica, ...]
    strict: int  # strict requests queued (FIFO)
    best_effort: int  # best-effort requests queued (FIFO)
    request_fbr: float = 0.0  # FBR of one of this function's requests
    # slice_id -> summed FBR of the requests in flight there now (every function's)
    resident_fbr: Mapping[str, float] = field(default_factory=dict)
    t_low: float = 0.0  # a slice's BE tag below this counts as none for strict work
    t_high: float = 1.0  # a slice tagged above this is kept for BE work


@dataclass(frozen=True)
class SliceRoutingDecision:
    """Replicas for the front of each queue, in queue order; the rest wait."""

    strict: tuple[str, ...]  # replica of the 1st, 2nd, ... queued strict request
    best_effort: tuple[str, ...]  # replica of the 1st, 2nd, ... queued BE request
    tags: Mapping[str, float] = field(default_factory=dict)  # slice_id -> Alg. 1's BE tag


@functools.lru_cache(maxsize=64)  # one per function's FBR: built once, not every round
def _profiles(request_fbr: float) -> ProteanProfiles:
    """One request on every slice type: a unit of memory (a credit), Solo ∝ 1/compute."""
    return ProteanProfiles(tuple(
        SliceProfile(_JOB_MODEL, s, 1.0 / int(s.rstrip("g")), request_fbr, 1)
        for s in SLICE_NAMES))


def route_to_slices(snap: SliceRoutingSnapshot) -> SliceRoutingDecision:
    """Alg. 1 over the function's slices: BE requests first-fit into the smallest slices,
    each strict request to the slice of least η among those not kept for BE work."""
    if not 0.0 <= snap.t_low < snap.t_high <= 1.0:
        raise BadRequest(f"need 0 <= t_low < t_high <= 1, got {snap.t_low}, {snap.t_high}")
    room: dict[str, dict[str, int]] = {}  # slice_id -> replica_id -> free credits
    kind: dict[str, str] = {}
    for r in snap.replicas:
        if r.free > 0:
            room.setdefault(r.slice_id, {})[r.replica_id] = r.free
            kind[r.slice_id] = r.slice
    total = sum(sum(v.values()) for v in room.values())
    n_strict = min(snap.strict, total)
    n_be = min(snap.best_effort, total - n_strict)  # strict first: BE gets what is left
    if n_strict + n_be == 0:
        return SliceRoutingDecision((), ())
    slices = tuple(SliceSnapshot(sid, kind[sid], sum(v.values()),
                                 resident_fbr=snap.resident_fbr.get(sid, 0.0))
                   for sid, v in room.items())
    profiles = _profiles(snap.request_fbr)

    def distribute(n_be: int) -> Distribution:
        queue = (*(Batch(f"s{i}", _JOB_MODEL, True) for i in range(n_strict)),
                 *(Batch(f"b{i}", _JOB_MODEL, False) for i in range(n_be)))
        return distribute_jobs(DistributionSnapshot(slices, queue), profiles,
                               t_low=snap.t_low, t_high=snap.t_high)

    def strict_placed(d: Distribution) -> bool:
        return sum(sid is not None for bid, sid in d.assignments if bid[0] == "s") == n_strict

    d = distribute(n_be)
    if not strict_placed(d):
        # Slices tagged above T_high turned strict requests away: fewer BE requests this
        # round (the most that leave every strict one a slice; with none, all fit).
        lo, hi = 0, n_be - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if strict_placed(distribute(mid)) else (lo, mid - 1)
        n_be = lo
        d = distribute(n_be)
    chosen = dict(d.assignments)

    def replicas(prefix: str, n: int) -> tuple[str, ...]:
        out: list[str] = []
        for i in range(n):
            sid = chosen[f"{prefix}{i}"]
            if sid is None:
                break  # identical requests: once one finds no room, none after it does
            free = room[sid]
            rid = min(free, key=lambda k: (-free[k], k))  # most room, then id
            free[rid] -= 1
            if free[rid] == 0:
                del free[rid]
            out.append(rid)
        return tuple(out)

    return SliceRoutingDecision(replicas("s", n_strict), replicas("b", n_be), dict(d.tags))
