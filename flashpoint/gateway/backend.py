"""The gateway's view of the cluster: one protocol the controller implements.

The gateway (HTTP parsing, auth, limits, encodings) only talks to an ``InvokeBackend``;
tests drive the gateway with a small in-memory backend, production with the Controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from flashpoint.spec import FunctionSpec


@dataclass
class InvokeResult:
    """Outputs of one request plus where its time went.

    ``timings_s`` keys: ``queue`` (waiting for a replica), ``cold_start`` (scale-from-zero
    wait, 0 when warm), ``fetch``/``load``/``to_device`` (the cold start's phases when this
    request triggered one), ``batch_wait``, ``inference``, ``total``.
    """

    outputs: dict[str, np.ndarray]
    timings_s: dict[str, float] = field(default_factory=dict)
    replica_id: str = ""
    cold: bool = False
    # Where the cold start this request waited for got the model bytes ("local",
    # "chain:<sender>", "registry", "peer:<host>"); empty when the request found a warm replica.
    cold_start_source: str = ""


@dataclass(frozen=True)
class StreamChunk:
    """One token boundary of a streamed generation: ``index`` from 0, the text it added
    (possibly empty: text a stop string could still cut is held back) and its token."""

    index: int
    text: str
    token_id: int | None


@dataclass
class FunctionInfo:
    spec: FunctionSpec
    # It can serve: a replica of it is warm, or it scales from zero and its last replica
    # start did not fail.
    ready: bool
    replicas_warm: int
    replicas_starting: int
    queued: int
    # Why not, when not ready: {"code": "model_load_failed", "message", "error_code",
    # "failed_starts", "since", "last_failure" (wall-clock s), "retry_in_s" (backing off)}.
    reason: dict[str, Any] | None = None
    # where a version roll-out stands (ControllerState.rollout): phase, version,
    # previous_version, canary_pct, replicas per model version; {} when not known
    rollout: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "spec": self.spec.to_dict(),
            "ready": self.ready,
            "replicas_warm": self.replicas_warm,
            "replicas_starting": self.replicas_starting,
            "queued": self.queued,
            "rollout": self.rollout,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        return out


class InvokeBackend(Protocol):
    """What the gateway needs from the cluster. All methods raise FlashpointError subclasses.

    A backend may also set ``enforces_deadline = True`` when its ``invoke`` always ends (with
    DeadlineExceeded at the latest) by ``timeout_s``; the gateway then arms no deadline
    backstop of its own for it (gateway/admission.py). Without it the backstop stays.
    """

    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        """Create or replace (same name) a function. Raises ModelNotFound, BadRequest."""

    async def delete_function(self, name: str) -> None:
        """Remove a function and stop its replicas. Raises FunctionNotFound."""

    def list_functions(self) -> list[FunctionInfo]: ...

    def get_function(self, name: str) -> FunctionInfo:
        """Raises FunctionNotFound."""

    def function_spec(self, name: str) -> FunctionSpec:
        """The registered spec alone: cheap enough for every request (no replica counts).
        Raises FunctionNotFound."""

    async def invoke(
        self,
        name: str,
        inputs: dict[str, np.ndarray],
        *,
        request_id: str,
        timeout_s: float | None = None,
        request_class: str = "strict",
    ) -> InvokeResult:
        """Run one request. Inputs carry the batch dimension first (a request is >= 1 rows).
        ``request_class`` is ``"strict"`` or ``"best_effort"`` (served after every queued
        strict request, never counted against the function's SLO).

        Raises FunctionNotFound, BadRequest (inputs do not match the function's signature),
        Overloaded / Unavailable (with retry_after_s; ModelLoadFailed when its replicas keep
        failing to start), DeadlineExceeded, ModelFailed.
        """

    # Optional: ``invoke_stream(name, inputs, *, request_id, timeout_s, request_class)``, an
    # async iterator of StreamChunk then the InvokeResult, for a text-generation function
    # (the Controller has it; a backend without it answers ``stream: true`` with a 400).

    def cluster_status(self) -> dict[str, Any]:
        """Hosts, devices, replicas and queues as plain data."""

    def is_live(self) -> bool: ...

    def is_ready(self) -> bool:
        """The cluster can serve: at least one live host."""
