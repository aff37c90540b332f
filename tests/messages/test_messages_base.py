"""The typed-message edge: a message survives the real frame codec, and a payload that does not
fit its type is a ProtocolError naming the field (never a KeyError deep in a handler)."""

from __future__ import annotations

import asyncio
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
    msg = Sample(replica_id="r-1", count=3, blob=b"\x00\x01", hosts=("h1", "h2"), part=Part(offset_bytes=9), cached=frozenset({"m@1"}))
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
