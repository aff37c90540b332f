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
    so a field renamed with ``msgspec.field(name=...)`` travels as that name), tuples lists,
    sets sorted lists; a domain value in an ``Any`` field (a FunctionSpec, a GpuShare)
    its own ``to_wire``/``to_dict`` form; every other value (numbers, str, bytes, encoded
    tensors) passes as it is, for the frame codec to pack. A ``wire_values`` message (the
    infer path's) is copied shallowly.

    A message whose field types are all plain (builtins, tuples, other such messages) is
    converted in C by a msgspec msgpack encode and decode (~3 us instead of ~23 us for the
    generic walk; ``msgspec.to_builtins`` would be faster still but keeps tuples as tuples,
    and a payload is lists as a peer decodes it); a message with other fields takes the
    generic walk for those alone (see :func:`_encode_plan`)."""
    if msg.wire_values:
        return msgspec.structs.asdict(msg)
    plan = _PLANS.get(type(msg))
    if plan is None:
        plan = _PLANS[type(msg)] = _encode_plan(type(msg))
    fields, seqs, tag = plan
    if fields is None and all(type(getattr(msg, n)) in _SEQ_OK for n in seqs):
        return _DECODE(_ENCODE(msg))  # type: ignore[no-any-return]
    out: dict[str, Any] = {}
    for name, wire, how in fields or _encode_fields(type(msg)):
        value = getattr(msg, name)
        if type(value) in _SCALARS:
            out[wire] = value
        elif how is _FAST or (how is _SEQ and type(value) in _SEQ_OK):
            out[wire] = _DECODE(_ENCODE(value))
        else:  # Any, a set, a domain type, or a sequence field given another collection
            out[wire] = _plain(value)
    if tag is not None:
        out[tag[0]] = tag[1]
    return out


# How a field is encoded: _FAST through msgspec's msgpack codec; _SEQ likewise when the value
# is the tuple or list its type says (a set given to a tuple field must still go out sorted);
# _SLOW by the generic walk.
_FAST, _SEQ, _SLOW = "fast", "seq", "slow"
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder().decode
# Values that are their own wire form: a field holding one is copied without a call.
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})
_SEQ_OK = frozenset({tuple, list, type(None)})
_Plan = tuple["tuple[tuple[str, str, str], ...] | None", tuple[str, ...],
              "tuple[str, Any] | None"]
_PLANS: dict[type, _Plan] = {}


def _encode_plan(cls: type[Message]) -> _Plan:
    """Per message class, once: how each field is encoded (None when every field's type is
    plain, so msgspec's codec gives for the whole message what :func:`_plain` gives as long
    as the sequence fields, named second, hold the tuple or list their type says), and the
    tag of a tagged union member."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    fields = []
    for f in info.fields:
        if not _plain_type(f.type, set()):
            how = _SLOW
        elif isinstance(f.type, _SEQUENCES) or (
                isinstance(f.type, msgspec.inspect.UnionType)
                and any(isinstance(t, _SEQUENCES) for t in f.type.types)):
            how = _SEQ
        else:
            how = _FAST
        fields.append((f.name, f.encode_name, how))
    cfg = cls.__struct_config__
    tag = (cfg.tag_field, cfg.tag) if cfg.tag_field is not None else None
    seqs = tuple(name for name, _, how in fields if how is _SEQ)
    if tag is None and all(how is not _SLOW for _, _, how in fields):
        return None, seqs, tag
    return tuple(fields), seqs, tag


def _encode_fields(cls: type[Message]) -> tuple[tuple[str, str, str], ...]:
    """Every field of an all-plain class, for the rare message whose sequence field was given
    another collection (a set): its sequences are then checked one by one."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple((f.name, f.encode_name, _SEQ) for f in info.fields)


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
        out = {wire: _plain(getattr(obj, f))
               for f, wire in zip(obj.__struct_fields__, obj.__struct_encode_fields__,
                                  strict=True)}
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
