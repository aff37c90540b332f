"""The hook <-> token-manager wire format, mirroring ``hook/fp_protocol.h`` byte for byte.

Every message is one fixed-size little-endian ``struct fp_msg`` of :data:`MSG_SIZE` bytes.
A test compiles a C program against the header and checks these offsets and sizes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from flashpoint.errors import ProtocolError

MAGIC = 0x4B545046
VERSION = 1
# magic u32, version u16, type u16, tenant u32, pid u32, seq u64, used_ns u64,
# requested_ns u64, quota_ns u64, mem_used_bytes u64, mem_limit_bytes u64
FORMAT = "<IHHIIQQQQQQ"
MSG_SIZE = struct.calcsize(FORMAT)
FIELDS = ("magic", "version", "type", "tenant", "pid", "seq", "used_ns", "requested_ns",
          "quota_ns", "mem_used_bytes", "mem_limit_bytes")
_STRUCT = struct.Struct(FORMAT)


class MsgType(enum.IntEnum):
    """``enum fp_msg_type``."""

    HELLO = 1
    REQUEST = 2
    GRANT = 3
    RELEASE = 4
    MEM = 5


@dataclass(frozen=True)
class TokenMsg:
    """One decoded ``struct fp_msg``."""

    type: MsgType
    tenant: int = 0
    pid: int = 0
    seq: int = 0
    used_ns: int = 0
    requested_ns: int = 0
    quota_ns: int = 0
    mem_used_bytes: int = 0
    mem_limit_bytes: int = 0


def offsets() -> dict[str, int]:
    """Byte offset of each field, for the header-agreement test."""
    out, pos = {}, 0
    for name, code in zip(FIELDS, FORMAT[1:], strict=True):
        out[name] = pos
        pos += struct.calcsize("<" + code)
    return out


def pack(msg: TokenMsg) -> bytes:
    """Encode one message."""
    return _STRUCT.pack(MAGIC, VERSION, int(msg.type), msg.tenant, msg.pid, msg.seq, msg.used_ns,
                        msg.requested_ns, msg.quota_ns, msg.mem_used_bytes, msg.mem_limit_bytes)


def unpack(data: bytes) -> TokenMsg:
    """Decode one message; :class:`ProtocolError` on a wrong size, magic, version or type."""
    if len(data) != MSG_SIZE:
        raise ProtocolError(f"token message is {len(data)} bytes, expected {MSG_SIZE}")
    magic, version, typ, *rest = _STRUCT.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad token message magic {magic:#x}")
    if version != VERSION:
        raise ProtocolError(f"token protocol version {version}, this side speaks {VERSION}")
    try:
        mtype = MsgType(typ)
    except ValueError:
        raise ProtocolError(f"unknown token message type {typ}") from None
    return TokenMsg(mtype, *rest)
