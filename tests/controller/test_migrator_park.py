"""Multi-round live migration, the controller's side (controller/migration.py; ServerlessLLM
§5) over fake workers: a move to another replica snapshots the source without stopping it,
parks the sequence on the destination, and only then asks the source to hand off; the wait
for the park is bounded (on timeout the source hands off anyway) and a forced drain near its
deadline does not park; a park nothing resumes -- its client left, its hand-off went to the
queue -- is dropped on the destination; a resume sent to the parking replica keeps it."""

from __future__ import annotations

import asyncio
from typing import Any

from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.handles import Pending
from flashpoint.controller.migration import Migrator
from flashpoint.controller.state.migration import LeaveCause, park_wait_s, worth_parking
from flashpoint.messages.base import to_payload
from flashpoint.messages.migration import ParkResult, SequenceHandOff, SequenceSnapshot
from tests.controller.test_migrator import _pending
from tests.controller.test_migrator import _setup as base_setup


class _GenWorker:
    """A generation replica's migration RPCs, recording the order they were called in."""

    def __init__(self, calls: list[tuple[str, str, tuple[str, ...]]], name: str, *,
                 park_code: str = "", park_hangs: bool = False,
                 tokens: tuple[int, ...] = (2,)) -> None:
        self.calls, self.name = calls, name
        # how many tokens each sequence has at each snapshot (the last one from then on)
        self.tokens = list(tokens)
        self.parked: list[tuple[int, ...]] = []  # the generated ids of each park
        self.park_code, self.park_hangs = park_code, park_hangs
        self.unparked: list[str] = []

    async def hand_off(self, request_ids: tuple[str, ...], timeout_s: float = 5.0) -> int:
        self.calls.append((self.name, "hand_off", request_ids))
        return len(request_ids)

    async def snapshot(self, request_ids: tuple[str, ...], timeout_s: float = 5.0
                       ) -> tuple[SequenceSnapshot, ...]:
        self.calls.append((self.name, "snapshot", request_ids))
        n = self.tokens.pop(0) if len(self.tokens) > 1 else self.tokens[0]
        return tuple(SequenceSnapshot(request_id=r, prompt_ids=(1, 2),
                                      generated_ids=tuple(range(5, 5 + n)), max_tokens=40)
                     for r in request_ids)

    async def park(self, snaps: tuple[SequenceSnapshot, ...], ttl_s: float, timeout_s: float
                   ) -> tuple[ParkResult, ...]:
        self.calls.append((self.name, "park", tuple(s.request_id for s in snaps)))
        self.parked += [s.generated_ids for s in snaps]
        if self.park_hangs:
            await asyncio.Event().wait()  # never ready: the controller's bound ends it
        return tuple(ParkResult(request_id=s.request_id, parked=not self.park_code,
                                code=self.park_code, prefill_s=0.01) for s in snaps)

    async def unpark(self, request_ids: tuple[str, ...], timeout_s: float = 5.0) -> int:
        self.unparked += request_ids
        return len(request_ids)


def _setup(*, draining: bool = False, deadline_s: float | None = None, room: int = 4,
           park_wait_s: float = 2.0, tokens: tuple[int, ...] = (2,), park_min_tokens: int = 0,
           **dest: Any
           ) -> tuple[Migrator, Dispatcher, dict[str, _GenWorker], list[Any], list[Any],
                      list[Any]]:
    calls: list[Any] = []
    workers = {"r1": _GenWorker(calls, "r1", tokens=tokens), "r2": _GenWorker(calls, "r2", **dest)}
    m, _, d, _, spawned, sent = base_setup(
        draining=draining, deadline_s=deadline_s, room=room, workers=workers,
        park_wait_s=park_wait_s, park_min_tokens=park_min_tokens)
    return m, d, workers, calls, spawned, sent


async def _run(spawned: list[Any]) -> None:
    for _ in range(10):  # bounded: each round may spawn an unpark
        if not spawned:
            return
        coros, spawned[:] = list(spawned), []
        for coro in coros:
            await coro


async def _moving(m: Migrator, spawned: list[Any], *request_ids: str) -> list[Pending]:
    """Streams ``request_ids`` running on the leaving r1, then a migration step and what it
    spawned, run to the end."""
    ps = [_pending(r) for r in request_ids]
    for p in ps:
        m.streams.open(p.request_id)
        m.sent(p, "r1")
    m.step(1.0)
    await _run(spawned)
    return ps


def _hand_off(m: Migrator, p: Pending) -> None:
    wire = to_payload(SequenceHandOff(prompt_ids=(1, 2), generated_ids=(5, 6, 7, 8),
                                      emitted_text="abcd", chunks=4))
    assert m.handled(p, {"handed_off": wire, "chunks": 4}, "r1")


async def test_the_destination_parks_before_the_source_is_asked_to_stop() -> None:
    m, d, workers, calls, spawned, sent = _setup()
    (p,) = await _moving(m, spawned, "q1")
    # round 2's snapshot finds no new token: no second park
    assert calls == [("r1", "snapshot", ("q1",)), ("r2", "park", ("q1",)),
                     ("r1", "snapshot", ("q1",)), ("r1", "hand_off", ("q1",))]
    _hand_off(m, p)
    await _run(spawned)
    assert sent == [(["q1"], "r2")] and d.inflight_of("r2") == 1
    p.future.set_result(({}, "r2"))  # finished there: its park was taken by the resume
    await _run(spawned)
    assert workers["r2"].unparked == []


async def test_later_rounds_park_what_the_source_made_meanwhile_until_it_is_little() -> None:
    """ServerlessLLM's multi-round move: while a round saw more than two new tokens,
    another round parks the longer snapshot (the destination extends its prefix); a round
    that sees at most two ends the rounds; never more than ``park_rounds``."""
    m, _, workers, calls, spawned, _ = _setup(tokens=(4, 14, 18, 19))
    (p,) = await _moving(m, spawned, "q1")
    assert [c[1] for c in calls] == ["snapshot", "park", "snapshot", "park", "snapshot",
                                     "park", "hand_off"]  # 3 rounds: park_rounds' default
    assert [len(g) for g in workers["r2"].parked] == [4, 14, 18]
    calls.clear()
    m, _, workers, calls, spawned, _ = _setup(tokens=(4, 9, 11))
    (p,) = await _moving(m, spawned, "q2")
    # round 2 saw 5 new tokens: parked; round 3 saw 2: not worth a round
    assert [c[1] for c in calls] == ["snapshot", "park", "snapshot", "park", "snapshot",
                                     "hand_off"]
    assert [len(g) for g in workers["r2"].parked] == [4, 9]


async def test_a_park_that_does_not_come_back_in_time_hands_off_anyway() -> None:
    m, _, workers, calls, spawned, sent = _setup(park_wait_s=0.05, park_hangs=True)
    p = _pending("q1")
    m.streams.open("q1")
    m.sent(p, "r1")
    m.step(1.0)
    async with asyncio.timeout(10):
        await _run(spawned)
    assert [c[1] for c in calls] == ["snapshot", "park", "hand_off"]
    # the park may yet complete there: the resume sent there finds (or discards) it
    _hand_off(m, p)
    await _run(spawned)
    assert sent == [(["q1"], "r2")]


async def test_a_refused_park_moves_as_before() -> None:
    m, _, workers, calls, spawned, sent = _setup(park_code="kv_cache_full")
    (p,) = await _moving(m, spawned, "q1")
    assert [c[1] for c in calls] == ["snapshot", "park", "hand_off"]  # no second round
    _hand_off(m, p)
    await _run(spawned)
    assert sent == [(["q1"], "r2")] and workers["r2"].unparked == []


async def test_a_client_that_leaves_after_the_park_frees_it_on_the_destination() -> None:
    m, _, workers, calls, spawned, _ = _setup()
    (p,) = await _moving(m, spawned, "q1")
    p.future.cancel()  # the client disconnected before the hand-off came back
    await asyncio.sleep(0)  # the future's done callbacks run on the next loop iteration
    await _run(spawned)
    assert workers["r2"].unparked == ["q1"]


async def test_a_hand_off_sent_to_the_queue_drops_its_park() -> None:
    m, d, workers, _, spawned, sent = _setup()
    (p,) = await _moving(m, spawned, "q1")
    for _ in range(4):  # the destination filled up meanwhile: no credit to claim
        d.claim("r2")
    _hand_off(m, p)
    await _run(spawned)
    assert not sent and d.queued("llm") == 1 and workers["r2"].unparked == ["q1"]


async def test_a_drain_close_to_its_deadline_does_not_wait_for_a_park() -> None:
    m, _, _, calls, spawned, _ = _setup(draining=True, deadline_s=1.0)
    p = _pending("q1")
    m.streams.open("q1")
    m.sent(p, "r1")
    m.step(1.0)  # at the deadline: no time to park
    await _run(spawned)
    assert calls == [("r1", "hand_off", ("q1",))]


def test_park_wait_bounds() -> None:
    assert park_wait_s(LeaveCause.SCALE_DOWN, 0.0, None, 2.0) == 2.0
    assert park_wait_s(LeaveCause.HOST_DRAIN, 0.0, 120.0, 2.0) == 2.0
    assert park_wait_s(LeaveCause.HOST_DRAIN, 0.0, 1.0, 2.0) == 0.5  # half the time left
    assert park_wait_s(LeaveCause.HOST_DRAIN, 5.0, 1.0, 2.0) == 0.0  # past it
    assert park_wait_s(LeaveCause.MIG, 0.0, None, 2.0) == 2.0
    assert park_wait_s(LeaveCause.SCALE_DOWN, 0.0, None, 0.0) == 0.0  # parking off


def test_worth_parking() -> None:
    assert worth_parking(2, 0, 128)  # two prefills would share the gap
    assert not worth_parking(1, 40, 128)  # a lone short one: its prefill ~ the extension
    assert worth_parking(1, 128, 128)  # a lone long one
    assert worth_parking(1, 0, 0)  # 0: every move to a replica is parked


async def test_a_lone_short_sequence_moves_in_one_round_and_several_are_parked() -> None:
    m, _, _, calls, spawned, _ = _setup(park_min_tokens=100)
    (p,) = await _moving(m, spawned, "q1")
    assert calls == [("r1", "hand_off", ("q1",))]  # no snapshot, no park
    m, _, _, calls, spawned, _ = _setup(park_min_tokens=100)
    ps = [_pending(r) for r in ("q1", "q2")]
    for p in ps:
        m.streams.open(p.request_id)
        m.sent(p, "r1")
    m.step(1.0)
    await _run(spawned)
    assert ("r2", "park", ("q1", "q2")) in calls or {
        c[2] for c in calls if c[1] == "park"} == {("q1",), ("q2",)}, calls
    assert calls[-1][1] == "hand_off"
