"""Live migration of in-flight generations, the controller's I/O half (issue 21 item 5).

When a replica stops taking work (scale-down, a draining host, a MIG reconfiguration) the
streamed generations it runs move to other replicas instead of holding it until they end:

1. :meth:`Migrator.step` (each control step, and at once when a replica leaves) builds a
   :class:`~flashpoint.controller.state.migration.MigrationSnapshot` and asks the pure
   :func:`~flashpoint.controller.state.migration.plan_migrations` which sequences move and
   where, then asks each source worker to hand those off (``hand_off``,
   ``messages/migration.py``).
   A move to a destination replica is multi-round (ServerlessLLM §5; :meth:`Migrator.
   _park_then_ask`): the source is first asked for the sequences' tokens so far without
   stopping (``snapshot_sequences``), the destination prefills them ahead and holds the
   caches under the request ids (``park_sequences``, answered once ready); while the source
   made more than ``ROUND_TOKENS`` tokens during a round, another round (``park_rounds`` at
   most) parks a new snapshot, which the destination adds to the parked cache in a small
   pass, each round shorter than the one before. Only then is the source asked to hand
   off: the destination's prefill overlaps the source's generation instead of the client's
   gap, and on the resume the destination extends the parked cache by the few tokens
   generated meanwhile. The wait for the park is bounded
   (``park_wait_s``; a forced drain at most half its time left): past it, or when the park
   is refused (no KV room), the source hands off anyway and the destination prefills as
   before. A park nothing will resume -- the request finished on its source, its client
   left, the hand-off went to the queue -- is dropped (``unpark_sequences``); the worker
   also drops one after ``park_ttl_s``.
2. The source stops each one at its next token boundary; the sequence's own ``infer`` call
   answers with a :class:`~flashpoint.messages.migration.SequenceHandOff` (its tokens so
   far, the text its client has, the sampler's state, its chunk count) instead of outputs.
3. :meth:`Migrator.handed_off` sends the same request on with that hand-off as ``resume``:
   to the destination chosen for it while it has a free credit, else to the front of its
   function's queue (the next replica with room, or the one the autoscaler starts). Its
   deadline, attempts and caller are unchanged; the client's stream goes on from the next
   chunk index (``gateway/streams.py`` orders the chunks of both replicas and records the
   gap).

The source's credit is released when its call returns, so a leaving replica is stopped (the
state's idle check) only after its sequences have moved or finished. Only streamed requests
move; a non-streamed generation finishes where it runs. A pipeline group serving a cold
generation model (``controller/pipeline_target.py``) leaves the same way once it stops taking
work (its stages completed into whole replicas): it is a source like a replica leaving by
choice, and its sequences go on on the whole replicas.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter, Histogram

from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.handles import Pending, WorkerHandle
from flashpoint.controller.state import core as cs
from flashpoint.controller.state.migration import (
    LeaveCause,
    LeavingReplica,
    MigrationSnapshot,
    MoveSequence,
    StreamInFlight,
    TargetReplica,
    park_wait_s,
    plan_migrations,
    worth_parking,
)
from flashpoint.controller.state.records import GroupPhase
from flashpoint.errors import FlashpointError
from flashpoint.gateway.streams import StreamRegistry
from flashpoint.log import get_logger
from flashpoint.messages.base import from_payload
from flashpoint.messages.migration import InferHandedOff, SequenceHandOff

log = get_logger("flashpoint.controller.migration")

MIGRATIONS = Counter("flashpoint_migrations_total",
                     "Generations moved off a leaving replica", ["cause"])
MIGRATION_GAP = Histogram(
    "flashpoint_migration_gap_seconds",
    "Per moved stream: from the source's last token to the destination's first",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
# A later park round is not worth its round trips once the source made at most this many
# tokens during the round before: the resume's pass adds them as cheaply.
ROUND_TOKENS = 2
PARKS = Counter("flashpoint_migration_parks_total",
                "Sequences prefilled ahead on their destination before a move, by outcome "
                "(parked, or why not: kv_cache_full, timeout, ...)", ["outcome"])


class Migrator:
    """See the module docstring. ``send(ps, replica_id)`` is the request path's send (it
    releases the credit it was given); ``pump(function)`` dispatches a function's queue.
    ``park_wait_s``: how long a move waits for its destination's park (0: moves are not
    parked, the single-round move); ``park_ttl_s``: how long a worker keeps a park that
    nothing resumes; ``park_rounds``: at most this many park rounds a move (module
    docstring); ``park_min_tokens``: a sequence moving alone is parked only from this many
    tokens on (``worth_parking``)."""

    def __init__(self, state: cs.ControllerState, dispatcher: Dispatcher,
                 streams: StreamRegistry, workers: dict[str, WorkerHandle],
                 spawn: Callable[[Any, str], asyncio.Task],
                 send: Callable[[list[Pending], str], Awaitable[None]],
                 pump: Callable[[str], None], *, park_wait_s: float = 2.0,
                 park_ttl_s: float = 10.0, park_rounds: int = 3,
                 park_min_tokens: int = 0) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.streams = streams
        self.workers = workers
        self.spawn = spawn
        self.send = send
        self.pump = pump
        self._where: dict[str, tuple[Pending, str]] = {}  # request id -> (it, its replica)
        self._asked: dict[str, tuple[str, LeaveCause]] = {}  # request id -> (dest, cause)
        self._parked: dict[str, str] = {}  # request id -> the replica parking it
        self.park_wait_s = park_wait_s
        self.park_ttl_s = park_ttl_s
        self.park_rounds = park_rounds
        self.park_min_tokens = park_min_tokens
        self._soon = False

    # the request path's hooks ------------------------------------------------------------
    def sent(self, p: Pending, replica_id: str) -> None:
        """A streamed request went to ``replica_id``."""
        self._where[p.request_id] = (p, replica_id)

    def handled(self, p: Pending, reply: dict[str, Any], replica_id: str) -> bool:
        """Whether ``reply`` (of ``p`` from ``replica_id``) is a hand-off, now sent on."""
        if "handed_off" not in reply:
            return False
        msg = from_payload(InferHandedOff, reply, method="infer")
        self.handed_off(p, msg.handed_off, reply["handed_off"], replica_id)
        return True

    def soon(self) -> None:
        """A replica left: plan at the end of this loop iteration, not at the next tick."""
        if self._soon:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a state driven synchronously): the next tick plans
            return
        self._soon = True
        loop.call_soon(self._step_soon)

    def _step_soon(self) -> None:
        self._soon = False
        self.step(time.monotonic())

    # planning ----------------------------------------------------------------------------
    def step(self, now_s: float) -> None:
        """Ask the pure plan what moves now and ask the sources (never raises)."""
        try:
            self._step(now_s)
        except Exception:  # a failed step must not take the control loop with it
            log.exception("migration_step_failed")

    def _step(self, now_s: float) -> None:
        for rid, (p, _) in list(self._where.items()):
            if p.future.done():
                self._where.pop(rid, None)
                self._asked.pop(rid, None)
        snap = self.snapshot(now_s)
        if not snap.streams:
            return
        causes = {r.replica_id: r.cause for r in snap.leaving}
        by_source: dict[str, list[str]] = {}
        to_park: dict[str, list[MoveSequence]] = {}
        waits: dict[str, float] = {}
        moves = plan_migrations(snap)
        tokens = {s.request_id: s.tokens for s in snap.streams}
        together = collections.Counter(m.destination for m in moves)
        for move in moves:
            cause = causes[move.source]
            self._asked[move.request_id] = (move.destination, cause)
            wait = self._park_wait(move, cause, now_s) if worth_parking(
                together[move.destination], tokens.get(move.request_id, 0),
                self.park_min_tokens) else 0.0
            if wait > 0:
                to_park.setdefault(move.source, []).append(move)
                waits[move.source] = min(wait, waits.get(move.source, wait))
            else:
                by_source.setdefault(move.source, []).append(move.request_id)
        for source, request_ids in by_source.items():
            self.spawn(self._ask(source, tuple(request_ids)), f"hand-off:{source}")
        for source, moves in to_park.items():
            self.spawn(self._park_then_ask(source, tuple(moves), waits[source]),
                       f"park:{source}")

    def _park_wait(self, move: MoveSequence, cause: LeaveCause, now_s: float) -> float:
        """How long ``move`` may wait for a park on its destination (0: not parked)."""
        if not move.destination or not getattr(self.workers.get(move.destination),
                                               "generates", True) \
                or not hasattr(self.workers.get(move.source), "snapshot"):
            return 0.0  # to the queue, or a source that cannot be read (a pipeline group)
        rep = self.state.replicas.get(move.source)
        host = self.state.hosts.get(rep.host_id) if rep is not None else None
        deadline = host.drain_deadline_s if host is not None and host.draining else None
        return park_wait_s(cause, now_s, deadline, self.park_wait_s)

    def snapshot(self, now_s: float) -> MigrationSnapshot:
        """Leaving replicas that run streams not yet asked to move, and where they may go."""
        on: dict[str, list[StreamInFlight]] = {}
        for request_id, (_, rid) in self._where.items():
            if request_id not in self._asked:
                on.setdefault(rid, []).append(StreamInFlight(
                    request_id, rid, self.streams.chunks(request_id)))
        leaving: list[LeavingReplica] = []
        for rid in on:
            rep = self.state.replicas.get(rid)
            if rep is not None and rep.phase == cs.ReplicaPhase.STOPPING and not rep.group_id:
                leaving.append(LeavingReplica(rid, rep.function, rep.model_key,
                                              self._cause(rep)))
            elif (group := self.state.groups.get(rid)) is not None \
                    and group.phase == GroupPhase.STOPPING \
                    and getattr(self.workers.get(rid), "generates", False) \
                    and (fn := self.state.functions.get(group.function)) is not None:
                # A pipeline serving a cold generation model stops once its stages are
                # whole replicas (or it is retired): its sequences move to them when they
                # have room, else finish in the pipeline (issue 21 item 6).
                leaving.append(LeavingReplica(rid, group.function, fn.model_key,
                                              LeaveCause.SCALE_DOWN))
        functions = {r.function for r in leaving}
        targets = tuple(
            TargetReplica(r.replica_id, r.function, r.model_key,
                          self.dispatcher.free_credits(r.replica_id))
            for r in self.state.replicas.values()
            if r.function in functions and r.phase == cs.ReplicaPhase.WARM
            and r.replica_id in self.workers and not self._cause_forced(r))
        mine = {r.replica_id for r in leaving}
        return MigrationSnapshot(now_s, tuple(leaving),
                                 tuple(s for rid in mine for s in on[rid]), targets)

    def _cause(self, rep: cs.ReplicaRecord) -> LeaveCause:
        host = self.state.hosts.get(rep.host_id)
        if host is not None and host.draining:
            return LeaveCause.HOST_DRAIN
        if (rep.host_id, rep.device_id) in self.state.blocked:
            return LeaveCause.MIG
        return LeaveCause.SCALE_DOWN

    def _cause_forced(self, rep: cs.ReplicaRecord) -> bool:
        """A replica about to be forced out is no destination either."""
        return self._cause(rep).forced

    async def _ask(self, source: str, request_ids: tuple[str, ...]) -> None:
        handle = self.workers.get(source)
        if handle is None:
            return  # gone: its calls fail and are handled as failures
        try:
            count = await handle.hand_off(request_ids)
        except FlashpointError as exc:
            # Asked again at the next step (an old worker without hand_off: they finish).
            log.warning("hand_off_failed", replica_id=source, error=exc.code)
            for rid in request_ids:
                self._asked.pop(rid, None)
            return
        log.info("hand_off_asked", replica_id=source, sequences=len(request_ids),
                 handing_off=count)

    async def _park_then_ask(self, source: str, moves: tuple[MoveSequence, ...],
                             wait_s: float) -> None:
        """The multi-round move (module docstring): snapshot on ``source``, park on each
        destination, then hand off -- after ``wait_s`` at most, parked or not."""
        request_ids = tuple(m.request_id for m in moves)
        started = time.monotonic()
        try:
            async with asyncio.timeout(wait_s):
                await self._park(source, moves, wait_s)
        except (TimeoutError, FlashpointError) as exc:  # moves on unparked (or half)
            outcome = "timeout" if isinstance(exc, TimeoutError) else exc.code
            PARKS.labels(outcome).inc(len(request_ids))
            log.info("park_skipped", replica_id=source, sequences=len(request_ids),
                     outcome=outcome)
        log.info("park_round", replica_id=source, sequences=len(request_ids),
                 parked=sum(r in self._parked for r in request_ids),
                 took_ms=round((time.monotonic() - started) * 1e3, 1))
        await self._ask(source, request_ids)

    async def _park(self, source: str, moves: tuple[MoveSequence, ...], wait_s: float
                    ) -> None:
        """Round 1 parks the sequences' snapshots; each later round (``park_rounds`` in
        all) parks a new snapshot of those parked, which the destination extends by the
        tokens generated during the round before -- until a round finds at most
        ``ROUND_TOKENS`` new tokens, few enough for the resume's own pass."""
        src = self.workers.get(source)
        if src is None:
            return
        dest_of = {m.request_id: m.destination for m in moves}
        seen: dict[str, int] = {}  # request id -> tokens in its last parked snapshot
        ids = tuple(dest_of)
        for round_ in range(max(1, self.park_rounds)):
            snaps = await src.snapshot(ids, timeout_s=wait_s)
            grown = max((len(s.generated_ids) - seen.get(s.request_id, 0) for s in snaps),
                        default=0)
            if round_ and grown <= ROUND_TOKENS:
                return
            by_dest: dict[str, list[Any]] = {}
            for snap in snaps:
                pending = self._where.get(snap.request_id)
                if pending is None or pending[0].future.done():
                    continue  # finished (or its caller left) meanwhile
                if round_ and self._parked.get(snap.request_id) != dest_of[snap.request_id]:
                    continue  # its first park was refused
                by_dest.setdefault(dest_of[snap.request_id], []).append(snap)
                if not round_:
                    self._track_park(pending[0], dest_of[snap.request_id])
                seen[snap.request_id] = len(snap.generated_ids)
            await asyncio.gather(*(self._park_on(d, tuple(s)) for d, s in by_dest.items()))
            ids = tuple(r for r in dest_of if self._parked.get(r) == dest_of[r])
            if not ids:
                return

    def _track_park(self, p: Pending, destination: str) -> None:
        """``p`` is (being) parked on ``destination``: drop it there should the request end
        anywhere but in a resume there (its client leaving included)."""
        self._parked[p.request_id] = destination
        p.future.add_done_callback(lambda _f, rid=p.request_id: self._unpark(rid))

    async def _park_on(self, destination: str, snaps: tuple[Any, ...]) -> None:
        handle = self.workers.get(destination)
        if handle is None:
            return
        results = await handle.park(snaps, self.park_ttl_s, timeout_s=self.park_wait_s + 1.0)
        for r in results:
            PARKS.labels("parked" if r.parked else r.code or "refused").inc()
            if not r.parked:
                self._parked.pop(r.request_id, None)
                log.info("park_refused", request_id=r.request_id, replica_id=destination,
                         code=r.code)

    def _unpark(self, request_id: str) -> None:
        """Drop ``request_id``'s park, if it still has one (never raises)."""
        destination = self._parked.pop(request_id, None)
        handle = self.workers.get(destination) if destination else None
        if handle is not None:
            self.spawn(self._unpark_on(handle, request_id), f"unpark:{request_id}")

    async def _unpark_on(self, handle: WorkerHandle, request_id: str) -> None:
        try:
            await handle.unpark((request_id,))
        except FlashpointError as exc:  # gone: its parks went with it (or expire there)
            log.info("unpark_failed", request_id=request_id, error=exc.code)

    # sending on ---------------------------------------------------------------------------
    def handed_off(self, p: Pending, msg: SequenceHandOff, wire: dict[str, Any],
                   source: str) -> None:
        """``p`` left ``source`` with ``msg``: send it on, resuming from there."""
        destination, cause = self._asked.pop(p.request_id, ("", LeaveCause.SCALE_DOWN))
        self._where.pop(p.request_id, None)
        p.payload["resume"] = wire
        self.streams.moved(p.request_id, msg.chunks)
        MIGRATIONS.labels(str(cause)).inc()
        log.info("sequence_handed_off", request_id=p.request_id, source=source,
                 destination=destination or "queue", tokens=len(msg.generated_ids),
                 chunks=msg.chunks, cause=str(cause))
        if p.future.done():
            return  # its caller left meanwhile (its park is dropped by the future's callback)
        if destination and destination in self.workers and self.dispatcher.claim(destination):
            if self._parked.get(p.request_id) == destination:
                del self._parked[p.request_id]  # the resume takes its park there
            self._unpark(p.request_id)  # one parked anywhere else
            self.spawn(self.send([p], destination), f"send:{p.request_id}")
            return
        self._unpark(p.request_id)
        self.dispatcher.enqueue(p.function, p, front=True, best_effort=p.best_effort)
        self.pump(p.function)
