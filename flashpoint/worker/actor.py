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
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashpoint.errors import BadRequest, FlashpointError, InvalidInput, Unavailable
from flashpoint.gpu.worker_env import apply_env
from flashpoint.log import bind_ids, configure, get_logger
from flashpoint.policy.request_class import RequestClass
from flashpoint.rpc.roles import CREDENTIAL_ENV, Credential
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import decode_tensors, encode_tensors

log = get_logger("flashpoint.worker")



@dataclass
class LoadedReplica:
    replica_id: str
    spec: FunctionSpec
    module: Any
    device: str
    input_names: list[str]
    output_names: list[str]
    mapping: mmap.mmap
    manifest: Any = None  # the model's Manifest (a stage builds the whole module from it)
    stage: Any = None  # [first, last] while this is a partition stage; None once whole
    # How requests become module inputs and outputs answers (models/serving); None for a stage.
    served: Any = None
    request_inputs: tuple[str, ...] = ()  # what a request must carry (the manifest's io)


class Worker:
    """The worker process's actor."""

    def __init__(self, worker_id: str, host_url: str, secret: bytes, torch_threads: int,
                 *, preload_transformers: bool = False, credential: Credential | None = None) -> None:
        self.preload_transformers = preload_transformers
        self.worker_id = worker_id
        self.host_url = host_url
        self.secret = secret  # the data plane's key (stage servers, pulls)
        # What it proves to its host and the controller (rpc/roles.py): its host's workers'.
        self.credential = credential or Credential("worker", secret)
        self.torch_threads = torch_threads
        self.replica: LoadedReplica | None = None
        self.batcher: Any = None
        self._controller: Any = None
        self._host_conn: Any = None
        self._done = asyncio.Event()
        self._ready_payload: dict[str, Any] | None = None
        self.stage_server: Any = None  # a StageServer while this worker serves a pipeline stage
        self._controller_url = ""
        self._completing: asyncio.Task | None = None
        self.kaas: Any = None  # a WorkerKaasRuntime while this worker is a KaaS executor
        self.weights_role = ""  # "exporter" / "reader" when its weights are shared by IPC
        self._loaded_s = 0.0  # perf_counter when its replica was loaded and warmed
        # Set once there is a replica to announce: a connection to the controller opened
        # while the module loads announces it only then.
        self._announceable = asyncio.Event()
        self._served_task: asyncio.Task | None = None  # tells the host of the first answer

    async def run(self) -> None:
        import torch  # imported before any replica is assigned: the warm pool's whole point

        torch.set_num_threads(self.torch_threads)
        # Import the model code now too: a cold start should pay for bytes, not imports.
        from flashpoint.models import zoo

        # Building on the meta device pulls in lazily imported torch modules (sympy among
        # them, seconds of imports); do it once per built-in model while the worker is idle.
        for name in zoo.MODELS:
            zoo.build_empty(name, zoo.resolve_config(name, "tiny"))
        if self.preload_transformers:
            await asyncio.to_thread(_preload_transformers)
        from flashpoint import heap

        heap.settle()  # torch and the model code out of the collector's scans
        from flashpoint.rpc import connect

        self._host_conn = await connect(
            self.host_url, {"load_replica": self._load_replica, "shutdown": self._shutdown,
                            "load_kaas": self._load_kaas,
                            "complete_replica": self._complete_replica,
                            "dissolve_stage": self._dissolve_stage,
                            "set_next_hop": self._set_next_hop,
                            "replica_stats": self._replica_stats},
            secret=self.credential.key, name=self.credential.principal, connect_timeout_s=10.0,
        )
        self._host_conn.add_close_callback(lambda *_: self._done.set())
        await self._host_conn.call("worker_hello", {"worker_id": self.worker_id, "pid": os.getpid()},
                                   timeout_s=10.0)
        await self._done.wait()
        await self._teardown()

    async def _teardown(self) -> None:
        if self.stage_server is not None:
            await self.stage_server.stop()
        if self.batcher is not None:
            await self.batcher.stop()
        if self._controller is not None:
            await self._controller.stop()
        if self._host_conn is not None and not self._host_conn.closed:
            await self._host_conn.close()

    async def _shutdown(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        asyncio.get_running_loop().call_later(0.01, self._done.set)
        return {"ok": True}

    # ------------------------------------------------------------------------------------
    async def _load_replica(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        received = time.perf_counter()
        if self.replica is not None:
            if self.replica.replica_id == payload["replica_id"]:
                return {"timings_s": self._ready_payload["timings_s"] if self._ready_payload else {},
                        **self._pipeline_reply()}
            raise BadRequest("worker already serves another replica")
        spec = FunctionSpec.from_dict(payload["spec"])
        pipeline = payload.get("pipeline")
        if pipeline is not None and (payload.get("stage") is None or not isinstance(pipeline, dict)):
            raise BadRequest("pipeline options need a stage and must be a map")
        bind_ids(replica_id=payload["replica_id"])
        # Before anything touches CUDA: its GPU binding and MPS/hook settings (warm pool
        # ordering, flashpoint/gpu/host_sharing.py).
        apply_env(payload.get("env") or {})
        self._controller_url = str(payload["controller_url"])
        if pipeline is None and self._controller is None:
            # Connect to the controller (socket, WebSocket upgrade, handshake: tens of ms)
            # while the module loads; the connection announces the replica once it serves.
            self._connect_controller()
            await self._controller.start()
        try:
            timings = await asyncio.to_thread(self._load_blocking, payload, spec, received)
        except BaseException:
            if self._controller is not None and not self._announceable.is_set():
                # Nothing to announce: the connection opened for it goes (the host stops
                # this worker after a failed start anyway).
                client, self._controller = self._controller, None
                await client.stop()
            raise
        timings["fetch"] = float(payload.get("fetch_s", 0.0))
        host_timings = payload.get("host_timings_s")
        if isinstance(host_timings, dict):
            timings.update({str(k): float(v) for k, v in host_timings.items()
                            if isinstance(v, int | float) and not isinstance(v, bool)})
        self._ready_payload = {
            "replica_id": payload["replica_id"], "host_id": payload["host_id"],
            "function": spec.name, "credits": spec.replica_concurrency, "timings_s": timings,
            "source": str(payload.get("source", "")),
        }
        if pipeline is not None:
            await self._start_stage_server(pipeline)
            log.info("stage_loaded", endpoint=str(self.stage_server.endpoint),
                     **{k: round(v, 4) for k, v in timings.items()})
            return {"timings_s": timings, **self._pipeline_reply()}
        await self._serve_whole(spec)
        log.info("replica_loaded", **{k: round(v, 4) for k, v in timings.items()})
        return {"timings_s": timings, "weights": self.weights_role}

    async def _serve_whole(self, spec: FunctionSpec) -> None:
        """Batch requests for the loaded module and announce it to the controller."""
        from flashpoint.worker.batcher import Batcher

        served = self.replica.served if self.replica is not None else None
        if getattr(served, "generates", False):  # a causal LM: token loop, not batches
            from flashpoint.worker.generation import GenerationLoop

            assert self.replica is not None
            engine = served.build_engine(self.replica.module, max_running=spec.max_batch_size)
            self.batcher = GenerationLoop(engine, max_waiting=4 * spec.max_batch_size)
        else:
            self.batcher = Batcher(self._run_batch, spec.max_batch_size,
                                   spec.batch_wait_ms / 1000.0,
                                   pad_values=served.pad_values if served is not None else None)
        self.batcher.start()
        self._announceable.set()
        if self._controller is None:
            self._connect_controller()
            await self._controller.start()

    def _connect_controller(self) -> None:
        """The client that serves this replica's requests; its first (and every later)
        connection announces the replica, once there is one (``_announceable``)."""
        from flashpoint.rpc import ReconnectingClient

        self._controller = ReconnectingClient(
            self._controller_url, {"infer": self._infer, "infer_many": self._infer_many,
             "replica_status": self._status, "ping": self._ping,
             "hand_off": self._hand_off},
            secret=self.credential.key, name=self.credential.principal,
            on_connected=self._announce,
        )

    # KaaS executor --------------------------------------------------------------------------
    async def _load_kaas(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Become a KaaS executor replica (idempotent by replica id): build the executor on
        the device now (its CUDA context and cache, so the first request pays for data
        only, as the paper's executors), then announce to the controller."""
        from flashpoint.kaas import KAAS_FUNCTION
        from flashpoint.kaas.remote import WorkerKaasRuntime
        from flashpoint.rpc import ReconnectingClient

        rid = str(payload.get("replica_id", ""))
        if self.kaas is not None and self.kaas.executor_id == rid:
            return {"timings_s": self._ready_payload["timings_s"] if self._ready_payload else {}}
        if self.kaas is not None or self.replica is not None:
            raise BadRequest("worker already serves another replica")
        cache_bytes = payload.get("cache_bytes")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes <= 0:
            raise BadRequest("load_kaas needs a positive integer cache_bytes")
        bind_ids(replica_id=rid)
        apply_env(payload.get("env") or {})
        runtime = WorkerKaasRuntime(rid, str(payload.get("device", "cpu")),
                                    capacity_bytes=cache_bytes)
        t0 = time.perf_counter()
        await asyncio.to_thread(runtime.executor)
        timings = {"load": time.perf_counter() - t0}
        self.kaas = runtime
        self._ready_payload = {
            "replica_id": rid, "host_id": payload.get("host_id", ""), "function": KAAS_FUNCTION,
            "kind": "kaas", "credits": 1, "timings_s": timings, "source": "kaas"}
        self._announceable.set()
        self._controller = ReconnectingClient(
            str(payload["controller_url"]),
            {"kaas_run": self._kaas_run, "kaas_reset": self._kaas_reset,
             "replica_status": self._status, "ping": self._ping,
             "hand_off": self._hand_off},
            secret=self.credential.key, name=self.credential.principal,
            on_connected=self._announce)
        await self._controller.start()
        log.info("kaas_executor_loaded", **{k: round(v, 4) for k, v in timings.items()})
        return {"timings_s": timings}

    async def _kaas_run(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        if self.kaas is None:
            raise Unavailable("this worker is no KaaS executor", retry_after_s=0.1)
        # Off the loop: kernels and copies block; the worker's connections stay responsive.
        return await asyncio.to_thread(self.kaas.run, payload)

    async def _kaas_reset(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        if self.kaas is None:
            raise Unavailable("this worker is no KaaS executor", retry_after_s=0.1)
        return await asyncio.to_thread(self.kaas.reset)

    # partition stages ---------------------------------------------------------------------
    def _pipeline_reply(self) -> dict[str, Any]:
        ep = self.stage_server.endpoint if self.stage_server is not None else None
        return {"pipeline_endpoint": ep.to_wire() if ep is not None else None}

    async def _start_stage_server(self, pipeline: dict[str, Any]) -> None:
        """Serve the stage module as one stage of a pipeline (``pipeline``: ``listen_host``,
        ``port`` (0: any), ``next_hop`` (an endpoint's wire form, or None for the last))."""
        from flashpoint.pipeline.stage import StageServer
        from flashpoint.transfer.plan import Endpoint

        rep = self.replica
        assert rep is not None
        nxt = pipeline.get("next_hop")
        port = pipeline.get("port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise BadRequest("pipeline port must be an integer in [0, 65536)")
        server = StageServer(
            rep.module, host=str(pipeline.get("listen_host") or "127.0.0.1"), port=port,
            secret=self.secret, next_hop=Endpoint.from_wire(nxt) if nxt is not None else None,
            device=rep.device, stage_id=rep.replica_id)
        await server.start()
        self.stage_server = server

    async def _complete_replica(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Model completion: the host has every byte of the model now. Build the whole
        module over the mapping this stage already holds, warm it, and announce this worker
        to the controller as a whole replica. The stage server (if any) keeps serving,
        untouched, until ``dissolve_stage``, so completion never fails a pipeline request
        in flight. Idempotent; a whole replica replies at once."""
        rep = self.replica
        if rep is None:
            raise Unavailable("no replica loaded", retry_after_s=0.1)
        if rep.stage is None:
            return {"completed": True, "timings_s": {}}
        if self._completing is None:
            self._completing = asyncio.get_running_loop().create_task(self._complete())
        try:
            timings = await asyncio.shield(self._completing)
        except BaseException:
            if self._completing.done():
                self._completing = None  # the host may try again
            raise
        return {"completed": True, "timings_s": timings}

    async def _complete(self) -> dict[str, float]:
        rep = self.replica
        assert rep is not None and rep.stage is not None
        whole, timings = await asyncio.to_thread(self._build_whole, rep)
        t0 = time.perf_counter()
        # From here ``_run_batch`` uses the whole module; the stage server holds its own.
        self.replica = whole
        assert self._ready_payload is not None
        self._ready_payload["timings_s"] = {**self._ready_payload["timings_s"], **timings}
        if self._controller is None:
            await self._serve_whole(whole.spec)
        else:  # a stage deployed without pipeline options announced itself already
            await self._controller.call("replica_ready", self._ready_payload, timeout_s=10.0)
        log.info("replica_completed", announce_s=round(time.perf_counter() - t0, 4))
        return dict(self._ready_payload["timings_s"])

    def _build_whole(self, rep: LoadedReplica) -> tuple[LoadedReplica, dict[str, float]]:
        import torch

        from flashpoint.models.publish import load_module

        t0 = time.perf_counter()
        module = load_module(rep.manifest, memoryview(rep.mapping), device="cpu")
        t1 = time.perf_counter()
        if rep.device.startswith("cuda"):
            module = module.to(rep.device)
            torch.cuda.synchronize(rep.device)
        t2 = time.perf_counter()
        whole = _whole_replica(rep.replica_id, rep.spec, module, rep.device, rep.mapping,
                               rep.manifest)
        self._warm_up(whole)
        return whole, {"complete_load": t1 - t0, "complete_to_device": t2 - t1,
                       "complete_first_inference": time.perf_counter() - t2}

    async def _set_next_hop(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Where this stage forwards its outputs: the controller links a pipeline only after
        every stage serves, so stages load in parallel without knowing each other first.
        (The stage server dials its next hop on its first request.)"""
        from flashpoint.transfer.plan import Endpoint

        if self.stage_server is None:
            raise BadRequest("this worker serves no pipeline stage")
        self.stage_server.next_hop = Endpoint.from_wire(payload.get("next_hop"))
        return {"ok": True}

    async def _dissolve_stage(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Stop serving the pipeline stage (its links close: a request still in it fails
        with PeerLost, so the controller dissolves a pipeline only once it sends no more
        work there). The whole replica, if completed, keeps serving."""
        server, self.stage_server = self.stage_server, None
        if server is None:
            return {"dissolved": False}
        await server.stop()
        return {"dissolved": True}

    async def _announce(self, conn: Any) -> None:
        await self._announceable.wait()  # connected while loading: announce once serving
        assert self._ready_payload is not None
        timings = self._ready_payload["timings_s"]
        if "announce" not in timings and self._loaded_s:  # the first announcement only
            timings["announce"] = time.perf_counter() - self._loaded_s
        await conn.call("replica_ready", self._ready_payload, timeout_s=10.0)

    def _load_blocking(self, payload: dict[str, Any], spec: FunctionSpec,
                       received_s: float) -> dict[str, float]:
        import torch

        from flashpoint.models.publish import builder_takes_files, load_module
        from flashpoint.registry.format import Manifest

        t0 = time.perf_counter()
        prepare = {"worker_prepare": t0 - received_s}
        manifest = Manifest.from_json(payload["manifest_json"])
        # O_NOFOLLOW: the host's private cache directory holds files, never symlinks.
        fd = os.open(payload["cache_path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            # MAP_PRIVATE: zero-copy views; a stray write copies a page instead of corrupting
            # the bytes every other worker on this host shares.
            mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        stage = payload.get("stage")
        if stage is not None:
            # A partition stage (execute-while-load): only its own layers' bytes need to be
            # in the cache yet; the host has waited for exactly that range.
            from flashpoint.models.publish import load_stage
            from flashpoint.models.serving.stage import served_stage
            from flashpoint.registry.manifest import layer_range

            module = load_stage(manifest, memoryview(mapping), stage[0], stage[1], device="cpu")
            i, j = layer_range(manifest, stage[0], stage[1])
            module = served_stage(manifest, module, memoryview(mapping), first=i == 0,
                                  last=j == len(manifest.layers) - 1)
        else:
            module = None
        device = payload.get("device", "cpu")
        slot = payload.get("weight_slot")
        if (module is None and device.startswith("cuda") and isinstance(slot, dict)
                and not builder_takes_files(manifest)):  # an archive's module needs its files
            # FaST-style weight sharing: the first replica on this GPU exports its weights,
            # later ones map them (CUDA IPC) once the slot's ready flag is up.
            module, role = self._shared_weights(manifest, mapping, device, slot)
            self.weights_role = role
            t1 = time.perf_counter()
        else:
            if module is None:
                module = load_module(manifest, memoryview(mapping), device="cpu")
            t1 = time.perf_counter()
            if device.startswith("cuda"):
                module = module.to(device)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if stage is not None:
            # A stage's input is the previous stage's activation; there is no example of it
            # here, so it is warmed by its first real request instead.
            self.replica = LoadedReplica(payload["replica_id"], spec, module, device,
                                         ["activation"], ["activation"], mapping, manifest,
                                         list(stage))
            self._loaded_s = t2
            return {**prepare, "load": t1 - t0, "to_device": t2 - t1, "first_inference": 0.0}
        self.replica = _whole_replica(payload["replica_id"], spec, module, device, mapping,
                                      manifest)
        self._warm_up(self.replica)
        t3 = time.perf_counter()
        if self.weights_role:
            log.info("weights_shared", role=self.weights_role)
        self._loaded_s = t3
        return {**prepare, "load": t1 - t0, "to_device": t2 - t1, "first_inference": t3 - t2}

    def _shared_weights(self, manifest: Any, mapping: mmap.mmap, device: str,
                        slot: dict[str, Any]) -> tuple[Any, str]:
        """The module with weights exported to, or mapped from, the host's slot for this
        model on this GPU (gpu/weight_share.py); returns it and this worker's role."""
        from flashpoint.gpu.weight_share import WeightSlot, share_module_weights
        from flashpoint.models.publish import empty_module, load_module

        module, role = share_module_weights(
            empty_module(manifest), WeightSlot(str(slot["dir"]), str(slot["key"])), device,
            float(slot.get("timeout_s", 60.0)),
            lambda: load_module(manifest, memoryview(mapping), device=device))
        return module, role.name.lower()

    def _warm_up(self, rep: LoadedReplica) -> None:
        """The replica's first inference, on its serving task's own valid request."""
        served = rep.served
        if getattr(served, "generates", False):  # one forward pass, no sequence
            self._run_batch(served.warmup_module_inputs(), rep)
            return
        self._run_batch(served.prepare(served.warmup_request()), rep)

    def _run_batch(self, inputs: dict[str, np.ndarray],
                   rep: LoadedReplica | None = None) -> dict[str, np.ndarray]:
        import torch

        rep = rep or self.replica
        assert rep is not None
        args = []
        for name in rep.input_names:
            arr = inputs[name]
            if not arr.flags.writeable:  # frombuffer over wire bytes; torch wants writable
                arr = arr.copy()
            t = torch.from_numpy(np.ascontiguousarray(arr))
            args.append(t.to(rep.device) if rep.device != "cpu" else t)
        with torch.inference_mode():
            out = rep.module(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return {n: o.detach().cpu().numpy() for n, o in zip(rep.output_names, outs, strict=False)}

    def _request(self, payload: dict[str, Any]) -> tuple[dict[str, np.ndarray], bool]:
        """One infer request's inputs, checked against the replica, and its class."""
        if self.replica is None or self.batcher is None:
            raise Unavailable("replica not loaded", retry_after_s=0.1)
        inputs = decode_tensors(payload.get("inputs"))
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
        return prepared, payload.get("class") == RequestClass.BEST_EFFORT

    def _prepares_in_thread(self) -> bool:
        """Whether requests are prepared off the event loop (image decoding takes ms)."""
        rep = self.replica
        return bool(rep is not None and getattr(rep.served, "prepare_in_thread", False))

    async def _infer(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        if self._prepares_in_thread():
            inputs, best_effort = await asyncio.to_thread(self._request, payload)
        else:
            inputs, best_effort = self._request(payload)
        assert self.batcher is not None
        if payload.get("stream") and hasattr(self.batcher, "stream"):
            return await self._infer_stream(conn, payload, inputs)
        outputs, timings = await self.batcher.submit(inputs, best_effort=best_effort)
        self._first_served()
        return {"outputs": encode_tensors(self._finish(outputs)), "timings_s": timings}

    def _first_served(self) -> None:
        """After the replica's first answer, tell the host (its warm pool waits for it
        before starting a process that would compete for the CPU)."""
        if self._served_task is None and self._host_conn is not None:
            self._served_task = asyncio.get_running_loop().create_task(
                self._report_served(), name="replica-served")

    async def _report_served(self) -> None:
        try:
            await self._host_conn.call("replica_served", {"worker_id": self.worker_id},
                                       timeout_s=10.0)
        except FlashpointError as exc:  # the host refills after refill_hold_s anyway
            log.warning("replica_served_report_failed", error=exc.code)

    async def _infer_stream(self, conn: Any, payload: dict[str, Any],
                            request: Any) -> dict[str, Any]:
        """A generation request whose tokens go back as they come: one ``gen_chunk``
        notification per token boundary to the caller (``request_id``, ``index`` from 0,
        ``text``, ``token_id``), then the reply: the whole answer and ``chunks``, how many
        were sent (notifications may be handled after the reply arrives). The caller
        cancelling the call (a client gone) cancels the sequence and frees its cache."""
        from flashpoint.messages.base import from_payload, to_payload
        from flashpoint.messages.migration import SequenceHandOff
        from flashpoint.models.generate import FinishReason, GenerationResult
        from flashpoint.worker.generation import hand_off_message, resumed_request

        rid = str(payload.get("request_id", ""))
        started = time.perf_counter()
        # a sequence another replica handed off goes on from its tokens (live migration)
        resume = payload.get("resume")
        request, index = resumed_request(request, None if resume is None else from_payload(
            SequenceHandOff, resume, method="infer"))
        stream = self.batcher.stream(request, key=rid)
        ids: list[int] = list(request.progress.generated_ids) if request.progress else []
        text = request.progress.emitted_text if request.progress else ""
        finish = FinishReason.LENGTH
        try:
            async for event in stream:
                if event.token_id is not None:
                    ids.append(event.token_id)
                text += event.text_delta
                if event.finish is not None:
                    finish = event.finish
                await conn.notify("gen_chunk", {"request_id": rid, "index": index,
                                                "text": event.text_delta,
                                                "token_id": event.token_id}, trace=rid)
                index += 1
        finally:
            await stream.aclose()
        if stream.handed_off is not None:  # left for another replica (hand_off)
            return {"handed_off": to_payload(hand_off_message(request, stream.handed_off,
                                                              index)), "chunks": index}
        result = GenerationResult(len(request.prompt_ids), tuple(ids), text, finish)
        timings = {"inference": time.perf_counter() - started}
        if request.progress is not None:  # resumed here: its prefill is part of the gap
            timings["resume_prefill"] = stream.prefill_s
        return {"outputs": encode_tensors(self._finish(result)), "chunks": index,
                "timings_s": timings}

    def _finish(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's module outputs as its answer (the serving task's ``finish``)."""
        served = self.replica.served if self.replica is not None else None
        return served.finish(outputs) if served is not None else outputs

    async def _infer_many(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Several requests in one frame; each gets its outputs or its own error.

        Every request is queued before the first wait, so the batching loop sees them all
        together; their futures are awaited in turn (no task per request).
        """
        requests = payload.get("requests")
        if not isinstance(requests, list) or not requests:
            raise BadRequest("infer_many needs a non-empty list of requests")
        def prepare_all() -> list[tuple[dict[str, np.ndarray], bool] | Exception]:
            out: list[tuple[dict[str, np.ndarray], bool] | Exception] = []
            for req in requests:
                try:
                    out.append(self._request(req if isinstance(req, dict) else {}))
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
                waits.append(_error_reply(item))
                continue
            inputs, best_effort = item
            assert self.batcher is not None
            waits.append(self.batcher.enqueue(inputs, best_effort=best_effort))
        replies: list[dict[str, Any]] = []
        try:
            for w in waits:
                if isinstance(w, dict):
                    replies.append(w)
                    continue
                try:
                    outputs, timings = await w
                    replies.append({"outputs": encode_tensors(self._finish(outputs)),
                                    "timings_s": timings})
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    replies.append(_error_reply(exc))
        except BaseException:
            for w in waits:  # cancelled (the caller gave up): nobody waits on the rest
                if not isinstance(w, dict):
                    w.cancel()
            raise
        self._first_served()
        return {"replies": replies}

    async def _replica_stats(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """The host's ``/metrics`` scrape: this replica's inference counters (see
        worker/replica_stats.py); ``stats`` is empty while no whole replica is served
        (idle, loading, a pipeline stage, a KaaS executor)."""
        rep, batcher = self.replica, self.batcher
        if rep is None or batcher is None:
            return {"replica_id": "", "function": "", "stats": {}}
        return {"replica_id": rep.replica_id, "function": rep.spec.name,
                "stats": batcher.stats.snapshot()}

    async def _hand_off(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Live migration: the controller takes these streamed sequences elsewhere; each
        leaves at the next token boundary and its ``infer`` call answers ``handed_off``."""
        from flashpoint.messages.base import from_payload, to_payload
        from flashpoint.messages.migration import HandOffAccepted, HandOffSequences

        msg = from_payload(HandOffSequences, payload, method="hand_off")
        count = self.batcher.hand_off(msg.request_ids) if hasattr(self.batcher, "hand_off") \
            else 0
        return to_payload(HandOffAccepted(handing_off=count))

    async def _ping(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """The controller's liveness probe on this connection (answered by the event loop,
        so a stopped or wedged process misses it; inference runs off the loop)."""
        return {}

    async def _status(self, conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        return {"depth": self.batcher.depth if self.batcher else 0,
                "batches": self.batcher.batches_run if self.batcher else 0,
                # sequences generating now (a text-generation replica; else 0)
                "running": getattr(self.batcher, "running", 0) if self.batcher else 0}


def _preload_transformers() -> None:
    """Import what a Hugging Face model's cold start needs (tokenizers, image processors,
    the common model families), so that it is not paid by the first request; absent
    transformers, nothing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a worker never downloads
    try:
        import transformers
        from transformers import AutoImageProcessor, AutoTokenizer  # noqa: F401
    except ImportError:
        return
    for cls in ("BertForSequenceClassification", "GPT2LMHeadModel", "LlamaForCausalLM",
                "RobertaForSequenceClassification",
                "DistilBertForSequenceClassification", "ViTForImageClassification",
                "ResNetForImageClassification", "ViTImageProcessorPil",
                "ConvNextImageProcessorPil"):
        getattr(transformers, cls, None)  # lazy modules: attribute access imports them


def _whole_replica(replica_id: str, spec: FunctionSpec, module: Any, device: str,
                   mapping: mmap.mmap, manifest: Any) -> LoadedReplica:
    """A whole replica with its serving task, built from the files its model carries."""
    from flashpoint.models import serving
    from flashpoint.models.publish import read_files

    served = serving.for_manifest(manifest, read_files(manifest, memoryview(mapping)))
    required = getattr(served, "required_inputs", None)  # text generation: text or messages
    return LoadedReplica(replica_id, spec, module, device, list(served.module_inputs),
                         list(served.module_outputs), mapping, manifest, None, served,
                         tuple(t.name for t in manifest.io.inputs) if required is None
                         else tuple(required))


def _error_reply(exc: Exception) -> dict[str, Any]:
    """One request's failure inside an infer_many reply, in wire form."""
    if isinstance(exc, FlashpointError):
        return {"error": exc.to_wire()}
    return {"error": FlashpointError(f"{type(exc).__name__}: {exc}"[:300]).to_wire()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpoint-worker")
    parser.add_argument("--host-url", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--preload-transformers", action="store_true")
    args = parser.parse_args(argv)
    configure(os.environ.get("FLASHPOINT_WORKER_LOG_LEVEL", "WARNING"))
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
