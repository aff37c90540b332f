"""Messages between the controller and the workers that serve replicas (STYLE §6).

The worker opens the connection and announces its replica (``replica_ready``); the
controller then calls, on that connection, ``infer`` / ``infer_many`` (a model replica;
``infer`` with ``stream`` answers a generation token by token through ``gen_chunk``
notifications), ``kaas_run`` / ``kaas_reset`` (a KaaS executor), ``replica_status`` and
``ping`` (its liveness probe). (A pipeline stage's server is announced by its host:
``stage_ready`` in messages/controller_host.py.)

The infer path is hot: a request's tensors stay in their encoded wire form (``inputs`` /
``outputs``: a map of :func:`~flashpoint.tensors.encode_tensor` maps whose bytes are the
frame's own), and validating or encoding a message never copies them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from flashpoint.errors import FlashpointError
from flashpoint.messages.base import Message
from flashpoint.messages.migration import SequenceHandOff


class Ok(Message, kw_only=True):
    """The reply of a call that only acknowledges."""

    ok: bool = True


# worker -> controller ----------------------------------------------------------------------
class ReplicaReady(Message, kw_only=True):
    """``replica_ready``: the replica serves on this connection (sent again after every
    reconnect, so a restarted controller re-learns its replicas)."""

    replica_id: str
    host_id: str = ""
    function: str = ""
    credits: int = 1  # how many requests it takes at once (the controller uses its spec's)
    timings_s: dict[str, float] = {}  # its cold start's phases (controller/cold_timings.py)
    source: str = ""  # where its cold start got the model bytes
    kind: str = "model"  # "model" or "kaas" (an executor replica)


class GenChunk(Message, kw_only=True):
    """``gen_chunk`` notification: one token boundary of a streamed generation."""

    request_id: str
    index: int
    text: str
    token_id: int | None = None


# controller -> worker ----------------------------------------------------------------------
class InferRequest(Message, kw_only=True):
    """``infer``: one request. ``inputs`` are encoded tensors, checked by the worker's
    decoder (a malformed tensor is that request's BadRequest, not a protocol error)."""

    request_id: str = ""
    inputs: Any = None
    request_class: str = msgspec.field(name="class", default="")  # RequestClass value
    stream: bool = False  # answer through gen_chunk notifications as tokens come
    traceparent: str = ""  # W3C trace context of the controller's span, when traced
    # a streamed generation another replica handed off: go on from there (live migration,
    # messages/migration.py); left off the wire when unset
    resume: SequenceHandOff | msgspec.UnsetType = msgspec.UNSET


class InferReply(Message, kw_only=True):
    wire_values: ClassVar[bool] = True
    outputs: dict[str, Any]  # encoded tensors
    timings_s: dict[str, float] = {}


class InferStreamReply(Message, kw_only=True):
    """A streamed request's reply: the whole answer and how many chunks were notified
    (notifications may be handled after the reply arrives)."""

    wire_values: ClassVar[bool] = True
    outputs: dict[str, Any]
    chunks: int
    timings_s: dict[str, float] = {}


class InferFailed(Message, kw_only=True):
    """One request's failure inside an ``infer_many`` reply (an error's wire form)."""

    wire_values: ClassVar[bool] = True
    error: dict[str, Any]

    @classmethod
    def of(cls, exc: Exception) -> InferFailed:
        """The failure of one request from the exception it raised (typed errors keep their
        code; anything else is a generic error with its type and message)."""
        if isinstance(exc, FlashpointError):
            return cls(error=exc.to_wire())
        return cls(error=FlashpointError(f"{type(exc).__name__}: {exc}"[:300]).to_wire())


class InferMany(Message, kw_only=True):
    """``infer_many``: several requests in one frame. Each item is an
    :class:`InferRequest`'s wire form, validated on its own so that one malformed request
    fails alone."""

    wire_values: ClassVar[bool] = True
    requests: list[Any]


class InferManyReply(Message, kw_only=True):
    """One :class:`InferReply` or :class:`InferFailed` wire form per request, in order."""

    wire_values: ClassVar[bool] = True
    replies: list[Any]


class KaasRun(Message, kw_only=True):
    """``kaas_run``: one KaaS request with the store objects the executor lacks shipped
    inline, and the keys it should drop (kaas/remote.py)."""

    version: int = 1  # kaas.remote.WIRE_VERSION; a worker of another version refuses
    request_id: str = ""
    client: str = ""
    request: dict[str, Any]  # KaasRequest.to_dict()
    objects: dict[str, bytes] = {}
    forget: list[str] = []


class KaasState(Message, kw_only=True):
    """What the controller's executor handle routes and ships by: ``kaas_reset``'s reply."""

    held: list[str]
    cached: list[str]
    free_bytes: int
    capacity_bytes: int


class KaasRunReply(Message, kw_only=True):
    version: int
    result: dict[str, Any]  # KaasResult wire form
    objects: dict[str, bytes]  # stored outputs' bytes
    held: list[str]
    cached: list[str]
    free_bytes: int
    capacity_bytes: int


class KaasReset(Message, kw_only=True):
    """``kaas_reset``: drop every cached buffer (an exclusive reassignment's cold start)."""


class ReplicaStatus(Message, kw_only=True):
    """``replica_status``: the batcher's queue as the worker sees it."""


class ReplicaStatusReply(Message, kw_only=True):
    depth: int
    batches: int
    running: int = 0  # sequences generating now (a text-generation replica)
    # a text-generation replica's KV budget reserved now (running, waiting-parked and parked
    # sequences), and how many prefixes it holds parked for live migration
    kv_reserved_bytes: int = 0
    parked: int = 0


class Ping(Message, kw_only=True):
    """``ping``: the controller's liveness probe (answered by the worker's event loop)."""


class Pong(Message, kw_only=True):
    """``ping``'s (empty) reply."""
