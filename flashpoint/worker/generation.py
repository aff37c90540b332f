"""The worker's generation loop: drives one :class:`~flashpoint.models.generate.GenerationEngine`
from the event loop, in place of the batcher, for a text-generation replica.

Requests join the engine and cancellations reach it only between steps, on the event
loop; each step (one token for every running sequence) runs on the model thread. A caller
either awaits the whole result (:meth:`GenerationLoop.submit`, the ``infer`` RPC) or reads
its tokens as they come (:meth:`GenerationLoop.stream`); a caller that stops waiting -- its
task cancelled, its stream closed -- cancels its sequence, which frees its KV cache at the
next token boundary. A step that raises fails the sequences it held, never the replica.
The waiting queue is bounded: past it a request is refused with ``kv_cache_full`` (429).

Live migration: :meth:`GenerationLoop.hand_off` takes keyed sequences out at the next token
boundary; each one's stream then ends with :attr:`SequenceStream.handed_off`, the
:class:`~flashpoint.models.generate.SequenceProgress` another replica resumes from.
Multi-round (ServerlessLLM §5): :meth:`GenerationLoop.snapshot` reads a running sequence's
tokens without stopping it; on the destination :meth:`GenerationLoop.park` prefills them
ahead (:mod:`flashpoint.models.parking`) and answers once the cache is ready, so the resumed
sequence later only extends it. Parks are dropped by :meth:`GenerationLoop.unpark`, by the
resume, or when their time is up (checked between steps, and by the idle loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from flashpoint.errors import FlashpointError, KvCacheFull, ModelFailed, Unavailable
from flashpoint.log import get_logger
from flashpoint.messages.migration import ParkResult, SequenceHandOff, SequenceSnapshot
from flashpoint.models.generate import (
    FinishReason,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SequenceProgress,
    TokenEvent,
)
from flashpoint.worker.replica_stats import ReplicaStats

log = get_logger("flashpoint.generation")

_DONE = object()


@dataclass(eq=False)
class _Sink:
    """Where one sequence's tokens go."""

    request: GenerationRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    finished: bool = False
    enqueued_s: float = field(default_factory=time.perf_counter)
    key: str = ""  # the caller's name for it (its request id): what hand_off selects by
    prefill_s: float = 0.0  # how long its prefill took here (the pass it joined in)
    park_prefill_s: float | None = None  # resumed onto a parked prefix: that pass's time


@dataclass(frozen=True)
class _HandedOff:
    """A sink's last item when its sequence left for another replica."""

    progress: SequenceProgress


class GenerationLoop:
    """See the module docstring. ``max_waiting`` bounds the sequences queued for room."""

    def __init__(self, engine: GenerationEngine, *, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._joining: list[_Sink] = []
        self._cancelling: list[_Sink] = []
        self._handing: list[_Sink] = []  # to leave at the next token boundary (hand_off)
        # live migration's parks: asked for (applied between steps), and their waiters
        self._parking: list[tuple[SequenceSnapshot, float]] = []
        self._unparking: list[str] = []
        self._park_waiters: dict[str, asyncio.Future] = {}
        self._sinks: dict[int, _Sink] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # no sequence joining, waiting or running
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._task: asyncio.Task | None = None
        self.stats = ReplicaStats()
        self.batches_run = 0  # steps

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="generation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        err = Unavailable("replica stopping", retry_after_s=0.1)
        for sink in [*self._joining, *self._sinks.values()]:
            self._end(sink, err)
        for key in list(self._park_waiters):
            self._parked(key, ParkResult(request_id=key, parked=False, code=err.code))
        for key in list(self.engine.parked):
            self.engine.unpark(key)
        self._joining.clear()
        self._sinks.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def depth(self) -> int:
        """Sequences not yet running."""
        return len(self._joining) + len(self.engine.waiting)

    async def wait_idle(self) -> None:
        """Until no sequence joins, waits or runs (every cancelled one has left: a drain)."""
        while True:
            await self._idle.wait()
            if self.engine.idle and not self._joining and not self._cancelling \
                    and not self._handing and not self._parking:
                return
            self._idle.clear()

    @property
    def running(self) -> int:
        return len(self.engine.running)

    # -- callers ------------------------------------------------------------------------
    def stream(self, request: GenerationRequest, *, key: str = "") -> SequenceStream:
        """Join now (KvCacheFull when too many wait) and iterate the sequence's token
        events as they come; the last one has ``finish`` set. Closing the stream before
        its end (``aclose``) cancels the sequence. ``key`` names it for :meth:`hand_off`."""
        sink = self._join(request)
        sink.key = key
        return SequenceStream(self, sink)

    def hand_off(self, keys: Collection[str]) -> int:
        """Take the sequences streamed under ``keys`` out at the next token boundary, for
        another replica to resume (live migration): each one's stream ends after the last
        token it generated here, with :attr:`SequenceStream.handed_off` set. How many will
        leave (finished or unknown keys are skipped; asking twice is harmless)."""
        wanted = set(keys) - {""}  # an unnamed sequence cannot be asked for
        count = 0
        for sink in list(self._joining):  # not in the engine yet: leaves as it came
            if sink.key in wanted and not sink.finished:
                self._joining.remove(sink)
                self._end(sink, _HandedOff(sink.request.progress or SequenceProgress((), "")))
                count += 1
        for sink in self._sinks.values():
            if sink.key in wanted and not sink.finished:
                if sink not in self._handing:
                    self._handing.append(sink)
                count += 1
        if self._handing:
            self._idle.clear()
            self._wake.set()
        return count

    def snapshot(self, keys: Collection[str]) -> list[SequenceSnapshot]:
        """The running sequences streamed under ``keys`` as they are now, without stopping
        them (the first round of a move: the destination parks them). A step may be adding
        a token meanwhile: any prefix is fine, the resume extends from what was parked."""
        wanted = set(keys) - {""}
        out = []
        for sink in list(self._sinks.values()):
            seq = self.engine.running.get(sink.seq_id) if sink.seq_id is not None else None
            if sink.key in wanted and seq is not None and not sink.finished:
                out.append(SequenceSnapshot(
                    request_id=sink.key, prompt_ids=tuple(seq.prompt_ids),
                    generated_ids=tuple(seq.generated), max_tokens=seq.params.max_tokens))
        return out

    async def park(self, snapshots: Collection[SequenceSnapshot], *, ttl_s: float
                   ) -> list[ParkResult]:
        """Prefill each snapshot's tokens ahead of its resume (module docstring); answers
        once every one is ready or refused (``code``: why, e.g. ``kv_cache_full``). A park
        nothing resumes is dropped after ``ttl_s``. A later round (a longer snapshot of a
        sequence parked here) extends its prefix by the new tokens only."""
        loop = asyncio.get_running_loop()
        waiters = []
        for snap in snapshots:
            old = self._park_waiters.pop(snap.request_id, None)
            if old is not None and not old.done():
                old.set_result(ParkResult(request_id=snap.request_id, parked=False,
                                          code="replaced"))
            fut = loop.create_future()
            self._park_waiters[snap.request_id] = fut
            self._parking.append((snap, time.monotonic() + ttl_s))
            waiters.append(fut)
        self._idle.clear()
        self._wake.set()
        return list(await asyncio.gather(*waiters))

    def unpark(self, keys: Collection[str]) -> int:
        """Drop the parks under ``keys`` (their sequences resumed elsewhere, finished, or
        their clients left) at the next token boundary; how many were asked for here."""
        count = 0
        for key in keys:
            if key in self.engine.parked or key in self._park_waiters:
                self._unparking.append(key)
                count += 1
        if count:
            self._wake.set()
        return count

    @property
    def parked_bytes(self) -> int:
        """KV budget the parks hold now."""
        return self.engine.parked_bytes

    def _parked(self, key: str, result: ParkResult) -> None:
        fut = self._park_waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def _apply_parks(self) -> None:
        """Parks and unparks asked for, and expiry, applied while no step runs."""
        for key in self._unparking:
            self.engine.unpark(key)
            self._parked(key, ParkResult(request_id=key, parked=False, code="unparked"))
        self._unparking.clear()
        for key in self.engine.expire(time.monotonic()):
            log.info("park_expired", request_id=key)
            self._parked(key, ParkResult(request_id=key, parked=False, code="expired"))
        parking, self._parking = self._parking, []
        for snap, expires_s in parking:
            if snap.request_id not in self._park_waiters:
                continue  # replaced or dropped meanwhile
            try:
                ready = self.engine.park(snap.request_id, snap.prompt_ids, snap.generated_ids,
                                         SamplingParams(max_tokens=snap.max_tokens),
                                         expires_s=expires_s)
            except FlashpointError as exc:
                self._parked(snap.request_id, ParkResult(request_id=snap.request_id,
                                                         parked=False, code=exc.code))
                continue
            if ready:  # a later round with nothing new to add
                self._parked(snap.request_id, ParkResult(request_id=snap.request_id,
                                                         parked=True))

    def _settle_parks(self, err: FlashpointError) -> None:
        """After a failed step: answer the parks it may have prefilled (a park whose pass
        failed is dropped, with ``err``'s code)."""
        for key in [k for k in self._park_waiters if k in self.engine.parked]:
            entry = self.engine.parked[key]
            if entry.ready:
                self._parked(key, ParkResult(request_id=key, parked=True,
                                             prefill_s=entry.prefill_s))
            else:
                self.engine.unpark(key)
                self._parked(key, ParkResult(request_id=key, parked=False, code=err.code))

    def _next_expiry(self) -> float | None:
        """Seconds until the next park expires (None when none is parked)."""
        if not self.engine.parked:
            return None
        return max(0.0, min(e.expires_s for e in self.engine.parked.values())
                   - time.monotonic())

    async def submit(self, request: GenerationRequest, *, alone: bool = True,
                     best_effort: bool = False) -> tuple[GenerationResult, dict[str, float]]:
        """The whole sequence, and its timings (``batch_wait``: until its first token)."""
        return await self._collect(self.stream(request))

    def enqueue(self, request: GenerationRequest, *, best_effort: bool = False) -> asyncio.Future:
        """:meth:`submit` as a future, joined now (several requests of one frame)."""
        return asyncio.ensure_future(self._collect(self.stream(request)))

    async def _collect(self, stream: SequenceStream
                       ) -> tuple[GenerationResult, dict[str, float]]:
        started = time.perf_counter()
        first_s = None
        ids: list[int] = []
        text = ""
        finish = FinishReason.LENGTH
        try:
            async for event in stream:
                if first_s is None:
                    first_s = time.perf_counter() - started
                if event.token_id is not None:
                    ids.append(event.token_id)
                text += event.text_delta
                if event.finish is not None:
                    finish = event.finish
        finally:
            await stream.aclose()
        total = time.perf_counter() - started
        return (GenerationResult(len(stream.request.prompt_ids), tuple(ids), text, finish),
                {"batch_wait": first_s or 0.0, "inference": total - (first_s or 0.0),
                 "batch_rows": float(len(ids))})

    def _join(self, request: GenerationRequest) -> _Sink:
        if self.depth >= self.max_waiting:
            raise KvCacheFull(f"{self.depth} sequences already wait for KV-cache room",
                              retry_after_s=0.5)
        sink = _Sink(request)
        self._joining.append(sink)
        self._idle.clear()
        self._wake.set()
        return sink

    def _cancel(self, sink: _Sink) -> None:
        sink.finished = True
        if sink in self._joining:
            self._joining.remove(sink)
            return
        self._cancelling.append(sink)
        self._idle.clear()
        self._wake.set()

    def _end(self, sink: _Sink, item: TokenEvent | _HandedOff | BaseException) -> None:
        if not sink.finished:
            sink.events.put_nowait(item)
        if not isinstance(item, TokenEvent) or item.finish is not None:
            sink.finished = True

    # -- the loop -----------------------------------------------------------------------
    def _between_steps(self) -> None:
        """Joins, cancellations and parks, applied while no step runs."""
        self._apply_parks()
        for sink in self._cancelling:
            if sink.seq_id is not None:
                self.engine.cancel(sink.seq_id)
                self._sinks.pop(sink.seq_id, None)
        self._cancelling.clear()
        for sink in self._handing:  # every token of the last step is in its queue already
            progress = self.engine.take_out(sink.seq_id) if sink.seq_id is not None else None
            self._sinks.pop(sink.seq_id, None)
            if progress is not None:
                self._end(sink, _HandedOff(progress))
        self._handing.clear()
        joining, self._joining = self._joining, []
        for sink in joining:
            try:
                sink.seq_id = self.engine.add(list(sink.request.prompt_ids), sink.request.params,
                                              sink.request.progress, key=sink.key)
            except FlashpointError as exc:
                self._end(sink, exc)
                continue
            self._sinks[sink.seq_id] = sink

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._between_steps()
            if self.engine.idle:
                self._wake.clear()
                if not self._joining and not self._cancelling and not self._parking \
                        and not self._unparking:
                    self._idle.set()
                    # parked prefixes expire while nothing else happens, too
                    try:
                        async with asyncio.timeout(self._next_expiry()):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                continue
            self._idle.clear()
            before = set(self.engine.running)
            started = time.perf_counter()
            try:
                events = await loop.run_in_executor(self._pool, self.engine.step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the model raised: its sequences fail, the replica lives
                self.stats.batch_ran(len(self.engine.running), len(self.engine.running),
                                     time.perf_counter() - started, failed=True)
                err = exc if isinstance(exc, FlashpointError) else ModelFailed(
                    f"model raised {type(exc).__name__}: {exc}"[:500])
                log.warning("generation_step_failed", error=str(err))
                self._settle_parks(err)
                for seq_id in list(self.engine.running):
                    self.engine.cancel(seq_id)
                    sink = self._sinks.pop(seq_id, None)
                    if sink is not None:
                        self._end(sink, err)
                continue
            run_s = time.perf_counter() - started
            for key in self.engine.last_parked:
                entry = self.engine.parked.get(key)
                self._parked(key, ParkResult(request_id=key, parked=entry is not None,
                                             prefill_s=entry.prefill_s if entry else 0.0))
            self.batches_run += 1
            self.stats.batch_ran(len(events), len(events), run_s)
            for event in events:
                sink = self._sinks.get(event.seq_id)
                if sink is None:
                    continue
                if event.seq_id not in before:  # joined in this step
                    self.stats.queued(started - sink.enqueued_s)
                    sink.prefill_s = self.engine.last_prefill_s.get(event.seq_id, 0.0)
                    sink.park_prefill_s = self.engine.last_park_prefill_s.get(event.seq_id)
                self._end(sink, event)
                if event.finish is not None:
                    self._sinks.pop(event.seq_id, None)


class SequenceStream:
    """One joined sequence's token events (see :meth:`GenerationLoop.stream`)."""

    def __init__(self, loop: GenerationLoop, sink: _Sink) -> None:
        self._loop = loop
        self._sink = sink
        self.request = sink.request
        # set when the sequence left for another replica (GenerationLoop.hand_off): the
        # iteration ends after its last token here
        self.handed_off: SequenceProgress | None = None

    def __aiter__(self) -> SequenceStream:
        return self

    async def __anext__(self) -> TokenEvent:
        sink = self._sink
        if sink.finished and sink.events.empty():
            raise StopAsyncIteration
        try:
            item = await sink.events.get()
        except BaseException:
            await self.aclose()  # the reader was cancelled: so is its sequence
            raise
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _HandedOff):
            self.handed_off = item.progress
            raise StopAsyncIteration
        return item

    @property
    def prefill_s(self) -> float:
        """Seconds its prefill took on this replica (0 until it has joined): the extension
        pass when it resumed onto a parked prefix."""
        return self._sink.prefill_s

    @property
    def park_prefill_s(self) -> float | None:
        """Resumed onto a parked prefix: seconds that prefix's prefill took (ahead of the
        move, outside the gap); None otherwise."""
        return self._sink.park_prefill_s

    async def aclose(self) -> None:
        """Cancel the sequence unless it has finished (idempotent)."""
        if not self._sink.finished:
            self._loop._cancel(self._sink)


# -- live migration: the wire edge ------------------------------------------------------
def resumed_request(request: GenerationRequest, resume: SequenceHandOff | None
                    ) -> tuple[GenerationRequest, int]:
    """``request`` as the continuation of a sequence another replica handed off, and the
    index of its first chunk here (0 for a fresh request). The prompt's ids come from the
    hand-off, not this replica's tokenizer: the sequence goes on from the very same ids."""
    if resume is None:
        return request, 0
    progress = SequenceProgress(tuple(resume.generated_ids), resume.emitted_text,
                                resume.rng_state)
    return (GenerationRequest(tuple(resume.prompt_ids), request.params, progress),
            resume.chunks)


def hand_off_message(request: GenerationRequest, progress: SequenceProgress,
                     chunks: int) -> SequenceHandOff:
    """What a sequence that leaves this replica tells the controller (its ``infer``
    reply): ``chunks`` counts every chunk of its stream so far, on every replica."""
    return SequenceHandOff(prompt_ids=tuple(request.prompt_ids),
                           generated_ids=tuple(progress.generated_ids),
                           emitted_text=progress.emitted_text, rng_state=progress.rng_state,
                           chunks=chunks)
