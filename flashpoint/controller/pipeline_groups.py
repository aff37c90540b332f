"""The I/O of partitioned scale-up groups (pipelines of stage replicas) for the controller.

``ControllerState`` decides when a group's stages are linked, when its held completions may
go and when its stage servers are dissolved (``controller/state/groups.py``); this object
carries those commands out over the hosts' RPC connections and keeps what the stages
reported when ready (their pipeline endpoints and cold-start timings). A linked group
serves through a :class:`~flashpoint.controller.pipeline_target.PipelineTarget` placed in
the controller's worker table under the group's id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from flashpoint.controller.functions import FunctionCatalog
from flashpoint.controller.handles import HostHandle, WorkerHandle
from flashpoint.controller.pipeline_target import PipelineTarget
from flashpoint.controller.state import events as cs
from flashpoint.controller.state.core import ControllerState
from flashpoint.errors import FlashpointError, FunctionNotFound
from flashpoint.log import get_logger
from flashpoint.pipeline.client import PipelineClient
from flashpoint.rpc import roles
from flashpoint.transfer.plan import Endpoint

log = get_logger("flashpoint.controller")


class PipelineGroups:
    """Links, completes and dissolves pipeline groups; remembers ready stages."""

    def __init__(self, secret: str, state: ControllerState, functions: FunctionCatalog,
                 hosts: dict[str, HostHandle], workers: dict[str, WorkerHandle | Any],
                 apply: Callable[[cs.Event], None], on_chunk: Callable[..., Any]) -> None:
        self._secret = secret
        self._state = state
        self._functions = functions
        self._hosts = hosts  # the controller's live tables, shared, not copied
        self._workers = workers
        self._apply = apply
        self._on_chunk = on_chunk
        self._endpoints: dict[str, Any] = {}  # stage replica id -> pipeline endpoint
        self._timings: dict[str, dict[str, float]] = {}  # stage replica id -> cold start

    def stage_ready(self, replica_id: str, endpoint: list[Any], timings: dict[str, float]
                    ) -> None:
        """A stage's pipeline server listens at ``endpoint``; ``timings`` its cold start."""
        self._endpoints[replica_id] = Endpoint.from_wire(endpoint).to_wire()
        self._timings[replica_id] = dict(timings)

    def forget(self, replica_id: str) -> None:
        self._endpoints.pop(replica_id, None)
        self._timings.pop(replica_id, None)

    async def link(self, cmd: cs.LinkGroup) -> None:
        """Point each stage at the next (last first), then open the pipeline's client."""
        try:
            eps = [self._endpoints.get(rid) for rid, _ in cmd.stages]
            if any(ep is None for ep in eps):
                raise FlashpointError("a stage's pipeline endpoint is unknown")
            for (rid, host_id), nxt in reversed(list(zip(cmd.stages[:-1], eps[1:], strict=True))):
                host = self._hosts.get(host_id)
                if host is None:
                    raise FlashpointError(f"host {host_id} has no connection")
                await host.link_stage(rid, nxt)
            fn = self._state.functions.get(cmd.function)
            if fn is None:
                raise FunctionNotFound(f"function {cmd.function!r} is gone")
            manifest = self._functions.manifests[fn.model_key]
            io = manifest.io.to_dict()
            client = PipelineClient(
                Endpoint.from_wire(eps[0]), roles.data_key(self._secret.encode()),
                timeout_s=fn.spec.timeout_s, name=f"controller:{cmd.group_id}",
                input_names=[t["name"] for t in io.get("inputs", [])] or None)
            # The group's cold start is its slowest stage's, phase by phase.
            timings: dict[str, float] = {}
            for rid, _ in cmd.stages:
                for phase, secs in self._timings.get(rid, {}).items():
                    timings[phase] = max(timings.get(phase, 0.0), secs)
            self._workers[cmd.group_id] = PipelineTarget(
                client, cmd.stages[0][1], [t["name"] for t in io.get("outputs", [])],
                timings, source=f"pipeline:{len(cmd.stages)}",
                on_first_answer=lambda gid=cmd.group_id: self._apply(cs.GroupAnswered(gid)),
                # a causal LM's group runs token loops (issue 21 item 6)
                generates=manifest.task == "text-generation", on_chunk=self._on_chunk)
            self._apply(cs.GroupLinked(cmd.group_id, True, "", time.monotonic()))
            log.info("group_linked", group_id=cmd.group_id, stages=[r for r, _ in cmd.stages])
        except FlashpointError as exc:
            log.warning("group_link_failed", group_id=cmd.group_id, error=exc.to_wire())
            self._apply(cs.GroupLinked(cmd.group_id, False, exc.message, time.monotonic()))

    async def begin_completion(self, cmd: cs.BeginCompletion) -> None:
        """Tell every stage's host its group answered: its held completion may go."""
        async def one(rid: str, host_id: str) -> None:
            host = self._hosts.get(host_id)
            if host is None:
                return  # its hold times out on its own
            try:
                await host.begin_completion(rid)
            except FlashpointError as exc:
                log.warning("begin_completion_failed", replica_id=rid, error=exc.code)

        await asyncio.gather(*(one(rid, host_id) for rid, host_id in cmd.stages))

    async def dissolve(self, cmd: cs.DissolveStages) -> None:
        """Stop the stages' pipeline servers (their completed replicas keep serving)."""
        for rid, host_id in cmd.stages:
            self.forget(rid)
            host = self._hosts.get(host_id)
            if host is None:
                continue
            try:
                await host.dissolve_stage(rid)
            except FlashpointError as exc:
                log.warning("dissolve_failed", replica_id=rid, error=exc.code)
        log.info("group_dissolved", group_id=cmd.group_id)
