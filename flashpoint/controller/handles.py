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

from flashpoint.controller.state import core as cs
from flashpoint.errors import DeadlineExceeded, FlashpointError
from flashpoint.messages.base import from_payload, to_payload
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
    """The only code that calls a host manager."""

    conn: Any
    data_endpoint: Any = None  # the host's data-plane address, as it reported it (opaque here)
    transfers: dict[str, Any] = field(default_factory=dict)  # model -> [verified, total] bytes

    async def deploy(self, cmd: cs.DeployReplica, source: dict[str, Any] | None,
                     manifest: Manifest) -> None:
        # The manifest travels with the deploy, so a host can fill from peers even while the
        # registry is unreachable; its digest is pinned: the host loads nothing else.
        payload = {"replica_id": cmd.replica_id, "device_id": cmd.device_id,
                   "spec": cmd.spec.to_dict(), "manifest_json": manifest.to_json(),
                   "manifest_digest": manifest.digest}
        if source is not None:
            payload["source"] = source
        if cmd.stage is not None:
            # The next hop is set when the group links (LinkGroup), once every stage serves.
            payload["stage"] = list(cmd.stage)
            payload["pipeline"] = {"next_hop": None}
        if cmd.share is not None:
            payload["share"] = cmd.share.to_wire()  # the host enforces it (MPS / tokens)
        await self.conn.call("deploy_replica", payload, timeout_s=10.0)

    async def start_chain(self, cmd: cs.StartChain, chain: list[Any], fallback: list[Any],
                          digest: str) -> None:
        await self.conn.call("start_chain", {
            "transfer_id": cmd.transfer_id, "model": cmd.model, "version": cmd.version,
            "chain": chain, "fallback": fallback, "manifest_digest": digest,
        }, timeout_s=10.0)

    async def expect_transfer(self, transfer_id: str, digest: str) -> None:
        """Announce a chain to a receiver: its data plane refuses any it was not told of."""
        await self.conn.call("expect_transfer", {"transfer_id": transfer_id,
                                                 "manifest_digest": digest}, timeout_s=10.0)

    async def deploy_kaas(self, cmd: cs.DeployKaas) -> None:
        await self.conn.call("deploy_replica", {
            "replica_id": cmd.replica_id, "device_id": cmd.device_id, "kind": "kaas",
            "device_bytes": cmd.device_bytes, "cache_bytes": cmd.cache_bytes,
        }, timeout_s=10.0)

    async def stop(self, replica_id: str) -> None:
        await self.conn.call("stop_replica", {"replica_id": replica_id}, timeout_s=10.0)

    async def link_stage(self, replica_id: str, next_hop: Any) -> None:
        await self.conn.call("link_stage", {"replica_id": replica_id, "next_hop": next_hop},
                             timeout_s=10.0)

    async def dissolve_stage(self, replica_id: str) -> None:
        await self.conn.call("dissolve_stage", {"replica_id": replica_id}, timeout_s=10.0)

    async def begin_completion(self, replica_id: str) -> None:
        await self.conn.call("begin_completion", {"replica_id": replica_id}, timeout_s=10.0)


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
            return list(await asyncio.gather(*(self.infer([p], timeout_s) for p in ps)))
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
