"""The controller's request path: from ``invoke`` to a worker's reply.

:class:`RequestPath` validates a request against its function's signature, queues it in the
:class:`~flashpoint.controller.dispatch.Dispatcher`, sends batches of it to warm replicas
(one frame per replica per loop iteration), retries what a replica failed retryably within
the deadline, and measures what the autoscaler reads (arrivals, completions, service time,
the oldest queued request) and the SLO compliance of strict requests. The
:class:`~flashpoint.controller.actor.Controller` owns it and delegates ``invoke`` and
``invoke_stream`` to it; the control loop reads :meth:`RequestPath.loads` every tick and
fails queues through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram

from flashpoint import tracing
from flashpoint.config import ControllerConfig
from flashpoint.controller.cold_timings import ColdStartMarks, cold_start_phases
from flashpoint.controller.dispatch import Dispatcher
from flashpoint.controller.handles import Pending, WorkerHandle
from flashpoint.controller.metrics import ControllerMetrics
from flashpoint.controller.mig_driver import MigDriver
from flashpoint.controller.migration import MIGRATION_GAP, Migrator
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import FailFunction, FunctionLoad, StartFailure
from flashpoint.controller.state.rates import RateMeter
from flashpoint.controller.token_metrics import TokenLedger
from flashpoint.controller.ui_journal import UiJournal
from flashpoint.errors import (
    BadRequest,
    DeadlineExceeded,
    FlashpointError,
    FunctionNotFound,
    ModelFailed,
    ModelLoadFailed,
    NoCapacity,
    Overloaded,
    PeerLost,
    from_wire,
)
from flashpoint.gateway.backend import InvokeResult, StreamChunk
from flashpoint.gateway.streams import StreamRegistry, stream_invocation
from flashpoint.log import get_logger, logs_debug
from flashpoint.policy.request_class import RequestClass, SloCompliance
from flashpoint.registry.manifest import Manifest
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import DECODED_DTYPE, decode_tensors, encode_tensors

LOGGER = "flashpoint.controller"
log = get_logger(LOGGER)

REQUESTS = Counter("flashpoint_requests_total", "Invocations by outcome", ["function", "outcome"])
SLO = Counter("flashpoint_slo_requests_total",
              "Strict requests of functions with an SLO, by whether they met it",
              ["function", "outcome"])
SLICE_REQUESTS = Counter("flashpoint_slice_requests_total",
                         "Requests answered by replicas on MIG slices, by request class and "
                         "the slice's MIG profile (PROTEAN's job distribution)",
                         ["function", "request_class", "slice"])
LATENCY = Histogram("flashpoint_request_seconds", "End-to-end invoke latency", ["function"],
                    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
MAX_DISPATCH_ATTEMPTS = 3
# A backlog left after dispatch wakes the control loop at most this often: the autoscaler's
# inputs (rates, queue age) do not change faster, and waking per request cost ~60 us each.
BACKLOG_WAKE_INTERVAL_S = 0.05

class _Expired(Exception):
    """A queued or in-flight request outlived its deadline (internal to ``invoke``)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class RequestPath:
    """Requests from their arrival to their reply, for the Controller that owns it.

    It shares the Controller's ``dispatcher``, ``workers`` (replica or group id -> the
    handle requests are sent to), ``streams``, ``cold_marks`` (replica id -> its cold
    start's marks) and the dashboard's ``ui`` journal, and reads ``state`` (functions, their
    back-off); ``spawn`` starts a task the Controller owns, ``wake`` wakes the control loop
    (a cold function, a backlog).
    """

    def __init__(self, cc: ControllerConfig, state: ControllerState, dispatcher: Dispatcher,
                 workers: Mapping[str, Any], streams: StreamRegistry,
                 cold_marks: Mapping[str, ColdStartMarks], mig: MigDriver | None,
                 spawn: Callable[[Coroutine[Any, Any, None], str], Any],
                 wake: Callable[[], None], started_s: float, ui: UiJournal,
                 tokens: TokenLedger, manifests: Mapping[str, Manifest],
                 metrics: ControllerMetrics | None = None) -> None:
        self.cc = cc
        self.state = state
        self.dispatcher = dispatcher
        self.workers = workers
        self.streams = streams
        self._cold_marks = cold_marks
        self.mig = mig
        self._spawn = spawn
        self._wake = wake
        # Queued work is failed as unplaceable only after a heartbeat timeout from here
        # (fail_unplaceable): a restarted controller's hosts are about to re-register.
        self._started_s = started_s
        self.ui = ui  # the dashboard's journal: cold starts and latencies (ui_journal.py)
        self.tokens = tokens  # generation load and metrics in tokens (token_metrics.py)
        self._manifests = manifests  # "name@version" -> manifest, the controller's cache
        self.metrics = metrics or ControllerMetrics()  # cold starts by tier (metrics.py)
        self._last_request: dict[str, float] = {}
        self._arrivals = RateMeter()
        self._completions = RateMeter()
        self._replica_completions = RateMeter()  # per replica (or group) id
        self._invocations: dict[str, int] = {}  # accepted per function, since start
        self._exec_s: dict[str, float] = {}  # EWMA of one request's service time
        self._backlog_wake_s = 0.0
        self._pump_pending: set[str] = set()
        self._ok_metrics: dict[str, tuple[Any, Any]] = {}  # function -> (ok counter, latency)
        self.slo: dict[str, SloCompliance] = {}  # strict requests within the function's SLO
        # function -> (request class, MIG profile) -> requests answered by a replica on such a
        # slice (which slices PROTEAN's Alg. 1 sent each class to); with their counters
        self.slices: dict[str, dict[tuple[str, str], int]] = {}
        self._slice_metrics: dict[tuple[str, str, str], Any] = {}
        # live migration (controller/migration.py), set by the Controller: streamed requests
        # it tracks, and hand-off replies it sends on
        self.migration: Migrator | None = None

    def loads(self, now: float) -> dict[str, FunctionLoad]:
        """What each registered function's requests look like at ``now``: the autoscaler's
        inputs for this tick (queue, in flight, λ, μ, service time, the oldest's wait)."""
        self._arrivals.update(now)
        self._completions.update(now)
        self._replica_completions.update(now)
        self.tokens.step(now)
        return {
            name: FunctionLoad(self.dispatcher.queued(name), self.dispatcher.inflight(name),
                               self._last_request.get(name), self._arrivals.rate(name),
                               self._completions.rate(name), self._exec_s.get(name, 0.0),
                               now - oldest.enqueued_s if (oldest := self._oldest(name))
                               else 0.0, self._invocations.get(name, 0),
                               tokens=self.tokens.load(name),
                               replica_rates=self._replica_rates(name) if fn.configs else {})
            for name, fn in self.state.functions.items()
        }

    def _replica_rates(self, name: str) -> dict[str, float]:
        """Requests per second each replica of ``name`` completed lately (only RPR's
        profiled functions ask: it ranks their replicas, policy/rpr.py)."""
        return {r.replica_id: self._replica_completions.rate(r.replica_id)
                for r in self.state.replicas_of(name)}

    def forget(self, name: str) -> None:
        """Drop what was measured for a deleted function."""
        self._last_request.pop(name, None)
        self._ok_metrics.pop(name, None)
        self.slo.pop(name, None)
        self.slices.pop(name, None)
        for key in [k for k in self._slice_metrics if k[0] == name]:
            del self._slice_metrics[key]
        self.tokens.forget(name)

    def forget_replica(self, replica_id: str) -> None:
        """Drop what was measured for a replica that is gone."""
        self._replica_completions.forget(replica_id)

    def fail_function(self, cmd: FailFunction) -> None:
        """Fail what waits for ``cmd.name`` with the error the state's command names."""
        if cmd.failure is not None:
            log.warning("function_backing_off", function=cmd.name,
                        failed_starts=cmd.failure.failed_starts,
                        error_code=cmd.failure.code, reason=cmd.failure.message)
            err: FlashpointError = _load_failed(cmd.reason, cmd.failure, time.monotonic())
        elif cmd.code == "function_not_found":
            err = FunctionNotFound(cmd.reason)
        else:
            err = ModelFailed(cmd.reason)
        self.fail_queue(cmd.name, err)

    def fail_unplaceable(self, now: float) -> None:
        """Queued work for a function that has no replica and could get none fails with 503.

        Not in the first heartbeat timeout after a start: a restarted controller does not know
        its hosts yet, and they are about to re-register with their replicas.
        """
        if now - self._started_s < self.cc.heartbeat_timeout_s:
            return
        if self.mig is not None and self.mig.busy():
            return  # a GPU is being reconfigured: its capacity comes back as new slices
        for name, fn in self.state.functions.items():
            if self.dispatcher.queued(name) and not self.state.replicas_of(name):
                first = self._oldest(name)
                if first is not None and now - first.enqueued_s > 2 * self.cc.loop_interval_s + 1.0:
                    self.fail_queue(name, NoCapacity(
                        f"no device can host {fn.model_key} now"
                        + (f": {fn.unplaced}" if fn.unplaced else ""), retry_after_s=5.0))

    def _oldest(self, name: str) -> Pending | None:
        fronts = self.dispatcher.fronts(name)
        return min(fronts, key=lambda p: p.enqueued_s) if fronts else None

    def pump(self, name: str) -> None:
        """Dispatch ``name``'s queue at the end of this loop iteration.

        Deferring by one iteration costs microseconds and lets every request that arrived in
        the same iteration travel to a replica in one frame (one write instead of N), which is
        what a loaded controller spends its time on.
        """
        if name not in self._pump_pending:
            self._pump_pending.add(name)
            asyncio.get_running_loop().call_soon(self._flush, name)

    def _flush(self, name: str) -> None:
        self._pump_pending.discard(name)
        by_replica: dict[str, list[Pending]] = {}
        for p, rid in self.dispatcher.assign(name):
            by_replica.setdefault(rid, []).append(p)
        for rid, ps in by_replica.items():
            self._spawn(self._send(ps, rid), f"send:{ps[0].request_id}")
        if self.dispatcher.queued(name):
            # Work is waiting for room: let the autoscaler look now, not at the next tick.
            now = time.monotonic()
            if now - self._backlog_wake_s >= BACKLOG_WAKE_INTERVAL_S:
                self._backlog_wake_s = now
                self._wake()

    async def send(self, ps: list[Pending], rid: str) -> None:
        """Send ``ps`` to ``rid``, whose credits they hold already (a migrated sequence to
        the destination chosen for it); their replies, retries and failures as dispatch's."""
        await self._send(ps, rid)

    async def _send(self, ps: list[Pending], rid: str) -> None:
        handle = self.workers.get(rid)
        live = [p for p in ps if not p.future.done()]
        try:
            if not live:
                return
            if handle is None:
                # Gone between assignment and sending: nothing was sent, so this is no attempt;
                # and a target without a handle can take no work.
                self.dispatcher.remove_replica(rid)
                for p in live:
                    self.dispatcher.enqueue(p.function, p, front=True, best_effort=p.best_effort)
                return
            now = time.monotonic()
            for p in live:
                p.sent_s = now
                self.tokens.sent(p.request_id, rid)
                if p.stream:  # its chunks come from this connection; its caller gone,
                    self.streams.sent(p.request_id, handle.conn)  # the call is cancelled
                    if self.migration is not None:
                        self.migration.sent(p, rid)
                    _cancel_with(p.future, asyncio.current_task())
            timeout = max(0.001, max(p.deadline_s for p in live) - now)
            replies = await handle.infer(live, timeout)
            took = (time.monotonic() - now) / len(live)  # a batch shares the replica's time
            prev = self._exec_s.get(live[0].function)
            self._exec_s[live[0].function] = took if prev is None else prev + 0.2 * (took - prev)
            mig_profile = self.dispatcher.mig_profile_of(rid)
            for p, reply in zip(live, replies, strict=True):
                if p.future.done() or (self.migration is not None
                                       and self.migration.handled(p, reply, rid)):
                    continue  # a hand-off goes on on another replica (live migration)
                if "error" in reply:
                    self._retry_or_fail(p, from_wire(reply["error"]))
                else:
                    p.future.set_result((reply, rid))
                    if mig_profile:
                        self._served_on_slice(p, mig_profile)
        except Exception as exc:
            err = exc if isinstance(exc, FlashpointError) else FlashpointError(repr(exc))
            if isinstance(err, PeerLost) and isinstance(handle, WorkerHandle):
                # Its connection is dead: no new work for it before the disconnect is handled
                # (the pump below would otherwise hand the retries straight back to it; a
                # reconnected worker announces itself and gets a fresh slot).
                self.dispatcher.stop_accepting(rid)
            for p in live:
                self._retry_or_fail(p, err)
        finally:
            for _ in ps:
                self.dispatcher.release(rid)
            self._completions.add(ps[0].function, len(ps))
            self._replica_completions.add(rid, len(ps))
            self.pump(ps[0].function)

    def _served_on_slice(self, p: Pending, mig_profile: str) -> None:
        """Count ``p`` as answered on a slice of ``mig_profile`` (metrics and status)."""
        cls = RequestClass.BEST_EFFORT if p.best_effort else RequestClass.STRICT
        key = (p.function, str(cls), mig_profile)
        counter = self._slice_metrics.get(key)
        if counter is None:  # label lookups cost more than the increments on this path
            counter = self._slice_metrics[key] = SLICE_REQUESTS.labels(*key)
        counter.inc()
        served = self.slices.setdefault(p.function, {})
        served[key[1:]] = served.get(key[1:], 0) + 1

    def _slo_failed(self, spec: FunctionSpec, best_effort: bool) -> None:
        """A strict request with an SLO that got no answer missed it (PROTEAN counts only
        strict requests; best-effort ones are judged by their latency tails instead)."""
        if spec.slo_ms > 0 and not best_effort:
            SLO.labels(spec.name, "missed").inc()
            self.slo[spec.name] = self.slo.get(spec.name, SloCompliance()).record_failure(
                RequestClass.STRICT)

    def _retry_or_fail(self, p: Pending, err: FlashpointError) -> None:
        p.attempts += 1
        if (err.retryable and p.attempts < MAX_DISPATCH_ATTEMPTS and not p.future.done()
                and not (p.stream and self.streams.relayed(p.request_id))
                and time.monotonic() < p.deadline_s and p.function in self.state.functions):
            # requests are idempotent (a stream, until its client has tokens of this try)
            self.dispatcher.enqueue(p.function, p, front=True, best_effort=p.best_effort)
        elif not p.future.done():
            p.future.set_exception(err)

    def fail_queue(self, name: str, err: FlashpointError) -> None:
        for p in self.dispatcher.drain_queue(name):
            if not p.future.done():
                p.future.set_exception(err)

    def _validate_inputs(self, spec: FunctionSpec, inputs: dict[str, np.ndarray]) -> None:
        if not inputs:
            raise BadRequest("request has no inputs")
        if spec.inputs:
            want = {t.name: t for t in spec.inputs}
            if inputs.keys() != want.keys():  # key views compare as sets, without building any
                raise BadRequest(f"inputs must be exactly {sorted(want)}, got {sorted(inputs)}")
            for name, arr in inputs.items():
                t = want[name]
                if arr.dtype != DECODED_DTYPE[t.datatype]:
                    raise BadRequest(f"input {name!r} must be {t.datatype}, got {arr.dtype.name}")
                shape = arr.shape
                if len(shape) != len(t.shape):
                    raise BadRequest(f"input {name!r} shape {list(shape)} does not match {list(t.shape)}")
                for i in range(1, len(shape)):
                    s = t.shape[i]
                    if s != -1 and s != shape[i]:
                        raise BadRequest(f"input {name!r} shape {list(shape)} does not match {list(t.shape)}")
        rows = -1
        for a in inputs.values():
            n = a.shape[0] if a.ndim else -1
            if n <= 0 or (rows != -1 and n != rows):
                raise BadRequest("all inputs need the same non-zero leading (batch) dimension")
            rows = n

    def invoke_stream(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                      timeout_s: float | None = None,
                      request_class: str = RequestClass.STRICT
                      ) -> AsyncIterator[StreamChunk | InvokeResult]:
        """A text-generation request's token chunks as they come, then its result
        (gateway/streams.py); closing the iterator early cancels the request."""
        return stream_invocation(self.streams, request_id, lambda: self.invoke(
            name, inputs, request_id=request_id, timeout_s=timeout_s,
            request_class=request_class, stream=True), on_gap=MIGRATION_GAP.observe)

    async def invoke(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = RequestClass.STRICT,
                     stream: bool = False) -> InvokeResult:
        t0 = time.monotonic()
        best_effort = request_class == RequestClass.BEST_EFFORT
        fn = self.state.functions.get(name)
        if fn is None:
            raise FunctionNotFound(f"function {name!r} is not registered")
        if (failure := self.state.backing_off(name, t0)) is not None \
                and self.state.not_ready(name) is not None:
            raise _load_failed(f"function {name!r} cannot start a replica: {failure.message}",
                               failure, t0)
        self._validate_inputs(fn.spec, inputs)
        if self.dispatcher.queued(name) >= self.cc.max_queued_per_function:
            REQUESTS.labels(name, "overloaded").inc()
            raise Overloaded(f"queue for {name!r} is full", retry_after_s=1.0)
        timeout = min(timeout_s or fn.spec.timeout_s, fn.spec.timeout_s)
        # Warm replicas and serving groups are the dispatcher's accepting targets: asking it
        # costs O(this function's replicas), not a scan of the whole cluster per request.
        cold = not self.dispatcher.accepting(name)
        payload = {"request_id": request_id, "inputs": encode_tensors(inputs)}
        if best_effort:
            payload["class"] = RequestClass.BEST_EFFORT  # the worker's queue serves strict first
        if stream:
            payload["stream"] = True
        tracing.inject(payload)  # the worker's span joins this request's trace
        loop = asyncio.get_running_loop()
        p = Pending(request_id, name, payload, loop.create_future(), t0, t0 + timeout, cold,
                    best_effort, stream=stream)
        self._last_request[name] = t0
        self._arrivals.add(name)
        self._invocations[name] = self._invocations.get(name, 0) + 1
        self.dispatcher.enqueue(name, p, best_effort=best_effort)
        if (m := self._manifests.get(fn.model_key)) is not None and m.task == "text-generation":
            self.tokens.admitted(name, request_id, inputs, t0)
        if best_effort and self.mig is not None:
            self.mig.be_began(name)  # PROTEAN's BE demand: queued or in flight
        # Sent from this task only when the function is idle (nothing queued or in flight):
        # the lowest latency for a lone request. Under load the request waits for the end of
        # this loop iteration (_pump), so every request that arrived in the same iteration
        # shares one frame to the replica and one reply frame back: a socket write and a
        # frame decode on each side per batch instead of per request.
        lone = (name not in self._pump_pending and self.dispatcher.queued(name) == 1
                and self.dispatcher.inflight(name) == 0)
        assigned = self.dispatcher.assign(name) if lone else []
        if not assigned:
            self.pump(name)  # a backlog left after dispatch wakes the control loop (_flush)
        if cold:
            self._wake()  # scale from zero now, not at the next tick
        # One timer instead of wait_for(shield(...)): a cancelled caller cancels the future,
        # so a request nobody waits for any more is skipped at dispatch.
        expiry = loop.call_later(timeout, _expire, p.future)
        answered = False
        try:
            if assigned:
                # Alone in its queue with a replica free: send it from this task. Nothing
                # could share its frame, and the trip through _flush and a send task costs
                # three loop steps each way. A retry it needs goes back through the queue.
                await self._send([p], assigned[0][1])
            reply, rid = await p.future
            answered = True
        except _Expired:
            self.dispatcher.remove(name, p)
            REQUESTS.labels(name, "deadline").inc()
            self._slo_failed(fn.spec, best_effort)
            log.info("request_failed", function=name, request_id=request_id, error="deadline")
            raise DeadlineExceeded(f"request {request_id} exceeded {timeout:.3f}s") from None
        except FlashpointError as exc:
            REQUESTS.labels(name, exc.code).inc()
            log.info("request_failed", function=name, request_id=request_id, error=exc.code)
            if exc.http_status >= 500:  # the platform failed it, not the caller's input
                self._slo_failed(fn.spec, best_effort)
            raise
        except asyncio.CancelledError:
            self.dispatcher.remove(name, p)
            raise
        finally:
            expiry.cancel()
            if not answered:  # an answer is counted by tokens.finished below
                self.tokens.ended(request_id)
            if best_effort and self.mig is not None:
                self.mig.be_ended(name)
        total = time.monotonic() - t0
        timings = {"queue": (p.sent_s or t0) - t0, "total": total}
        timings.update({k: float(v) for k, v in (reply.get("timings_s") or {}).items()})
        handle = self.workers.get(rid)
        if cold and handle is not None:
            timings["cold_start"] = timings["queue"]
            for phase in ("fetch", "load", "to_device", "first_inference"):
                timings[phase] = handle.timings_s.get(phase, 0.0)
            if (marks := self._cold_marks.get(rid)) is not None:
                # Every millisecond of the scale from zero, in order (controller/cold_timings.py).
                timings.update(cold_start_phases(marks, handle.timings_s, arrived_s=t0,
                                                 sent_s=p.sent_s, done_s=t0 + total))
            self.ui.cold_start(rid, name, handle.source, timings, t0 + total)
            self.metrics.cold_request(rid, name, handle.source, timings)
        ok = self._ok_metrics.get(name)
        if ok is None:  # label lookups cost more than the increments on this path
            ok = self._ok_metrics[name] = (REQUESTS.labels(name, "ok"), LATENCY.labels(name))
        ok[0].inc()
        ok[1].observe(total)
        if logs_debug(LOGGER):  # the gateway's request id beside the replica that answered
            log.debug("request_done", function=name, request_id=request_id, replica=rid,
                      total_s=round(total, 6))
        self.ui.request_done(name, total, t0 + total)
        if fn.spec.slo_ms > 0 and not best_effort:
            before = self.slo.get(name, SloCompliance())
            after = self.slo[name] = before.record(RequestClass.STRICT, total,
                                                    fn.spec.slo_ms / 1000)
            SLO.labels(name, "met" if after.met > before.met else "missed").inc()
        outputs = decode_tensors(reply.get("outputs"))
        timings.update(self.tokens.finished(request_id, outputs, timings, cold=cold,
                                            now_s=t0 + total))
        return InvokeResult(outputs, timings, rid, cold,
                            handle.source if cold and handle is not None else "")


def _load_failed(message: str, failure: StartFailure, now_s: float) -> ModelLoadFailed:
    """What a request to a function backing off from ``failure`` fails with."""
    retry_s = max(0.0, (failure.retry_at_s or now_s) - now_s)
    return ModelLoadFailed(message, retry_after_s=round(max(retry_s, 0.001), 3),
                           failed_starts=failure.failed_starts, error_code=failure.code)


def _cancel_with(future: asyncio.Future, task: asyncio.Task | None) -> None:
    """Cancel ``task`` (a send to a worker) when ``future`` (its request) is cancelled."""
    if task is not None:
        future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)

