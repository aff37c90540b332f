"""The controller's migration I/O (controller/migration.py) over fakes: which leaving
replicas it asks to hand sequences off (a draining host, a GPU blocked for a MIG geometry, a
scale-down only when another replica has room), and how a hand-off is sent on (to the chosen
destination with a credit claimed, else to the front of the queue) with its resume payload."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.handles import Pending
from flashpoint.controller.migration import Migrator
from flashpoint.controller.state.core import HostRecord, ReplicaPhase, ReplicaRecord
from flashpoint.controller.state.records import GroupPhase, GroupRecord
from flashpoint.gateway.streams import StreamRegistry
from flashpoint.messages.base import to_payload
from flashpoint.messages.migration import SequenceHandOff


@dataclass
class _State:
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    blocked: set[tuple[str, str]] = field(default_factory=set)
    groups: dict[str, GroupRecord] = field(default_factory=dict)
    functions: dict[str, Any] = field(default_factory=dict)


class _Worker:
    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []

    async def hand_off(self, request_ids: tuple[str, ...], timeout_s: float = 5.0) -> int:
        self.asked.append(request_ids)
        return len(request_ids)


def _rep(rid: str, host: str, phase: ReplicaPhase) -> ReplicaRecord:
    return ReplicaRecord(rid, "llm", host, "cpu0", 1, phase, 0.0, model_key="lm@1")


def _setup(*, draining: bool = False, blocked: bool = False, room: int = 4,
           deadline_s: float | None = None, workers: dict[str, Any] | None = None,
           **migrator: Any
           ) -> tuple[Migrator, _State, Dispatcher, dict[str, Any], list[Any], list[Any]]:
    """A migrator over leaving replica r1 (host h1) and warm r2 (host h0, ``room`` free
    credits); ``workers`` their fakes (default: hand-off only); ``migrator``: its options."""
    state = _State()
    state.hosts = {h: HostRecord(h, {}, 0, set(), 0.0) for h in ("h0", "h1")}
    state.hosts["h1"].draining = draining
    state.hosts["h1"].drain_deadline_s = deadline_s
    if blocked:
        state.blocked.add(("h1", "cpu0"))
    state.replicas = {"r1": _rep("r1", "h1", ReplicaPhase.STOPPING),
                      "r2": _rep("r2", "h0", ReplicaPhase.WARM)}
    d = Dispatcher()
    d.add_replica("r1", "llm", 4)
    d.stop_accepting("r1")
    d.add_replica("r2", "llm", 4)
    for _ in range(4 - room):
        d.claim("r2")
    if workers is None:
        workers = {"r1": _Worker(), "r2": _Worker()}
    spawned: list[Any] = []
    sent: list[Any] = []

    async def send(ps: list[Pending], rid: str) -> None:
        sent.append(([p.request_id for p in ps], rid))

    def spawn(coro: Any, name: str) -> Any:
        spawned.append(coro)

    m = Migrator(state, d, StreamRegistry(), workers, spawn, send,  # type: ignore[arg-type]
                 lambda name: None, **migrator)
    return m, state, d, workers, spawned, sent


def _pending(rid: str) -> Pending:
    return Pending(rid, "llm", {"request_id": rid}, asyncio.get_running_loop().create_future(),
                   0.0, 1e9, False, stream=True)


async def _run(spawned: list[Any]) -> None:
    for coro in spawned:
        await coro
    spawned.clear()


async def test_scale_down_moves_to_a_replica_with_room_and_sends_on() -> None:
    m, _, d, workers, spawned, sent = _setup()
    p = _pending("q1")
    m.streams.open("q1")
    m.sent(p, "r1")
    m.step(1.0)
    await _run(spawned)
    assert workers["r1"].asked == [("q1",)]
    m.step(1.1)  # asked already: not again
    assert not spawned
    wire = to_payload(SequenceHandOff(prompt_ids=(1, 2), generated_ids=(5, 6, 7),
                                      emitted_text="abc", chunks=3))
    assert m.handled(p, {"handed_off": wire, "chunks": 3}, "r1")
    await _run(spawned)
    assert sent == [(["q1"], "r2")] and d.inflight_of("r2") == 1  # its credit claimed
    assert p.payload["resume"] == wire
    assert not m.handled(p, {"outputs": {}}, "r2")  # an ordinary reply is not a hand-off


async def test_scale_down_without_room_stays() -> None:
    m, _, _, workers, spawned, _ = _setup(room=0)
    m.streams.open("q1")
    m.sent(_pending("q1"), "r1")
    m.step(1.0)
    assert not spawned and workers["r1"].asked == []


async def test_drain_and_mig_move_even_without_room_via_the_queue() -> None:
    for how in ("draining", "blocked"):
        m, _, d, workers, spawned, sent = _setup(room=0, **{how: True})
        p = _pending("q1")
        m.streams.open("q1")
        m.sent(p, "r1")
        m.step(1.0)
        await _run(spawned)
        assert workers["r1"].asked == [("q1",)], how
        wire = to_payload(SequenceHandOff(prompt_ids=(1,), generated_ids=(2,),
                                          emitted_text="", chunks=1))
        assert m.handled(p, {"handed_off": wire, "chunks": 1}, "r1")
        assert not sent and d.queued("llm") == 1  # to the front of its queue


async def test_finished_streams_are_forgotten() -> None:
    m, _, _, workers, spawned, _ = _setup()
    p = _pending("q1")
    m.sent(p, "r1")
    p.future.set_result(({}, "r1"))
    m.step(1.0)
    assert not spawned and workers["r1"].asked == []


class _Pipeline(_Worker):
    def __init__(self, generates: bool) -> None:
        super().__init__()
        self.generates = generates


async def test_a_stopping_generation_pipeline_moves_its_streams_to_whole_replicas() -> None:
    """Issue 21 item 6: a group serving a cold generation model, stopped once its stages are
    whole, is a source leaving by choice; a group of another model is not (its requests are
    one-shot)."""
    from types import SimpleNamespace

    for generates in (True, False):
        m, state, d, workers, spawned, sent = _setup()
        state.functions["llm"] = SimpleNamespace(model_key="lm@1")
        state.groups["g1"] = GroupRecord("g1", "llm", ("s1", "s2"), GroupPhase.STOPPING, 0.0)
        d.add_replica("g1", "llm", 4)
        d.stop_accepting("g1")
        workers["g1"] = _Pipeline(generates)
        p = _pending("q1")
        m.streams.open("q1")
        m.sent(p, "g1")
        m.step(1.0)
        await _run(spawned)
        if not generates:
            assert workers["g1"].asked == []
            continue
        assert workers["g1"].asked == [("q1",)]
        wire = to_payload(SequenceHandOff(prompt_ids=(1, 2), generated_ids=(5,),
                                          emitted_text="a", chunks=1))
        assert m.handled(p, {"handed_off": wire, "chunks": 1}, "g1")
        await _run(spawned)
        assert sent == [(["q1"], "r2")] and p.payload["resume"] == wire
