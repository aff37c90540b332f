"""RPC frames: what travels in one WebSocket message, and its strict msgpack codec.

Every frame is a msgpack array whose first element is its kind:

    REQUEST  [0, id, method, payload, timeout_s, trace]
    RESPONSE [1, id, payload]
    ERROR    [2, id, wire_error]          id 0 = about the connection, not one call
    NOTIFY   [3, method, payload, trace]
    CANCEL   [4, id]
    HELLO    [5, version, nonce]           handshake, server -> client
    PROOF    [6, name, nonce, mac]         handshake, client -> server
    WELCOME  [7, name, mac]                handshake, server -> client

Request ids belong to the side that sent the request; a RESPONSE, ERROR or CANCEL names an id
in the requester's space. ``trace`` carries a causality id (a request id) for the peer's logs.

Decoding never raises anything but :class:`ProtocolError` or :class:`FrameTooLarge`: lengths
are bounded by the frame limit and must be backed by the frame's own bytes, ext types are
refused and nesting depth is checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from flashpoint.errors import FrameTooLarge, ProtocolError

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 32
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_METHOD_CHARS = 200

REQUEST, RESPONSE, ERROR, NOTIFY, CANCEL, HELLO, PROOF, WELCOME = range(8)


@dataclass(slots=True, frozen=True)
class Request:
    id: int
    method: str
    payload: dict[str, Any]
    timeout_s: float
    trace: str | None = None


@dataclass(slots=True, frozen=True)
class Response:
    id: int
    payload: dict[str, Any]


@dataclass(slots=True, frozen=True)
class Error:
    id: int
    error: dict[str, Any]


@dataclass(slots=True, frozen=True)
class Notify:
    method: str
    payload: dict[str, Any]
    trace: str | None = None


@dataclass(slots=True, frozen=True)
class Cancel:
    id: int


@dataclass(slots=True, frozen=True)
class Hello:
    version: int
    nonce: bytes


@dataclass(slots=True, frozen=True)
class Proof:
    name: str
    nonce: bytes
    mac: bytes


@dataclass(slots=True, frozen=True)
class Welcome:
    name: str
    mac: bytes


Frame = Request | Response | Error | Notify | Cancel | Hello | Proof | Welcome


def _as_list(frame: Frame) -> list[Any]:
    match frame:
        case Request():
            return [REQUEST, frame.id, frame.method, frame.payload, frame.timeout_s, frame.trace]
        case Response():
            return [RESPONSE, frame.id, frame.payload]
        case Error():
            return [ERROR, frame.id, frame.error]
        case Notify():
            return [NOTIFY, frame.method, frame.payload, frame.trace]
        case Cancel():
            return [CANCEL, frame.id]
        case Hello():
            return [HELLO, frame.version, frame.nonce]
        case Proof():
            return [PROOF, frame.name, frame.nonce, frame.mac]
        case Welcome():
            return [WELCOME, frame.name, frame.mac]
    raise TypeError(f"not a frame: {type(frame).__name__}")


def encode(frame: Frame, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Encode one frame; raises FrameTooLarge over the limit, ProtocolError if unencodable."""
    try:
        data = msgpack.packb(_as_list(frame), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"payload cannot be encoded: {exc}") from None
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(
            f"frame of {len(data)} bytes is over the {max_frame_bytes} byte limit",
            size_bytes=len(data),
            max_frame_bytes=max_frame_bytes,
        )
    return data


def decode(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode and validate one frame; raises only ProtocolError or FrameTooLarge."""
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(
            f"frame of {len(data)} bytes is over the {max_frame_bytes} byte limit",
            size_bytes=len(data),
            max_frame_bytes=max_frame_bytes,
        )
    try:
        _check_claims(data)
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_frame_bytes,
            max_str_len=max_frame_bytes,
            max_array_len=max_frame_bytes,
            max_map_len=max_frame_bytes,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises a zoo of types on bad input
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not isinstance(obj, list) or not obj:
        raise ProtocolError("frame is not a non-empty array")
    _check_depth(obj)
    try:
        return _from_list(obj)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - validation must never leak another type
        raise ProtocolError(f"malformed frame: {type(exc).__name__}") from None


def _check_claims(data: bytes) -> None:
    """Fail (msgpack's OutOfData) when ``data`` claims more elements than it holds.

    msgpack preallocates part of what each array header claims before reading an element, so
    nested claims it can never fill cost ~80 KB a level: a 4 KB handshake frame from anyone
    took ~35 ms and ~33 MB. ``Unpacker.skip`` walks the structure building nothing and fails
    on a claim the bytes cannot back; once it passes, every claimed slot costs a byte or more.
    """
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    unpacker.skip()


def _check_depth(obj: Any) -> None:
    # Level by level (every container of one depth, then the next): half the cost of a
    # stack of (container, depth) pairs, on every frame. msgpack.unpackb makes exactly
    # list and dict, never subclasses, so ``type`` is enough.
    level = [obj]
    depth = 1
    while level:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"frame nested deeper than {MAX_DEPTH}")
        below = []
        for value in level:
            for child in value.values() if type(value) is dict else value:
                t = type(child)
                if t is list or t is dict:
                    below.append(child)
        level = below
        depth += 1


def _from_list(obj: list[Any]) -> Frame:
    kind = obj[0]
    n = len(obj)
    if kind == REQUEST and n == 6:
        timeout_s = obj[4]
        if not _is_number(timeout_s) or not (0 < timeout_s <= MAX_TIMEOUT_S):
            raise ProtocolError("request timeout_s must be a positive finite number")
        return Request(_id(obj[1]), _method(obj[2]), _payload(obj[3]), float(timeout_s), _trace(obj[5]))
    if kind == RESPONSE and n == 3:
        return Response(_id(obj[1]), _payload(obj[2]))
    if kind == ERROR and n == 3:
        rid = obj[1]
        if not _is_int(rid) or rid < 0:
            raise ProtocolError("error id must be a non-negative integer")
        if not isinstance(obj[2], dict):
            raise ProtocolError("error body must be a map")
        return Error(rid, obj[2])
    if kind == NOTIFY and n == 4:
        return Notify(_method(obj[1]), _payload(obj[2]), _trace(obj[3]))
    if kind == CANCEL and n == 2:
        return Cancel(_id(obj[1]))
    if kind == HELLO and n == 3:
        if not _is_int(obj[1]):
            raise ProtocolError("hello version must be an integer")
        return Hello(obj[1], _nonce(obj[2]))
    if kind == PROOF and n == 4:
        return Proof(_name(obj[1]), _nonce(obj[2]), _mac(obj[3]))
    if kind == WELCOME and n == 3:
        return Welcome(_name(obj[1]), _mac(obj[2]))
    raise ProtocolError(f"unknown frame kind {kind!r:.40} with {n} fields")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _id(v: Any) -> int:
    if not _is_int(v) or not (1 <= v < 2**63):
        raise ProtocolError("frame id must be a positive 63-bit integer")
    return v


def _method(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_METHOD_CHARS:
        raise ProtocolError("method must be a non-empty short string")
    return v


def _payload(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError("payload must be a map")
    return v


def _trace(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or len(v) > MAX_METHOD_CHARS):
        raise ProtocolError("trace must be a short string or nil")
    return v


def _nonce(v: Any) -> bytes:
    if not isinstance(v, bytes) or not (16 <= len(v) <= 64):
        raise ProtocolError("nonce must be 16-64 bytes")
    return v


def _mac(v: Any) -> bytes:
    if not isinstance(v, bytes) or len(v) != 32:
        raise ProtocolError("mac must be 32 bytes")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_METHOD_CHARS:
        raise ProtocolError("peer name must be a short string")
    return v
