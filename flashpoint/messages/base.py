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
from dataclasses import dataclass
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
    so a field renamed with ``msgspec.field(name=...)`` travels as that name), tuples lists,
    sets sorted lists; a domain value (a FunctionSpec, an Endpoint, a GpuShare) its own
    ``to_wire``/``to_dict`` form; every other value (numbers, str, bytes, encoded tensors)
    passes as it is, for the frame codec to pack. A ``wire_values`` message (the infer
    path's) is copied shallowly.

    A message whose declared field types are all plain (builtins, tuples, untagged messages
    of such fields: see :func:`_plain_type`) goes through msgspec's C msgpack codec instead
    of the generic walk (~3 us instead of ~23 us): encoded, checked against its own type
    (a caller may have put a domain value where the type declares its wire form, e.g. an
    Endpoint in a chain of ``EndpointWire``; msgspec would encode that dataclass as a map),
    and decoded into builtins. Anything that does not pass, and a set given to a sequence
    field (it must go out sorted), takes the generic walk, so the wire never changes.
    (``msgspec.to_builtins`` would be cheaper still but keeps tuples as tuples, and a
    payload is what a peer decodes: lists.)"""
    if msg.wire_values:
        return msgspec.structs.asdict(msg)
    plan = _PLANS.get(type(msg))
    if plan is None:
        plan = _PLANS[type(msg)] = _encode_plan(type(msg))
    if plan is not _SLOW and all(type(getattr(msg, n)) in _SEQ_OK for n in plan.seqs):
        try:
            data = _ENCODE(msg)
            plan.check(data)
            return _DECODE(data)  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - a value not of its declared type: the generic walk
            pass
    return _plain(msg)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _FastPlan:
    """How an all-plain message class is encoded: ``seqs`` are its top-level sequence
    fields (checked to hold a tuple, list or None), ``check`` decodes its bytes into the
    class itself (raising when a value was not of its declared type)."""

    seqs: tuple[str, ...]
    check: Callable[[bytes], Any]


_SLOW = "slow"  # the plan of a class with a field that is not plain: the generic walk
_PLANS: dict[type, _FastPlan | str] = {}


def _str_subclass(obj: Any) -> Any:
    """msgspec's hook for what it does not encode: a str subclass (a ModelKey) is its
    string, as msgpack packs it; anything else falls back to the generic walk."""
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"not plain: {type(obj).__name__}")


_ENCODE = msgspec.msgpack.Encoder(enc_hook=_str_subclass).encode
_DECODE = msgspec.msgpack.Decoder().decode
_SEQ_OK = frozenset({tuple, list, type(None)})


def _encode_plan(cls: type[Message]) -> _FastPlan | str:
    """Per message class, once: a :class:`_FastPlan` when every field's declared type is
    plain (and the class is not a tagged union member: msgspec writes the tag first, the
    generic walk last), else ``_SLOW``."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    if cls.__struct_config__.tag_field is not None or not _plain_type(info, set()):
        return _SLOW
    seqs = tuple(f.name for f in info.fields
                 if isinstance(f.type, _SEQUENCES) or (
                     isinstance(f.type, msgspec.inspect.UnionType)
                     and any(isinstance(t, _SEQUENCES) for t in f.type.types)))
    return _FastPlan(seqs, msgspec.msgpack.Decoder(cls).decode)


_SEQUENCES = (msgspec.inspect.ListType, msgspec.inspect.TupleType,
              msgspec.inspect.VarTupleType)
_LEAVES = (msgspec.inspect.BoolType, msgspec.inspect.IntType, msgspec.inspect.FloatType,
           msgspec.inspect.StrType, msgspec.inspect.BytesType, msgspec.inspect.ByteArrayType,
           msgspec.inspect.MemoryViewType, msgspec.inspect.NoneType,
           msgspec.inspect.LiteralType)


def _plain_type(t: msgspec.inspect.Type, seen: set[type]) -> bool:
    """True when every value of type ``t`` converts the same through msgspec's codec and by
    :func:`_plain`: no Any (it may hold a domain value or a set), no set (msgspec keeps
    its iteration order, the wire sorts it), no dataclass or custom type (they travel as their
    ``to_wire``), no enum (it passes as itself), no tagged union member (msgspec would move
    its tag to the front of the map). A nested message counts when its fields do."""
    mi = msgspec.inspect
    if isinstance(t, _LEAVES):
        return True
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return _plain_type(t.item_type, seen)
    if isinstance(t, mi.TupleType):
        return all(_plain_type(x, seen) for x in t.item_types)
    if isinstance(t, mi.DictType):
        return _plain_type(t.key_type, seen) and _plain_type(t.value_type, seen)
    if isinstance(t, mi.UnionType):
        return all(_plain_type(x, seen) for x in t.types)
    if isinstance(t, mi.StructType):
        if t.cls.__struct_config__.tag_field is not None:
            return False  # msgspec writes the tag first, the wire has it last
        if t.cls in seen:
            return True
        seen.add(t.cls)
        return all(_plain_type(f.type, seen) for f in t.fields)
    return False


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
