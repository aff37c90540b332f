"""The typed-message edge: a message survives the real frame codec, and a payload that does not
fit its type is a ProtocolError naming the field (never a KeyError deep in a handler)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from flashpoint.errors import ProtocolError
from flashpoint.messages.base import Message, from_payload, handler, to_payload
from flashpoint.rpc import frames


class Part(Message):
    offset_bytes: int


class Sample(Message):
    replica_id: str
    count: int = 1
    blob: bytes = b""
    hosts: tuple[str, ...] = ()
    part: Part | None = None
    cached: frozenset[str] = frozenset()


def test_round_trip_through_the_frame_codec():
    msg = Sample(replica_id="r-1", count=3, blob=b"\x00\x01", hosts=("h1", "h2"),
                 part=Part(offset_bytes=9), cached=frozenset({"m@1"}))
    wire = frames.encode(frames.Request(id=1, method="deploy", payload=to_payload(msg),
                                        timeout_s=5.0))
    back = from_payload(Sample, frames.decode(wire).payload, method="deploy")
    assert back.replica_id == "r-1" and back.count == 3 and back.blob == b"\x00\x01"
    assert back.hosts == ("h1", "h2") and back.part == Part(offset_bytes=9)
    assert back.cached == frozenset({"m@1"})


@pytest.mark.parametrize("payload,field", [
    ({}, "replica_id"), ({"replica_id": "r", "count": "three"}, "count"),
    ({"replica_id": "r", "surprise": 1}, "surprise"), ({"replica_id": 7}, "replica_id"),
    ({"replica_id": "r", "part": {"offset_bytes": "x"}}, "offset_bytes"), ([1, 2], ""),
])
def test_a_payload_that_does_not_fit_is_a_protocol_error(payload, field):
    with pytest.raises(ProtocolError) as info:
        from_payload(Sample, payload, method="deploy")
    assert "Sample" in info.value.message and "'deploy'" in info.value.message
    assert field in info.value.message


def test_handler_validates_in_and_encodes_out():
    async def deploy(conn: Any, msg: Sample) -> Part:
        return Part(offset_bytes=msg.count * 2)

    wrapped = handler(Sample, deploy)
    assert asyncio.run(wrapped(None, {"replica_id": "r", "count": 4})) == {"offset_bytes": 8}
    with pytest.raises(ProtocolError):
        asyncio.run(wrapped(None, {"count": 4}))


class Hop(Message, frozen=True, tag="hop", tag_field="kind"):
    endpoint: tuple[str, str, int]
    via: tuple[str, ...] | None = None


class Route(Message, frozen=True):
    route_id: str
    hops: tuple[Hop, ...] = ()
    chain: tuple[tuple[str, str, int], ...] = ()
    names: tuple[str, ...] = ()
    weights: dict[str, float] = {}
    note: str | None = None


def test_a_plain_message_is_the_map_a_peer_decodes_lists_not_tuples():
    msg = Route(route_id="r", hops=(Hop(endpoint=("h1", "10.0.0.1", 7001), via=("a",)),),
                chain=(("h2", "10.0.0.2", 7002),), names=("x", "y"), weights={"h1": 0.5})
    expected = {"route_id": "r",
                "hops": [{"endpoint": ["h1", "10.0.0.1", 7001], "via": ["a"], "kind": "hop"}],
                "chain": [["h2", "10.0.0.2", 7002]], "names": ["x", "y"],
                "weights": {"h1": 0.5}, "note": None}
    got = to_payload(msg)
    assert got == expected
    # Lists, as msgpack decodes them (== alone would not tell a tuple from a list).
    assert type(got["hops"]) is list and type(got["chain"][0]) is list
    assert frames.encode(frames.Request(id=1, method="m", payload=got, timeout_s=1.0)) == \
        frames.encode(frames.Request(id=1, method="m", payload=expected, timeout_s=1.0))


def test_a_set_given_to_a_tuple_field_still_goes_out_sorted():
    names = frozenset(f"m{i}@1" for i in range(40))  # enough that iteration order is not sorted
    got = to_payload(Route(route_id="r", names=names))  # type: ignore[arg-type]
    assert got["names"] == sorted(names)
    assert to_payload(Sample(replica_id="r", cached=names))["cached"] == sorted(names)


@dataclasses.dataclass(frozen=True)
class _Where:  # a domain value with its own wire form, like transfer/plan.Endpoint
    host: str
    port: int

    def to_wire(self) -> list[Any]:
        return [self.host, self.port]


class Chain(Message, frozen=True):
    hops: tuple[tuple[str, int] | str, ...] = ()
    key: str = ""


def test_a_domain_value_where_its_wire_form_is_declared_still_travels_as_its_wire_form():
    class Key(str):  # like ids.ModelKey
        pass

    msg = Chain(hops=(_Where("h1", 7001), "registry"), key=Key("bert@1"))  # type: ignore[arg-type]
    expected = {"hops": [["h1", 7001], "registry"], "key": "bert@1"}
    assert to_payload(msg) == expected
    assert frames.encode(frames.Request(id=1, method="m", payload=to_payload(msg),
                                        timeout_s=1.0)) == \
        frames.encode(frames.Request(id=1, method="m", payload=expected, timeout_s=1.0))
    assert to_payload(Chain(hops=(("h1", 7001),), key=Key("m@2"))) == {
        "hops": [["h1", 7001]], "key": "m@2"}
