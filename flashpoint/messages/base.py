"""The message base type and its codec edge: msgspec Structs over today's msgpack frames.

A message is a frozen :class:`msgspec.Struct`. The RPC frame still carries a msgpack map as
its payload (``rpc/frames.py`` is unchanged), so a typed message is turned into builtins once
when it is sent and validated into its type once when it arrives; a payload that does not
fit its type (a missing field, a wrong type, an unknown field) is a
:class:`~flashpoint.errors.ProtocolError` that names the method and the field, and it crosses
the RPC boundary as such.

Field names are the wire names, so a typed sender and an older dict-building peer agree on the
bytes while modules move over one at a time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import msgspec

from flashpoint.errors import ProtocolError

M = TypeVar("M", bound="Message")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every RPC request and reply. Unknown fields are refused: a peer that sends
    what this side does not understand learns it at once instead of being half-obeyed.
    msgspec does not inherit ``kw_only``: a subclass whose required fields follow defaulted
    ones declares ``class X(Message, kw_only=True)`` itself."""

    # True on a message whose field values are in wire form already (builtins, encoded
    # tensors, other messages' payloads) and whose fields keep their names: to_payload then
    # copies it shallowly instead of walking every value (the infer path's tensor maps and
    # frames of requests: ~0.06 us instead of 1-100 us a message).
    wire_values: ClassVar[bool] = False


def to_payload(msg: Message) -> dict[str, Any]:
    """The frame payload for ``msg``: nested messages become maps (under their wire names,
    so a field renamed with ``msgspec.field(name=...)`` travels as that name), tuples lists;
    every other value (numbers, str, bytes, encoded tensors) passes as it is, for the frame
    codec to pack. A ``wire_values`` message (the infer path's) is copied shallowly."""
    if msg.wire_values:
        return msgspec.structs.asdict(msg)
    return _plain(msg)  # type: ignore[no-any-return]


def _plain(obj: Any) -> Any:
    if isinstance(obj, msgspec.Struct):
        # an UNSET field is left out, as msgspec's own encoder does (an optional field
        # added to a hot message costs its senders nothing while unused)
        out = {wire: _plain(v)
               for f, wire in zip(obj.__struct_fields__, obj.__struct_encode_fields__,
                                  strict=True)
               if (v := getattr(obj, f)) is not msgspec.UNSET}
        cfg = obj.__struct_config__
        if cfg.tag_field is not None:  # a tagged union member names its type on the wire
            out[cfg.tag_field] = cfg.tag
        return out
    # A domain value a message carries typed (a FunctionSpec, an Endpoint, a GpuShare)
    # travels as its own wire form; the message's __post_init__ turns it back.
    if (to_wire := getattr(obj, "to_wire", None)) is not None and not isinstance(obj, type):
        return _plain(to_wire())
    if (to_dict := getattr(obj, "to_dict", None)) is not None and not isinstance(obj, type):
        return _plain(to_dict())
    if isinstance(obj, (tuple, list)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (frozenset, set)):
        return sorted(_plain(v) for v in obj)
    return obj


def from_payload(kind: type[M], payload: Any, *, method: str = "") -> M:
    """Validate ``payload`` into ``kind``; a mismatch is a ProtocolError naming the field."""
    try:
        return msgspec.convert(payload, kind, strict=False)
    except msgspec.ValidationError as exc:
        where = f" in {method!r}" if method else ""
        raise ProtocolError(f"malformed {kind.__name__}{where}: {exc}") from None


Handler = Callable[[Any, Any], Awaitable[Any]]


def handler(kind: type[M], fn: Callable[[Any, M], Awaitable[Message | None]],
            method: str = "") -> Callable[[Any, Any], Awaitable[dict[str, Any] | None]]:
    """Wrap a typed handler ``fn(conn, msg) -> reply`` for the RPC method table, which
    deals in payload dicts: the payload is validated into ``kind`` and the reply encoded."""
    name = method or getattr(fn, "__name__", "")

    async def typed(conn: Any, payload: Any) -> dict[str, Any] | None:
        reply = await fn(conn, from_payload(kind, payload, method=name))
        return None if reply is None else to_payload(reply)

    typed.__name__ = name
    return typed
