"""Whatever JSON arrives, parsing and validation raise typed errors only (never a 500)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.errors import FlashpointError
from flashpoint.kaas.graph import plan_graph
from flashpoint.kaas.library import default_library
from flashpoint.kaas.spec import KaasRequest

from .helpers import chain_request

LIB = default_library(raw=False)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
GOOD = chain_request()


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p in _paths(GOOD) if p]


@settings(max_examples=300, deadline=None)
@given(path=st.sampled_from(PATHS), value=JSON)
def test_mutated_requests_fail_typed(path, value):
    d = copy.deepcopy(GOOD)
    target = d
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    try:
        plan_graph(KaasRequest.from_dict(d, max_buffer_bytes=1 << 20), LIB)
    except FlashpointError:
        pass


@settings(max_examples=100, deadline=None)
@given(body=JSON)
def test_arbitrary_bodies_fail_typed(body):
    try:
        plan_graph(KaasRequest.from_dict(body), LIB)
    except FlashpointError:
        pass
