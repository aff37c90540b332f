"""Pure planning pieces of the data plane: endpoints, chain splicing, bitmaps, fault plans.

Nothing here touches the network or the event loop (the import rule: no asyncio, aiohttp,
torch or rpc), so the controller and the simulator can build and splice chains with the
same functions the data plane uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashpoint.errors import BadRequest


@dataclass(frozen=True)
class Endpoint:
    """A host's data-plane address: ``host_id`` names it in results and logs."""

    host_id: str
    addr: str
    port: int

    def to_wire(self) -> list[Any]:
        return [self.host_id, self.addr, self.port]

    @classmethod
    def from_wire(cls, v: Any) -> Endpoint:
        if (not isinstance(v, (list, tuple)) or len(v) != 3 or not isinstance(v[0], str)
                or not isinstance(v[1], str) or isinstance(v[2], bool) or not isinstance(v[2], int)
                or not 0 < v[2] < 65536):
            raise BadRequest(f"malformed endpoint {v!r:.100}")
        return cls(v[0], v[1], v[2])

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``host_id:addr:port`` (the CLI form); an IPv6 addr may be written in brackets."""
        host_id, sep, rest = text.partition(":")
        addr, sep2, port = rest.rpartition(":")
        if not (sep and sep2 and host_id and addr and port.isdigit()):
            raise BadRequest(f"endpoint must look like host_id:addr:port, got {text!r:.100}")
        return cls(host_id, addr.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host_id}:{self.addr}:{self.port}"


def parse_endpoints(text: str) -> list[Endpoint]:
    """A comma-separated list of ``host_id:addr:port``."""
    return [Endpoint.parse(p.strip()) for p in text.split(",") if p.strip()]


def drop_dead(chain: Sequence[Endpoint], dead: Endpoint) -> list[Endpoint]:
    """The default splice: the chain without the dead node (its downstream moves up one)."""
    return [e for e in chain if e != dead]


# --------------------------------------------------------------------------------------
# Chunk bitmaps: bit i set <=> chunk i verified at the sender of the bitmap
# --------------------------------------------------------------------------------------


def pack_bitmap(marked: Sequence[bool] | bytes | bytearray) -> bytes:
    """Little-endian bit order inside each byte: chunk i is bit ``i % 8`` of byte ``i // 8``."""
    out = bytearray((len(marked) + 7) // 8)
    for i, m in enumerate(marked):
        if m:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def unpack_bitmap(data: bytes, num_chunks: int) -> list[bool]:
    if not isinstance(data, (bytes, bytearray)) or len(data) != (num_chunks + 7) // 8:
        raise BadRequest("bitmap length does not match the chunk count")
    return [bool(data[i >> 3] & (1 << (i & 7))) for i in range(num_chunks)]


def missing_chunks(marked: Sequence[bool]) -> list[int]:
    return [i for i, m in enumerate(marked) if not m]


def first_missing(marked: Sequence[bool], start: int = 0) -> int | None:
    for i in range(start, len(marked)):
        if not marked[i]:
            return i
    return None


def merge_hosts(*groups: Iterable[str]) -> list[str]:
    """Concatenate host lists keeping the first occurrence of each (results stay ordered)."""
    seen: dict[str, None] = {}
    for g in groups:
        for h in g:
            seen.setdefault(h, None)
    return list(seen)


# --------------------------------------------------------------------------------------
# Fault injection (tests and benchmarks); a DataPlaneServer applies it to what it relays
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultPlan:
    """Faults one data-plane server injects.

    * ``corrupt_forward``: chunk indices whose bytes are flipped (one byte) in what this node
      forwards downstream; its own copy stays good.
    * ``corrupt_store``: chunk indices flipped in this node's own copy once they have landed,
      before verification (what it forwards afterwards is corrupt too).
    * ``corrupt_serve``: chunk indices flipped in what this node serves to ``get`` pulls.
    * ``stall_after_bytes``: as a chain receiver, stop reading its upstream and stop sending
      heartbeats once this many bytes have arrived (a hung process).
    * ``forward_rate_bps``: pace what it forwards downstream (a slow link), bits per second.
    """

    corrupt_forward: frozenset[int] = field(default_factory=frozenset)
    corrupt_store: frozenset[int] = field(default_factory=frozenset)
    corrupt_serve: frozenset[int] = field(default_factory=frozenset)
    stall_after_bytes: int | None = None
    forward_rate_bps: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultPlan:
        """From JSON (the node CLI's ``--fault``)."""
        known = {"corrupt_forward", "corrupt_store", "corrupt_serve", "stall_after_bytes",
                 "forward_rate_bps"}
        if not isinstance(d, dict) or set(d) - known:
            raise BadRequest(f"fault plan keys must be among {sorted(known)}")
        return cls(
            corrupt_forward=frozenset(d.get("corrupt_forward", ())),
            corrupt_store=frozenset(d.get("corrupt_store", ())),
            corrupt_serve=frozenset(d.get("corrupt_serve", ())),
            stall_after_bytes=d.get("stall_after_bytes"),
            forward_rate_bps=d.get("forward_rate_bps"),
        )
