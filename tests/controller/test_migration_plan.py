"""The pure live-migration decision (controller/state/migration.py): which sequences move
off a leaving replica and where."""

from __future__ import annotations

from flashpoint.controller.state.migration import (
    LeaveCause,
    LeavingReplica,
    MigrationSnapshot,
    MoveSequence,
    StreamInFlight,
    TargetReplica,
    plan_migrations,
)


def _snap(cause: LeaveCause, targets: tuple[TargetReplica, ...],
          streams: int = 3) -> MigrationSnapshot:
    return MigrationSnapshot(
        now_s=10.0,
        leaving=(LeavingReplica("r1", "llm", "lm@1", cause),),
        streams=tuple(StreamInFlight(f"q{i}", "r1", tokens=10 - i) for i in range(streams)),
        targets=targets)


def test_moves_go_to_the_least_loaded_room_youngest_first() -> None:
    targets = (TargetReplica("r2", "llm", "lm@1", 1), TargetReplica("r3", "llm", "lm@1", 2))
    moves = plan_migrations(_snap(LeaveCause.SCALE_DOWN, targets))
    # q2 has the fewest tokens: first, to r3 (2 free); then q1 to r2 or r3 (1 each: by id)
    assert moves == (MoveSequence("q2", "r1", "r3"), MoveSequence("q1", "r1", "r2"),
                     MoveSequence("q0", "r1", "r3"))


def test_scale_down_without_room_finishes_in_place() -> None:
    targets = (TargetReplica("r2", "llm", "lm@1", 1),)
    moves = plan_migrations(_snap(LeaveCause.SCALE_DOWN, targets))
    assert moves == (MoveSequence("q2", "r1", "r2"),)  # the other two stay


def test_forced_leave_without_room_goes_to_the_queue() -> None:
    for cause in (LeaveCause.HOST_DRAIN, LeaveCause.MIG):
        moves = plan_migrations(_snap(cause, (TargetReplica("r2", "llm", "lm@1", 1),)))
        assert moves == (MoveSequence("q2", "r1", "r2"), MoveSequence("q1", "r1", ""),
                         MoveSequence("q0", "r1", ""))


def test_only_same_function_and_version_and_never_another_leaver() -> None:
    snap = MigrationSnapshot(
        now_s=0.0,
        leaving=(LeavingReplica("r1", "llm", "lm@1", LeaveCause.HOST_DRAIN),
                 LeavingReplica("r4", "llm", "lm@1", LeaveCause.HOST_DRAIN)),
        streams=(StreamInFlight("a", "r1", 1), StreamInFlight("b", "r9", 1)),
        targets=(TargetReplica("r2", "llm", "lm@2", 5),  # another version (a canary)
                 TargetReplica("r3", "other", "lm@1", 5),  # another function
                 TargetReplica("r4", "llm", "lm@1", 5)))  # leaving too
    # "b" runs on a replica that is not leaving: untouched
    assert plan_migrations(snap) == (MoveSequence("a", "r1", ""),)


def test_cause_forced() -> None:
    assert not LeaveCause.SCALE_DOWN.forced
    assert LeaveCause.HOST_DRAIN.forced and LeaveCause.MIG.forced
