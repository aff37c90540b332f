"""Pure planning: endpoints, splicing, bitmaps, fault plans; and plan.py stays pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flashpoint.transfer.plan as plan
from flashpoint.errors import BadRequest
from flashpoint.transfer.plan import (
    Endpoint,
    FaultPlan,
    drop_dead,
    first_missing,
    merge_hosts,
    missing_chunks,
    pack_bitmap,
    parse_endpoints,
    unpack_bitmap,
)

FORBIDDEN = ("asyncio", "aiohttp", "torch", "pynvml", "flashpoint.rpc",
             "flashpoint.controller", "flashpoint.host", "flashpoint.worker")


def test_plan_module_is_pure():
    tree = ast.parse(Path(plan.__file__).read_text())
    mods = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods.append(node.module or "")
    assert not [m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_endpoint_wire_and_parse():
    e = Endpoint("h1", "10.0.0.2", 7000)
    assert Endpoint.from_wire(e.to_wire()) == e
    assert Endpoint.parse("h1:10.0.0.2:7000") == e
    assert Endpoint.parse("h6:[::1]:9") == Endpoint("h6", "::1", 9)
    assert parse_endpoints("a:1.2.3.4:5, b:1.2.3.5:6") == [Endpoint("a", "1.2.3.4", 5),
                                                            Endpoint("b", "1.2.3.5", 6)]
    for bad in (["h", "a"], ["h", "a", 0], ["h", "a", True], "x", None):
        with pytest.raises(BadRequest):
            Endpoint.from_wire(bad)
    with pytest.raises(BadRequest):
        Endpoint.parse("nohost")


def test_drop_dead_and_merge():
    a, b, c = (Endpoint(x, "127.0.0.1", 1) for x in "abc")
    assert drop_dead([a, b, c], b) == [a, c]
    assert drop_dead([a], a) == []
    assert merge_hosts(["a", "b"], ["b", "c"], ["a"]) == ["a", "b", "c"]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100])
def test_bitmap_round_trip(n):
    marked = [i % 3 == 0 for i in range(n)]
    data = pack_bitmap(marked)
    assert len(data) == (n + 7) // 8
    assert unpack_bitmap(data, n) == marked
    assert pack_bitmap(bytes(int(m) for m in marked)) == data
    assert missing_chunks(marked) == [i for i in range(n) if i % 3]
    assert first_missing(marked) == (1 if n > 1 else None)
    with pytest.raises(BadRequest):
        unpack_bitmap(data + b"\x00", n)


def test_fault_plan_from_dict():
    f = FaultPlan.from_dict({"corrupt_forward": [1, 2], "stall_after_bytes": 10})
    assert f.corrupt_forward == frozenset({1, 2}) and f.stall_after_bytes == 10
    with pytest.raises(BadRequest):
        FaultPlan.from_dict({"explode": True})
