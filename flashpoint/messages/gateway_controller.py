"""Gateway <-> controller messages: one Struct per request and reply of the ``gw_*`` methods.

A stand-alone gateway (``gateway/remote.py``, ``gateway/remote_kaas.py``) sends these to the
controller's ``controller/gateway_service.py``. Every message carries the protocol version
``v``; each side checks it before it validates the rest (:func:`decode`), so a peer of
another version is told so by name instead of failing on a field it does not know. The
controller answers a request of another version with BadRequest; a gateway refuses a reply of
another version with Unavailable (retry once the fleet agrees).

Tensors travel in the codec's wire form (``tensors.encode_tensor``: ``{dtype, shape, data}``
maps), which the controller checks from the header and forwards to the worker without
decoding (``tensors.check_encoded_tensors``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from flashpoint.errors import BadRequest, Unavailable
from flashpoint.messages.base import Message, from_payload, to_payload
from flashpoint.policy.request_class import RequestClass

GATEWAY_RPC_VERSION = 1

M = TypeVar("M", bound="GatewayMessage")

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
PositiveS = Annotated[float, msgspec.Meta(gt=0)]
# A tensor in the codec's wire form; ``tensors`` checks its header (the frame codec has
# already made it builtins, so a Struct per tensor would only copy the map).
TensorWire = dict[str, Any]


# Binary values stay bytes in the payload (the frame codec packs them as msgpack bin).
_RAW_TYPES = (bytes, bytearray, memoryview)


class GatewayMessage(Message, kw_only=True):
    """Base of every gateway <-> controller message: the protocol version it speaks."""

    v: int = GATEWAY_RPC_VERSION


def encode(msg: GatewayMessage) -> dict[str, Any]:
    """The frame payload of ``msg``: what ``messages.base.to_payload`` makes of it (these
    types hold no sets), built by msgspec in C, ~50x faster than the generic walk on the
    invocation path (0.5 us against 22 us for an InvokeRequest). A free-form field holding a
    value msgspec does not know (a status map with a ``ModelKey``, which the frame codec
    packs as the str it is) takes the generic walk, which leaves such values as they are."""
    try:
        return msgspec.to_builtins(msg, builtin_types=_RAW_TYPES)  # type: ignore[no-any-return]
    except TypeError:
        return to_payload(msg)


def decode(kind: type[M], payload: Any, *, method: str, reply: bool = False) -> M:
    """``payload`` as ``kind`` once its version is this side's. Another version is a
    BadRequest at the controller (``reply=False``) and Unavailable at a gateway. The
    version is read before the type is checked: fields a newer peer added are not this
    side's to judge until the version says they should be known."""
    v = payload.get("v") if isinstance(payload, dict) else None
    if v != GATEWAY_RPC_VERSION or v is True:
        if reply:
            raise Unavailable(f"controller speaks gateway protocol {v!r}, "
                              f"this gateway {GATEWAY_RPC_VERSION}", retry_after_s=5.0)
        raise BadRequest(f"gateway protocol version {v!r} is not supported "
                         f"(this controller speaks {GATEWAY_RPC_VERSION})")
    return from_payload(kind, payload, method=method)


# -- functions ---------------------------------------------------------------------------
class InvokeRequest(GatewayMessage):
    """``gw_invoke`` and ``gw_stream``: one inference request."""

    name: NonEmpty
    inputs: dict[str, TensorWire]
    request_id: NonEmpty
    timeout_s: PositiveS | None = None
    request_class: RequestClass = RequestClass.STRICT
    traceparent: str = ""  # W3C trace context of the gateway's span, when traced


class InvokeReply(GatewayMessage):
    """The answer to ``gw_invoke`` / ``gw_stream`` (after a stream's last chunk)."""

    outputs: dict[str, TensorWire]
    timings_s: dict[str, float] = {}
    replica_id: str = ""
    cold: bool = False
    cold_start_source: str = ""


class StreamChunkNote(Message):
    """``gw_chunk`` notification: one generated piece of ``request_id``'s text
    (``gateway/streams.py`` reads it; the worker's ``gen_chunk`` has the same fields)."""

    request_id: str
    index: int
    text: str
    token_id: int | None = None


class FunctionInfoWire(Message):
    """``gateway.backend.FunctionInfo`` on the wire (its ``to_dict`` form)."""

    spec: dict[str, Any]
    ready: bool
    replicas_warm: int
    replicas_starting: int
    queued: int
    rollout: dict[str, Any] = {}
    reason: dict[str, Any] | None = None


class FunctionsRequest(GatewayMessage):
    """``gw_functions``: the function table, readiness and cluster status."""


class FunctionsReply(GatewayMessage):
    functions: list[FunctionInfoWire]
    ready: bool
    status: dict[str, Any] = {}


class RegisterRequest(GatewayMessage):
    """``gw_register``: an upsert of ``spec`` (a ``FunctionSpec.to_dict``)."""

    spec: dict[str, Any]


class RegisterReply(GatewayMessage):
    info: FunctionInfoWire


class DeleteRequest(GatewayMessage):
    """``gw_delete``: remove function ``name``."""

    name: NonEmpty


class Ack(GatewayMessage):
    """The reply of calls that answer nothing but success."""


# -- KaaS and its object store -------------------------------------------------------------
class KaasInvokeRequest(GatewayMessage):
    """``gw_kaas_invoke``: a kernel graph (a ``KaasRequest.to_dict``) run for ``client``."""

    request: dict[str, Any]
    client: NonEmpty
    request_id: NonEmpty
    timeout_s: PositiveS | None = None


class KaasInvokeReply(GatewayMessage):
    result: dict[str, Any]  # KaasResult.to_wire


class KaasStatusRequest(GatewayMessage):
    """``gw_kaas_status``."""


class KaasStatusReply(GatewayMessage):
    status: dict[str, Any]


class ObjectPutRequest(GatewayMessage):
    """``gw_object_put``. ``data`` is bytes, checked by ``kaas.spec.check_object``: a
    ``bytes`` field would take a str as base64, and a str here is a mistake to refuse."""

    key: Any  # checked by kaas.spec.check_key (its errors name the rule)
    data: Any
    ttl_s: Any = None  # checked by kaas.spec.check_ttl


class ObjectKeyRequest(GatewayMessage):
    """``gw_object_get`` and ``gw_object_delete``."""

    key: Any  # checked by kaas.spec.check_key


class ObjectGetReply(GatewayMessage):
    data: bytes
