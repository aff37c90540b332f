"""The controller's handles on the processes it calls, and a request waiting for one.

:class:`HostHandle` is the only code that calls a host manager and :class:`WorkerHandle` the
only code that calls a worker (a partitioned group has the same shape,
``controller/pipeline_target.PipelineTarget``); :class:`Pending` is one accepted request from the
moment it is queued until its reply or its error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from flashpoint.controller.state import events as cs
from flashpoint.errors import DeadlineExceeded, FlashpointError
from flashpoint.messages import controller_host as ch
from flashpoint.messages.base import Message, from_payload, to_payload
from flashpoint.messages.controller_worker import InferMany, InferManyReply
from flashpoint.registry.manifest import Manifest


@dataclass(eq=False)
class Pending:
    request_id: str
    function: str
    payload: dict[str, Any]
    future: asyncio.Future
    enqueued_s: float
    deadline_s: float
    cold: bool
    best_effort: bool = False
    attempts: int = 0
    sent_s: float = 0.0
    # A streamed generation request: its token chunks arrive as ``gen_chunk`` notifications
    # on the connection it was sent to, and it travels alone (never in an infer_many frame).
    stream: bool = False


@dataclass
class HostHandle:
    """The only code that calls a host manager: one typed message per call
    (``messages/controller_host.py``)."""

    conn: Any
    data_endpoint: Any = None  # the host's data-plane address, as it reported it (opaque here)
    transfers: dict[str, Any] = field(default_factory=dict)  # model -> [verified, total] bytes

    async def _call(self, method: str, msg: Message, timeout_s: float = 10.0) -> Any:
        return await self.conn.call(method, to_payload(msg), timeout_s=timeout_s)

    async def deploy(self, cmd: cs.DeployReplica, source: ch.SourcePlan | None,
                     manifest: Manifest) -> None:
        # The manifest travels with the deploy, so a host can fill from peers even while the
        # registry is unreachable; its digest is pinned: the host loads nothing else.
        await self._call("deploy_replica", ch.DeployReplica(
            replica_id=cmd.replica_id, device_id=cmd.device_id, spec=cmd.spec,
            manifest_json=manifest.to_json(), manifest_digest=manifest.digest, source=source,
            stage=tuple(cmd.stage) if cmd.stage is not None else None,
            # The next hop is set when the group links (LinkGroup), once every stage serves.
            pipeline=ch.PipelineOptions() if cmd.stage is not None else None,
            # the host enforces it (MPS / tokens)
            share=cmd.share.to_wire() if cmd.share is not None else None))

    async def start_chain(self, cmd: cs.StartChain, chain: list[Any], fallback: list[Any],
                          digest: str) -> None:
        await self._call("start_chain", ch.StartChain(
            transfer_id=cmd.transfer_id, model=cmd.model, version=cmd.version,
            chain=tuple(chain), fallback=tuple(fallback), manifest_digest=digest))

    async def expect_transfer(self, transfer_id: str, digest: str) -> None:
        """Announce a chain to a receiver: its data plane refuses any it was not told of."""
        await self._call("expect_transfer", ch.ExpectTransfer(transfer_id=transfer_id,
                                                              manifest_digest=digest))

    async def deploy_kaas(self, cmd: cs.DeployKaas) -> None:
        await self._call("deploy_replica", ch.DeployKaas(
            replica_id=cmd.replica_id, device_id=cmd.device_id,
            device_bytes=cmd.device_bytes, cache_bytes=cmd.cache_bytes))

    async def stop(self, replica_id: str) -> None:
        await self._call("stop_replica", ch.StopReplica(replica_id=replica_id))

    async def link_stage(self, replica_id: str, next_hop: Any) -> None:
        await self._call("link_stage", ch.LinkStage(replica_id=replica_id,
                                                    next_hop=tuple(next_hop)))

    async def dissolve_stage(self, replica_id: str) -> None:
        await self._call("dissolve_stage", ch.DissolveStage(replica_id=replica_id))

    async def begin_completion(self, replica_id: str) -> None:
        await self._call("begin_completion", ch.BeginCompletion(replica_id=replica_id))

    async def apply_mig(self, gpu_index: int, geometry: tuple[str, ...], timeout_s: float) -> None:
        await self._call("apply_mig", ch.ApplyMig(gpu_index=gpu_index, geometry=tuple(geometry)),
                         timeout_s=timeout_s)

    async def set_replica_share(self, replica_id: str, share: Any) -> ch.ShareSet:
        reply = await self._call("set_replica_share",
                                 ch.SetReplicaShare(replica_id=replica_id, share=share))
        return from_payload(ch.ShareSet, reply, method="set_replica_share")

    async def status(self) -> ch.HostStatus:
        reply = await self._call("host_status", ch.HostStatusRequest())
        return from_payload(ch.HostStatus, reply, method="host_status")


@dataclass
class WorkerHandle:
    """The only code that calls a worker (messages/controller_worker.py).

    A :class:`Pending`'s ``payload`` is its :class:`~flashpoint.messages.controller_worker.
    InferRequest` in wire form, built once when the request is accepted: it goes to the
    worker as it is (its tensors' bytes are the client's, never copied here), and the reply
    comes back as an ``InferReply`` / ``InferStreamReply`` / ``InferFailed`` wire form."""

    conn: Any
    host_id: str
    timings_s: dict[str, float] = field(default_factory=dict)
    source: str = ""  # where its cold start got the model bytes

    async def infer(self, ps: list[Pending], timeout_s: float) -> list[dict[str, Any]]:
        """One frame for all of ``ps``; one reply (outputs or a wire error) per request.
        Streamed requests go as calls of their own, side by side."""
        if len(ps) > 1 and any(p.stream for p in ps):
            return [r for rs in await asyncio.gather(*(self.infer([p], timeout_s) for p in ps))
                    for r in rs]  # one reply each
        if len(ps) == 1:
            try:
                return [await self.conn.call("infer", ps[0].payload, timeout_s=timeout_s)]
            except FlashpointError as exc:
                if exc.retryable or isinstance(exc, DeadlineExceeded):
                    raise
                return [{"error": exc.to_wire()}]
        reply = await self.conn.call("infer_many",
                                     to_payload(InferMany(requests=[p.payload for p in ps])),
                                     timeout_s=timeout_s)
        return from_payload(InferManyReply, reply, method="infer_many").replies

    async def hand_off(self, request_ids: tuple[str, ...], timeout_s: float = 5.0) -> int:
        """Live migration: these streamed sequences leave at the worker's next token
        boundary (each one's ``infer`` then answers ``handed_off``); how many will."""
        from flashpoint.messages.migration import HandOffAccepted, HandOffSequences

        reply = await self.conn.call("hand_off", to_payload(HandOffSequences(
            request_ids=request_ids)), timeout_s=timeout_s)
        return from_payload(HandOffAccepted, reply, method="hand_off").handing_off

    async def snapshot(self, request_ids: tuple[str, ...], timeout_s: float = 5.0
                       ) -> tuple[Any, ...]:
        """Live migration's first round on the source: these streamed sequences' tokens so
        far (``SequenceSnapshot``), read without stopping them."""
        from flashpoint.messages.migration import SequenceSnapshots, SnapshotSequences

        reply = await self.conn.call("snapshot_sequences", to_payload(SnapshotSequences(
            request_ids=request_ids)), timeout_s=timeout_s)
        return from_payload(SequenceSnapshots, reply,
                            method="snapshot_sequences").sequences

    async def park(self, snapshots: tuple[Any, ...], ttl_s: float, timeout_s: float
                   ) -> tuple[Any, ...]:
        """Live migration's destination round: prefill these snapshots ahead of their
        resume; one ``ParkResult`` each, once every one is ready or refused."""
        from flashpoint.messages.migration import ParkSequences, SequencesParked

        reply = await self.conn.call("park_sequences", to_payload(ParkSequences(
            sequences=snapshots, ttl_s=ttl_s)), timeout_s=timeout_s)
        return from_payload(SequencesParked, reply, method="park_sequences").results

    async def unpark(self, request_ids: tuple[str, ...], timeout_s: float = 5.0) -> int:
        """Drop the parks of these requests (nothing will resume them here)."""
        from flashpoint.messages.migration import Unparked, UnparkSequences

        reply = await self.conn.call("unpark_sequences", to_payload(UnparkSequences(
            request_ids=request_ids)), timeout_s=timeout_s)
        return from_payload(Unparked, reply, method="unpark_sequences").dropped
