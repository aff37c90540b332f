"""Which in-flight generations move off a leaving replica, and where (live migration,
issue 21 item 5; ServerlessLLM §5).

A replica leaves -- the autoscaler retires it (scale-down), its host drains on a spot
notice, its GPU is re-cut for a MIG geometry -- by first stopping to take work; until now it
then finished what it held, so a long generation held the replica (and, on a draining host,
raced the deadline). With migration the streamed sequences it runs move instead: the source
stops each at a token boundary and reports the tokens so far, and another replica prefills
prompt + tokens and goes on. This module is the decision, a pure function of a frozen
snapshot (STYLE §2); ``controller/migration.py`` does the asking and the re-sending.

The rules:

* A sequence moves to a warm replica of the same function and model version that has a
  free credit, the one with the most free credits first (least loaded, as dispatch does);
  each move takes one of its credits, so one decision never overfills a destination.
  The youngest sequences (fewest tokens so far) go first: they are the cheapest to prefill
  and likely have the most tokens left to gain from the move.
* No destination has room:

  - the replica is **forced** out (a draining host, a GPU being reconfigured): the
    sequence moves anyway, to its function's queue, where the next free replica -- or the
    one the autoscaler starts for the queued work -- takes it;
  - the replica leaves **by choice** (scale-down, or any other retirement): the sequence
    finishes where it is, and is looked at again at the next step (a destination may have
    room by then). Moving it to the queue would wait for capacity the scale-down just gave
    back.

A sequence already asked to move is not in the snapshot (the caller tracks those).

Multi-round moves (ServerlessLLM §5): a move to a destination replica first parks the
sequence there -- the destination prefills its tokens so far while the source goes on --
and only then asks the source to stop, so the prefill leaves the client's gap. How long
that may take is :func:`park_wait_s`: the configured bound, and for a forced leave with a
deadline (a spot drain) at most half the time left, so the hand-off still happens in time.
Moves to the queue are not parked (no replica to park on). An operator may also leave a
lone short sequence unparked (:func:`worth_parking`, ``migration_park_min_tokens``; by
default every move to a replica is parked: the extension pass left in the gap costs less
than the prefill it replaces, bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LeaveCause(StrEnum):
    """Why a replica leaves; it decides whether its sequences may wait for room."""

    SCALE_DOWN = "scale_down"  # retired by the autoscaler (or any voluntary retirement)
    HOST_DRAIN = "host_drain"  # its host goes away (spot eviction notice)
    MIG = "mig_reconfigure"  # its GPU is re-cut into another MIG geometry

    @property
    def forced(self) -> bool:
        """Whether the replica goes whether or not another has room."""
        return self is not LeaveCause.SCALE_DOWN


@dataclass(frozen=True)
class LeavingReplica:
    replica_id: str
    function: str
    model_key: str  # its model version: a sequence continues on the same weights
    cause: LeaveCause


@dataclass(frozen=True)
class StreamInFlight:
    """A streamed generation running on a leaving replica; ``tokens`` its chunks so far."""

    request_id: str
    replica_id: str
    tokens: int


@dataclass(frozen=True)
class TargetReplica:
    """A warm, accepting replica that is not leaving, and its free credits now."""

    replica_id: str
    function: str
    model_key: str
    free_credits: int


@dataclass(frozen=True)
class MigrationSnapshot:
    now_s: float
    leaving: tuple[LeavingReplica, ...]
    streams: tuple[StreamInFlight, ...]
    targets: tuple[TargetReplica, ...]


@dataclass(frozen=True)
class MoveSequence:
    """Hand ``request_id`` off ``source``; ``destination`` "" means the function's queue
    (the next replica with room, or a new one)."""

    request_id: str
    source: str
    destination: str


def plan_migrations(snap: MigrationSnapshot) -> tuple[MoveSequence, ...]:
    """The moves to make now (see the module docstring)."""
    leaving = {r.replica_id: r for r in snap.leaving}
    free = {t.replica_id: t.free_credits for t in snap.targets if t.replica_id not in leaving}
    by_key: dict[tuple[str, str], list[TargetReplica]] = {}
    for t in snap.targets:
        if t.replica_id in free:
            by_key.setdefault((t.function, t.model_key), []).append(t)
    moves: list[MoveSequence] = []
    for s in sorted(snap.streams, key=lambda s: (s.tokens, s.request_id)):
        src = leaving.get(s.replica_id)
        if src is None:
            continue
        room = [t for t in by_key.get((src.function, src.model_key), ()) if free[t.replica_id] > 0]
        if room:
            best = min(room, key=lambda t: (-free[t.replica_id], t.replica_id))
            free[best.replica_id] -= 1
            moves.append(MoveSequence(s.request_id, s.replica_id, best.replica_id))
        elif src.cause.forced:
            moves.append(MoveSequence(s.request_id, s.replica_id, ""))
    return tuple(moves)


def park_wait_s(cause: LeaveCause, now_s: float, deadline_s: float | None,
                bound_s: float) -> float:
    """How long a move off a replica leaving for ``cause`` may wait for its destination's
    park before the source is asked to stop anyway (0: do not park). ``deadline_s``: when
    a draining host goes away (None when none is known)."""
    if bound_s <= 0:
        return 0.0
    if cause.forced and deadline_s is not None:
        return max(0.0, min(bound_s, (deadline_s - now_s) / 2))
    return bound_s


def worth_parking(together: int, tokens: int, min_tokens: int) -> bool:
    """Whether a move is parked first: when ``together`` > 1 sequences move to the same
    destination in one plan (their prefills would be one long pass inside the gap), or the
    sequence already holds ``min_tokens`` tokens or more (its prefill outgrows the one short
    extension pass that parking leaves in the gap)."""
    return together > 1 or tokens >= min_tokens
