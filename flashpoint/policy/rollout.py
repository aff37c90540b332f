"""Version roll-outs: which replicas to start and which to retire while a function moves
from one model version to another (issue 18 item 6).

A pure function of a frozen snapshot, like the other policies. The controller's state calls
it every tick for a function whose replicas run more than one model version, or that holds a
canary; the replicas it names to retire are drained the usual way (no new work, stopped once
idle), so no request is lost.

The rules (a rolling update with a surge of one and nothing unavailable):

* ``desired`` (the autoscaler's count) is split between the versions: all of it to the
  target, or with a canary ``canary_pct`` percent of it (at least one replica each while any
  is wanted) to the target and the rest to the stable version.
* A starting replica of a version over its share is stopped at once (no work is on it).
* Replicas of a version under its share are started, at most one beyond the sum of the shares
  while some replica still has to leave: the old version serves while the new one loads.
* A warm replica of a version over its share is retired only while the warm replicas left
  still number at least the sum of the shares: one leaves for each new one that is warm.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RollPhase(StrEnum):
    STABLE = "stable"  # every replica runs the target version
    ROLLING = "rolling"  # replicas of another version are still to leave (or to come)
    CANARY = "canary"  # the split between target and stable version is in place
    # (set by the controller's state, never by the plan) the target version's replicas kept
    # failing to start: the previous version serves until the next deploy
    FAILED = "failed"


@dataclass(frozen=True)
class RollReplica:
    replica_id: str
    model_key: str  # the model version it runs ("name@version")
    warm: bool
    since_s: float  # when it turned warm (or was requested, while starting)


@dataclass(frozen=True)
class RollSnapshot:
    target: str  # the model key the function is registered with
    stable: str | None  # the key that keeps the rest of the traffic while a canary holds
    canary_pct: float  # percent of requests and replicas on ``target``; 100 = no canary
    desired: int  # the autoscaler's replica count for the function
    replicas: tuple[RollReplica, ...]  # its replicas that are not leaving already


@dataclass(frozen=True)
class RollDecision:
    start: tuple[tuple[str, int], ...]  # (model key, how many replicas to start)
    retire: tuple[str, ...]  # replica ids to drain and stop
    phase: RollPhase
    shares: tuple[tuple[str, int], ...]  # (model key, replicas wanted), target first


def canary_active(target: str, stable: str | None, canary_pct: float) -> bool:
    return stable is not None and stable != target and canary_pct < 100.0


def shares(snap: RollSnapshot) -> dict[str, int]:
    """Replicas wanted per model key (insertion order: target first)."""
    n = max(0, snap.desired)
    if not canary_active(snap.target, snap.stable, snap.canary_pct) or n == 0:
        return {snap.target: n}
    on_target = max(1, min(n - 1, round(n * snap.canary_pct / 100.0))) if n > 1 else 1
    assert snap.stable is not None
    return {snap.target: on_target, snap.stable: max(1, n - on_target)}


def plan_roll(snap: RollSnapshot) -> RollDecision:
    want = shares(snap)
    floor = sum(want.values())
    by_key: dict[str, list[RollReplica]] = {}
    for r in snap.replicas:
        by_key.setdefault(r.model_key, []).append(r)
    retire: list[str] = []
    # 1. Starting replicas over their version's share: nothing runs on them.
    for key, reps in by_key.items():
        excess = len(reps) - want.get(key, 0)
        for r in sorted((r for r in reps if not r.warm), key=lambda r: -r.since_s)[:max(0, excess)]:
            retire.append(r.replica_id)
    kept = {key: [r for r in reps if r.replica_id not in retire] for key, reps in by_key.items()}
    to_leave = any(len(reps) > want.get(key, 0) for key, reps in kept.items())
    # 2. Versions under their share: start them, one surge replica while others must leave.
    room = floor + (1 if to_leave else 0) - sum(len(reps) for reps in kept.values())
    start: list[tuple[str, int]] = []
    for key, n in want.items():
        count = min(max(0, n - len(kept.get(key, ()))), max(0, room))
        if count:
            start.append((key, count))
            room -= count
    # 3. Warm replicas over their share leave while the warm ones left cover every share:
    # versions no share wants first, then the most recently warmed.
    removable = sum(r.warm for reps in kept.values() for r in reps) - floor
    over: list[RollReplica] = []
    for key, reps in kept.items():
        excess = len(reps) - want.get(key, 0)
        if excess > 0:
            over += sorted((r for r in reps if r.warm), key=lambda r: -r.since_s)[:excess]
    over.sort(key=lambda r: (r.model_key in want, -r.since_s))
    retire += [r.replica_id for r in over[:max(0, removable)]]
    left = {key: [r for r in reps if r.replica_id not in retire] for key, reps in kept.items()}
    if any(len(reps) > want.get(key, 0) for key, reps in left.items()) or any(
            key != snap.target and len(left.get(key, ())) < n for key, n in want.items()):
        phase = RollPhase.ROLLING
    elif canary_active(snap.target, snap.stable, snap.canary_pct):
        phase = RollPhase.CANARY
    else:
        phase = RollPhase.STABLE
    return RollDecision(tuple(start), tuple(retire), phase, tuple(want.items()))
