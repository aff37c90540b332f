"""GPUWorker: one OS process per placement unit, serving one replica.

Started by its host manager ahead of need (the warm pool), with torch already imported, so a
cold start pays only for the model bytes. Lifecycle:

1. connect to the host manager's local RPC endpoint and say ``worker_hello``;
2. on ``load_replica``: map the cached weights copy-on-write, build the module over them
   (no copy), move it to the device, run one warm-up inference;
3. connect to the controller and announce ``replica_ready`` (again after every reconnect,
   so a restarted controller re-learns its replicas); then serve ``infer`` with dynamic
   batching and credit-based flow control (the controller never sends more than the credits).

A partition stage (``load_replica`` with ``stage``) with ``pipeline`` options serves a
:class:`~flashpoint.pipeline.stage.StageServer` over the stage module instead of announcing
to the controller, and replies with the server's bound endpoint. Model completion: once the
host has the whole model, it sends ``complete_replica``; the worker builds the whole module
over the mapping it already holds (MAP_PRIVATE of the full-size cache file: pages this
process never wrote are the page cache's, so they show the bytes the host wrote after the
stage was built), warms it, and announces itself to the controller as a whole replica
(``replica_ready`` with its replica id). Completion never touches the stage server, so no
in-flight pipeline request fails because of it: the stage server keeps serving until the
host sends ``dissolve_stage`` (the controller's call, once the pipeline gets no more work).

A KaaS executor replica (``load_kaas``, issue 10) serves no model: the worker builds a
:class:`~flashpoint.kaas.remote.WorkerKaasRuntime` (one executor, its buffer cache of the
deploy's ``cache_bytes`` on the worker's device), announces itself to the controller with
``replica_ready`` (``kind: "kaas"``), and serves ``kaas_run`` / ``kaas_reset`` on that
connection; the controller ships the objects a request needs inline (see kaas/remote.py).

The process exits when its host connection is lost (never an orphan) or on ``shutdown``.

What the worker holds and must do next is :class:`~flashpoint.worker.state.WorkerState`
(pure); this actor is its I/O: the RPC handlers (messages/host_worker.py,
messages/controller_worker.py), loading threads (worker/loading.py), the batcher or
generation loop (streamed answers: worker/streaming.py) and the state's commands.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import numpy as np

from flashpoint import tracing
from flashpoint.actor import PROCESS_LOOP_LAG_INTERVAL_S, Actor
from flashpoint.errors import BadRequest, FlashpointError, InvalidInput, Unavailable
from flashpoint.gpu.worker_env import apply_env
from flashpoint.log import bind_ids, bound_ids, configure, get_logger, logs_debug
from flashpoint.messages import controller_worker as cw
from flashpoint.messages import host_worker as hw
from flashpoint.messages.base import from_payload, handler, to_payload
from flashpoint.messages.migration import InferHandedOff
from flashpoint.policy.request_class import RequestClass
from flashpoint.rpc.roles import CREDENTIAL_ENV, Credential
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import decode_tensors, encode_tensors
from flashpoint.worker import loading
from flashpoint.worker import state as ws
from flashpoint.worker.loading import LoadedReplica
from flashpoint.worker.migration_rpc import migration_methods
from flashpoint.worker.streaming import serve_stream

LOGGER = "flashpoint.worker"
log = get_logger(LOGGER)


class Worker(Actor):
    """The worker process's actor: the I/O around its :class:`WorkerState`. Its background
    tasks (the served report, a completion build) are owned by the
    :class:`~flashpoint.actor.Actor` base."""

    def __init__(self, worker_id: str, host_url: str, secret: bytes, torch_threads: int,
                 *, preload_transformers: bool = False, credential: Credential | None = None) -> None:
        super().__init__(f"worker:{worker_id}", loop_lag_interval_s=PROCESS_LOOP_LAG_INTERVAL_S)
        self.preload_transformers = preload_transformers
        self.worker_id = worker_id
        self.host_url = host_url
        self.secret = secret  # the data plane's key (stage servers, pulls)
        # What it proves to its host and the controller (rpc/roles.py): its host's workers'.
        self.credential = credential or Credential("worker", secret)
        self.torch_threads = torch_threads
        self.state = ws.WorkerState()
        self.replica: LoadedReplica | None = None
        self.batcher: Any = None
        self.stage_server: Any = None  # a StageServer while this worker serves a pipeline stage
        self.kaas: Any = None  # a WorkerKaasRuntime while this worker is a KaaS executor
        self.weights_role = ""  # "exporter" / "reader" when its weights are shared by IPC
        self._controller: Any = None
        self._controller_url = ""
        self._host_conn: Any = None
        self._done = asyncio.Event()
        self._completing: asyncio.Task | None = None
        # Set with the state's ``announceable``: a connection to the controller opened while
        # the module loads announces the replica only then.
        self._announceable = asyncio.Event()
        self._served_task: asyncio.Task | None = None  # tells the host of the first answer

    async def run(self) -> None:
        """The worker process's life: start, serve until the host connection closes or the
        host asks it to shut down, stop."""
        await self.start()
        await self._done.wait()
        await self.stop()

    async def on_start(self) -> None:
        """Import torch and the model code (the warm pool's whole point), then say hello to
        the host."""
        import torch  # imported before any replica is assigned: the warm pool's whole point

        torch.set_num_threads(self.torch_threads)
        # Import the model code now too: a cold start should pay for bytes, not imports.
        from flashpoint.models import zoo

        # Building on the meta device pulls in lazily imported torch modules (sympy among
        # them, seconds of imports); do it once per built-in model while the worker is idle.
        for name in zoo.MODELS:
            zoo.build_empty(name, zoo.resolve_config(name, "tiny"))
        if self.preload_transformers:
            await asyncio.to_thread(loading.preload_transformers)
        from flashpoint import heap

        heap.settle()  # torch and the model code out of the collector's scans
        from flashpoint.rpc import connect

        self._host_conn = await connect(
            self.host_url, {
                "load_replica": handler(hw.LoadReplica, self._load_replica, "load_replica"),
                "load_kaas": handler(hw.LoadKaas, self._load_kaas, "load_kaas"),
                "complete_replica": handler(hw.CompleteReplica, self._complete_replica,
                                            "complete_replica"),
                "dissolve_stage": handler(hw.DissolveStage, self._dissolve_stage,
                                          "dissolve_stage"),
                "set_next_hop": handler(hw.SetNextHop, self._set_next_hop, "set_next_hop"),
                "replica_stats": handler(hw.ReplicaStats, self._replica_stats, "replica_stats"),
                "shutdown": handler(hw.Shutdown, self._shutdown, "shutdown")},
            secret=self.credential.key, name=self.credential.principal, connect_timeout_s=10.0,
        )
        self._host_conn.add_close_callback(lambda *_: self._done.set())
        await self._host_conn.call(
            "worker_hello", to_payload(hw.WorkerHello(worker_id=self.worker_id, pid=os.getpid())),
            timeout_s=10.0)

    async def on_stop(self, timeout_s: float) -> None:
        """After the base cancelled every task: stop serving, close the connections."""
        if self.stage_server is not None:
            await self.stage_server.stop()
        if self.batcher is not None:
            await self.batcher.stop()
        if self._controller is not None:
            await self._controller.stop()
        if self._host_conn is not None and not self._host_conn.closed:
            await self._host_conn.close()

    async def _shutdown(self, conn: Any, msg: hw.Shutdown) -> hw.Ok:
        asyncio.get_running_loop().call_later(0.01, self._done.set)
        return hw.Ok()

    # the state and its commands -----------------------------------------------------------
    def _apply(self, event: ws.Event) -> list[ws.Command]:
        commands = self.state.handle(event)
        if self.state.announceable:
            self._announceable.set()
        return commands

    async def _execute(self, commands: list[ws.Command]) -> None:
        """Run the commands that need nothing but this actor (the handlers run the others,
        whose outcome is their reply)."""
        for cmd in commands:
            if isinstance(cmd, ws.ConnectController):
                self._connect_controller()
                await self._controller.start()
            elif isinstance(cmd, ws.DropController):
                client, self._controller = self._controller, None
                if client is not None:
                    await client.stop()
            elif isinstance(cmd, ws.StartServing):
                self._start_batcher()
            elif isinstance(cmd, ws.Announce):
                await self._controller.call("replica_ready", to_payload(cmd.message),
                                            timeout_s=10.0)
            elif isinstance(cmd, ws.ReportServed):
                if self._host_conn is not None:
                    self._served_task = self.spawn(self._report_served(), "replica-served")
            else:  # a command for the handler that applied the event
                raise AssertionError(f"unexpected worker command {cmd!r}")

    async def _announce(self, conn: Any) -> None:
        """Every connection to the controller announces the replica, once it serves."""
        await self._announceable.wait()  # connected while loading: announce once serving
        for cmd in self._apply(ws.ControllerConnected(time.perf_counter())):
            assert isinstance(cmd, ws.Announce)
            await conn.call("replica_ready", to_payload(cmd.message), timeout_s=10.0)

    def _connect_controller(self) -> None:
        """The client that serves this replica's requests (or KaaS runs); its first and
        every later connection announces the replica (``_announce``)."""
        from flashpoint.rpc import ReconnectingClient

        common = {"replica_status": handler(cw.ReplicaStatus, self._status, "replica_status"),
                  "ping": handler(cw.Ping, self._ping, "ping")}
        if self.state.kind is ws.ReplicaKind.KAAS:
            methods = {"kaas_run": handler(cw.KaasRun, self._kaas_run, "kaas_run"),
                       "kaas_reset": handler(cw.KaasReset, self._kaas_reset, "kaas_reset")}
        else:
            methods = {"infer": handler(cw.InferRequest, self._infer, "infer"),
                       "infer_many": handler(cw.InferMany, self._infer_many, "infer_many"),
                       **migration_methods(lambda: self.batcher)}
        self._controller = ReconnectingClient(
            self._controller_url, {**methods, **common}, secret=self.credential.key,
            name=self.credential.principal, on_connected=self._announce)

    # loading -------------------------------------------------------------------------------
    async def _load_replica(self, conn: Any, msg: hw.LoadReplica) -> hw.LoadReplicaReply:
        received = time.perf_counter()
        if msg.pipeline is not None:
            if msg.stage is None:
                raise BadRequest("pipeline options need a stage")
            if not 0 <= msg.pipeline.port < 65536:
                raise BadRequest("pipeline port must be an integer in [0, 65536)")
        commands = self._apply(ws.LoadRequested(msg.replica_id, ws.ReplicaKind.MODEL,
                                             pipeline=msg.pipeline is not None))
        if isinstance(commands[0], ws.ReplyLoaded):  # a retried call: the same answer
            return hw.LoadReplicaReply(timings_s=commands[0].timings_s,
                                       weights=self.weights_role,
                                       pipeline_endpoint=self._stage_endpoint())
        try:
            spec = FunctionSpec.from_dict(msg.spec)
            bind_ids(replica_id=msg.replica_id)
            # Before anything touches CUDA: its GPU binding and MPS/hook settings (warm pool
            # ordering, flashpoint/gpu/host_sharing.py).
            apply_env(msg.env)
            self._controller_url = msg.controller_url
            # ConnectController first (when the state asks): the socket, WebSocket upgrade
            # and handshake (tens of ms) overlap LoadModule, the thread below.
            await self._execute([c for c in commands if isinstance(c, ws.ConnectController)])
            loaded = await asyncio.to_thread(loading.load, msg, spec, received)
        except BaseException:
            await self._execute(self._apply(ws.LoadFailed()))
            raise
        self.replica, self.weights_role = loaded.replica, loaded.weights_role
        timings = {**loaded.timings_s, "fetch": msg.fetch_s, **msg.host_timings_s}
        commands = self._apply(ws.ReplicaLoaded(
            msg.replica_id, msg.host_id, spec.name, spec.replica_concurrency, timings,
            msg.source, loaded.loaded_s, stage=msg.stage))
        if any(isinstance(c, ws.StartStageServer) for c in commands):
            assert msg.pipeline is not None
            await self._start_stage_server(msg.pipeline)
            log.info("stage_loaded", endpoint=str(self.stage_server.endpoint),
                     **{k: round(v, 4) for k, v in timings.items()})
            return hw.LoadReplicaReply(timings_s=timings, pipeline_endpoint=self._stage_endpoint())
        await self._execute(commands)
        log.info("replica_loaded", **{k: round(v, 4) for k, v in timings.items()})
        return hw.LoadReplicaReply(timings_s=timings, weights=self.weights_role)

    def _start_batcher(self) -> None:
        """Batch requests for the loaded module (a causal LM: its token loop instead)."""
        from flashpoint.worker.batcher import Batcher

        rep = self.replica
        assert rep is not None
        served, spec = rep.served, rep.spec
        if getattr(served, "generates", False):
            from flashpoint.worker.generation import GenerationLoop

            engine = served.build_engine(rep.module, max_running=spec.max_batch_size)
            self.batcher = GenerationLoop(engine, max_waiting=4 * spec.max_batch_size)
        else:
            self.batcher = Batcher(self._run_batch, spec.max_batch_size,
                                   spec.batch_wait_ms / 1000.0,
                                   pad_values=served.pad_values if served is not None else None)
        self.batcher.start()

    def _run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.replica is not None  # the whole module once completed
        return loading.run_batch(inputs, self.replica)

    # KaaS executor --------------------------------------------------------------------------
    async def _load_kaas(self, conn: Any, msg: hw.LoadKaas) -> hw.LoadKaasReply:
        """Become a KaaS executor replica (idempotent by replica id): build the executor on
        the device now (its CUDA context and cache, so the first request pays for data
        only, as the paper's executors), then announce to the controller."""
        from flashpoint.kaas import KAAS_FUNCTION
        from flashpoint.kaas.remote import WorkerKaasRuntime

        commands = self._apply(ws.LoadRequested(msg.replica_id, ws.ReplicaKind.KAAS))
        if isinstance(commands[0], ws.ReplyLoaded):
            return hw.LoadKaasReply(timings_s=commands[0].timings_s)
        try:
            if msg.cache_bytes <= 0:
                raise BadRequest("load_kaas needs a positive integer cache_bytes")
            bind_ids(replica_id=msg.replica_id)
            apply_env(msg.env)
            runtime = WorkerKaasRuntime(msg.replica_id, msg.device, capacity_bytes=msg.cache_bytes)
            t0 = time.perf_counter()
            await asyncio.to_thread(runtime.executor)
        except BaseException:
            await self._execute(self._apply(ws.LoadFailed()))
            raise
        timings = {"load": time.perf_counter() - t0}
        self.kaas, self._controller_url = runtime, msg.controller_url
        # now_s 0: an executor's announcement carries no ``announce`` phase (as before).
        await self._execute(self._apply(ws.ReplicaLoaded(
            msg.replica_id, msg.host_id, KAAS_FUNCTION, 1, timings, "kaas", 0.0,
            kind=ws.ReplicaKind.KAAS)))
        log.info("kaas_executor_loaded", **{k: round(v, 4) for k, v in timings.items()})
        return hw.LoadKaasReply(timings_s=timings)

    async def _kaas_run(self, conn: Any, msg: cw.KaasRun) -> cw.KaasRunReply:
        if self.kaas is None:
            raise Unavailable("this worker is no KaaS executor", retry_after_s=0.1)
        # Off the loop: kernels and copies block; the worker's connections stay responsive.
        return await asyncio.to_thread(self.kaas.run, msg)

    async def _kaas_reset(self, conn: Any, msg: cw.KaasReset) -> cw.KaasState:
        if self.kaas is None:
            raise Unavailable("this worker is no KaaS executor", retry_after_s=0.1)
        return await asyncio.to_thread(self.kaas.reset)

    # partition stages ---------------------------------------------------------------------
    def _stage_endpoint(self) -> list[Any] | None:
        ep = self.stage_server.endpoint if self.stage_server is not None else None
        return ep.to_wire() if ep is not None else None

    async def _start_stage_server(self, pipeline: hw.PipelineOptions) -> None:
        """Serve the stage module as one stage of a pipeline."""
        from flashpoint.pipeline.stage import StageServer
        from flashpoint.transfer.plan import Endpoint

        rep = self.replica
        assert rep is not None
        nxt = pipeline.next_hop
        server = StageServer(
            rep.module, host=pipeline.listen_host or "127.0.0.1", port=pipeline.port,
            secret=self.secret, next_hop=Endpoint.from_wire(nxt) if nxt is not None else None,
            device=rep.device, stage_id=rep.replica_id)
        await server.start()
        self.stage_server = server

    async def _complete_replica(self, conn: Any,
                                msg: hw.CompleteReplica) -> hw.CompleteReplicaReply:
        """Model completion: the host has every byte of the model now. Build the whole
        module over the mapping this stage already holds, warm it, and announce this worker
        to the controller as a whole replica. The stage server (if any) keeps serving,
        untouched, until ``dissolve_stage``, so completion never fails a pipeline request
        in flight. Idempotent; a whole replica replies at once."""
        commands = self._apply(ws.CompletionRequested())
        if isinstance(commands[0], ws.ReplyCompleted):
            return hw.CompleteReplicaReply(completed=True, timings_s=commands[0].timings_s)
        if isinstance(commands[0], ws.BuildWhole):
            self._completing = self.spawn(self._complete(), "complete-replica")
        task = self._completing  # AwaitCompletion: the one already under way
        assert task is not None
        try:
            timings = await asyncio.shield(task)
        except BaseException:
            if task.done() and self._completing is task:
                self._completing = None  # the host may try again
            raise
        return hw.CompleteReplicaReply(completed=True, timings_s=timings)

    async def _complete(self) -> dict[str, float]:
        rep = self.replica
        assert rep is not None and rep.stage is not None
        try:
            whole, timings = await asyncio.to_thread(loading.build_whole, rep)
        except BaseException:
            self._apply(ws.CompletionFailed())
            raise
        t0 = time.perf_counter()
        # From here ``_run_batch`` uses the whole module; the stage server holds its own.
        self.replica = whole
        await self._execute(self._apply(ws.ReplicaCompleted(timings, t0)))
        log.info("replica_completed", announce_s=round(time.perf_counter() - t0, 4))
        return dict(self.state.timings_s)

    async def _set_next_hop(self, conn: Any, msg: hw.SetNextHop) -> hw.Ok:
        """Where this stage forwards its outputs: the controller links a pipeline only after
        every stage serves, so stages load in parallel without knowing each other first.
        (The stage server dials its next hop on its first request.)"""
        from flashpoint.transfer.plan import Endpoint

        if self.stage_server is None:
            raise BadRequest("this worker serves no pipeline stage")
        self.stage_server.next_hop = Endpoint.from_wire(msg.next_hop)
        return hw.Ok()

    async def _dissolve_stage(self, conn: Any, msg: hw.DissolveStage) -> hw.DissolveStageReply:
        """Stop serving the pipeline stage (its links close: a request still in it fails
        with PeerLost, so the controller dissolves a pipeline only once it sends no more
        work there). The whole replica, if completed, keeps serving."""
        server, self.stage_server = self.stage_server, None
        if server is None:
            return hw.DissolveStageReply(dissolved=False)
        self._apply(ws.StageDissolved())
        await server.stop()
        return hw.DissolveStageReply(dissolved=True)

    # requests ------------------------------------------------------------------------------
    def _request(self, msg: cw.InferRequest) -> tuple[dict[str, np.ndarray], bool]:
        """One infer request's inputs, checked against the replica, and its class."""
        if self.replica is None or self.batcher is None:
            raise Unavailable("replica not loaded", retry_after_s=0.1)
        inputs = decode_tensors(msg.inputs)
        missing = set(self.replica.request_inputs) - set(inputs)
        if missing:
            raise BadRequest(f"missing inputs: {sorted(missing)}")
        try:
            prepared = self.replica.served.prepare(inputs)
        except FlashpointError:
            raise
        except Exception as exc:  # the tokenizer or decoder raised on this request's values
            raise InvalidInput(f"inputs could not be prepared: {type(exc).__name__}: "
                               f"{exc}"[:500]) from None
        return prepared, msg.request_class == RequestClass.BEST_EFFORT

    def _prepares_in_thread(self) -> bool:
        """Whether requests are prepared off the event loop (image decoding takes ms)."""
        rep = self.replica
        return bool(rep is not None and getattr(rep.served, "prepare_in_thread", False))

    async def _infer(self, conn: Any, msg: cw.InferRequest
                     ) -> cw.InferReply | cw.InferStreamReply | InferHandedOff:
        # The gateway's request id on the log lines of this request's handling (issue 23);
        # bound only when DEBUG lines are written or the request failed: binding costs ~1 us.
        try:
            if not logs_debug(LOGGER):
                return await self._infer_one(conn, msg)
            with bound_ids(request_id=msg.request_id):
                reply = await self._infer_one(conn, msg)
                log.debug("request_served")
                return reply
        except FlashpointError as exc:
            with bound_ids(request_id=msg.request_id):
                log.info("request_failed", error=exc.code)
            raise

    async def _infer_one(self, conn: Any, msg: cw.InferRequest
                         ) -> cw.InferReply | cw.InferStreamReply | InferHandedOff:
        if self._prepares_in_thread():
            inputs, best_effort = await asyncio.to_thread(self._request, msg)
        else:
            inputs, best_effort = self._request(msg)
        assert self.batcher is not None
        if msg.stream and hasattr(self.batcher, "stream"):
            return await serve_stream(conn, msg, inputs, self.batcher, self._finish)
        outputs, timings = await self.batcher.submit(inputs, best_effort=best_effort)
        tracing.worker_span(msg.traceparent, msg.request_id, timings)
        if not self.state.served:  # the hot path pays one attribute read after the first
            await self._execute(self._apply(ws.RequestAnswered()))
        return cw.InferReply(outputs=encode_tensors(self._finish(outputs)), timings_s=timings)

    async def _report_served(self) -> None:
        try:
            await self._host_conn.call(
                "replica_served", to_payload(hw.ReplicaServed(worker_id=self.worker_id)),
                timeout_s=10.0)
        except FlashpointError as exc:  # the host refills after refill_hold_s anyway
            log.warning("replica_served_report_failed", error=exc.code)

    def _finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's module outputs as its answer (the serving task's ``finish``)."""
        served = self.replica.served if self.replica is not None else None
        return served.finish(outputs) if served is not None else outputs

    async def _infer_many(self, conn: Any, msg: cw.InferMany) -> cw.InferManyReply:
        """Several requests in one frame; each gets its outputs or its own error.

        Every request is queued before the first wait, so the batching loop sees them all
        together; their futures are awaited in turn (no task per request).
        """
        if not msg.requests:
            raise BadRequest("infer_many needs a non-empty list of requests")

        def prepare_all() -> list[tuple[dict[str, np.ndarray], bool] | Exception]:
            out: list[tuple[dict[str, np.ndarray], bool] | Exception] = []
            for req in msg.requests:
                try:  # each request validated alone: a malformed one fails by itself
                    item = (from_payload(cw.InferRequest, req, method="infer_many")
                            if isinstance(req, dict) else cw.InferRequest())
                    out.append(self._request(item))
                except Exception as exc:  # never let one request fail its neighbours
                    out.append(exc)
            return out

        # Prepared all together (off the loop where decoding is slow), then every one queued
        # before the first wait.
        prepared = (await asyncio.to_thread(prepare_all) if self._prepares_in_thread()
                    else prepare_all())
        waits: list[asyncio.Future | dict[str, Any]] = []
        for item in prepared:
            if isinstance(item, Exception):
                waits.append(to_payload(cw.InferFailed.of(item)))
                continue
            inputs, best_effort = item
            assert self.batcher is not None
            waits.append(self.batcher.enqueue(inputs, best_effort=best_effort))
        # Each reply in wire form as it comes (InferManyReply carries wire values).
        replies: list[dict[str, Any]] = []
        debug = logs_debug(LOGGER)
        try:
            for req, w in zip(msg.requests, waits, strict=True):
                if isinstance(w, dict):
                    replies.append(w)
                    continue
                try:
                    outputs, timings = await w
                    if isinstance(req, dict) and req.get("traceparent"):
                        tracing.worker_span(str(req["traceparent"]),
                                            str(req.get("request_id", "")), timings)
                    replies.append(to_payload(cw.InferReply(
                        outputs=encode_tensors(self._finish(outputs)), timings_s=timings)))
                    if debug:
                        log.debug("request_served", request_id=_rid(req))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    replies.append(to_payload(cw.InferFailed.of(exc)))
                    log.info("request_failed", request_id=_rid(req),
                             error=getattr(exc, "code", type(exc).__name__))
        except BaseException:
            for w in waits:  # cancelled (the caller gave up): nobody waits on the rest
                if not isinstance(w, dict):
                    w.cancel()
            raise
        if not self.state.served:  # the hot path pays one attribute read after the first
            await self._execute(self._apply(ws.RequestAnswered()))
        return cw.InferManyReply(replies=replies)

    async def _replica_stats(self, conn: Any, msg: hw.ReplicaStats) -> hw.ReplicaStatsReply:
        """The host's ``/metrics`` scrape: this replica's inference counters (see
        worker/replica_stats.py); ``stats`` is empty while no whole replica is served
        (idle, loading, a pipeline stage, a KaaS executor)."""
        rep, batcher = self.replica, self.batcher
        if rep is None or batcher is None:
            return hw.ReplicaStatsReply()
        return hw.ReplicaStatsReply(replica_id=rep.replica_id, function=rep.spec.name,
                                    stats={**batcher.stats.snapshot(),
                                                                     "queued": batcher.depth})

    async def _ping(self, conn: Any, msg: cw.Ping) -> cw.Pong:
        """The controller's liveness probe on this connection (answered by the event loop,
        so a stopped or wedged process misses it; inference runs off the loop)."""
        return cw.Pong()

    async def _status(self, conn: Any, msg: cw.ReplicaStatus) -> cw.ReplicaStatusReply:
        b = self.batcher
        engine = getattr(b, "engine", None)  # a generation loop's
        return cw.ReplicaStatusReply(depth=b.depth if b else 0, batches=b.batches_run if b else 0,
                                     running=getattr(b, "running", 0) if b else 0,
                                     kv_reserved_bytes=engine.reserved_bytes if engine else 0,
                                     parked=len(engine.parked) if engine else 0)


def _rid(req: Any) -> str:
    """The request id of one wire request of an ``infer_many`` frame ("" if it has none)."""
    return str(req.get("request_id", "")) if isinstance(req, dict) else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpoint-worker")
    parser.add_argument("--host-url", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--preload-transformers", action="store_true")
    args = parser.parse_args(argv)
    configure(os.environ.get("FLASHPOINT_WORKER_LOG_LEVEL", "WARNING"))
    tracing.setup_from_env("flashpoint-worker")  # OpenTelemetry, when the host's env has it
    secret = os.environ.get("FLASHPOINT_SECRET", "").encode()
    bind_ids(worker_id=args.worker_id)
    token = os.environ.get(CREDENTIAL_ENV)
    worker = Worker(args.worker_id, args.host_url, secret, args.torch_threads,
                    preload_transformers=args.preload_transformers,
                    credential=Credential.parse(token) if token else None)
    try:
        import uvloop

        uvloop.run(worker.run())
    except FlashpointError as exc:
        log.error("worker_failed", error=exc.to_wire())
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
